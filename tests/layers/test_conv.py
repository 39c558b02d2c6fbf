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


def _autodiff_reference(x, kernel, bias, activation):
  """The same convolution as plain jnp (autodiff's gradient), for the written-out backward."""
  W, T = kernel.shape[0], x.shape[1]
  padded = jnp.pad(x, ((0, 0), (W - 1, 0), (0, 0)))
  y = sum(padded[:, w:w + T] * kernel[w] for w in range(W))
  y = y if bias is None else y + bias
  return jax.nn.silu(y) if activation == "silu" else y


@pytest.mark.parametrize("width,T,activation,use_bias", [
    (4, 9, "silu", False), (4, 2, "silu", True), (1, 5, "identity", True), (3, 1, "identity", False)])
def test_written_out_backward_matches_autodiff_in_float64(width, T, activation, use_bias):
  # Given a conv (T shorter than the window among them), its input and a cotangent
  with jax.enable_x64():
    from linear_attention_jax.layers.conv import causal_conv
    keys = jax.random.split(jax.random.key(3), 4)
    x = jax.random.normal(keys[0], (2, T, 5), jnp.float64)
    kernel = jax.random.normal(keys[1], (width, 5), jnp.float64)
    bias = jax.random.normal(keys[2], (5,), jnp.float64) if use_bias else None
    dy = jax.random.normal(keys[3], (2, T, 5), jnp.float64)
    # When both are differentiated in x, the kernel and the bias
    ours = jax.vjp(lambda *a: causal_conv(*a, activation, jnp.float64), x, kernel, bias)
    ref = jax.vjp(lambda *a: _autodiff_reference(*a, activation), x, kernel, bias)
    # Then the outputs and every gradient agree to float64 rounding
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-12, atol=1e-12)
    for got, want in zip(ours[1](dy), ref[1](dy)):
      if want is None:
        assert got is None
      else:
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-11)


def test_bf16_layer_gradients_match_float32_loosely():
  # Given the module in bfloat16 and in float32 over the same parameters
  conv = ShortConvolution(8, 4, use_bias=True, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(4), (2, 33, 8))

  def loss(params, x, dtype):
    graphdef, _ = nnx.split(conv)
    model = nnx.merge(graphdef, params)
    model.dtype = dtype
    y, _ = model(x.astype(dtype))
    return jnp.sum(jnp.sin(y.astype(jnp.float32)))

  params = nnx.state(conv)
  # When both are differentiated
  g16 = jax.grad(loss, argnums=(0, 1))(params, x, jnp.bfloat16)
  g32 = jax.grad(loss, argnums=(0, 1))(params, x, jnp.float32)
  # Then every gradient agrees to bfloat16's precision (relative RMS)
  for a, b in zip(jax.tree.leaves(g16), jax.tree.leaves(g32)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.sqrt(np.mean((a - b) ** 2)) <= 2e-2 * np.sqrt(np.mean(b ** 2))
