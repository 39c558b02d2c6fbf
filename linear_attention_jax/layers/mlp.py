"""SwiGLU: the gated MLP of the models' blocks (and of MoE's shared experts)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention_jax.layers.base import dense_joined
from linear_attention_jax.sharding.rules import axes, axis_size, current_rules, to_spec


@jax.custom_vjp
def _gated_silu(y):
  """`silu(y[..., 0, :]) * y[..., 1, :]` for the gate's and up's outputs side by side, `y [..., 2, hidden]`."""
  return jax.nn.silu(y[..., 0, :]) * y[..., 1, :]


def _gated_silu_fwd(y):
  return _gated_silu(y), y


def _gated_silu_bwd(y, dh):
  # both halves' cotangents as one elementwise pass over y's layout: a select between the two
  # expressions, where the transpose of the split would concatenate them (XLA 0.11.2 on a GPU
  # copies such a concatenation twice, unfused: +0.48 ms a layer at [32768, 2 x 2752], NOTES.md v77)
  f32 = jnp.float32
  a, b, dh = y[..., 0:1, :].astype(f32), y[..., 1:2, :].astype(f32), dh[..., None, :].astype(f32)
  s = jax.nn.sigmoid(a)
  first = jax.lax.broadcasted_iota(jnp.int32, y.shape, y.ndim - 2) == 0
  dy = jnp.where(first, dh * b * s * (1.0 + a * (1.0 - s)), dh * a * s)
  return (dy.astype(y.dtype),)


_gated_silu.defvjp(_gated_silu_fwd, _gated_silu_bwd)


class SwiGLU(nnx.Module):
  """`down(silu(gate(x)) * up(x))`: `[B, T, d] -> [B, T, d]` through a hidden width `hidden`.

  `join`: gate and up run as one product onto their kernels side by side (the same sums; the
  parameters stay two), and the backward forms both halves' cotangents in one pass over the hidden
  activations and takes x's cotangent as one product where two would be added. Under
  `sharding.use_rules` with the mlp axis split over devices the two stay apart (a join would
  interleave the devices' columns).
  """

  def __init__(self, width: int, hidden: int, *, dtype, param_dtype, rngs: nnx.Rngs, join: bool = True):
    kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.gate = nnx.Linear(width, hidden, kernel_metadata=axes("embed", "mlp"), **kw)
    self.up = nnx.Linear(width, hidden, kernel_metadata=axes("embed", "mlp"), **kw)
    self.down = nnx.Linear(hidden, width, kernel_metadata=axes("mlp", "embed"), **kw)
    self.join = join

  def _joined(self) -> bool:
    if not self.join:
      return False
    rules = current_rules()
    if rules is None:
      return True
    mesh, table = rules
    return axis_size(mesh, to_spec(("mlp",), table, mesh)[0]) == 1

  def __call__(self, x: jax.Array) -> jax.Array:
    if self._joined():
      y = dense_joined((self.gate, self.up), x)
      return self.down(_gated_silu(y.reshape(*y.shape[:-1], 2, -1)))
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))
