"""Norms: the linear mixers' output norms (a gated RMSNorm, RetNet's per-head group norm) and an RMSNorm
with an optional zero-centred weight.

All normalise over the last axis in float32 and return the layer dtype.

  RMSNorm:       y = x / sqrt(mean(x^2) + eps) * w         (zero_centered=False; w starts at 1)
                 y = x / sqrt(mean(x^2) + eps) * (1 + w)   (zero_centered=True; w starts at 0: Qwen3-Next
                                                            and Qwen3.5, whose weight decay then pulls
                                                            the scale towards 1, not 0)

  GatedRMSNorm:  y = x / sqrt(mean(x^2) + eps) * weight * act(gate)     (GLA, Gated DeltaNet, KDA;
                 without a gate it is a plain RMSNorm, as DeltaNet uses it)
  HeadGroupNorm: y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias  (RetNet's GroupNorm with one
                 group per head)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention_jax.sharding.rules import axes

GATE_ACTIVATIONS = {"swish": jax.nn.silu, "silu": jax.nn.silu, "sigmoid": jax.nn.sigmoid}


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis; `weight: [features]`, applied as `1 + weight` when `zero_centered`.

  `axis`: the logical axis of the weight ("embed" for the residual stream, None inside a head).
  """

  def __init__(self, features: int, *, eps: float = 1e-6, zero_centered: bool = False,
               axis: str | None = "embed", dtype=jnp.float32, param_dtype=jnp.float32,
               rngs: nnx.Rngs | None = None):
    if features < 1:
      raise ValueError(f"features must be >= 1; got {features=}")
    self.features, self.eps, self.zero_centered, self.dtype = features, eps, zero_centered, dtype
    init = jnp.zeros if zero_centered else jnp.ones
    self.weight = nnx.Param(init((features,), param_dtype), **axes(axis))

  def __call__(self, x: jax.Array) -> jax.Array:
    """`x: [..., features]`. Returns the same shape in the layer dtype."""
    if x.shape[-1] != self.features:
      raise ValueError(f"x must end in {self.features} features; got shape {x.shape}")
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    w = self.weight[...].astype(jnp.float32)
    return (y * (1.0 + w if self.zero_centered else w)).astype(self.dtype)


class GatedRMSNorm(nnx.Module):
  """RMSNorm over the last axis, multiplied by `act(gate)`; the gate is a projection of the layer input.

  The weight `[V]` is shared by all heads (the norm is applied to `[..., H_v, V]`).
  """

  def __init__(self, features: int, *, eps: float = 1e-5, activation: str = "swish",
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
    if activation not in GATE_ACTIVATIONS:
      raise ValueError(f"activation must be one of {sorted(GATE_ACTIVATIONS)}; got {activation!r}")
    self.features, self.eps, self.activation, self.dtype = features, eps, activation, dtype
    self.weight = nnx.Param(jnp.ones((features,), param_dtype), **axes("head_v"))

  def __call__(self, x: jax.Array, gate: jax.Array | None = None) -> jax.Array:
    """`x: [..., V]`, `gate: [..., V]` or None (no gating). Returns `[..., V]` in the layer dtype."""
    if x.shape[-1] != self.features:
      raise ValueError(f"x must end in {self.features} features; got shape {x.shape}")
    if gate is not None and gate.shape != x.shape:
      raise ValueError(f"gate must have x's shape {x.shape}; got {gate.shape}")
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    y = y * self.weight[...].astype(jnp.float32)
    if gate is not None:
      y = y * GATE_ACTIVATIONS[self.activation](gate.astype(jnp.float32))
    return y.astype(self.dtype)


class HeadGroupNorm(nnx.Module):
  """GroupNorm with one group per head: mean and variance over V for each token and head.

  Parameters `weight, bias: [H_v, V]` (one affine per channel, as GroupNorm has).
  """

  def __init__(self, num_heads: int, features: int, *, eps: float = 1e-5, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
    self.num_heads, self.features, self.eps, self.dtype = num_heads, features, eps, dtype
    self.weight = nnx.Param(jnp.ones((num_heads, features), param_dtype), **axes("heads", "head_v"))
    self.bias = nnx.Param(jnp.zeros((num_heads, features), param_dtype), **axes("heads", "head_v"))

  def __call__(self, x: jax.Array) -> jax.Array:
    """`x: [..., H_v, V]`. Returns the same shape in the layer dtype."""
    if x.shape[-2:] != (self.num_heads, self.features):
      raise ValueError(f"x must end in [H_v, V] = {(self.num_heads, self.features)}; got {x.shape}")
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    y = y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
    return y.astype(self.dtype)
