"""Packed rows (`segment_ids`) in the GPU kernels: the per-token mask vectors XLA forms once
(`segment_vectors`) and the chunk's masks a kernel reads from them (`segment_masks`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas.mosaic_gpu as plgpu

from .. import prep
from .tiles import COLS, F32, ROWS

SEG_ROWS = 4  # run (read as rows), run (read as columns), carry, to_last


def segment_vectors(segment_ids, C: int, T_pad: int):
  """`[B, 4, T_pad]` float32 per-token masks of packed rows, prep.py's: the token's run (twice: rows
  and columns of the same-run mask), `carry` (the token reads the state carried into its chunk) and
  `to_last` (its write survives to the chunk's end). The carried state survives a chunk iff `carry`
  of its last token is 1."""
  seg = prep.canonical_segments(segment_ids)
  B, T = seg.shape
  seg = jnp.pad(seg, [(0, 0), (0, T_pad - T)], mode="edge").reshape(B, T_pad // C, C)
  before = jnp.concatenate([seg[:, :1, :1], seg[:, :-1, -1:]], axis=1)
  run = seg.astype(F32)
  vecs = (run, run, (seg == before).astype(F32), (seg == seg[..., -1:]).astype(F32))
  return jnp.stack([x.reshape(B, T_pad) for x in vecs], axis=1)


def segment_masks(m_s, slot, C):
  """(same-run `[C, C]` bool, carry `[C]`, to_last `[C]`, carry of the last token) of one chunk."""
  at = (lambda i: m_s.at[slot, i]) if slot is not None else (lambda i: m_s.at[i])
  run_r = plgpu.load(at(0), layout=ROWS)
  run_c = plgpu.load(at(1), layout=COLS)
  same = lax.broadcast_in_dim(run_r, (C, C), [0]) == lax.broadcast_in_dim(run_c, (C, C), [1])
  carry_last = m_s[slot, 2, C - 1] if slot is not None else m_s[2, C - 1]
  return same, plgpu.load(at(2), layout=ROWS), plgpu.load(at(3), layout=ROWS), carry_last
