"""Packed sequences: `segment_ids` and `cu_seqlens` turned into what the two forms need.

- `segment_ids: [B, T]`: the state restarts from zero wherever the id changes along T. Ids are made
  canonical (0, 1, 2, ... counting changes; `pallas_kernels.prep.canonical_segments`, as in the
  kernels), so equal canonical ids mean "same contiguous run".
- `cu_seqlens: [N + 1]` with B == 1: sequence n is tokens `cu[n]:cu[n+1]`; it starts from
  `initial_state[n]` and has its own final state. The chunked form lays each sequence out from a chunk
  boundary (`CuLayout`), so no chunk ever holds two sequences.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from linear_attention_jax.pallas_kernels.prep import canonical_segments


@dataclasses.dataclass(frozen=True)
class Packing:
  """How the tokens of a call are grouped into sequences.

  Attributes:
    kind: "none", "segments" or "cu_seqlens".
    seg: `[B, T]` int32 canonical segment index (kind "segments").
    cu: `[N + 1]` int32 offsets (kind "cu_seqlens").
  """

  kind: str = "none"
  seg: jax.Array | None = None
  cu: jax.Array | None = None

  @property
  def num_sequences(self) -> int:
    return self.cu.shape[0] - 1

  def per_token(self, B: int, T: int):
    """`(restart [B, T] bool, seq [B, T] int32, last [B, T] bool)` for the recurrent scan."""
    if self.kind == "segments":
      restart = jnp.concatenate(
          [jnp.zeros((B, 1), bool), self.seg[:, 1:] != self.seg[:, :-1]], axis=1)
      return restart, self.seg, jnp.zeros((B, T), bool)
    if self.kind == "cu_seqlens":
      t = jnp.arange(T, dtype=jnp.int32)
      n = sequence_of_token(self.cu, t)
      restart = t == self.cu[n]
      last = t == self.cu[n + 1] - 1
      return restart[None], n[None], last[None]
    return (jnp.zeros((B, T), bool), jnp.zeros((B, T), jnp.int32), jnp.zeros((B, T), bool))


def from_segment_ids(segment_ids) -> Packing:
  return Packing(kind="segments", seg=canonical_segments(segment_ids))


def from_cu_seqlens(cu_seqlens) -> Packing:
  return Packing(kind="cu_seqlens", cu=jnp.asarray(cu_seqlens, jnp.int32))


def sequence_of_token(cu, t):
  """Index of the sequence holding token `t` (the last non-empty one whose offset is <= t)."""
  n = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)
  return jnp.clip(n, 0, cu.shape[0] - 2)


@dataclasses.dataclass(frozen=True)
class CuLayout:
  """Where each sequence of a `cu_seqlens` call sits once padded to whole chunks.

  Sequence n occupies padded positions `C * first_chunk[n] + [0, len_n)` of a padded row of
  `num_chunks * C` tokens; the rest of its last chunk, and any trailing chunks, are neutral padding.
  """

  src: jax.Array          # [NC * C] int32: original token for each padded position (clipped)
  valid: jax.Array        # [NC * C] bool: padded position holds a real token
  dst: jax.Array          # [T] int32: padded position of each original token
  reset: jax.Array        # [NC] bool: chunk is the first chunk of a sequence
  reset_seq: jax.Array    # [NC] int32: that sequence
  first_chunk: jax.Array  # [N] int32
  num_chunks_of: jax.Array  # [N] int32
  num_chunks: int


def cu_layout(cu, T: int, C: int) -> CuLayout:
  N = cu.shape[0] - 1
  lens = cu[1:] - cu[:-1]
  nch = (lens + C - 1) // C
  first = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(nch)[:-1].astype(jnp.int32)])
  num_chunks = max(1, (T + N * (C - 1)) // C)  # static bound on sum(ceil(len_n / C))
  p = jnp.arange(num_chunks * C, dtype=jnp.int32)
  chunk = p // C
  n = jnp.clip(jnp.searchsorted(first, chunk, side="right").astype(jnp.int32) - 1, 0, N - 1)
  local = p - first[n] * C
  valid = local < lens[n]
  src = jnp.clip(cu[n] + local, 0, T - 1)
  t = jnp.arange(T, dtype=jnp.int32)
  nt = sequence_of_token(cu, t)
  dst = first[nt] * C + (t - cu[nt])
  c = jnp.arange(num_chunks, dtype=jnp.int32)
  nc = n[::C]
  reset = (c == first[nc]) & (nch[nc] > 0)
  return CuLayout(src=src, valid=valid, dst=dst, reset=reset, reset_seq=nc, first_chunk=first,
                  num_chunks_of=nch.astype(jnp.int32), num_chunks=num_chunks)
