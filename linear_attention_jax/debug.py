"""Opt-in checks of what cannot be checked while tracing: traced `cu_seqlens`, cache positions, token ids.

Outside `jit` these arguments are concrete and always checked (a `ValueError` at the call). Under `jit`
they are tracers, and the checks below run on the device values only when asked for:

    with linear_attention_jax.debug_checks():
      out = jax.jit(f)(...)          # a bad traced argument raises here, naming it

or `LINEAR_ATTENTION_DEBUG_CHECKS=1` in the environment. The switch is read when a function is
traced: a function jitted (and cached) before the switch keeps its trace without the checks. Each
check is a `jax.debug.callback` that raises `ValueError` on the host; under `jit` the error arrives
wrapped in a runtime error whose text holds the message. The checks cost a device-to-host copy of the
checked array per call, so they are off by default.
"""

from __future__ import annotations

import contextlib
import os
import threading

import jax
import numpy as np

_state = threading.local()


def enabled() -> bool:
  """Whether traced arguments are checked (the innermost `debug_checks` context, else the env var)."""
  value = getattr(_state, "enabled", None)
  if value is None:
    return os.environ.get("LINEAR_ATTENTION_DEBUG_CHECKS", "") not in ("", "0", "false", "False")
  return value


@contextlib.contextmanager
def debug_checks(on: bool = True):
  """Within the context, functions traced check their traced arguments at run time."""
  previous = getattr(_state, "enabled", None)
  _state.enabled = on
  try:
    yield
  finally:
    _state.enabled = previous


def is_traced(x) -> bool:
  return isinstance(x, jax.core.Tracer)


def check_at_run_time(check, *arrays):
  """Runs `check(*numpy_arrays)` (which raises `ValueError` with its message) on the values of
  `arrays` when the program runs, if `enabled()` and any of them is traced; else does nothing."""
  if enabled() and any(is_traced(a) for a in arrays):
    jax.debug.callback(lambda *xs: check(*(np.asarray(x) for x in xs)), *arrays)
