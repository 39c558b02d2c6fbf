"""The switch that runs the Mosaic GPU kernels in the interpreter (tests without a GPU), and the check that
the interpreter has the threads a multi-warpgroup kernel needs."""

from __future__ import annotations

import os

import jax.experimental.pallas.mosaic_gpu as plgpu

from .. import common

_INTERPRET = common.InterpretSwitch("pallas_kernels_gpu_interpret", plgpu.InterpretGPUParams)


def interpret_kernels(params: plgpu.InterpretGPUParams | None = None):
  """Inside this context the GPU kernels run in the Mosaic GPU interpreter (on any backend) with
  `params` (default `plgpu.InterpretGPUParams()`: NaN for uninitialised memory, out-of-bounds reads
  raise), and `supports` treats the backend as a Hopper GPU, so `impl="pallas"` reaches these kernels
  on a CPU. jit caches do not see this switch: trace inside the context what you mean to interpret."""
  return _INTERPRET.use(params)


def interpreting() -> plgpu.InterpretGPUParams | None:
  """The interpreter parameters in force (`interpret_kernels`), or None."""
  return _INTERPRET.current()


def interpreter_threads() -> int:
  """Threads in XLA's CPU pool, on which the interpreter runs each warpgroup of a multi-warpgroup kernel
  as a computation of its own (one that waits on a barrier holds its thread): the `NPROC` environment
  variable if set (read when JAX's CPU backend starts), else the CPUs this process may run on."""
  if os.environ.get("NPROC"):
    return int(os.environ["NPROC"])
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:   # not on Linux
    return os.cpu_count() or 1


def check_interpreter_threads(call: dict[str, int]):
  """Raises, naming the option, where a multi-warpgroup kernel that `call` (option -> threads it needs:
  its warpgroups and the launcher) would run cannot start all its warpgroups in the interpreter: it
  would wait forever instead."""
  threads = interpreter_threads()
  short = [f"{name} needs {need}" for name, need in call.items() if threads < need]
  if short:
    raise ValueError(
        f"in the Mosaic GPU interpreter XLA's CPU pool has {threads} threads and {', '.join(short)} "
        f"(one a warpgroup and one for the launcher); set the environment variable NPROC to at least "
        f"{max(call.values())} before JAX starts, or pass the option's one-warpgroup value (1)")
