"""Session-wide setup for the suite.

The Mosaic GPU interpreter runs each warpgroup of a multi-warpgroup kernel
(`delta_grads_pair.chunk_grads_pair`, `fused_streamed.streamed_walk`) as a
separate computation, and each of them blocks in its barrier
waits. These computations, and the one that launched them, run on XLA's CPU thread pool. That pool
has one thread per core (the `NPROC` environment variable overrides the count). On a 2-core machine
the launcher and one blocked warpgroup fill the pool. The warpgroup the blocked one waits for then
never starts, and the suite hangs.

Twelve threads leave room for the launcher and three warpgroups of two kernel calls in flight at once,
as asynchronous dispatch allowed. With six, one run of the suite hung: a worker sat at 0% CPU in an
eager dispatch inside test_chunked_attention's l2 test, which was read as a pool whose threads all
wait on barriers (inferred, not traced); the dispatch deadlock described below, traced later, fits it
as well, and the suite now dispatches synchronously. The environment variable also
reaches the scripts that tests run as subprocesses. It is set here, before any test initialises JAX's CPU
backend.
"""

import os

os.environ["NPROC"] = str(max(12, int(os.environ.get("NPROC") or 0)))

# The suite's programs are tiny and mostly run once, so LLVM's optimisations of XLA's CPU code cost more
# than they save: the whole suite compiles at -O0 (XLA's fusion and every numeric choice are the same;
# only LLVM's passes are skipped). Measured on 2 cores: notebook 01's variant table 68 s -> 16 s, 18
# of the slowest tests 739 s -> 547 s. Like NPROC it reaches the scripts and notebooks tests start.
_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()

# JAX's CPU client runs the computations it is given in order, asynchronously. An eager test dispatches
# an interpreted kernel, goes on, and enqueues its next eager op behind it; inside the kernel the
# interpreter's callbacks evaluate jax ops of their own (`wait_smem_to_gmem` compares a jax array), which
# are enqueued behind that eager op, which waits for the kernel: each waits for the other. A run of the
# suite hung so (the watchdog's dump: the main thread in `dispatch.apply_primitive` under a layer's
# backward, an XLA thread in the interpreter's `shared_memory.wait_smem_to_gmem` at a jax `<`), in
# test_joined_projection's KDA test; the l2 test's hang the docstring notes (a worker at 0% CPU in
# an eager dispatch) fits the same shape. Synchronous dispatch runs each computation to completion
# before the call returns (the interpreter's warpgroups still run side by side on the CPU pool), so
# nothing is enqueued behind a running kernel. (A flag read when the CPU backend starts, which no test
# has done yet; it has no environment variable.)
import jax  # noqa: E402

jax.config.update("jax_cpu_enable_async_dispatch", False)

import faulthandler
import gc
import tempfile

import pytest

# Every program XLA compiles for the CPU keeps its code in memory maps of its own until its executable is
# freed, and JAX's caches keep the executables. A Mosaic GPU interpreter test adds 600 to 1,200 maps, so
# a test worker that runs a few hundred of them reaches Linux's limit of 65,530 maps a process
# (vm.max_map_count); the next compile then fails to map its code and the worker aborts inside XLA's
# compiler: what CI saw, twice, as a "crashed" worker. Measured with the limit lowered to 12,000:
# test_channel_prep.py then test_channel_grads.py in one process die at 11,174 maps (a segmentation
# fault in the next compile); with the hook below they pass, never above 5,000. Past a third of the limit, a test's teardown clears JAX's caches, which
# frees those maps (to ~600, measured) at the cost of recompiling what a later test shares.


def _maps() -> tuple[int, int]:
  """(memory maps of this process, the system's limit); (0, 1) where there is no /proc (not Linux)."""
  try:
    with open("/proc/sys/vm/max_map_count", "rb") as f:
      limit = int(f.read())
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f), limit
  except (OSError, ValueError):
    return 0, 1


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
  maps, limit = _maps()
  if maps > limit // 3:
    import jax
    jax.clear_caches()
    gc.collect()


