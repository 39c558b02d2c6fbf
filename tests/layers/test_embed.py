"""`layers.Embed`: nnx.Embed's parameters and forward, with a table gradient that is a one-hot product
(small vocabularies) or a float32 scatter (large ones), checked against a float64 sum per row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention_jax import layers
from linear_attention_jax.layers import embed


def _table_grad(module, tokens, w):
  return nnx.grad(lambda m: jnp.sum(m(tokens).astype(jnp.float32) * w))(module).embedding[...]


@pytest.mark.parametrize("V,one_hot", [(256, None), (256, False), (5000, None), (5000, True)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_table_gradient_is_the_float64_row_sum(V, one_hot, dtype):
  tokens = jax.random.randint(jax.random.key(1), (3, 257), 0, 40)   # many tokens on few rows
  w = jax.random.normal(jax.random.key(2), (3, 257, 32))
  new = layers.Embed(V, 32, dtype=dtype, one_hot=one_hot, rngs=nnx.Rngs(0))
  old = nnx.Embed(V, 32, dtype=dtype, rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(np.asarray(new(tokens)), np.asarray(old(tokens)))
  want = np.zeros((V, 32))
  np.add.at(want, np.asarray(tokens).reshape(-1), np.asarray(w, np.float64).reshape(-1, 32))
  got = np.asarray(_table_grad(new, tokens, w), np.float64)
  scale = np.abs(want).max()
  if dtype == jnp.float32:
    np.testing.assert_allclose(got, want, atol=1e-5 * scale)
  else:   # one rounding of the float32 sum to bfloat16; nnx.Embed's bfloat16 scatter rounds at every add
    assert np.abs(got - want).max() <= 2 ** -8 * scale
    assert np.abs(got - want).max() <= np.abs(np.asarray(_table_grad(old, tokens, w)) - want).max()


def test_small_vocabularies_take_no_scatter_and_large_ones_a_float32_one():
  tokens = jnp.zeros((2, 16), jnp.int32)
  hlo = lambda m: jax.jit(nnx.grad(lambda m: jnp.sum(m(tokens).astype(jnp.float32)))).lower(m).as_text()
  small = hlo(layers.Embed(embed.ONE_HOT_MAX_VOCAB, 8, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
  large = hlo(layers.Embed(embed.ONE_HOT_MAX_VOCAB + 1, 8, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
  assert "scatter" not in small and "dot_general" in small
  op = large.split("stablehlo.scatter", 1)[1]
  signature = op[op.index("}) :"):].split("\n", 1)[0]     # the scatter's operand and result types
  assert f"-> tensor<{embed.ONE_HOT_MAX_VOCAB + 1}x8xf32>" in signature, signature
  assert "scatter" in hlo(nnx.Embed(256, 8, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))   # what it replaces


def test_parameters_match_nnx_embed_and_bad_ids_raise():
  new, old = layers.Embed(64, 8, rngs=nnx.Rngs(0)), nnx.Embed(64, 8, rngs=nnx.Rngs(0))
  assert jax.tree.structure(nnx.state(new, nnx.Param)) == jax.tree.structure(nnx.state(old, nnx.Param))
  query = jnp.ones((2, 8))
  np.testing.assert_array_equal(np.asarray(new.attend(query)), np.asarray(old.attend(query)))
  with pytest.raises(ValueError, match="integer"):
    new(jnp.zeros((2, 3)))
