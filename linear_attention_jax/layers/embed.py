"""Token embedding whose gradient does not scatter into a small table.

`jnp.take`'s gradient is a scatter-add of every token's row into the table. On a GPU that is one
atomic add per element, and a small vocabulary (a byte-level LM's 256 rows) puts hundreds of tokens on
each row: in bfloat16 (and, in jaxlib 0.10.2-0.11.x, also in float32) XLA emits compare-and-swap
loops, which serialise under that contention. `Embed` keeps `nnx.Embed`'s parameters, call and
`attend`, and takes its gradient as

    d table = one_hot(tokens)^T  d x      (a [V, N] x [N, D] product, float32 accumulation)

for vocabularies up to `ONE_HOT_MAX_VOCAB`, and as a float32 scatter-add above it (contention falls
with the vocabulary, and float32 has a native atomic add).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

# The largest vocabulary whose table gradient is the one-hot product: 2 N V D FLOPs, ~0.4 ms for
# N = 32768 tokens of width 1024 at V = 4096 on an H200 (the scatter's cost grows as V shrinks).
ONE_HOT_MAX_VOCAB = 4096


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def lookup(table, tokens, one_hot: bool):
  """`table [V, D][tokens [...]] -> [..., D]` (`jnp.take` along axis 0); differentiable in `table`
  (module docstring)."""
  return jnp.take(table, tokens, axis=0)


def _lookup_fwd(table, tokens, one_hot):
  # the table's rows and dtype ride in an empty [V, 0] array
  return jnp.take(table, tokens, axis=0), (tokens, jnp.zeros((table.shape[0], 0), table.dtype))


def _lookup_bwd(one_hot, res, dx):
  tokens, like = res
  V, D = like.shape[0], dx.shape[-1]
  ids, rows = tokens.reshape(-1), dx.reshape(-1, D)
  if one_hot:
    onehot = jax.nn.one_hot(ids, V, dtype=rows.dtype, axis=0)           # [V, N], exact in any dtype
    dtable = jnp.matmul(onehot, rows, preferred_element_type=jnp.float32)
  else:
    dtable = jnp.zeros((V, D), jnp.float32).at[ids].add(rows.astype(jnp.float32))
  return dtable.astype(like.dtype), None


lookup.defvjp(_lookup_fwd, _lookup_bwd)


class Embed(nnx.Embed):
  """`nnx.Embed` (same parameters, call and `attend`) with the table's gradient of the module docstring:
  token ids `[...]` int -> `[..., features]` rows of the `[num_embeddings, features]` table. `one_hot`:
  None (`num_embeddings <= ONE_HOT_MAX_VOCAB`), True or False."""

  def __init__(self, *args, one_hot: bool | None = None, **kwargs):
    super().__init__(*args, **kwargs)
    self.one_hot = one_hot

  def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
    if out_sharding is not None or self.num_embeddings == 1:
      return super().__call__(inputs, out_sharding=out_sharding)
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError(f"inputs must be integer token ids; got {inputs.dtype}")
    (embedding,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype, inexact=False)
    one_hot = self.num_embeddings <= ONE_HOT_MAX_VOCAB if self.one_hot is None else bool(self.one_hot)
    return lookup(embedding, inputs, one_hot)
