"""The suite's guards against dying workers (tests/conftest.py): compiled programs are freed before a
worker nears the system's limit on memory maps, and a test whose worker dies anyway runs once more in a
fresh worker, counted in the summary; a test that fails is never rerun."""

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


@pytest.mark.parametrize("dist", ["load", "loadfile"])   # loadfile: what `make test` runs
def test_a_dead_worker_reruns_once_and_a_failure_never(tmp_path, dist):
  pytest.importorskip("pytest_rerunfailures")
  pytest.importorskip("xdist")
  (tmp_path / "cases").mkdir()
  (tmp_path / "cases" / "conftest.py").write_text(
      "from tests.conftest import pytest_collection_modifyitems, pytest_handlecrashitem  # noqa: F401\n")
  (tmp_path / "cases" / "test_cases.py").write_text(CASES)
  flags = tmp_path / "flags"
  flags.mkdir()
  env = dict(os.environ, FLAG_DIR=str(flags),
             PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
  done = subprocess.run([sys.executable, "-m", "pytest", "-n", "1", "--dist", dist, "-q", "-p", "no:cacheprovider",
                         "--rootdir", str(tmp_path / "cases"), str(tmp_path / "cases")],
                        capture_output=True, text=True, env=env, timeout=300)
  summary = done.stdout.strip().splitlines()[-1]
  # the crashed test passed on its rerun; the failing one ran once and failed
  assert "1 failed, 1 passed, 1 rerun" in summary, done.stdout[-3000:]
  assert len([f for f in os.listdir(flags) if f.startswith("failed_")]) == 1


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
