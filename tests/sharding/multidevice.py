"""Runs a test in a child process whose JAX sees 8 simulated CPU devices.

XLA reads `--xla_force_host_platform_device_count` once, when JAX starts its CPU backend; a pytest
worker that has already run other tests (`pytest -n 2`) has one device for good. So a test marked
`@multidevice` re-runs itself, alone, in a fresh `python -m pytest <its node id>` with the flag set,
and passes when the child passes (the child's output is shown on failure, and with `-s`).
"""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys

DEVICES = 8
ROOT = pathlib.Path(__file__).resolve().parents[2]
_CHILD = "LINEAR_ATTENTION_JAX_MULTIDEVICE_CHILD"
_TIMEOUT_S = 600


def in_child() -> bool:
  return os.environ.get(_CHILD) == "1"


def multidevice(test):
  """Decorator: run `test` in a child process with `DEVICES` CPU devices."""

  @functools.wraps(test)
  def wrapper(*args, **kwargs):
    if in_child():
      import jax
      assert jax.device_count() == DEVICES, f"child sees {jax.device_count()} devices"
      return test(*args, **kwargs)
    node_id = os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0]
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{_CHILD: "1"})
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={DEVICES}").strip()
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "no:xdist",
               "-W", "ignore::DeprecationWarning", node_id]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=_TIMEOUT_S)
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, (f"{node_id} failed with {DEVICES} devices:\n{proc.stdout[-8000:]}\n"
                                  f"{proc.stderr[-4000:]}")

  return wrapper
