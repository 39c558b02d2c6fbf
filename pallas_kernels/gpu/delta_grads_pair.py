"""The delta family's per-chunk gradients for two value blocks in one program of two warpgroups
(`chunk_grads_delta_pair`; `delta_grads.backward(..., warpgroups=2)` where `delta_grads.pair_serves`):
the math of delta_grads.py's docstring, the two blocks' partial sums added in shared memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from .decay import decay_tile, last_state_term, row_scales
from .delta_terms import dl_and_m
from .masks import SEG_ROWS
from .once import lowered_once
from .tiles import (BLOCK_V, COLS, F32, ROWS, SMEM_BYTES, WGMMA, compiler_params, l2_normalize_grad,
                    l2_normalize_rows, matmul, matmuls, phase, phase_bytes, scratch_bytes, smem,
                    vary_like)


def _pair_scratch(C, K, bv, dtype, has_seg):
  """Shared memory of `chunk_grads_pair`: q, k, X and the dq / dk staging tile once; per warpgroup
  (leading 2) v, do, S, dS and four working tiles: `buf` holds r, then u, then r again (recomputed),
  then -beta e^G dB_v; `p` holds P, then X dX^T, then X^T dX, then dM D; `a` holds dP D; `du` holds du,
  then dX; `do` holds do, then e^(G_C - G) u. dv is staged in v's tile once dbeta has read it. dk's five
  terms are products of these tiles, chained in one accumulator at the end (no `[C, K]` float32 tile
  lives through the middle phases)."""
  two = lambda shape: smem((2,) + shape, dtype)
  scratch = dict(
      q_s=smem((C, K), dtype), k_s=smem((C, K), dtype), x_s=smem((C, C), dtype), out_k=smem((C, K), dtype),
      v_s=two((C, bv)), do_s=two((C, bv)), st_s=two((bv, K)), dst_s=two((bv, K)),
      buf_s=two((C, bv)), p_s=two((C, C)), a_s=two((C, C)), du_s=two((C, bv)),
      vec_s=plgpu.SMEM((2, 3, C), F32), norm_s=plgpu.SMEM((2, C), F32),
      g_s=plgpu.SMEM((C,), F32), gc_s=plgpu.SMEM((C,), F32), b_s=plgpu.SMEM((C,), F32),
      bc_s=plgpu.SMEM((C,), F32), bar=plgpu.Barrier(num_arrivals=6 + SEG_ROWS * has_seg),
      q_bar=plgpu.Barrier(), early=plgpu.Barrier(num_arrivals=2, num_barriers=2),
      late=plgpu.Barrier(num_arrivals=2, num_barriers=2),
      # warpgroup 0 -> 1: k normalised, q normalised, out_k free again; 1 -> 0: its dq, dk, vectors staged
      sync=plgpu.Barrier(num_barriers=6), done=plgpu.Barrier(num_arrivals=2))
  if has_seg:
    scratch["m_s"] = plgpu.SMEM((SEG_ROWS, C), F32)
  return scratch


@lowered_once(arrays=("masks",))
def chunk_grads_pair(q, k, v, G, b, X, states, dstates, do, *, dtype, masks=None, interpret=None,
                     qk_l2norm: bool = False, programs: int | None = None):
  """`delta_grads.chunk_grads` for two value blocks (V = 2 x 64) in one program of two warpgroups, one
  per block, sharing q, k and X: while one warpgroup waits on its tensor-core products or shared-memory
  fences the other computes (one warpgroup alone leaves half of an SM's registers unused, and
  `chunk_grads` fits one program per SM). The two blocks' partial dq, dk, dG, dbeta and kdv are added
  inside the program (warpgroup 1 stages its partial, warpgroup 0 adds its own and writes the sum), so
  no partial sums reach device memory. V = 256 (V = 4 x 64): one program per pair of blocks, each
  writing its pair's partial sums (the leading dimension, V / 128: the caller adds them). Same inputs
  and outputs as `chunk_grads` otherwise; dv in the operand dtype. The column sums of `A = dP P + dM M` come from
  transposed products (as rows), not cross-warp reductions, whose scratch the two warpgroups would share.

  programs: None (one program a chunk and pair of blocks: the grid) or that many persistent programs,
  program p taking the items p, p + P, ... in turn (the items in the grid's order, its pair fastest):
  what a program pays before its first and after its last phase is paid once, not once a chunk (NOTES.md
  v50: a program's phases span ~17 us of the ~22 us a chunk's program takes on the H200).

  In the Mosaic GPU interpreter the two warpgroups run as separate computations on XLA's CPU thread
  pool, which needs at least three threads (launcher + two warpgroups). That pool has one thread per
  core unless the environment variable `NPROC` says otherwise, so a 2-core machine hangs without
  `NPROC >= 3`, set before JAX's CPU backend starts (tests/conftest.py sets 12)."""
  B, T_pad, H, K = q.shape
  Hv, V = v.shape[2:]
  NC = states.shape[2]
  C = T_pad // NC
  bv = BLOCK_V
  if V not in (2 * bv, 4 * bv) or C != bv:
    raise ValueError(f"chunk_grads_pair serves V = {2 * bv} or {4 * bv} in chunks of {bv}; got V={V}, C={C}")
  NP = V // (2 * bv)   # pairs of value blocks: one program each, partial sums of dq, dk and the vectors
  items = B * Hv * NC * NP
  if programs is not None and (isinstance(programs, bool) or not isinstance(programs, int) or programs < 1):
    raise ValueError(f"programs must be None or a positive int; got {programs!r}")
  P = None if programs is None else min(programs, items)
  if jnp.dtype(v.dtype).itemsize != 2 or jnp.dtype(dtype).itemsize != 2:
    raise ValueError(f"chunk_grads_pair needs 16-bit operands; got v {v.dtype}, dtype {jnp.dtype(dtype)}")
  group = Hv // H
  has_seg = masks is not None
  scratch = _pair_scratch(C, K, bv, dtype, has_seg)
  if scratch_bytes(scratch) + phase_bytes(2) > SMEM_BYTES:
    raise ValueError(f"chunk_grads_pair needs {scratch_bytes(scratch) + phase_bytes(2)} bytes of shared memory "
                     f"(at most {SMEM_BYTES})")
  K_NORMED, Q_NORMED, DQ_STAGED, OUT_FREE, DK_STAGED, VEC_STAGED = range(6)

  def body(*refs, q_s, k_s, x_s, out_k, v_s, do_s, st_s, dst_s, buf_s, p_s, a_s, du_s, vec_s, norm_s,
           g_s, gc_s, b_s, bc_s, bar, q_bar, early, late, sync, done, m_s=None):
    q_r, k_r, v_r, g_r, b_r, x_r, st_r, dst_r, do_r = refs[:9]
    m_r = refs[9] if has_seg else None
    dq_r, dk_r, dv_r, dg_r, db_r, kdv_r = refs[9 + has_seg:]
    wg = lax.axis_index("wg")

    def one(bi, h, n, pv):
      """Chunk n of batch row bi, value head h, pair of value blocks pv."""
      hk = lax.div(h, group)
      rows_t = pl.ds(n * C, C)
      vs = pl.ds((2 * pv + wg) * bv, bv)
      first, second = wg == 0, wg == 1
      v_b, do_b, st_b, dst_b = v_s.at[wg], do_s.at[wg], st_s.at[wg], dst_s.at[wg]
      buf, p_b, a_b, du_b = buf_s.at[wg], p_s.at[wg], a_s.at[wg], du_s.at[wg]

      @pl.when(first)
      def _shared_inputs():
        copies = [(k_r.at[bi, rows_t, hk], k_s), (x_r.at[bi, h, rows_t], x_s), (g_r.at[bi, h, rows_t], g_s),
                  (g_r.at[bi, h, rows_t], gc_s), (b_r.at[bi, h, rows_t], b_s), (b_r.at[bi, h, rows_t], bc_s)]
        copies += [(m_r.at[bi, r, rows_t], m_s.at[r]) for r in range(SEG_ROWS if has_seg else 0)]
        for src, dst in copies:
          plgpu.copy_gmem_to_smem(src, dst, bar)
        plgpu.copy_gmem_to_smem(q_r.at[bi, rows_t, hk], q_s, q_bar)

      plgpu.copy_gmem_to_smem(v_r.at[bi, rows_t, h, vs], v_b, early.at[wg])
      plgpu.copy_gmem_to_smem(st_r.at[bi, h, n, vs], st_b, early.at[wg])
      plgpu.copy_gmem_to_smem(do_r.at[bi, rows_t, h, vs], do_b, late.at[wg])
      plgpu.copy_gmem_to_smem(dst_r.at[bi, h, n, vs], dst_b, late.at[wg])
      with phase("pair.wait_shared"):
        plgpu.barrier_wait(bar)

      def normalised(tile, idx, flag):
        """q or k l2-normalised in place by warpgroup 0 (its reciprocal norms kept for the gradient); the
        other warpgroup waits for it."""
        if not qk_l2norm:
          return
        @pl.when(first)
        def _():
          norm_s.at[idx][...] = l2_normalize_rows(tile, C)
          plgpu.commit_smem()
          plgpu.barrier_arrive(sync.at[flag])

        @pl.when(second)
        def _():
          plgpu.barrier_wait(sync.at[flag])

      with phase("pair.normalise_k"):
        normalised(k_s, 1, K_NORMED)
      rows = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])
      cols = lambda x, shape: lax.broadcast_in_dim(x, shape, [1])
      sq, ck, cv = (C, C), (C, K), (C, bv)
      fresh = lax.optimization_barrier

      def vectors():
        return (fresh(plgpu.load(b_s, layout=ROWS)),) + row_scales(g_s, m_s, C)

      decay = lambda lower, strict: decay_tile(g_s, gc_s, m_s, C, lower=lower, strict=strict)

      def form_r():
        """r = B_v - B_k S^T = beta (v - e^G k S^T) into `buf`."""
        beta, e_q, _ = vectors()
        ks = matmul(k_s, st_b.T, cv)
        buf[...] = (rows(beta, cv) * (plgpu.load(v_b, layout=WGMMA).astype(F32) - rows(e_q, cv) * ks)).astype(dtype)
        plgpu.commit_smem()
        return ks

      def summed(x, staged, done=None):
        """The two warpgroups' partial [C, K] tile `x`: warpgroup 1 stages its own (after `done`, the
        barrier saying out_k is free) and signals `staged`; warpgroup 0 adds it to its own and returns the
        sum (warpgroup 1 gets None)."""
        @pl.when(second)
        def _():
          if done is not None:
            plgpu.barrier_wait(sync.at[done])
          out_k[...] = x.astype(dtype)
          plgpu.commit_smem()
          plgpu.barrier_arrive(sync.at[staged])

      def write_sum(x, staged, dst, done=None):
        summed(x, staged, done)

        @pl.when(first)
        def _():
          plgpu.barrier_wait(sync.at[staged])
          total = x + plgpu.load(out_k, layout=WGMMA).astype(F32)
          out_k[...] = total.astype(dtype)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(out_k, dst)
          if done is None:   # out_k is read by this copy; warpgroup 1 may stage again once it is done
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.barrier_arrive(sync.at[OUT_FREE])

      with phase("pair.wait_v_s"):
        plgpu.barrier_wait(early.at[wg])
      with phase("pair.r_u"):
        form_r()
        un = matmul(x_s, buf, cv)            # u = X r; buf then holds u
        buf[...] = un.astype(dtype)
        plgpu.commit_smem()
      with phase("pair.wait_do_ds"):
        plgpu.barrier_wait(late.at[wg])
        plgpu.barrier_wait(q_bar)
        normalised(q_s, 0, Q_NORMED)
      with phase("pair.p_dp"):
        # P, dP; rowsum(dP P) now, and its column sums from the transposed products
        P, dP = matmuls((sq, [(q_s, k_s.T)]), (sq, [(do_b, buf.T)]))
        D = decay(True, False)
        P = P * D
        p_b[...] = P.astype(dtype)
        a_b[...] = (dP * D).astype(dtype)
        plgpu.commit_smem()
        dG = jnp.sum(dP * P, axis=1)
        ud, kq = matmuls((sq, [(buf, do_b.T)]), (sq, [(k_s, q_s.T)]))
        dG = dG - jnp.sum(ud * kq * decay(False, False), axis=1)
      with phase("pair.dq"):
        # dq = e^G (do S^T) + (dP D) k, summed over the two blocks
        _, e_q, _ = vectors()
        dqg = matmul(do_b, st_b, ck)
        dG = dG + e_q * jnp.sum(plgpu.load(q_s, layout=WGMMA).astype(F32) * dqg, axis=1)
        dq = dqg * rows(e_q, ck) + matmul(a_b, k_s, ck)
        if qk_l2norm:
          dq = l2_normalize_grad(dq, q_s, fresh(plgpu.load(norm_s.at[0], layout=ROWS)))
      with phase("pair.dq_out"):
        write_sum(dq, DQ_STAGED, dq_r.at[pv, bi, rows_t, h])
      with phase("pair.du"):
        # du = P^T do + kd dS; dkd = u dS^T only through its row sums with k, rowsum(u (k dS^T)), and as
        # dk's term (e^(G_C - G) u) dS, whose first operand replaces do in do's tile
        du_p, kdS = matmuls((cv, [(p_b.T, do_b)]), (cv, [(k_s, dst_b.T)]))
        _, _, e_k = vectors()
        du_b[...] = (du_p + rows(e_k, cv) * kdS).astype(dtype)
        un = plgpu.load(buf, layout=WGMMA).astype(F32)
        kd_term = e_k * jnp.sum(un * kdS, axis=1)
        do_b[...] = (un * rows(e_k, cv)).astype(dtype)
        plgpu.commit_smem()
        kdv = kd_term + last_state_term(g_s, m_s, st_b, dst_b, C)
        dG = dG - kd_term
      with phase("pair.dx_dbv"):
        # r again (buf held u); dX = du r^T and dB_v = X^T du (issued together) into du's and buf's tiles;
        # dB_k = -dB_v S^T only through its row sums with k, -rowsum(dB_v (k S^T)), and as dk's term
        # (-beta e^G dB_v) S, whose first operand replaces r in buf
        ks = form_r()
        dX, dBv = matmuls((sq, [(du_b, buf.T)]), (cv, [(x_s.T, du_b)]))
        du_b[...] = dX.astype(dtype)
        beta, e_q, _ = vectors()
        dbeta = jnp.sum(dBv * plgpu.load(v_b, layout=WGMMA).astype(F32), axis=1)
        r = -e_q * jnp.sum(dBv * ks, axis=1)
        v_b[...] = (dBv * rows(beta, cv)).astype(dtype)        # dv, staged in v's tile
        buf[...] = (dBv * rows(-beta * e_q, cv)).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(v_b, dv_r.at[bi, rows_t, h, vs])
        dG = dG + beta * r
        dbeta = dbeta + r
      with phase("pair.dl_cols"):
        # column sums of dM M from the transposed products: (dM M)^T = beta_j dL^T (k k^T D_excl)^T,
        # dL^T = -X dX^T X
        p_b[...] = matmul(x_s, du_b.T, sq).astype(dtype)
        plgpu.commit_smem()
        dLt, kk = matmuls((sq, [(p_b, x_s)]), (sq, [(k_s, k_s.T)]))
        beta_cols = fresh(plgpu.load(bc_s, layout=COLS))
        dG = dG + jnp.sum(dLt * cols(beta_cols, sq) * kk * decay(False, True), axis=1)
      with phase("pair.dl_m"):
        # dM = beta dL (du's tile holds dX)
        dL, M = dl_and_m(x_s, du_b, k_s, p_b, decay, dtype, sq)
        dbeta = dbeta + jnp.sum(dL * M, axis=1)
        beta, _, _ = vectors()
        dM = dL * rows(beta, sq)
        dG = dG + jnp.sum(dM * M, axis=1)
      with phase("pair.dk"):
        # dk = (dP D)^T q + e^(G_C - G) dkd + beta e^G dB_k + (dM D) k + (dM D)^T k, one chain of products
        p_b[...] = (dM * decay(True, True)).astype(dtype)
        plgpu.commit_smem()
        (dk,) = matmuls((ck, [(do_b, dst_b), (a_b.T, q_s), (buf, st_b), (p_b, k_s), (p_b.T, k_s)]))
        if qk_l2norm:
          dk = l2_normalize_grad(dk, k_s, fresh(plgpu.load(norm_s.at[1], layout=ROWS)))
      with phase("pair.dk_out"):
        write_sum(dk, DK_STAGED, dk_r.at[pv, bi, rows_t, h], done=OUT_FREE)
      with phase("pair.vectors_out"):
        # the vectors: warpgroup 1 stages its own, warpgroup 0 adds them to its own and writes the sums
        @pl.when(second)
        def _():
          for idx, x in enumerate((dG, dbeta, kdv)):
            vec_s.at[1, idx][...] = x
          plgpu.commit_smem()
          plgpu.barrier_arrive(sync.at[VEC_STAGED])

        @pl.when(first)
        def _():
          plgpu.barrier_wait(sync.at[VEC_STAGED])
          for idx, x in enumerate((dG, dbeta, kdv)):
            vec_s.at[0, idx][...] = x + plgpu.load(vec_s.at[1, idx], layout=ROWS)
          plgpu.commit_smem()
          for idx, dst in enumerate((dg_r, db_r, kdv_r)):
            plgpu.copy_smem_to_gmem(vec_s.at[0, idx], dst.at[pv, bi, h, rows_t])

      with phase("pair.exit"):
        # persistent: the next chunk's copies may overwrite the tiles once the stores have read them
        plgpu.wait_smem_to_gmem(0, wait_read_only=programs is not None)
        plgpu.barrier_arrive(done)   # neither warpgroup exits (or starts the next chunk's copies of the
        plgpu.barrier_wait(done)     # shared tiles) while the other still reads them

    if programs is None:   # one program a chunk (and pair)
      one(*(lax.axis_index(a) for a in ("b", "h", "n", "v")))
      return

    def step(i, carry):   # persistent: program p takes items p, p + P, p + 2P, ...
      item = lax.axis_index("p") + i * P

      @pl.when(item < items)
      def _():
        rest, pv = lax.div(item, NP), lax.rem(item, NP)
        rest, n = lax.div(rest, NC), lax.rem(rest, NC)
        one(lax.div(rest, Hv), lax.rem(rest, Hv), n, pv)
      return carry

    lax.fori_loop(0, pl.cdiv(items, P), step, 0)
    plgpu.wait_smem_to_gmem(0)

  args = [q, k, v, G, b, X, states, dstates, do] + ([masks] if has_seg else [])
  vec = jax.ShapeDtypeStruct((NP, B, Hv, T_pad), F32)
  partial_k = jax.ShapeDtypeStruct((NP, B, T_pad, Hv, K), dtype)
  out_type = (partial_k, partial_k, jax.ShapeDtypeStruct((B, T_pad, Hv, V), v.dtype), vec, vec, vec)
  grid = dict(grid=(B, Hv, NC, NP), grid_names=("b", "h", "n", "v")) if programs is None else dict(
      grid=(P,), grid_names=("p",))
  outs = plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, **grid,
      num_threads=2, thread_name="wg", compiler_params=compiler_params(approx_math=True),
      interpret=interpret, kernel_name="chunk_grads_delta_pair")(*args)
  return vary_like(outs, args)
