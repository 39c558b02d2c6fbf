"""Typed decode caches: what one mixer carries from one call to the next.

Three kinds, all pytrees (they pass through `jax.jit`, `lax.scan` and `jax.eval_shape`):

  LinearCache: the recurrent state `[B, H_v, K, V]` float32 (V + 1 columns for normalised linear
    attention), the short-convolution windows (the last `W - 1` inputs of each convolved stream,
    `[B, W - 1, D]` float32) and the number of tokens seen. Its size does not depend on the context.
  KVCache: key and value buffers `[B, L, H_kv, D]` in the compute dtype for a context of L = max_len
    tokens, the number of tokens written, and the short-convolution windows when the layer has them.
    Its size grows linearly with L.
  LatentCache: multi-head latent attention's compressed keys and values, `[B, L, R + D_r]` per sequence
    whatever the number of heads; it also grows linearly with L.

`pos` is a scalar int32: every row of a batch has seen the same number of tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LinearCache:
  """State of a linear mixer.

  Attributes:
    state: `[B, H_v, K, V]` float32 (`V + 1` columns for `LinearAttention(normalize=True)`).
    conv: the short-convolution windows, one `[B, W - 1, D]` float32 array per convolved stream
      (q, k, v in that order); an empty tuple when the layer has no short convolution.
    pos: `[]` int32, tokens seen so far.
  """
  state: jax.Array
  conv: tuple[jax.Array, ...]
  pos: jax.Array

  def advance(self, state, conv, num_tokens: int) -> LinearCache:
    """The cache after `num_tokens` more tokens, with the new state and windows."""
    return LinearCache(state=state, conv=tuple(conv), pos=self.pos + num_tokens)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Keys and values of a softmax attention layer.

  Attributes:
    k, v: `[B, L, H_kv, D]` in the layer's compute dtype; rows `>= pos` are unwritten (zeros).
    pos: `[]` int32, tokens written so far.
    conv: the short-convolution windows (q, k, v; `[B, W - 1, D]` float32 each), or an empty tuple
      when the layer has no short convolution.
  """
  k: jax.Array
  v: jax.Array
  pos: jax.Array
  conv: tuple[jax.Array, ...] = ()

  @property
  def max_len(self) -> int:
    return self.k.shape[1]


def nbytes(cache) -> int:
  """Bytes held by a cache (any pytree of arrays or `jax.ShapeDtypeStruct`s)."""
  return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(cache))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LatentCache:
  """The compressed keys and values of multi-head latent attention (MLA): what it caches instead of
  per-head keys and values.

  Attributes:
    latent: `[B, L, R]` in the compute dtype, the normalised kv latent of every token (R = kv_lora_rank).
    k_shared: `[B, L, D_r]`, the key channels all heads share (D_r = qk_rope_head_dim).
    pos: `[]` int32, tokens written so far.
  """
  latent: jax.Array
  k_shared: jax.Array
  pos: jax.Array

  @property
  def max_len(self) -> int:
    return self.latent.shape[1]
