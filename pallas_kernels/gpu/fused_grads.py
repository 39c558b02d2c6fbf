"""The additive family's per-chunk gradients for no or scalar decay in one Mosaic GPU kernel, every
chunk in parallel, from the raw tiles, the state entering each chunk and the gradient of the state
leaving it (`chunk_grads_fused`; `fused.backward` runs the walks before it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from .decay import last_state_term
from .masks import SEG_ROWS, segment_masks
from .once import lowered_once
from .tiles import COLS, F32, ROWS, WGMMA, compiler_params, matmul, smem, vary_like


@lowered_once(arrays=("masks",))
def chunk_grads(q, k, v, G, states, dstates, do, *, dtype, masks=None, interpret=None,
                    grad_dtypes=(F32, F32, F32), scale: float = 1.0):
  """The additive family's per-chunk gradients, every chunk in parallel (one program per chunk of one
  value head), from the (transposed) state entering each chunk and the gradient of the state leaving it.

  With `D_ij = e^(G_i - G_j)` (j <= i), `P = (q k^T) * D`, `kd = k e^(G_C - G)` and `do` the gradient of
  the unscaled o (`scale` times the given one), `dP = do v^T`:

      dq = e^G * (do S^T) + (dP * D) k          dv = P^T do + kd dS
      dk = (dP * D)^T q + e^(G_C - G) * (v dS^T)
      dG_i = q_i e^(G_i) . (do S^T)_i + sum_j (dP * P)_ij - sum_j (dP * P)_ji - kd_i . (v dS^T)_i

  and the last token's `dG` also takes `sum_i kd_i . (v dS^T)_i + e^(G_C) sum(S * dS)`, which the caller
  adds as the sum of the returned `kdv` over the chunk (`kdv` holds the per-token terms of the first
  sum plus the row sums of `e^(G_C) S * dS`, folded onto the chunk's rows). With `masks`
  (`segment_vectors`), D keeps pairs of one run, `e^G` counts only where the token reads the carried
  state and `kd` only where its write reaches the chunk's end.

  Args: q, k `[B, T_pad, H, K]`, v `[B, T_pad, H_v, V]` (operand dtype); G `[B, H_v, T_pad]` float32;
    states, dstates `[B, H_v, NC, V, K]` (operand dtype); do `[B, T_pad, H_v, V]` (operand dtype).
    grad_dtypes: the dtypes of dq, dk, dv as written (float32 where the caller still sums over grouped
    heads; else the inputs' dtypes, which saves a float32 round trip through device memory).
  Returns: dq, dk `[B, T_pad, H_v, K]` (per value head), dv `[B, T_pad, H_v, V]` in `grad_dtypes`; dG,
    kdv `[B, H_v, T_pad]` float32.
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
      kd_s=smem((C, K), dtype),
      # one staging tile per dtype and width of the gradients, reused (shared memory is tight at
      # K = V = 128; a TMA copy wants a whole, contiguous tile)
      # (swizzled: with lane semantics, jax 0.12's store of a WGMMA-layout array into a plain 64-column
      # tile finds no transfer free of bank conflicts)
      out_s={f"{jnp.dtype(t).name}_{n}": smem((C, n), t) for t, n in zip(grad_dtypes, (K, K, V))},
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
              (do_r.at[b, rows_t, h], do_s), (st_r.at[b, h, n], st_s), (dst_r.at[b, h, n], dst_s),
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
      same, carry, to_last, _ = segment_masks(m_s, None, C)
      lower, upper = lower & same, upper & same
      q_scale, k_decay = q_scale * carry, k_decay * to_last
    D = jnp.exp(jnp.where(lower, diff, -jnp.inf))
    P = matmul(q_s, k_s.T, sq) * D
    dP = matmul(do_s, v_s.T, sq) * scale
    A_rows = jnp.sum(dP * P, axis=1)   # row sums now: the [C, C] tiles need not stay live
    # (dP P)^T from its own matmuls: the column sums of dP P are the row sums of its transpose
    A_cols = jnp.sum((matmul(v_s, do_s.T, sq) * scale) * matmul(k_s, q_s.T, sq) * jnp.exp(
        jnp.where(upper, -diff, -jnp.inf)), axis=1)
    p_s[...] = P.astype(dtype)
    dpd_s[...] = (dP * D).astype(dtype)
    kd_s[...] = (plgpu.load(k_s, layout=WGMMA).astype(F32) * rows(k_decay, ck)).astype(dtype)
    plgpu.commit_smem()

    def emit(x, i, dst):
      """Stages the float32 tile `x` in the `i`-th gradient's dtype and copies it to `dst`."""
      tile = out_s[f"{jnp.dtype(grad_dtypes[i]).name}_{x.shape[1]}"]
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      tile[...] = x.astype(tile.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(tile, dst)

    # dq = e^G (do S^T) + (dP D) k; the first dG term needs (do S^T) too
    do_st = matmul(do_s, st_s, ck) * scale
    gamma = rows(q_scale, ck)
    dG = jnp.sum(plgpu.load(q_s, layout=WGMMA).astype(F32) * gamma * do_st, axis=1)
    emit(gamma * do_st + matmul(dpd_s, k_s, ck), 0, dq_r.at[b, rows_t, h])
    # dk = (dP D)^T q + e^(G_C - G) (v dS^T)
    v_dst = matmul(v_s, dst_s, ck)
    kdv = jnp.sum(plgpu.load(kd_s, layout=WGMMA).astype(F32) * v_dst, axis=1)
    emit(matmul(dpd_s.T, q_s, ck) + rows(k_decay, ck) * v_dst, 1, dk_r.at[b, rows_t, h])
    # dv = P^T do + kd dS
    emit(matmul(p_s.T, do_s, (C, V)) * scale + matmul(kd_s, dst_s.T, (C, V)), 2, dv_r.at[b, rows_t, h])
    # dG = ... + rowsum(dP P) - colsum(dP P) - kd . (v dS^T)
    dG = dG + A_rows - A_cols - kdv
    vec_s.at[0][...] = dG
    # the caller sums kdv over the chunk for the last token's dG, which also takes e^(G_C) sum(S dS):
    # that sum is added here, row by row of S (the states are in shared memory already)
    vec_s.at[1][...] = kdv + last_state_term(g_s, m_s, st_s, dst_s, C)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(vec_s.at[0], dg_r.at[b, h, rows_t])
    plgpu.copy_smem_to_gmem(vec_s.at[1], kdv_r.at[b, h, rows_t])
    plgpu.wait_smem_to_gmem(0)

  args = [q.astype(dtype), k.astype(dtype), v.astype(dtype), G, states.astype(dtype),
          dstates.astype(dtype), do.astype(dtype)] + ([masks] if has_seg else [])
  dq_t, dk_t, dv_t = grad_dtypes
  out_type = (jax.ShapeDtypeStruct((B, T_pad, Hv, K), dq_t), jax.ShapeDtypeStruct((B, T_pad, Hv, K), dk_t),
              jax.ShapeDtypeStruct((B, T_pad, Hv, V), dv_t), jax.ShapeDtypeStruct((B, Hv, T_pad), F32),
              jax.ShapeDtypeStruct((B, Hv, T_pad), F32))
  outs = plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=(B, Hv, NC), grid_names=("b", "h", "n"),
      compiler_params=compiler_params(approx_math=True), interpret=interpret,
      kernel_name="chunk_grads_fused")(*args)
  return vary_like(outs, args)
