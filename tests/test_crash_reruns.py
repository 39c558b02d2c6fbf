"""The suite's guards against dying workers (tests/conftest.py): compiled programs are freed before a
worker nears the system's limit on memory maps, and a test whose worker dies anyway runs once more in a
fresh worker, counted in the summary; a test that fails is never rerun; a test that hangs ends its
worker after the time limit and is rerun as a dead worker's test is."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = '''
import os, signal

def test_dies_once(tmp_path_factory):
    flag = os.path.join(os.environ["FLAG_DIR"], "died")
    if not os.path.exists(flag):
        open(flag, "w").close()
        os.kill(os.getpid(), signal.SIGSEGV)

def test_fails_every_time():
    open(os.path.join(os.environ["FLAG_DIR"], "failed_%d" % os.getpid()), "w").close()
    assert 1 == 2
'''


HANGS = '''
import os, time

def test_hangs_once():
    flag = os.path.join(os.environ["FLAG_DIR"], "hung")
    if not os.path.exists(flag):
        open(flag, "w").close()
        time.sleep(3600)

def test_after_it():
    pass
'''


def _run_cases(tmp_path, cases, dist, **env):
  """pytest on `cases` with tests/conftest.py's hooks, one xdist worker: (its output, the flags' folder)."""
  pytest.importorskip("pytest_rerunfailures")
  pytest.importorskip("xdist")
  (tmp_path / "cases").mkdir()
  (tmp_path / "cases" / "conftest.py").write_text(
      "from tests.conftest import (pytest_collection_modifyitems, pytest_handlecrashitem,  # noqa: F401\n"
      "                            pytest_runtest_protocol)\n")
  (tmp_path / "cases" / "test_cases.py").write_text(cases)
  flags = tmp_path / "flags"
  flags.mkdir()
  env = dict(os.environ, FLAG_DIR=str(flags),
             PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p), **env)
  done = subprocess.run([sys.executable, "-m", "pytest", "-n", "1", "--dist", dist, "-q", "-p", "no:cacheprovider",
                         "--rootdir", str(tmp_path / "cases"), str(tmp_path / "cases")],
                        capture_output=True, text=True, env=env, timeout=300)
  return done.stderr + done.stdout, flags


@pytest.mark.parametrize("dist", ["load", "loadfile"])   # loadfile: what `make test` runs
def test_a_dead_worker_reruns_once_and_a_failure_never(tmp_path, dist):
  output, flags = _run_cases(tmp_path, CASES, dist)
  summary = output.strip().splitlines()[-1]
  # the crashed test passed on its rerun; the failing one ran once and failed
  assert "1 failed, 1 passed, 1 rerun" in summary, output[-3000:]
  assert len([f for f in os.listdir(flags) if f.startswith("failed_")]) == 1


def test_a_hung_test_ends_its_worker_with_its_stacks_and_reruns(tmp_path):
  # past the limit (5 s here) the hung test's stacks reach the terminal and its worker ends; the test then
  # passes in a fresh worker, as does the rest of its file
  output, _ = _run_cases(tmp_path, HANGS, "loadfile", PYTEST_TEST_TIMEOUT_S="5")
  assert "2 passed, 1 rerun" in output.strip().splitlines()[-1], output[-3000:]
  assert "Timeout (0:00:05)!" in output and 'line 8 in test_hangs_once' in output, output[-3000:]


def test_teardown_frees_the_compiled_programs_past_a_third_of_the_map_limit(monkeypatch):
  import jax
  from tests import conftest
  f = jax.jit(lambda x: x + 1)
  f(1.0)
  assert f._cache_size() == 1
  monkeypatch.setattr(conftest, "_maps", lambda: (100, 400))   # below a third: caches kept
  conftest.pytest_runtest_teardown(None, None)
  assert f._cache_size() == 1
  monkeypatch.setattr(conftest, "_maps", lambda: (200, 400))   # past it: cleared
  conftest.pytest_runtest_teardown(None, None)
  assert f._cache_size() == 0
