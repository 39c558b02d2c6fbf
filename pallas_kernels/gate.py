"""KDA's per-channel gate from its pre-activation, as an op can take it (`ops.kda(..., A_log=, dt_bias=)`):

    u = f + dt_bias
    g = -exp(A_log) * softplus(u)                    kind "softplus" (Kimi Linear's gate)
    g = lb * sigmoid(exp(A_log) * u)                 kind lb, a float in [-5, 0) (the bounded gate)

with `f: [B, T, H_v, K]`, `A_log: [H_v]` and `dt_bias: [H_v * K]`. `elementwise` is the one formula:
XLA's `values` and the GPU's cumsum walks (`gpu/cumsum.py`, which compute g on load and its
derivatives in their reverse walk) both call it, so the kernels' g is the reference's to the rounding
of exp and log.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

F32 = jnp.float32
SOFTPLUS = "softplus"


class Gate(NamedTuple):
  """A call's gate: `A_log [H_v]`, `dt_bias [H_v * K]` and its `kind` ("softplus" or a lower bound)."""
  A_log: Any
  dt_bias: Any
  kind: Any

  def values(self, f):
    return values(f, self.A_log, self.dt_bias, self.kind)

  def vjp(self, f, dg):
    return vjp(f, self.A_log, self.dt_bias, self.kind, dg)

  def columns(self, K: int):
    """`(A, bias)` float32 `[H_v * K]`: exp(A_log) repeated over each head's channels, and dt_bias."""
    return jnp.repeat(jnp.exp(self.A_log.astype(F32)), K), self.dt_bias.astype(F32)


def from_args(A_log, dt_bias, lower_bound) -> Gate | None:
  """The `Gate` of an op's `A_log=`, `dt_bias=`, `gate_lower_bound=` (None where all three are None; the
  arrays' shapes are checked by `check`), or a ValueError for a bound without them."""
  if A_log is None and dt_bias is None:
    if lower_bound is not None:
      raise ValueError("gate_lower_bound takes the gate's pre-activation: pass A_log and dt_bias too")
    return None
  return Gate(A_log, dt_bias, SOFTPLUS if lower_bound is None else lower_bound)


def check_kind(kind):
  """`kind` ("softplus" or a lower bound in [-5, 0)) or a ValueError."""
  if kind == SOFTPLUS:
    return kind
  if isinstance(kind, (int, float)) and not isinstance(kind, bool) and -5.0 <= kind < 0.0:
    return float(kind)
  raise ValueError(f"gate_lower_bound must be None (the softplus gate) or a float in [-5, 0); got {kind!r}")


def _log1p_exact(x):
  return jnp.log1p(x)


def _log1p_plain(x):   # the kernels' (Mosaic GPU lowers log, not log1p): within 1e-7 of log1p for x in [0, 1]
  return jnp.log(1.0 + x)


def _sigmoid(z):
  """`(sigmoid(z), e^-|z|)` without overflow."""
  e = jnp.exp(-jnp.maximum(z, -z))
  return jnp.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e)), e


def elementwise(u, A, kind, *, exact_log1p: bool = True):
  """`(g, dg/du, dg/dA_log)` float32 of the gate's argument `u` (f + dt_bias, float32) and `A =
  exp(A_log)` (broadcast against u), for the gate `kind`."""
  if kind == SOFTPLUS:
    s, e = _sigmoid(u)
    log1p = _log1p_exact if exact_log1p else _log1p_plain
    g = -A * (jnp.maximum(u, 0.0) + log1p(e))
    return g, -A * s, g
  s, _ = _sigmoid(A * u)
  du = kind * A * s * (1.0 - s)
  return kind * s, du, du * u


def values(f, A_log, dt_bias, kind):
  """`g [B, T, H_v, K]` float32 (XLA; differentiable in f, A_log and dt_bias)."""
  B, T, Hv, K = f.shape
  u = f.astype(F32) + dt_bias.astype(F32).reshape(Hv, K)
  A = jnp.exp(A_log.astype(F32))[:, None]
  return elementwise(u, A, kind)[0]


def vjp(f, A_log, dt_bias, kind, dg):
  """`(df, dA_log, ddt_bias)` in their primals' dtypes: the cotangent `dg` of `values` pulled back."""
  _, pull = jax.vjp(lambda *x: values(*x, kind), f, A_log, dt_bias)
  return pull(dg.astype(F32))


def check(f, A_log, dt_bias, kind, Hv: int, K: int):
  """ValueError naming the argument of a gated call whose shape is wrong; returns the checked kind."""
  if A_log is None or dt_bias is None:
    raise ValueError("the gate's pre-activation needs both A_log [H_v] and dt_bias [H_v * K]; got "
                     f"A_log {'None' if A_log is None else A_log.shape}, "
                     f"dt_bias {'None' if dt_bias is None else dt_bias.shape}")
  if tuple(A_log.shape) != (Hv,):
    raise ValueError(f"A_log must be [H_v] = ({Hv},); got {tuple(A_log.shape)}")
  if tuple(dt_bias.shape) != (Hv * K,):
    raise ValueError(f"dt_bias must be [H_v * K] = ({Hv * K},); got {tuple(dt_bias.shape)}")
  if f.ndim != 4 or f.shape[2:] != (Hv, K):
    raise ValueError(f"g (the gate's pre-activation) must be [B, T, {Hv}, {K}]; got {tuple(f.shape)}")
  return check_kind(kind)
