"""The additive family in fused Mosaic GPU kernels: forward and backward with no XLA preparation.

For scalar or no decay, packed or not, the per-chunk tensors of the additive family are cheap to form
from the raw tiles, so the kernel reads q, k, v and the chunk-local cumulative log-decay `G` once and
never writes `qg`, `kd` or `P` to device memory (prep.py's tensors, formed in shared memory instead):

    P    = (q k^T) * e^(G_i - G_j)   on j <= i, else 0      (exponent masked before the exponential)
    o    = (q * e^G) S + P v                              (unscaled)
    S   <- e^(G_C) S + (k * e^(G_C - G))^T v

Every exponent is <= 0 (G is non-increasing). Packed rows (`segment_ids`) enter as per-token masks
(`segment_vectors`), as in prep.py. Per program (batch, value head, 64 value columns) the walk
is that of `walk.forward`; q and k are read from their `[B, T, H, K]` layout (grouped value heads read
their q/k head), v from `[B, T, H_v, V]`. The backward (`backward`) runs the two walks of walk.py and
`backward_chunks`, which forms every chunk's gradients in parallel, with no XLA preparation either.
Opt-in (`chunked_attention(..., fused=True)`): it has run in the Mosaic GPU interpreter and lowered for
an H200, not yet on the GPU itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import prep
from pallas_kernels.gpu import walk
from pallas_kernels.gpu.walk import (BLOCK_V, COLS, F32, WGMMA, _initial, _program, _store_last,
                                     _vary_like, _walk_chunks, matmul, smem)

ROWS = plgpu.Layout.WGMMA.reduce(1)   # one value per row of a WGMMA-layout tile


def serves(g, beta, segment_ids) -> bool:
  """True for the calls these kernels take: additive family, no or scalar decay (packed or not)."""
  del segment_ids  # packed rows are served (`segment_vectors`)
  return beta is None and (g is None or g.ndim == 3)


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


def _segment_masks(m_s, slot, C):
  """(same-run `[C, C]` bool, carry `[C]`, to_last `[C]`, carry of the last token) of one chunk."""
  at = (lambda i: m_s.at[slot, i]) if slot is not None else (lambda i: m_s.at[i])
  run_r = plgpu.load(at(0), layout=ROWS)
  run_c = plgpu.load(at(1), layout=COLS)
  same = lax.broadcast_in_dim(run_r, (C, C), [0]) == lax.broadcast_in_dim(run_c, (C, C), [1])
  carry_last = m_s[slot, 2, C - 1] if slot is not None else m_s[2, C - 1]
  return same, plgpu.load(at(2), layout=ROWS), plgpu.load(at(3), layout=ROWS), carry_last


def local_cumsum(g, B: int, T_pad: int, Hv: int, C: int):
  """`[B, H_v, T_pad]` float32: the cumulative log-decay from each chunk's start (zeros for no decay)."""
  if g is None:
    return jnp.zeros((B, Hv, T_pad), F32)
  g = jnp.pad(g.astype(F32), [(0, 0), (0, T_pad - g.shape[1]), (0, 0)])
  return jnp.cumsum(jnp.swapaxes(g, 1, 2).reshape(B, Hv, T_pad // C, C), axis=-1).reshape(B, Hv, T_pad)


def forward(q, k, v, g, h0, *, chunk_size: int, dtype, out_dtype, segment_ids=None, interpret=None,
            block_v: int = BLOCK_V):
  """`(o [B, H_v, NC, C, V] unscaled in out_dtype, final [B, H_v, K, V] float32)`.

  q, k: `[B, T, H, K]`; v: `[B, T, H_v, V]`; g: None or `[B, T, H_v]`; h0: None or `[B, H_v, K, V]`;
  segment_ids: None or `[B, T]`. Matmul operands in `dtype` (bfloat16 or float16), accumulation and
  state in float32.
  """
  B, T, H, K = q.shape
  Hv, V = v.shape[2:]
  C = chunk_size
  NC = -(-T // C)
  T_pad = NC * C
  bv = min(block_v, V)
  group = Hv // H
  has_h0 = h0 is not None
  pad = lambda x: jnp.pad(x.astype(dtype), [(0, 0), (0, T_pad - T), (0, 0), (0, 0)])
  q, k, v = pad(q), pad(k), pad(v)
  G = local_cumsum(g, B, T_pad, Hv, C)
  has_seg = segment_ids is not None

  scratch = dict(
      q_s=smem((2, C, K), dtype), k_s=smem((2, C, K), dtype), v_s=smem((2, C, bv), dtype),
      g_s=plgpu.SMEM((2, C), F32), gc_s=plgpu.SMEM((2, C), F32),
      qg_s=smem((C, K), dtype), kd_s=smem((C, K), dtype), p_s=smem((C, C), dtype),
      h_s=smem((2, bv, K), dtype), o_s=smem((2, C, bv), out_dtype), state_s=plgpu.SMEM((bv, K), F32),
      in_bar=plgpu.Barrier(num_arrivals=5 + SEG_ROWS * has_seg, num_barriers=2),
      state_bar=plgpu.Barrier())
  if has_seg:
    scratch["m_s"] = plgpu.SMEM((2, SEG_ROWS, C), F32)

  def body(q_r, k_r, v_r, g_r, *refs, q_s, k_s, v_s, g_s, gc_s, qg_s, kd_s, p_s, h_s, o_s, state_s, in_bar,
           state_bar, m_s=None):
    refs = list(refs)
    m_r = refs.pop(0) if has_seg else None
    h0_r = refs.pop(0) if has_h0 else None
    o_r, final_r = refs
    b, h, vs = _program(bv)
    hk = lax.div(h, group)

    def issue(n, slot):
      rows, bar = pl.ds(n * C, C), in_bar.at[slot]
      plgpu.copy_gmem_to_smem(q_r.at[b, rows, hk], q_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(k_r.at[b, rows, hk], k_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(v_r.at[b, rows, h, vs], v_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(g_r.at[b, h, rows], g_s.at[slot], bar)
      # the same G again: Mosaic GPU's layout inference wants one layout per buffer (rows, columns)
      plgpu.copy_gmem_to_smem(g_r.at[b, h, rows], gc_s.at[slot], bar)
      for i in range(SEG_ROWS if has_seg else 0):
        plgpu.copy_gmem_to_smem(m_r.at[b, i, rows], m_s.at[slot, i], bar)

    def chunk(n, slot, s_t):
      # The chunk's tensors, in shared memory: P, q e^G and k e^(G_C - G).
      G_rows = plgpu.load(g_s.at[slot], layout=ROWS)
      G_cols = plgpu.load(gc_s.at[slot], layout=COLS)
      G_last = g_s[slot, C - 1]
      rows = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])
      sq = (C, C)
      causal = (plgpu.broadcasted_iota(jnp.int32, sq, 0, layout=WGMMA)
                >= plgpu.broadcasted_iota(jnp.int32, sq, 1, layout=WGMMA))
      q_scale, k_scale, s_decay = jnp.exp(G_rows), jnp.exp(G_last - G_rows), jnp.exp(G_last)
      if has_seg:  # pairs of one run only; the carried state reaches its own run
        same, carry, to_last, carry_last = _segment_masks(m_s, slot, C)
        causal = causal & same
        q_scale, k_scale, s_decay = q_scale * carry, k_scale * to_last, s_decay * carry_last
      expo = jnp.where(causal, rows(G_rows, sq) - lax.broadcast_in_dim(G_cols, sq, [1]), -jnp.inf)
      p_s[...] = (matmul(q_s.at[slot], k_s.at[slot].T, sq) * jnp.exp(expo)).astype(dtype)
      qk = (C, K)
      qg_s[...] = (plgpu.load(q_s.at[slot], layout=WGMMA).astype(F32) * rows(q_scale, qk)).astype(dtype)
      kd_s[...] = (plgpu.load(k_s.at[slot], layout=WGMMA).astype(F32) * rows(k_scale, qk)).astype(dtype)
      # The walk (walk.forward, additive): o^T = S^T Qg^T + v^T P^T, S^T <- e^(G_C) S^T + v^T Kd.
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)
      s_lo = h_s.at[slot]
      s_lo[...] = s_t.astype(dtype)
      plgpu.commit_smem()
      v_t = v_s.at[slot].T
      o_t = matmul(s_lo, qg_s.T, (bv, C))
      o_t = matmul(v_t, p_s.T, (bv, C), init=o_t)
      o_s.at[slot].T[...] = o_t.astype(out_dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_s.at[slot], o_r.at[b, h, pl.ds(n * C, C), vs])
      return matmul(v_t, kd_s, (bv, K), init=s_t * s_decay)

    init = lambda: _initial(h0_r.at[b, h, vs] if has_h0 else None, state_s, state_bar, bv, K)
    _store_last(_walk_chunks(NC, issue, in_bar, init, chunk), state_s, final_r.at[b, h, vs])

  args = ([q, k, v, G] + ([segment_vectors(segment_ids, C, T_pad)] if has_seg else [])
          + ([jnp.swapaxes(h0.astype(F32), -1, -2)] if has_h0 else []))
  out_type = (jax.ShapeDtypeStruct((B, Hv, T_pad, V), out_dtype), jax.ShapeDtypeStruct((B, Hv, V, K), F32))
  o, final = plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=(B, Hv, V // bv), grid_names=("b", "h", "v"),
      compiler_params=plgpu.CompilerParams(approx_math=True), interpret=interpret,
      kernel_name="chunk_walk_fused_fwd")(*args)
  o, final = _vary_like((o, final), args)
  return o.reshape(B, Hv, NC, C, V), jnp.swapaxes(final, -1, -2)


def backward_chunks(q, k, v, G, states, dstates, do, *, dtype, masks=None, interpret=None):
  """The additive family's per-chunk gradients, every chunk in parallel (one program per chunk of one
  value head), from the (transposed) state entering each chunk and the gradient of the state leaving it.

  With `D_ij = e^(G_i - G_j)` (j <= i), `P = (q k^T) * D`, `dP = do v^T`, `kd = k e^(G_C - G)`:

      dq = e^G * (do S^T) + (dP * D) k          dv = P^T do + kd dS
      dk = (dP * D)^T q + e^(G_C - G) * (v dS^T)
      dG_i = q_i e^(G_i) . (do S^T)_i + sum_j (dP * P)_ij - sum_j (dP * P)_ji - kd_i . (v dS^T)_i

  and the last token's `dG` also takes `sum_i kd_i . (v dS^T)_i + e^(G_C) sum(S * dS)`, which the caller
  adds (`kdv`, the per-token terms of the first sum, is returned for it). With `masks`
  (`segment_vectors`), D keeps pairs of one run, `e^G` counts only where the token reads the carried
  state and `kd` only where its write reaches the chunk's end.

  Args: q, k `[B, T_pad, H, K]`, v `[B, T_pad, H_v, V]` (operand dtype); G `[B, H_v, T_pad]` float32;
    states, dstates `[B, H_v, NC, V, K]` (operand dtype); do `[B, H_v, T_pad, V]` (operand dtype).
  Returns: dq, dk `[B, T_pad, H_v, K]` (per value head), dv `[B, T_pad, H_v, V]`, float32; dG, kdv
    `[B, H_v, T_pad]` float32.
  """
  B, T_pad, H, K = q.shape
  Hv, V = v.shape[2:]
  NC, C = states.shape[2], T_pad // states.shape[2]
  group = Hv // H
  has_seg = masks is not None
  scratch = dict(
      q_s=smem((C, K), dtype), k_s=smem((C, K), dtype), v_s=smem((C, V), dtype), do_s=smem((C, V), dtype),
      st_s=smem((V, K), dtype), dst_s=smem((V, K), dtype),
      g_s=plgpu.SMEM((C,), F32), gc_s=plgpu.SMEM((C,), F32),
      p_s=smem((C, C), dtype), dpd_s=smem((C, C), dtype),
      kd_s=smem((C, K), dtype), out_s=plgpu.SMEM((C, max(K, V)), F32),
      vec_s=plgpu.SMEM((2, C), F32), bar=plgpu.Barrier(num_arrivals=8 + SEG_ROWS * has_seg))
  if has_seg:
    scratch["m_s"] = plgpu.SMEM((SEG_ROWS, C), F32)

  def body(*refs, q_s, k_s, v_s, do_s, st_s, dst_s, g_s, gc_s, p_s, dpd_s, kd_s, out_s, vec_s, bar,
           m_s=None):
    q_r, k_r, v_r, g_r, st_r, dst_r, do_r = refs[:7]
    m_r = refs[7] if has_seg else None
    dq_r, dk_r, dv_r, dg_r, kdv_r = refs[7 + has_seg:]
    b, h, n = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
    hk = lax.div(h, group)
    rows_t = pl.ds(n * C, C)
    copies = [(q_r.at[b, rows_t, hk], q_s), (k_r.at[b, rows_t, hk], k_s), (v_r.at[b, rows_t, h], v_s),
              (do_r.at[b, h, rows_t], do_s), (st_r.at[b, h, n], st_s), (dst_r.at[b, h, n], dst_s),
              (g_r.at[b, h, rows_t], g_s), (g_r.at[b, h, rows_t], gc_s)]
    copies += [(m_r.at[b, i, rows_t], m_s.at[i]) for i in range(SEG_ROWS if has_seg else 0)]
    for src, dst in copies:
      plgpu.copy_gmem_to_smem(src, dst, bar)
    plgpu.barrier_wait(bar)

    G_rows = plgpu.load(g_s, layout=ROWS)
    G_cols = plgpu.load(gc_s, layout=COLS)
    G_last = g_s[C - 1]
    rows = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])
    sq, ck = (C, C), (C, K)
    i = plgpu.broadcasted_iota(jnp.int32, sq, 0, layout=WGMMA)
    j = plgpu.broadcasted_iota(jnp.int32, sq, 1, layout=WGMMA)
    diff = rows(G_rows, sq) - lax.broadcast_in_dim(G_cols, sq, [1])     # G_i - G_j
    lower, upper = i >= j, i <= j
    q_scale, k_decay = jnp.exp(G_rows), jnp.exp(G_last - G_rows)
    if has_seg:
      same, carry, to_last, _ = _segment_masks(m_s, None, C)
      lower, upper = lower & same, upper & same
      q_scale, k_decay = q_scale * carry, k_decay * to_last
    D = jnp.exp(jnp.where(lower, diff, -jnp.inf))
    P = matmul(q_s, k_s.T, sq) * D
    dP = matmul(do_s, v_s.T, sq)
    A = dP * P
    # (dP P)^T from its own matmuls: the column sums of dP P are the row sums of its transpose
    A_t = matmul(v_s, do_s.T, sq) * matmul(k_s, q_s.T, sq) * jnp.exp(jnp.where(upper, -diff, -jnp.inf))
    p_s[...] = P.astype(dtype)
    dpd_s[...] = (dP * D).astype(dtype)
    kd_s[...] = (plgpu.load(k_s, layout=WGMMA).astype(F32) * rows(k_decay, ck)).astype(dtype)
    plgpu.commit_smem()

    def emit(x, dst):
      """Stages the float32 tile `x` and copies it to `dst`."""
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      out_s.at[:, pl.ds(0, x.shape[1])][...] = x
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_s.at[:, pl.ds(0, x.shape[1])], dst)

    # dq = e^G (do S^T) + (dP D) k; the first dG term needs (do S^T) too
    do_st = matmul(do_s, st_s, ck)
    gamma = rows(q_scale, ck)
    dG = jnp.sum(plgpu.load(q_s, layout=WGMMA).astype(F32) * gamma * do_st, axis=1)
    emit(gamma * do_st + matmul(dpd_s, k_s, ck), dq_r.at[b, rows_t, h])
    # dk = (dP D)^T q + e^(G_C - G) (v dS^T)
    v_dst = matmul(v_s, dst_s, ck)
    kdv = jnp.sum(plgpu.load(kd_s, layout=WGMMA).astype(F32) * v_dst, axis=1)
    emit(matmul(dpd_s.T, q_s, ck) + rows(k_decay, ck) * v_dst, dk_r.at[b, rows_t, h])
    # dv = P^T do + kd dS
    emit(matmul(p_s.T, do_s, (C, V)) + matmul(kd_s, dst_s.T, (C, V)), dv_r.at[b, rows_t, h])
    # dG = ... + rowsum(dP P) - colsum(dP P) - kd . (v dS^T)
    dG = dG + jnp.sum(A, axis=1) - jnp.sum(A_t, axis=1) - kdv
    vec_s.at[0][...] = dG
    vec_s.at[1][...] = kdv
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(vec_s.at[0], dg_r.at[b, h, rows_t])
    plgpu.copy_smem_to_gmem(vec_s.at[1], kdv_r.at[b, h, rows_t])
    plgpu.wait_smem_to_gmem(0)

  args = [q.astype(dtype), k.astype(dtype), v.astype(dtype), G, states.astype(dtype),
          dstates.astype(dtype), do.astype(dtype)] + ([masks] if has_seg else [])
  out_type = (jax.ShapeDtypeStruct((B, T_pad, Hv, K), F32), jax.ShapeDtypeStruct((B, T_pad, Hv, K), F32),
              jax.ShapeDtypeStruct((B, T_pad, Hv, V), F32), jax.ShapeDtypeStruct((B, Hv, T_pad), F32),
              jax.ShapeDtypeStruct((B, Hv, T_pad), F32))
  outs = plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=(B, Hv, NC), grid_names=("b", "h", "n"),
      compiler_params=plgpu.CompilerParams(approx_math=True), interpret=interpret,
      kernel_name="chunk_grads_fused")(*args)
  return _vary_like(outs, args)


