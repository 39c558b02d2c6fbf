"""ShortConvolution: causal depthwise convolution, exact decoding from its window cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention_jax.layers import ShortConvolution


def reference_conv(x, kernel):
  """y[b, t, d] = silu(sum_w kernel[w, d] * x[b, t - W + 1 + w, d]), zeros before the start."""
  x, kernel = np.asarray(x, np.float64), np.asarray(kernel, np.float64)
  B, T, D = x.shape
  W = kernel.shape[0]
  y = np.zeros_like(x)
  for t in range(T):
    for w in range(W):
      s = t - W + 1 + w
      if s >= 0:
        y[:, t] += kernel[w] * x[:, s]
  return y / (1 + np.exp(-y))


@pytest.mark.parametrize("width", [1, 2, 4])
def test_matches_a_direct_convolution(width):
  # Given a conv of some width and a sequence
  conv = ShortConvolution(6, width, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 9, 6))
  # When applied without a cache
  y, cache = conv(x)
  # Then it equals the causal sum over the last `width` inputs, through SiLU
  np.testing.assert_allclose(y, reference_conv(x, conv.kernel[...]), rtol=1e-5, atol=1e-6)
  assert cache is None


def test_decoding_from_the_window_equals_the_full_sequence():
  # Given a width-4 conv and its (zero) cache of the last 3 inputs
  conv = ShortConvolution(5, 4, use_bias=True, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(2), (2, 10, 5))
  full, _ = conv(x)
  cache = conv.init_cache(2)
  assert cache.shape == (2, 3, 5) and cache.dtype == jnp.float32
  # When 4 tokens are prefilled and the rest fed one at a time
  head, cache = conv(x[:, :4], cache)
  outs = [head]
  for t in range(4, 10):
    y, cache = conv(x[:, t:t + 1], cache)
    outs.append(y)
  # Then the outputs match, and the cache holds the last 3 inputs
  np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(cache, x[:, -3:])


def test_width_one_has_an_empty_window():
  conv = ShortConvolution(3, 1, rngs=nnx.Rngs(0))
  assert conv.init_cache(2).shape == (2, 0, 3) and conv.state_size() == 0
  y, cache = conv(jnp.ones((2, 1, 3)), conv.init_cache(2))
  assert y.shape == (2, 1, 3) and cache.shape == (2, 0, 3)


@pytest.mark.parametrize("width", [0, -1])
def test_width_below_one_raises(width):
  with pytest.raises(ValueError, match="kernel_size"):
    ShortConvolution(4, width, rngs=nnx.Rngs(0))


def test_bf16_output_float32_window():
  conv = ShortConvolution(4, 4, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  y, cache = conv(jnp.ones((1, 3, 4), jnp.bfloat16), conv.init_cache(1))
  assert y.dtype == jnp.bfloat16 and cache.dtype == jnp.float32
