"""Edge shapes (B = 0, T = 0, cu_seqlens as a list or NumPy array), traced arguments (a traced static
argument says it must be static; `debug_checks` catches traced cu_seqlens, cache positions and token ids
at run time)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import linear_attention_jax
from linear_attention_jax import ops
from linear_attention_jax.layers import Attention
from linear_attention_jax.models import LM, LMConfig

H, K, V = 2, 4, 4


def inputs(B, T, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  q, k = (jax.random.normal(x, (B, T, H, K)) for x in ks[:2])
  v = jax.random.normal(ks[2], (B, T, H, V))
  g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H)))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
  return q, k, v, g, beta


@pytest.mark.parametrize("impl", ["recurrent", "chunk"])
@pytest.mark.parametrize("B,T", [(0, 8), (2, 0)])
def test_empty_batch_or_sequence_gives_empty_output_and_the_initial_state(B, T, impl):
  q, k, v, g, beta = inputs(B, T)
  h0 = jnp.full((B, H, K, V), 0.5)
  o, final = ops.gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                  impl=impl, chunk_size=4)
  assert o.shape == (B, T, H, V) and o.dtype == v.dtype
  np.testing.assert_array_equal(final, h0)
  o, final = ops.linear_attention(q, k, v, output_final_state=True, impl=impl, chunk_size=4)
  assert o.shape == (B, T, H, V) and final.shape == (B, H, K, V + 1) and not final.any()


@pytest.mark.parametrize("as_", [list, np.asarray, tuple])
def test_cu_seqlens_accepts_lists_and_numpy_arrays(as_):
  q, k, v, g, beta = inputs(1, 8)
  want = ops.gated_delta_rule(q, k, v, g, beta, cu_seqlens=jnp.array([0, 3, 8]), impl="chunk",
                              chunk_size=4)[0]
  got = ops.gated_delta_rule(q, k, v, g, beta, cu_seqlens=as_([0, 3, 8]), impl="chunk", chunk_size=4)[0]
  np.testing.assert_array_equal(got, want)


def test_a_traced_chunk_size_says_it_must_be_static():
  q, k, v, g, _ = inputs(1, 8)
  with pytest.raises(ValueError, match=r"chunk_size must be static.*static_argnames=\('chunk_size',\)"):
    jax.jit(lambda c: ops.simple_gla(q, k, v, g, impl="chunk", chunk_size=c))(4)


def test_a_traced_output_final_state_says_it_must_be_static():
  q, k, v, g, _ = inputs(1, 8)
  with pytest.raises(ValueError, match="output_final_state must be static"):
    jax.jit(lambda f: ops.simple_gla(q, k, v, g, output_final_state=f))(True)


@jax.jit
def _packed(q, k, v, g, beta, cu):
  return ops.gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, impl="chunk", chunk_size=4)[0]


@pytest.mark.parametrize("cu", [[0, 5, 3, 8], [0, -1, 8], [0, 3, 6]],
                         ids=["decreasing", "negative", "not_ending_at_T"])
def test_debug_checks_catch_bad_traced_cu_seqlens(cu):
  q, k, v, g, beta = inputs(1, 8)
  with linear_attention_jax.debug_checks():
    run = jax.jit(lambda *a: ops.gated_delta_rule(*a[:5], cu_seqlens=a[5], impl="chunk", chunk_size=4)[0])
    with pytest.raises(Exception, match="cu_seqlens must"):
      jax.block_until_ready(run(q, k, v, g, beta, jnp.array(cu)))
  # And without them the call is not checked (the documented default): it runs
  jax.block_until_ready(_packed(q, k, v, g, beta, jnp.array(cu)))


def test_debug_checks_pass_good_traced_cu_seqlens():
  q, k, v, g, beta = inputs(1, 8)
  with linear_attention_jax.debug_checks():
    run = jax.jit(lambda *a: ops.gated_delta_rule(*a[:5], cu_seqlens=a[5], impl="chunk", chunk_size=4)[0])
    np.testing.assert_allclose(run(q, k, v, g, beta, jnp.array([0, 3, 8])),
                               _packed(q, k, v, g, beta, jnp.array([0, 3, 8])), rtol=1e-6)


def test_debug_checks_catch_attention_decoding_past_max_len():
  layer = Attention(8, num_heads=2, rngs=nnx.Rngs(0))
  cache = layer.init_cache(1, max_len=4)
  step = nnx.jit(lambda m, x, c: m(x, cache=c))
  x = jnp.ones((1, 1, 8))
  with linear_attention_jax.debug_checks():
    for _ in range(4):
      _, cache = step(layer, x, cache)
    with pytest.raises(Exception, match="decoding past max_len: pos=4"):
      jax.block_until_ready(step(layer, x, cache))


def test_out_of_vocabulary_token_ids_raise_eagerly_and_with_debug_checks_under_jit():
  model = LM(LMConfig(vocab_size=16, width=8, depth=1, num_heads=2, pattern="A"), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"token ids must lie in \[0, vocab_size=16\)"):
    model(jnp.array([[1, -1]]))
  with linear_attention_jax.debug_checks():
    with pytest.raises(Exception, match="token ids must lie"):
      jax.block_until_ready(nnx.jit(lambda m, t: m(t)[0])(model, jnp.array([[1, 16]])))
