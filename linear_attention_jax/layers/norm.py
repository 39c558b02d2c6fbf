"""Norms: the linear mixers' output norms (a gated RMSNorm, RetNet's per-head group norm) and an RMSNorm
with an optional zero-centred weight.

All normalise over the last axis in float32 and return the layer dtype.

  RMSNorm:       y = x / sqrt(mean(x^2) + eps) * w         (zero_centered=False; w starts at 1)
                 y = x / sqrt(mean(x^2) + eps) * (1 + w)   (zero_centered=True; w starts at 0: Qwen3-Next
                                                            and Qwen3.5, whose weight decay then pulls
                                                            the scale towards 1, not 0)

  GatedRMSNorm:  y = x / sqrt(mean(x^2) + eps) * weight * act(gate)     (GLA, Gated DeltaNet, KDA;
                 without a gate it is a plain RMSNorm, as DeltaNet uses it). `impl`: "xla" (the jnp
                 form, autodiff'd by XLA), "pallas" (two Mosaic GPU kernels on Hopper,
                 `linear_attention_jax.pallas_kernels.gpu.gated_norm`, each pass reading its inputs once;
                 raises where they do not serve the call, saying why) or "auto" (the kernels where they
                 serve it, else the jnp form); the mixers pass "auto" when their own impl is "pallas"
                 or "auto", else "xla"
  HeadGroupNorm: y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias  (RetNet's GroupNorm with one
                 group per head)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention_jax.pallas_kernels.gpu import gated_norm as norm_kernels
from linear_attention_jax.sharding.rules import axes, axis_size, current_rules, to_spec

GATE_ACTIVATIONS = {"swish": jax.nn.silu, "silu": jax.nn.silu, "sigmoid": jax.nn.sigmoid}
IMPLS = ("xla", "pallas", "auto")


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

  The weight `[V]` is shared by all heads (the norm is applied to `[..., H_v, V]`). `impl`: the module
  docstring's.
  """

  def __init__(self, features: int, *, eps: float = 1e-5, activation: str = "swish", impl: str = "auto",
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
    if activation not in GATE_ACTIVATIONS:
      raise ValueError(f"activation must be one of {sorted(GATE_ACTIVATIONS)}; got {activation!r}")
    if impl not in IMPLS:
      raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
    self.features, self.eps, self.activation, self.dtype = features, eps, activation, dtype
    self.impl = impl
    self.weight = nnx.Param(jnp.ones((features,), param_dtype), **axes("head_v"))

  @property
  def _kernel_activation(self) -> str:
    return "swish" if self.activation == "silu" else self.activation

  def _split(self, ndim: int):
    """Under `sharding.use_rules`, for x `[B, T, H_v, V]`: `(mesh, spec of x)`; else None."""
    rules = current_rules()
    if rules is None or ndim != 4:
      return None
    mesh, table = rules
    return mesh, to_spec(("batch", "seq", "heads", "head_v"), table, mesh)

  def kernel_reason(self, x_shape, dtype, gate_dtype=None) -> str | None:
    """None if the Mosaic GPU kernels serve a call on `x: [..., V]` of `dtype` (a gate of `gate_dtype`,
    None for none; on this backend, per device under sharding rules), else why not."""
    rules = current_rules()
    if rules is not None:
      split = self._split(len(x_shape))
      if split is None:
        return "under sharding rules the kernels take x as [B, T, H_v, V]"
      mesh, spec = split
      if axis_size(mesh, spec[3]) > 1:
        return "V is split over devices: a row's norm would span shards"
    return norm_kernels.reason(x_shape, dtype, gate_dtype=gate_dtype, out_dtype=self.dtype,
                               activation=self._kernel_activation)

  def _kernel_call(self, x, gate):
    """The kernels' function `(x, gate, weight) -> y` for this call, or None for the jnp form (impl
    "xla", or "auto" where the kernels do not serve it)."""
    if self.impl == "xla":
      return None
    why = self.kernel_reason(x.shape, x.dtype, None if gate is None else gate.dtype)
    if why is not None:
      if self.impl == "pallas":
        raise ValueError(f"GatedRMSNorm(impl='pallas') cannot serve x of shape {x.shape}: {why}")
      return None
    norm = lambda x, g, w: norm_kernels.gated_rms_norm(x, g, w, eps=self.eps,
                                                       activation=self._kernel_activation)
    split = self._split(x.ndim)
    if split is None:
      return norm
    mesh, rows = split
    P = jax.sharding.PartitionSpec
    if gate is None:
      ungated = jax.shard_map(lambda x, w: norm(x, None, w), mesh=mesh, in_specs=(rows, P(None)),
                              out_specs=rows)
      return lambda x, g, w: ungated(x, w)
    return jax.shard_map(norm, mesh=mesh, in_specs=(rows, rows, P(None)), out_specs=rows)

  def __call__(self, x: jax.Array, gate: jax.Array | None = None) -> jax.Array:
    """`x: [..., V]`, `gate: [..., V]` or None (no gating). Returns `[..., V]` in the layer dtype."""
    if x.shape[-1] != self.features:
      raise ValueError(f"x must end in {self.features} features; got shape {x.shape}")
    if gate is not None and gate.shape != x.shape:
      raise ValueError(f"gate must have x's shape {x.shape}; got {gate.shape}")
    call = self._kernel_call(x, gate)
    if call is not None:
      return call(x, gate, self.weight[...])
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
