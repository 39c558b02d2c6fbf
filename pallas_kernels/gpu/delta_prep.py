"""The delta family's per-chunk tensors in one Mosaic GPU kernel: prep.py's preparation, every chunk in
parallel, for no or scalar decay, packed or not.

One program per (batch, value head, chunk) reads q, k, v, the chunk-local cumulative log-decay G and
beta once and writes the walk's inputs in the operand dtype (`prep.ChunkTensors`; module docstring of
prep.py for the definitions):

    P     = (q k^T) * e^(G_i - G_j)                          j <= i
    L     = Diag(beta) (k k^T) * e^(G_i - G_j)               j < i
    X     = (I + L)^-1                                       by block doubling, below
    w     = X (beta k e^G),  u = X (beta v),  qg = q e^G,  kd = k e^(G_C - G)

Every exponent is masked before the exponential (<= 0). Packed rows (`segment_ids`) enter as prep.py's
masks (`masks.segment_vectors`): pairs of one run only in P and L, `e^G` only where a token reads the
carried state, `kd` only where its write reaches the chunk's end, `decay` 0 where the chunk's last
token left the carried run. `X` is built as prep.unit_lower_inverse builds it
(`tiles.unit_lower_inverse`), on whole 64 x 64 tiles so that every step after the first is a
tensor-core product: with `X_s` the block-diagonal matrix of the inverses of the s x s diagonal blocks
and `E_s` the part of L inside the 2s x 2s diagonal blocks but outside the s x s ones,

    X_2s = X_s - (X_s E_s) X_s                               s = 1, 2, 4, ..., C / 2

(for one 2s block `[[A, 0], [E, D]]` this is `[[A^-1, 0], [-D^-1 E A^-1, D^-1]]`; at s = 1, where
X_1 = I, it is I - E_1, written without products). X stays float32 in registers; the products take
it, E_s and X_s E_s rounded to the operand dtype, as prep.py did with a
16-bit `inverse_dtype`. The backward is unchanged (prep.py's vjp recomputes in XLA).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from .. import prep
from .decay import decay_tile, local_cumsum, row_scales
from .masks import SEG_ROWS, segment_vectors
from .once import lowered_once
from .tiles import (F32, ROWS, WGMMA, compiler_params, l2_normalize_rows, matmul, matmuls, phase,
                    scratch_bytes, smem, unit_lower_inverse, vary_like)


VALUE_BLOCK = 128   # u's columns a product


def serves(g, beta, segment_ids) -> bool:
  """True for the calls this kernel prepares: delta family, no or scalar decay (packed or not)."""
  del segment_ids  # packed rows are served (`masks.segment_vectors`)
  return beta is not None and (g is None or g.ndim == 3)


def _scratch(K: int, V: int, C: int, dtype, has_seg: bool):
  """`(scratch, late_v, resident)`: the kernel's shared memory, whether the second of two value blocks
  arrives late in q's tile, and how many v tiles stay resident."""
  vb = min(V, VALUE_BLOCK)
  nvb = V // vb
  # V = 2 x 128 at K = 128: the second value block arrives in q's tile once qg is out (q's last use),
  # so a program holds one v tile: 104 KB of shared memory, two programs a multiprocessor, where two
  # resident v tiles (120 KB) leave room for one
  late_v = nvb == 2 and vb == K
  resident = nvb - late_v
  scratch = dict(
      q_s=smem((C, K), dtype), k_s=smem((C, K), dtype), v_s=smem((resident, C, vb), dtype),
      g_s=plgpu.SMEM((C,), F32), gc_s=plgpu.SMEM((C,), F32), b_s=plgpu.SMEM((C,), F32),
      x_s=smem((C, C), dtype), e_s=smem((C, C), dtype), y_s=smem((C, C), dtype), p_s=smem((C, C), dtype),
      l_s=smem((C, C), dtype),
      out_s={n: smem((C, n), dtype) for n in {K, vb}},   # staging tiles, one per width (TMA: whole tiles)
      bar=plgpu.Barrier(num_arrivals=5 + resident + SEG_ROWS * has_seg))
  if has_seg:
    scratch["m_s"] = plgpu.SMEM((SEG_ROWS, C), F32)
  if late_v:
    scratch["v_bar"] = plgpu.Barrier(num_arrivals=1)
  return scratch, late_v, resident


