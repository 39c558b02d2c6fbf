"""Attention: causal softmax with grouped KV heads and RoPE, and its KV cache's limits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention_jax.layers import Attention, apply_rope
from tests.layers.util import call


def naive_attention(layer, x):
  """Softmax attention written out: repeat KV heads, causal mask, float32."""
  B, T, _ = x.shape
  H, H_kv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
  pos = jnp.arange(T)
  q = apply_rope((x @ layer.q_proj.kernel[...]).reshape(B, T, H, D), pos)
  k = apply_rope((x @ layer.k_proj.kernel[...]).reshape(B, T, H_kv, D), pos)
  v = (x @ layer.v_proj.kernel[...]).reshape(B, T, H_kv, D)
  k, v = jnp.repeat(k, H // H_kv, axis=2), jnp.repeat(v, H // H_kv, axis=2)
  scores = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(D)
  scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -jnp.inf)
  o = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v)
  return o.reshape(B, T, H * D) @ layer.o_proj.kernel[...]


def test_grouped_query_attention_matches_the_written_out_form():
  # Given GQA with 4 query heads sharing 2 KV heads
  layer = Attention(32, 4, num_kv_heads=2, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 7, 32))
  # When run through jax.nn.dot_product_attention
  y, cache = call(layer, x, None)
  # Then it equals the written-out softmax attention
  np.testing.assert_allclose(y, naive_attention(layer, x), rtol=1e-4, atol=1e-5)
  assert cache is None


def test_decoding_past_max_len_raises():
  layer = Attention(32, 2, rngs=nnx.Rngs(0))
  cache = layer.init_cache(1, max_len=4)
  assert cache.k.shape == (1, 4, 2, 16)
  with pytest.raises(ValueError, match="max_len"):
    layer(jnp.ones((1, 5, 32)), cache)
  _, cache = call(layer, jnp.ones((1, 3, 32)), cache)
  with pytest.raises(ValueError, match="max_len"):
    layer(jnp.ones((1, 2, 32)), cache)


def test_init_cache_needs_max_len():
  with pytest.raises(ValueError, match="max_len"):
    Attention(32, 2, rngs=nnx.Rngs(0)).init_cache(1)


def test_auto_implementation_is_xla_off_nvidia_gpus():
  layer = Attention(32, 2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  if jax.devices()[0].platform == "cpu":
    assert layer._implementation(jnp.bfloat16, masked=False) == "xla"
  assert layer._implementation(jnp.float32, masked=False) == "xla"  # cuDNN needs 16-bit inputs
  assert Attention(32, 2, implementation="cudnn", rngs=nnx.Rngs(0))._implementation(
      jnp.float32, masked=True) == "cudnn"