def backward(q, k, v, g, h0, do, dfinal, *, chunk_size: int, dtype, segment_ids=None, interpret=None):
  """`(dq, dk, dv, dg, dh0)` of `forward` (in q, k, v, g's dtypes; dh0 float32), for the cotangents
  `do: [B, H_v, NC, C, V]` (of the unscaled o) and `dfinal: None | [B, H_v, K, V]`.

  Three kernels: the forward walk storing the state entering every chunk, the reverse walk storing the
  gradient of the state leaving every chunk (walk.py), then every chunk's gradients in parallel
  (`backward_chunks`). XLA forms only `q e^G` and `k e^(G_C - G)` for the walks (elementwise) and adds
  up the per-value-head dq, dk of grouped heads.
  """
  B, T, H, K = q.shape
  Hv, V = v.shape[2:]
  C = chunk_size
  NC = -(-T // C)
  T_pad = NC * C
  group = Hv // H
  pad = lambda x: jnp.pad(x.astype(dtype), [(0, 0), (0, T_pad - T), (0, 0), (0, 0)])
  qp, kp, vp = pad(q), pad(k), pad(v)
  G = local_cumsum(g, B, T_pad, Hv, C)
  Gc = G.reshape(B, Hv, NC, C)
  G_last = Gc[..., -1:]
  q_scale, k_scale, s_decay = jnp.exp(Gc), jnp.exp(G_last - Gc), jnp.exp(G_last)
  masks = None
  if segment_ids is not None:
    masks = segment_vectors(segment_ids, C, T_pad)
    carry, to_last = (masks[:, None, i].reshape(B, 1, NC, C) for i in (2, 3))
    q_scale, k_scale, s_decay = q_scale * carry, k_scale * to_last, s_decay * carry[..., -1:]
  heads = lambda x: prep.to_chunks(jnp.repeat(x, group, axis=2) if group > 1 else x, C, T_pad)
  t = prep.ChunkTensors(
      qg=(heads(qp).astype(F32) * q_scale[..., None]).astype(dtype),
      kd=(heads(kp).astype(F32) * k_scale[..., None]).astype(dtype),
      w=None, u=prep.to_chunks(vp, C, T_pad), p=None,
      decay=jnp.broadcast_to(s_decay, (B, Hv, NC, K)))
  _, states, _ = walk.forward(t, h0, with_o=False, with_states=True, out_dtype=dtype, interpret=interpret)
  dstates, dh0 = walk.backward_states(t, do, dfinal, interpret=interpret)
  dq, dk, dv, dG, kdv = backward_chunks(qp, kp, vp, G, states, dstates, do.reshape(B, Hv, T_pad, V),
                                        dtype=dtype, masks=masks, interpret=interpret)
  last = (jnp.sum(kdv.reshape(B, Hv, NC, C), axis=-1) + s_decay[..., 0]
          * jnp.einsum("bhnvk,bhnvk->bhn", states, dstates, preferred_element_type=F32))
  dG = dG.reshape(B, Hv, NC, C).at[..., -1].add(last)
  dg = jnp.flip(jnp.cumsum(jnp.flip(dG, -1), -1), -1).reshape(B, Hv, T_pad)   # G = cumsum(g) per chunk
  per_head = lambda x: x.reshape(B, T_pad, H, group, K).sum(3)[:, :T] if group > 1 else x[:, :T]
  return (per_head(dq).astype(q.dtype), per_head(dk).astype(k.dtype), dv[:, :T].astype(v.dtype),
          None if g is None else jnp.swapaxes(dg, 1, 2)[:, :T].astype(g.dtype), dh0)
