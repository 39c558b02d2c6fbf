"""ShortConvolution: a causal depthwise convolution over time with a small window (default 4).

The linear mixers of the delta family (DeltaNet, Gated DeltaNet, KDA) put one in front of the recurrence on
each of q, k and v: it mixes each channel with its own last few inputs, which gives the layer cheap local
context (token shifts, n-grams) that the compressed state is bad at. For a window of W taps

    y_t = act( sum_{w < W} kernel[w] * x_{t - W + 1 + w} + bias )

with x_s = 0 before the sequence start, or the cached inputs when decoding continues a sequence. The
cache is the last `W - 1` inputs, so a decode step is exact, not an approximation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention_jax.sharding.rules import axes

ACTIVATIONS = {"silu": jax.nn.silu, "swish": jax.nn.silu, "identity": lambda x: x}


class ShortConvolution(nnx.Module):
  """Causal depthwise conv over T with `kernel_size` taps and an activation (SiLU by default).

  Attributes:
    kernel: `[W, D]` param, tap w multiplies the input `W - 1 - w` steps back.
    bias: `[D]` param or None.

  `axis`: the logical axis of D ("heads" for a mixer's q/k/v channels), for the sharding rules.
  """

  def __init__(self, features: int, kernel_size: int = 4, *, use_bias: bool = False,
               activation: str = "silu", axis: str | None = None, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    if not isinstance(kernel_size, int) or kernel_size < 1:
      raise ValueError(f"kernel_size (the conv width) must be an integer >= 1; got {kernel_size!r}")
    if features < 1:
      raise ValueError(f"features must be >= 1; got {features=}")
    if activation not in ACTIVATIONS:
      raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}; got {activation!r}")
    self.features, self.kernel_size, self.activation = features, kernel_size, activation
    self.dtype = dtype
    # PyTorch's Conv1d default for a depthwise conv: U(-1/sqrt(W), 1/sqrt(W)), fan-in W.
    bound = kernel_size ** -0.5
    self.kernel = nnx.Param(jax.random.uniform(rngs.params(), (kernel_size, features), param_dtype,
                                               -bound, bound), **axes(None, axis))
    self.bias = nnx.Param(jnp.zeros((features,), param_dtype), **axes(axis)) if use_bias else None

  def init_cache(self, batch: int) -> jax.Array:
    """Zero window `[B, W - 1, D]` float32: the sequence starts here."""
    return jnp.zeros((batch, self.kernel_size - 1, self.features), jnp.float32)

  def state_size(self) -> int:
    """Elements of the window per sequence: `(W - 1) * D`."""
    return (self.kernel_size - 1) * self.features

  def __call__(self, x: jax.Array, cache: jax.Array | None = None):
    """Convolves `x` along T.

    Args:
      x: `[B, T, D]`.
      cache: `[B, W - 1, D]` (the inputs before x, float32) or None (zeros before x).

    Returns:
      `(y, new_cache)`: `y: [B, T, D]` in the layer dtype; `new_cache: [B, W - 1, D]` float32 holding
      the last `W - 1` inputs (cache included), or None when `cache` is None.
    """
    if x.ndim != 3 or x.shape[-1] != self.features:
      raise ValueError(f"x must have shape [B, T, D] with D={self.features}; got {x.shape}")
    B, T, D = x.shape
    W = self.kernel_size
    if cache is not None and cache.shape != (B, W - 1, D):
      raise ValueError(f"cache must have shape [B, W - 1, D] = {(B, W - 1, D)}; got {cache.shape}")
    x32 = x.astype(jnp.float32)
    history = jnp.zeros((B, W - 1, D), jnp.float32) if cache is None else cache.astype(jnp.float32)
    padded = jnp.concatenate([history, x32], axis=1)  # [B, W - 1 + T, D]
    kernel = self.kernel[...].astype(jnp.float32)
    y = sum(padded[:, w:w + T] * kernel[w] for w in range(W))
    if self.bias is not None:
      y = y + self.bias[...].astype(jnp.float32)
    y = ACTIVATIONS[self.activation](y).astype(self.dtype)
    return y, (None if cache is None else padded[:, T:])