# A test whose worker process dies is run once more, in a fresh worker; a test that fails (an assertion
# or any exception) is never rerun. A worker that dies (as above, or of
# anything else outside the test's own code) would otherwise fail the whole run. The summary line counts the reruns ("1 rerun"), so a crash is never hidden. Needs
# pytest-rerunfailures (the test extra) and pytest-xdist's -n; without them nothing changes.
CRASH_RERUNS = 1
NO_ERROR = r"(?!)"  # an `only_rerun` pattern that matches no error: failures are final


# Whole-file scheduling hands each worker the next file when it is done, and xdist by default sorts the
# files by their number of tests. The slowest files are not the ones with the most tests (the notebooks'
# file holds 10 tests and 2.4 minutes, pallas_kernels/gpu/test_plan.py 114 tests and seconds), so a
# heavy file could start last and run alone at the end. The files are ordered instead by their worker-seconds (the
# heaviest first, so the last ones to start are short), measured on 2 cores (`--durations=0`, summed
# per file); a file not listed keeps its place after them. Only the order changes: every test runs.
# Measured on the run that also held one test's 10-minute hang (not counted here; its rerun is).
FILE_SECONDS = {  # 3,274 worker-seconds in all, 1,364 tests, 33.0 min on 2 cores
    "tests/pallas_kernels/gpu/test_lowering.py": 324,
    "tests/pallas_kernels/gpu/test_chunked_attention.py": 291,
    "tests/experiments/test_scripts.py": 182,
    "tests/sharding/test_kernels.py": 140,
    "tests/ops/test_nonfinite.py": 137,
    "tests/ops/test_equivalence.py": 133,
    "tests/pallas_kernels/tpu/test_chunked_attention.py": 123,
    "tests/sharding/test_model.py": 114,
    "tests/notebooks/test_notebooks.py": 112,
    "tests/pallas_kernels/gpu/test_channel_delta_grads.py": 101,
    "tests/pallas_kernels/gpu/test_groups.py": 97,
    "tests/pallas_kernels/gpu/test_channel_prep_split.py": 93,
    "tests/pallas_kernels/gpu/test_channel_prep.py": 88,
    "tests/sharding/test_context_parallel.py": 72,
    "tests/pallas_kernels/gpu/test_channel_grads.py": 70,
    "tests/pallas_kernels/gpu/test_head_blocks.py": 65,
    "tests/pallas_kernels/gpu/test_gate.py": 65,
    "tests/pallas_kernels/gpu/test_channel_delta_keys.py": 56,
    "tests/ops/test_properties.py": 56,
    "tests/pallas_kernels/gpu/test_races.py": 55,
    "tests/pallas_kernels/gpu/test_call_test.py": 50,
    "tests/experiments/test_train.py": 49,
    "tests/pallas_kernels/gpu/test_fused_streamed.py": 48,
    "tests/ops/test_variants.py": 47,
    "tests/layers/test_channel_order.py": 38,
    "tests/layers/test_mixers.py": 38,
    "tests/pallas_kernels/gpu/test_channel_order.py": 37,
    "tests/ops/test_pallas_dispatch.py": 37,
    "tests/models/test_hf.py": 35,
    "tests/experiments/test_mqar.py": 33,
    "tests/pallas_kernels/gpu/test_delta_grads_pair.py": 33,
    "tests/sharding/test_train_script.py": 30,
    "tests/pallas_kernels/gpu/test_unit_bound.py": 30,
    "tests/pallas_kernels/gpu/test_conv.py": 29,
    "tests/layers/test_bridge.py": 28,
    "tests/experiments/test_decode.py": 26,
    "tests/pallas_kernels/test_prep.py": 24,
    "tests/ops/test_forward_mode.py": 24,
    "tests/models/test_lm.py": 23,
    "tests/experiments/test_checkpoint_integrity.py": 23,
    "tests/pallas_kernels/gpu/test_once.py": 21,
    "tests/experiments/test_recall.py": 20,
}


