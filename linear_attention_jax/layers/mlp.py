"""SwiGLU: the gated MLP of the models' blocks (and of MoE's shared experts)."""

from __future__ import annotations

import jax
from flax import nnx

from linear_attention_jax.sharding.rules import axes


class SwiGLU(nnx.Module):
  """`down(silu(gate(x)) * up(x))`: `[B, T, d] -> [B, T, d]` through a hidden width `hidden`."""

  def __init__(self, width: int, hidden: int, *, dtype, param_dtype, rngs: nnx.Rngs):
    kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.gate = nnx.Linear(width, hidden, kernel_metadata=axes("embed", "mlp"), **kw)
    self.up = nnx.Linear(width, hidden, kernel_metadata=axes("embed", "mlp"), **kw)
    self.down = nnx.Linear(hidden, width, kernel_metadata=axes("mlp", "embed"), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))
