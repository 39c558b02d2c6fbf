"""Loud checks at the public boundary: every bad argument is a `ValueError` that names it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from linear_attention_jax import debug

IMPLS = ("auto", "recurrent", "chunk", "pallas")


def _shape(x) -> tuple[int, ...]:
  return tuple(np.shape(x))


def check_qkv(q, k, v) -> tuple[int, int, int, int, int, int]:
  """Returns `(B, T, H, K, H_v, V)` after checking ranks, sizes and dtypes of q, k, v."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x is None:
      raise ValueError(f"{name} is required")
    if len(_shape(x)) != 4:
      want = "[B, T, H_v, V]" if name == "v" else "[B, T, H, K]"
      raise ValueError(f"{name} must have shape {want} (rank 4); got shape {_shape(x)}")
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
      raise ValueError(f"{name} must be a floating-point array; got dtype {jnp.result_type(x)}")
  B, T, H, K = _shape(q)
  if _shape(k) != _shape(q):
    raise ValueError(f"k must have the shape of q [B, T, H, K] = {_shape(q)}; got {_shape(k)}")
  Bv, Tv, Hv, V = _shape(v)
  if (Bv, Tv) != (B, T):
    raise ValueError(f"v must have shape [B, T, H_v, V] with B={B}, T={T} as in q; got {_shape(v)}")
  if min(H, K, V) < 1:  # B = 0 or T = 0: empty outputs (the ops return the initial state)
    raise ValueError(f"q, k, v need H, K, V >= 1; got q {_shape(q)}, v {_shape(v)}")
  if Hv % H != 0:
    raise ValueError(f"v's heads H_v={Hv} must be a multiple of q's heads H={H}; got v {_shape(v)}")
  return B, T, H, K, Hv, V


def check_gate(name, g, B, T, Hv, K, *, per_channel: bool):
  """Gates and beta: `[B, T, H_v]`, or `[B, T, H_v, K]` per channel; `T=None` (a step) drops T."""
  want = (B, T, Hv, K) if per_channel else (B, T, Hv)
  label = "[B, T, H_v, K]" if per_channel else "[B, T, H_v]"
  if T is None:
    want, label = want[:1] + want[2:], label.replace("T, ", "")
  if g is None:
    raise ValueError(f"{name} is required, with shape {label} = {want}")
  if _shape(g) != want:
    raise ValueError(f"{name} must have shape {label} = {want}; got {_shape(g)}")
  if not jnp.issubdtype(jnp.result_type(g), jnp.floating):
    raise ValueError(f"{name} must be a floating-point array; got dtype {jnp.result_type(g)}")


def check_log_decay(name, g, why: str):
  """`g <= 0` everywhere (-inf allowed, NaN passed through): concrete g at the call, traced g when the
  program runs with `debug_checks` on (its maximum only leaves the device). `why`: who needs it."""
  def check(top):
    if top > 0:
      raise ValueError(f"{name} must be a log-decay, <= 0 everywhere ({why}); got a maximum of "
                       f"{float(top):.4g}")

  if debug.is_traced(g) and not debug.enabled():
    return
  top = jnp.max(jnp.where(jnp.isnan(g), -jnp.inf, g))
  if debug.is_traced(top):
    debug.check_at_run_time(check, top)
  else:
    check(np.asarray(top))


def check_static(**values):
  """Arguments that set shapes or the program's structure must be Python values, not tracers."""
  for name, value in values.items():
    if debug.is_traced(value):
      raise ValueError(f"{name} must be static (a Python value: it sets shapes or the program), but it "
                       f"is traced; under jax.jit pass it with static_argnames=({name!r},) or close "
                       f"over it (functools.partial)")