def _by_file_seconds(items):
  """`items` with the files of FILE_SECONDS first, heaviest first; each file's tests in their order."""
  rank = {path: i for i, path in enumerate(sorted(FILE_SECONDS, key=lambda p: -FILE_SECONDS[p]))}
  unlisted = len(rank)
  return sorted(items, key=lambda item: rank.get(item.nodeid.split("::")[0], unlisted))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
  if hasattr(config.option, "loadscopereorder"):  # xdist: keep the order below, not its count order
    config.option.loadscopereorder = False


# A test that hangs ends its worker. CI once stopped at its time limit with 1,357 of 1,363 tests done:
# a worker waited forever and nothing said where. A test still running after TEST_TIMEOUT_S
# (PYTEST_TEST_TIMEOUT_S overrides it) has every thread's Python stack written to a file and its
# process ended, by faulthandler's watchdog thread, which needs no lock the hung threads might hold:
# the crash below, so the test runs once more in a fresh worker and the summary counts it, and the
# controller prints the stacks (a worker's own stderr is pytest's capture while a test runs). The
# slowest test takes 84 s on 2 cores. What it has caught (one run of the suite in two on this 2-core
# machine): test_chunked_attention.py's test_public_api_gradients_through_the_kernels[simple_gla-False]
# in an eager dispatch on the main thread while a kernel's interpreter callback (`wait_smem_to_gmem`)
# compared with its count, which io_callback hands over as a jax.Array, so dispatching a computation
# from inside the running kernel; its rerun passed. The pool above hangs too, when too small: with
# NPROC=2 a jit of eight independent two-warpgroup kernel calls hung in 3 runs of 3, with 12 a jit of
# 32 ran.
TEST_TIMEOUT_S = float(os.environ.get("PYTEST_TEST_TIMEOUT_S") or 600)


def _stacks_path(controller_pid: int, worker: str) -> str:
  return os.path.join(tempfile.gettempdir(), f"pytest-stacks-{controller_pid}-{worker}.txt")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
  path = _stacks_path(os.getppid() if worker != "main" else os.getpid(), worker)
  with open(path, "w") as stacks:
    stacks.write(f"{item.nodeid} still running after {TEST_TIMEOUT_S:.0f} s:\n")
    stacks.flush()
    faulthandler.dump_traceback_later(TEST_TIMEOUT_S, exit=True, file=stacks)
    try:
      yield
    finally:
      faulthandler.cancel_dump_traceback_later()
  os.remove(path)   # left only by a process that died in the test


def pytest_collection_modifyitems(config, items):
  items[:] = _by_file_seconds(items)
  if not config.pluginmanager.hasplugin("rerunfailures"):
    return
  for item in items:
    if item.get_closest_marker("flaky") is None:
      item.add_marker(pytest.mark.flaky(reruns=CRASH_RERUNS, only_rerun=[NO_ERROR]))


# Whole-file scheduling (`--dist loadfile`, what `make test` runs) cannot hand one test back to the queue,
# so pytest-rerunfailures reports a dead worker's test as failed; but xdist itself puts the rest of that
# file back, the crashed test first, and runs it in a fresh worker. Its first crash is then counted as
# a rerun, as under per-test scheduling; a second crash of the same test fails the run.
_CRASHES: dict = {}


@pytest.hookimpl(trylast=True, optionalhook=True)  # an xdist hook: absent without -n
def pytest_handlecrashitem(crashitem, report, sched):
  from xdist.scheduler import LoadScopeScheduling
  _CRASHES[crashitem] = _CRASHES.get(crashitem, 0) + 1
  path = _stacks_path(os.getpid(), report.node.gateway.id)
  if os.path.exists(path):
    with open(path) as stacks:
      text = stacks.read()
    os.remove(path)
    if "Timeout" in text:   # the watchdog's dump (a worker that died otherwise leaves its header alone)
      report.node.config.get_terminal_writer().line("\n" + text)
  if isinstance(sched, LoadScopeScheduling) and _CRASHES[crashitem] <= CRASH_RERUNS:
    report.outcome = "rerun"