def smem_bytes(K: int, V: int, C: int = 64, dtype=jnp.bfloat16, has_seg: bool = False) -> int:
  """Shared memory of one preparation program (`scratch_bytes`, the staging tiles counted)."""
  scratch = dict(_scratch(K, V, C, dtype, has_seg)[0])
  scratch.update({f"out_{n}": tile for n, tile in scratch.pop("out_s").items()})
  return scratch_bytes(scratch)


@lowered_once(arrays=("segment_ids",))
def prepare(q, k, v, g, beta, *, chunk_size: int, dtype, segment_ids=None, interpret=None,
            with_inverse: bool = False, chunk_multiple: int = 1, qk_l2norm: bool = False):
  """`prep.prepare(q, k, v, g, beta, segment_ids, ...)` with every matmul operand in `dtype` (16-bit),
  the tensors in `dtype` and `decay` float32; shapes as there (`[B, H_v, NC, C, ...]`). With
  `with_inverse`, `(tensors, X)`: also `X = (I + L)^-1` `[B, H_v, NC, C, C]` in `dtype` (for
  `delta_grads`). chunk_multiple: T is padded to whole groups of this many chunks (as in prep.py).
  qk_l2norm: q and k are l2-normalised in the kernel (over K, in float32) before anything reads them."""
  B, T, H, K = q.shape
  Hv, V = v.shape[2:]
  vb = min(V, VALUE_BLOCK)   # u's columns a product: V = 256 as two blocks (one [64, 256] float32 tile
  nvb = V // vb              # would take half the registers)
  if V % vb:
    raise ValueError(f"V must be at most {VALUE_BLOCK} or a multiple of it; got {V}")
  C = chunk_size
  T_pad = prep.padded_length(T, C, chunk_multiple)
  NC = T_pad // C
  group = Hv // H
  pad = lambda x: jnp.pad(x.astype(dtype), [(0, 0), (0, T_pad - T), (0, 0), (0, 0)])
  q, k, v = pad(q), pad(k), pad(v)
  G = local_cumsum(g, B, T_pad, Hv, C)
  b = jnp.swapaxes(jnp.pad(beta.astype(F32), [(0, 0), (0, T_pad - T), (0, 0)]), 1, 2)   # [B, H_v, T]
  has_seg = segment_ids is not None
  masks = segment_vectors(segment_ids, C, T_pad) if has_seg else None

  scratch, late_v, resident = _scratch(K, V, C, dtype, has_seg)

  def body(*refs, q_s, k_s, v_s, g_s, gc_s, b_s, x_s, e_s, y_s, p_s, l_s, out_s, bar, m_s=None,
           v_bar=None):
    q_r, k_r, v_r, g_r, b_r = refs[:5]
    m_r = refs[5] if has_seg else None
    qg_r, kd_r, w_r, u_r, p_r = refs[5 + has_seg:10 + has_seg]
    x_r = refs[10 + has_seg] if with_inverse else None
    bi, h, n = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
    hk = lax.div(h, group)
    rows_t = pl.ds(n * C, C)
    for src, dst in ((q_r.at[bi, rows_t, hk], q_s), (k_r.at[bi, rows_t, hk], k_s),
                     (g_r.at[bi, h, rows_t], g_s), (g_r.at[bi, h, rows_t], gc_s),
                     (b_r.at[bi, h, rows_t], b_s)) + tuple(
                         (v_r.at[bi, rows_t, h, pl.ds(j * vb, vb)], v_s.at[j]) for j in range(resident)) + tuple(
                         (m_r.at[bi, r, rows_t], m_s.at[r]) for r in range(SEG_ROWS if has_seg else 0)):
      plgpu.copy_gmem_to_smem(src, dst, bar)
    with phase("prep.loads"):
      plgpu.barrier_wait(bar)
    if qk_l2norm:
      with phase("prep.l2"):
        l2_normalize_rows(q_s, C)
        l2_normalize_rows(k_s, C)

    # Register budget (one warpgroup, 255 registers a thread; a float32 [64, 128] tile takes 64): k is
    # not held as float32 across the inversion but read again, L waits in shared memory (it is rounded
    # to the operand dtype for its matmuls anyway), and one index tile (i XOR j) serves the loop.
    rows = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])
    sq, ck, cv = (C, C), (C, K), (C, vb)
    beta_rows = lambda: lax.optimization_barrier(plgpu.load(b_s, layout=ROWS))
    decay = lambda strict: decay_tile(g_s, gc_s, m_s, C, strict=strict)

    with phase("prep.grams"):
      P, M = matmuls((sq, [(q_s, k_s.T)]), (sq, [(k_s, k_s.T)]))   # one wait for both
      p_s[...] = (P * decay(False)).astype(dtype)
      l_s[...] = (M * decay(True) * rows(beta_rows(), sq)).astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(p_s, p_r.at[bi, h, rows_t])

    def emit(x, dst):
      """Stages the float32 tile `x` in the operand dtype and copies it to `dst`."""
      tile = out_s[x.shape[1]]
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      tile[...] = x.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(tile, dst)

    load = lambda ref: plgpu.load(ref, layout=WGMMA).astype(F32)
    with phase("prep.qg_kd"):
      q_scale, k_scale = row_scales(g_s, m_s, C)
      emit(load(q_s) * rows(q_scale, ck), qg_r.at[bi, h, rows_t])
      if late_v:   # emit's commit_smem has every thread's reads of q done: the tile is free
        plgpu.copy_gmem_to_smem(v_r.at[bi, rows_t, h, pl.ds(vb, vb)], q_s, v_bar)
      emit(load(k_s) * rows(k_scale, ck), kd_r.at[bi, h, rows_t])

    with phase("prep.inverse"):
      unit_lower_inverse(l_s, x_s, e_s, y_s)
      if with_inverse:
        plgpu.copy_smem_to_gmem(x_s, x_r.at[bi, h, rows_t])
    # beta k e^G and beta v replace k and v in shared memory (k's other uses are done)
    with phase("prep.w_u"):
      beta, (q_scale, _) = beta_rows(), row_scales(g_s, m_s, C)
      k_s[...] = (load(k_s) * rows(beta * q_scale, ck)).astype(dtype)
      v_tiles = [v_s.at[j] for j in range(resident)] + ([q_s] if late_v else [])
      if late_v:
        plgpu.barrier_wait(v_bar)
      for tile in v_tiles:
        tile[...] = (load(tile) * rows(beta, cv)).astype(dtype)
      plgpu.commit_smem()
      # w with u's first block in one wait (a further block would hold 64 more registers)
      w, u = matmuls((ck, [(x_s, k_s)]), (cv, [(x_s, v_tiles[0])]))
      emit(w, w_r.at[bi, h, rows_t])
      for j, tile in enumerate(v_tiles):
        emit(u if j == 0 else matmul(x_s, tile, cv), u_r.at[bi, h, rows_t, pl.ds(j * vb, vb)])
    with phase("prep.exit"):
      plgpu.wait_smem_to_gmem(0)

  args = (q, k, v, G, b) + ((masks,) if has_seg else ())
  shape = lambda d: jax.ShapeDtypeStruct((B, Hv, T_pad, d), dtype)
  outs = plgpu.kernel(
      body,
      out_type=(shape(K), shape(K), shape(K), shape(V), shape(C)) + ((shape(C),) if with_inverse else ()),
      scratch_types=scratch,
      grid=(B, Hv, NC), grid_names=("b", "h", "n"),
      compiler_params=compiler_params(approx_math=True), interpret=interpret,
      kernel_name="chunk_prep_delta")(*args)
  qg, kd, w, u, p, *inverse = (x.reshape(B, Hv, NC, C, x.shape[-1]) for x in vary_like(outs, args))
  G_last = G.reshape(B, Hv, NC, C)[..., -1]
  decay = jnp.exp(G_last)
  if has_seg:
    decay = decay * masks[:, None, 2].reshape(B, 1, NC, C)[..., -1]   # carry of the last token
  decay = jnp.broadcast_to(decay[..., None], (B, Hv, NC, K))
  t = prep.ChunkTensors(qg=qg, kd=kd, w=w, u=u, p=p, decay=decay)
  return (t, inverse[0]) if with_inverse else t
