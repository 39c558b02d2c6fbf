"""ShortConvolution: causal depthwise convolution, exact decoding from its window cache; a mixer's three
convolutions in one kernel launch (`convolve_together`), with the numbers of three calls."""

from __future__ import annotations

import jax
import jax.extend.core
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


def kernel_launches(jaxpr, name: str) -> int:
  """Equations of `jaxpr` (a ClosedJaxpr), nested ones included, that launch the kernel `name`."""
  def count(j):
    return (sum(e.params.get("name") == name for e in j.eqns)
            + sum(count(sub) for sub in jax.extend.core.subjaxprs(j)))
  return count(jaxpr.jaxpr)


def test_mixer_convolves_q_k_v_in_one_launch_with_the_numbers_of_three(monkeypatch):
  """`LinearMixer._project` in training runs its three convolutions (widths 128, 128, 256) in one forward
  and one backward kernel launch, with the outputs and gradients of the three modules' own calls."""
  from linear_attention_jax.layers import conv as conv_layers
  from linear_attention_jax.layers.base import LinearMixer
  from linear_attention_jax.pallas_kernels import gpu

  # Given a mixer's projections and convolutions (the base class: q, k 128 channels, v 256), which the
  # kernels serve (in the interpreter)
  mixer = LinearMixer(32, 1, num_v_heads=None, head_dim=128, head_v_dim=256, use_short_conv=True,
                      conv_size=4, impl="pallas", chunk_size=64, dtype=jnp.float32,
                      param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(mixer)
  x = jax.random.normal(jax.random.key(5), (1, 8, 32))

  def loss(params, x):
    q, k, v, windows = nnx.merge(graphdef, params)._project(x, None)
    assert windows == (None, None, None)
    return jnp.sum(jnp.sin(q)) + jnp.sum(k ** 2) + jnp.sum(jnp.cos(v)), (q, k, v)

  def run():
    traced = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)).trace(params, x)
    (_, qkv), grads = traced.lower().compile()(params, x)
    return qkv, grads, tuple(kernel_launches(traced.jaxpr, name) for name in ("short_conv_fwd",
                                                                              "short_conv_bwd"))

  # When it runs jointly, and with each module's own call (the joint path refused)
  with gpu.interpret_kernels():
    assert conv_layers.joint_reason(mixer.convs, (jnp.ones((1, 8, 128)),) * 2 + (jnp.ones((1, 8, 256)),),
                                    (None,) * 3) is None
    joint, joint_grads, joint_launches = run()
    monkeypatch.setattr(conv_layers, "joint_reason", lambda *a: "the test takes each module's call")
    apart, apart_grads, apart_launches = run()
  # Then one launch each way serves the three, and q, k, v and every gradient are the same
  assert joint_launches == (1, 1) and apart_launches == (3, 3)
  for a, b in zip(joint, apart):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(joint_grads), jax.tree.leaves(apart_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_joint_call_says_why_it_keeps_each_modules_call():
  from linear_attention_jax.layers.conv import joint_reason
  from linear_attention_jax.pallas_kernels import gpu
  from linear_attention_jax.sharding import use_rules

  make = lambda D, **kw: ShortConvolution(D, 4, rngs=nnx.Rngs(0), **kw)
  convs, xs = (make(128), make(256)), (jnp.ones((1, 16, 128)), jnp.ones((1, 16, 256)))
  with gpu.interpret_kernels():
    assert joint_reason(convs, xs, (None, None)) is None
    assert "cache" in joint_reason(convs, xs, (convs[0].init_cache(1), None))
    assert "differ in kernel_size" in joint_reason((convs[0], ShortConvolution(256, 3, rngs=nnx.Rngs(0))),
                                                   xs, (None, None))
    assert "differ in dtype" in joint_reason((convs[0], make(256, dtype=jnp.bfloat16)), xs, (None, None))
    assert "shifted sum" in joint_reason((convs[0], make(256, impl="xla")), xs, (None, None))
    assert "share B and T" in joint_reason(convs, (xs[0], jnp.ones((1, 32, 256))), (None, None))
    mesh = jax.sharding.AbstractMesh((1,), ("data",))
    with use_rules(mesh, "tp"):
      assert "sharding rules" in joint_reason(convs, xs, (None, None))
  # off a Hopper GPU the kernels serve none of them ("auto": each module takes the shifted sum)
  assert "shifted sum" in joint_reason(convs, xs, (None, None))
