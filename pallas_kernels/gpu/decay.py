"""Scalar decay in the GPU kernels: the chunk-local cumulative log-decay `G` (XLA) and the tiles a
kernel forms from it (the decay tile `e^(G_i - G_j)`, the rows' scales, the carried state's term of
the last token's dG), packed rows' masks applied.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from .masks import segment_masks
from .tiles import COLS, F32, ROWS, WGMMA


def local_cumsum(g, B: int, T_pad: int, Hv: int, C: int):
  """`[B, H_v, T_pad]` float32: the cumulative log-decay from each chunk's start (zeros for no decay)."""
  if g is None:
    return jnp.zeros((B, Hv, T_pad), F32)
  g = jnp.pad(g.astype(F32), [(0, 0), (0, T_pad - g.shape[1]), (0, 0)])
  return jnp.cumsum(jnp.swapaxes(g, 1, 2).reshape(B, Hv, T_pad // C, C), axis=-1).reshape(B, Hv, T_pad)


def row_scales(g_s, m_s, C):
  """`(e^G, e^(G_C - G))` `[C]` of one chunk (rows layout): what the carried state contributes to each
  token and what each token's write contributes to the chunk's end (zero across runs when `m_s` holds
  `segment_vectors`). The loads pass an optimisation barrier, so a kernel that calls this again where
  it needs the vectors does not have CSE merge them into one long-lived value."""
  G_rows = lax.optimization_barrier(plgpu.load(g_s, layout=ROWS))
  G_last = g_s[C - 1]
  e_q, e_k = jnp.exp(G_rows), jnp.exp(G_last - G_rows)
  if m_s is not None:
    _, carry, to_last, _ = segment_masks(m_s, None, C)
    e_q, e_k = e_q * carry, e_k * to_last
  return e_q, e_k


def decay_tile(g_s, gc_s, m_s, C, *, lower: bool = True, strict: bool):
  """`exp(G_i - G_j)` `[C, C]` on the (strictly) lower triangle, or its transpose on the upper one
  (`lower=False`), pairs of one run only when `m_s` holds `segment_vectors`; zero elsewhere. Loads
  behind an optimisation barrier, as `row_scales`."""
  G_rows, G_cols = lax.optimization_barrier((plgpu.load(g_s, layout=ROWS), plgpu.load(gc_s, layout=COLS)))
  i = plgpu.broadcasted_iota(jnp.int32, (C, C), 0, layout=WGMMA)
  j = plgpu.broadcasted_iota(jnp.int32, (C, C), 1, layout=WGMMA)
  diff = lax.broadcast_in_dim(G_rows, (C, C), [0]) - lax.broadcast_in_dim(G_cols, (C, C), [1])
  if lower:
    mask = (i > j) if strict else (i >= j)
  else:
    mask, diff = ((i < j) if strict else (i <= j)), -diff
  if m_s is not None:
    mask = mask & segment_masks(m_s, None, C)[0]
  return jnp.exp(jnp.where(mask, diff, -jnp.inf))


def last_state_term(g_s, m_s, st_s, dst_s, C):
  """`e^(G_C) rowsum(S * dS)` of one chunk as a `[C]` vector, the `[R, K]` S and dS tiles' rows folded
  onto the chunk's C rows (R a multiple of C): its sum is the last token's dG term from the carried
  state (zero where the chunk's last token left the carried run)."""
  s_decay = jnp.exp(g_s[C - 1])
  if m_s is not None:
    s_decay = s_decay * segment_masks(m_s, None, C)[3]
  load = lambda ref, r: plgpu.load(ref.at[pl.ds(r, C)], layout=WGMMA).astype(F32)
  total = sum(jnp.sum(load(st_s, r) * load(dst_s, r), axis=1) for r in range(0, st_s.shape[0], C))
  return s_decay * total