def check_options(*, impl, chunk_size, scale):
  check_static(impl=impl, chunk_size=chunk_size)
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
  if (not isinstance(chunk_size, (int, np.integer)) or isinstance(chunk_size, bool)
      or chunk_size < 1 or chunk_size & (chunk_size - 1)):
    raise ValueError(f"chunk_size must be a positive power of two; got {chunk_size!r}")
  s = None if scale is None else _concrete(scale)  # a traced scale is not checked
  if s is not None and (s.shape != () or s.dtype.kind not in "iuf" or not s > 0):
    raise ValueError(f"scale must be a positive number or None (= K ** -0.5); got {scale!r}")


def _concrete(x):
  """The value of `x` as a NumPy array, or None when it is traced (checks then happen at trace time only)."""
  try:
    return np.asarray(x)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return None


def check_packing(segment_ids, cu_seqlens, B, T) -> int | None:
  """Checks `segment_ids` / `cu_seqlens`; returns N for `cu_seqlens`, else None."""
  if segment_ids is not None and cu_seqlens is not None:
    raise ValueError("pass at most one of segment_ids and cu_seqlens")
  if segment_ids is not None:
    if _shape(segment_ids) != (B, T):
      raise ValueError(f"segment_ids must have shape [B, T] = {(B, T)}; got {_shape(segment_ids)}")
    if not jnp.issubdtype(jnp.result_type(segment_ids), jnp.integer):
      raise ValueError(f"segment_ids must be integer; got dtype {jnp.result_type(segment_ids)}")
    return None
  if cu_seqlens is None:
    return None
  if len(_shape(cu_seqlens)) != 1 or _shape(cu_seqlens)[0] < 2:
    raise ValueError(f"cu_seqlens must have shape [N + 1] with N >= 1; got {_shape(cu_seqlens)}")
  if not jnp.issubdtype(jnp.result_type(cu_seqlens), jnp.integer):
    raise ValueError(f"cu_seqlens must be integer; got dtype {jnp.result_type(cu_seqlens)}")
  if B != 1:
    raise ValueError(f"cu_seqlens needs B == 1 (sequences packed along T); got B={B}")
  cu = _concrete(cu_seqlens)
  if cu is not None:
    check_cu_seqlens_values(cu, T)
  else:  # traced: checked when the program runs, with debug_checks on
    debug.check_at_run_time(lambda c: check_cu_seqlens_values(c, T), cu_seqlens)
  return _shape(cu_seqlens)[0] - 1


def check_cu_seqlens_values(cu, T: int):
  """`cu_seqlens` starts at 0, ends at T and never decreases (so every offset lies in [0, T])."""
  if cu[0] != 0 or cu[-1] != T:
    raise ValueError(f"cu_seqlens must start at 0 and end at T={T}; got {cu.tolist()}")
  if np.any(np.diff(cu) < 0):
    raise ValueError(f"cu_seqlens must be non-decreasing; got {cu.tolist()}")


def check_initial_state(initial_state, rows: int, Hv: int, K: int, V: int, *, rows_name: str,
                        name: str = "initial_state", v_extra: int = 0):
  """`[rows, H_v, K, V + v_extra]`; `v_extra` columns ride along (linear attention's normaliser)."""
  if initial_state is None:
    return
  want = (rows, Hv, K, V + v_extra)
  if _shape(initial_state) != want:
    v_label = f"V + {v_extra}" if v_extra else "V"
    raise ValueError(f"{name} must have shape [{rows_name}, H_v, K, {v_label}] = {want}; "
                     f"got {_shape(initial_state)}")
  if not jnp.issubdtype(jnp.result_type(initial_state), jnp.floating):
    raise ValueError(f"{name} must be floating-point; got {jnp.result_type(initial_state)}")


def check_step_ranks(**arrays):
  """One-token inputs: q, k `[B, H, K]`, v `[B, H_v, V]`."""
  for name, x in arrays.items():
    if x is None or len(_shape(x)) != 3:
      want = "[B, H_v, V]" if name == "v" else "[B, H, K]"
      raise ValueError(f"{name} must have shape {want} (rank 3) for a step; got {_shape(x)}")
