"""The delta family's gradients, every chunk in parallel: the backward without XLA's preparation vjp, for
no or scalar decay, packed or not (the default; `chunked_attention(..., delta_backward=False)` takes XLA's vjp).

Per chunk (prep.py's notation; `S` the state entering the chunk, `dS` the gradient of the state leaving
it, both from the two walks; `X = (I + L)^-1` from `delta_prep`; `B_k = beta k e^G`, `B_v = beta v`,
`W = X B_k`, `U = X B_v`, `u = U - W S = X r` with `r = B_v - B_k S`, `P = (q k^T) * D_incl`, `M = (k k^T) * D_excl` so `L = beta M`):

    do S^T = dqg            dP = do u^T             du = P^T do + kd dS        dkd = u dS^T
    dW = -du S^T            dX = du B_v^T + dW B_k^T = du r^T                  dL = -X^T dX X^T
    dB_v = X^T du           dB_k = X^T dW = -dB_v S^T                          dM = beta * dL
    dq = e^G dqg + (dP D) k
    dk = (dP D)^T q + e^(G_C - G) dkd + beta e^G dB_k + (dM D) k + (dM D)^T k
    dv = beta dB_v          dbeta = rowsum(dB_v v) + rowsum(dB_k k e^G) + rowsum(dL M)
    dG = rowsum(dqg q e^G) + rowsum(A) - colsum(A) + beta rowsum(dB_k k e^G) - rowsum(dkd kd),
         A = dP * P + dM * M

and the last token's dG also takes `sum(dkd kd) + e^(G_C) sum(S dS)` (the caller adds it; `kdv` holds
the per-token terms of the first sum). The kernel forms u, dX and dB_k through r and dB_v (no W, dW or
B_k tiles). Every product is a wgmma on 16-bit shared-memory operands, independent ones issued
together; the column sums of A are cross-warp reductions of the tiles already in registers. V splits
into blocks of 64 columns: everything above is linear in (do, dS), so each block's dq, dk, dbeta and dG
are partial sums that the caller adds up. A program takes one block by default;
with `blocks_per_program` > 1 it loops over several, reading q, k and X once and fetching the next
block's v, S, do, dS while the current one computes (slower on the H200 as measured: NOTES v21).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from .. import prep
from . import delta_prep, walk
from .decay import decay_tile, last_state_term, local_cumsum, row_scales
from .delta_grads_pair import chunk_grads_pair
from .delta_terms import dbk_term, dl_and_m, dm_k
from .masks import SEG_ROWS, segment_vectors
from .once import lowered_once
from .tiles import (BLOCK_V, F32, ROWS, SMEM_BYTES, WGMMA, compiler_params, l2_normalize_grad,
                    l2_normalize_rows, matmul, matmuls, scratch_bytes, smem, vary_like)


def _scratch(C, K, bv, dtype, partial_dtype, dv_dtype, slots, has_seg):
  """chunk_grads' shared memory: q, k, X once; v, do, S, dS in `slots` slots (the next value block's
  fetched while the current one computes); the products staged for wgmma; output staging tiles."""
  buf = lambda shape: smem((slots,) + shape, dtype)
  scratch = dict(
      q_s=smem((C, K), dtype), k_s=smem((C, K), dtype), x_s=smem((C, C), dtype),
      v_s=buf((C, bv)), do_s=buf((C, bv)), st_s=buf((bv, K)), dst_s=buf((bv, K)),
      r_s=smem((C, bv), dtype), un_s=smem((C, bv), dtype), du_s=smem((C, bv), dtype),
      dbv_s=smem((C, bv), dtype), p_s=smem((C, C), dtype), a_s=smem((C, C), dtype), dx_s=smem((C, C), dtype),
      out_k=smem((C, K), partial_dtype), out_v=smem((C, bv), dv_dtype),   # swizzled, as every staging tile
      vec_s=plgpu.SMEM((3, C), F32), col_s=plgpu.SMEM((2, C), F32), norm_s=plgpu.SMEM((2, C), F32),
      g_s=plgpu.SMEM((C,), F32), gc_s=plgpu.SMEM((C,), F32), b_s=plgpu.SMEM((C,), F32),
      bar=plgpu.Barrier(num_arrivals=5 + SEG_ROWS * has_seg),
      q_bar=plgpu.Barrier(), early=plgpu.Barrier(num_arrivals=2, num_barriers=slots),
      late=plgpu.Barrier(num_arrivals=2, num_barriers=slots))
  if has_seg:
    scratch["m_s"] = plgpu.SMEM((SEG_ROWS, C), F32)
  return scratch


@lowered_once(arrays=("masks",))
def chunk_grads(q, k, v, G, b, X, states, dstates, do, *, dtype, masks=None, interpret=None,
                block_v: int = BLOCK_V, dv_dtype=F32, partial_dtype=F32, blocks_per_program: int = 1,
                qk_l2norm: bool = False):
  """Per-chunk gradients (module docstring). q, k `[B, T_pad, H, K]`, v `[B, T_pad, H_v, V]` (operand
  dtype); G, b `[B, H_v, T_pad]` float32 (chunk-local cumulative log-decay, beta); X `[B, H_v, T_pad, C]`,
  states, dstates `[B, H_v, NC, V, K]`, do `[B, T_pad, H_v, V]` (gradient of the unscaled o, in o's
  token layout); masks: None or `segment_vectors`. Returns `(dq, dk [NVB, B, T_pad, H_v, K], dv [B, T_pad, H_v,
  V] in dv_dtype, dG, dbeta, kdv [NVB, B, H_v, T_pad])`, NVB = V / block_v partial sums (each block
  owns its columns of dv): dq, dk in partial_dtype (16-bit halves their bytes; the caller adds them in
  float32), dG, dbeta, kdv float32. kdv's sum over a chunk is the last token's extra dG term,
  `sum(dkd * kd) + e^(G_C) sum(S * dS)` (per-token terms of the first, row sums of the block's S * dS
  for the second). blocks_per_program: value blocks per program (a divisor of NVB). qk_l2norm: q and k
  are l2-normalised on load (as `delta_prep.prepare(..., qk_l2norm=True)`) and dq, dk are the gradients
  of the raw q, k (the norm's gradient applied to each partial sum: it is linear)."""
  B, T_pad, H, K = q.shape
  Hv, V = v.shape[2:]
  NC = states.shape[2]
  C = T_pad // NC
  bv = min(block_v, V)
  NVB = V // bv
  if bv != C:   # kdv folds each block's rows of S onto the chunk's rows
    raise ValueError(f"value blocks of the chunk size ({C}) rows only; got {bv}")
  group = Hv // H
  has_seg = masks is not None
  blocks = blocks_per_program
  if blocks < 1 or NVB % blocks:
    raise ValueError(f"blocks_per_program must divide the {NVB} value blocks; got {blocks}")
  slots = min(blocks, 2)
  scratch = _scratch(C, K, bv, dtype, partial_dtype, dv_dtype, slots, has_seg)
  if scratch_bytes(scratch) > SMEM_BYTES:
    raise ValueError(f"blocks_per_program={blocks} needs {scratch_bytes(scratch)} bytes of shared memory "
                     f"(at most {SMEM_BYTES}); use 1")

  def body(*refs, q_s, k_s, v_s, do_s, st_s, dst_s, x_s, r_s, un_s, du_s, dbv_s, p_s, a_s, dx_s, out_k,
           out_v, vec_s, col_s, norm_s, g_s, gc_s, b_s, bar, q_bar, early, late, m_s=None):
    q_r, k_r, v_r, g_r, b_r, x_r, st_r, dst_r, do_r = refs[:9]
    m_r = refs[9] if has_seg else None
    dq_r, dk_r, dv_r, dg_r, db_r, kdv_r = refs[9 + has_seg:]
    bi, h, n, pv = (lax.axis_index(a) for a in ("b", "h", "n", "v"))
    hk = lax.div(h, group)
    rows_t = pl.ds(n * C, C)
    # what u needs first (k, X, the vectors, then each block's v and S); q, do and dS arrive while u is
    # formed
    copies = [(k_r.at[bi, rows_t, hk], k_s), (x_r.at[bi, h, rows_t], x_s), (g_r.at[bi, h, rows_t], g_s),
              (g_r.at[bi, h, rows_t], gc_s), (b_r.at[bi, h, rows_t], b_s)]
    copies += [(m_r.at[bi, r, rows_t], m_s.at[r]) for r in range(SEG_ROWS if has_seg else 0)]
    for src, dst in copies:
      plgpu.copy_gmem_to_smem(src, dst, bar)

    def fetch(j, with_q=False):
      """Block j's v, S (on `early`) and do, dS (on `late`) into slot j % 2."""
      vs, slot = pl.ds((pv * blocks + j) * bv, bv), lax.rem(j, slots)
      plgpu.copy_gmem_to_smem(v_r.at[bi, rows_t, h, vs], v_s.at[slot], early.at[slot])
      plgpu.copy_gmem_to_smem(st_r.at[bi, h, n, vs], st_s.at[slot], early.at[slot])
      if with_q:
        plgpu.copy_gmem_to_smem(q_r.at[bi, rows_t, hk], q_s, q_bar)
      plgpu.copy_gmem_to_smem(do_r.at[bi, rows_t, h, vs], do_s.at[slot], late.at[slot])
      plgpu.copy_gmem_to_smem(dst_r.at[bi, h, n, vs], dst_s.at[slot], late.at[slot])

    fetch(0, with_q=True)
    if blocks > 1:
      fetch(1)
    plgpu.barrier_wait(bar)
    if qk_l2norm:
      norm_s.at[1][...] = l2_normalize_rows(k_s, C)
      plgpu.commit_smem()

    def wait_q():
      plgpu.barrier_wait(q_bar)
      if qk_l2norm:
        norm_s.at[0][...] = l2_normalize_rows(q_s, C)
        plgpu.commit_smem()

    rows = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])
    sq, ck, cv = (C, C), (C, K), (C, bv)
    # Register budget: one warpgroup holds 255 registers a thread; a float32 [64, 128] tile takes 64 of
    # them. Only dk and a few [C] vectors live across the body; the decay masks, k and the products
    # are re-formed where they are used (`fresh` hides the re-formed values from CSE, which would
    # otherwise merge them back into one long-lived value and spill it).
    fresh = lax.optimization_barrier

    def vectors():
      return (fresh(plgpu.load(b_s, layout=ROWS)),) + row_scales(g_s, m_s, C)

    decay = lambda lower, strict: decay_tile(g_s, gc_s, m_s, C, lower=lower, strict=strict)
    load_k = lambda: plgpu.load(k_s, layout=WGMMA).astype(F32)

    def emit(x, tile, dst):
      """Stages the float32 tile `x` in `tile` and copies it to `dst`."""
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      tile[...] = x.astype(tile.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(tile, dst)

    def block(j):
      """Value block j of this program: its partial dq, dk, dG, dbeta, kdv and its dv."""
      slot, vb = lax.rem(j, slots), pv * blocks + j
      v_b, do_b, st_b, dst_b = v_s.at[slot], do_s.at[slot], st_s.at[slot], dst_s.at[slot]
      plgpu.barrier_wait(early.at[slot])
      if blocks > 2:
        @pl.when((j >= 1) & (j < blocks - 1))
        def _prefetch():   # into the slot block j - 1 has finished with
          fetch(j + 1)
      # r = B_v - B_k S^T = beta (v - e^G k S^T); u = X r
      beta, e_q, _ = vectors()
      ks = matmul(k_s, st_b.T, cv)
      r_s[...] = (rows(beta, cv) * (plgpu.load(v_b, layout=WGMMA).astype(F32) - rows(e_q, cv) * ks)).astype(dtype)
      plgpu.commit_smem()
      un_s[...] = matmul(x_s, r_s, cv).astype(dtype)
      plgpu.commit_smem()
      plgpu.barrier_wait(late.at[slot])
      if blocks == 1:
        wait_q()
      # P, dP (issued together); rowsum(dP P) now, so neither lives on
      P, dP = matmuls((sq, [(q_s, k_s.T)]), (sq, [(do_b, un_s.T)]))
      D = decay(True, False)
      P = P * D
      p_s[...] = P.astype(dtype)
      a_s[...] = (dP * D).astype(dtype)
      # dG takes rowsum(A) - colsum(A), A = dP P + dM M: the column sums are cross-warp reductions,
      # parked in shared memory until the end (a [C] vector in the column layout costs 16 registers)
      A = dP * P
      col_s.at[0][...] = jnp.sum(A, axis=0)
      plgpu.commit_smem()
      dG = jnp.sum(A, axis=1)
      # dq = e^G (do S^T) + (dP D) k; its dG term
      _, e_q, _ = vectors()
      dqg = matmul(do_b, st_b, ck)
      dG = dG + e_q * jnp.sum(plgpu.load(q_s, layout=WGMMA).astype(F32) * dqg, axis=1)
      dq = dqg * rows(e_q, ck) + matmul(a_s, k_s, ck)
      if qk_l2norm:
        dq = l2_normalize_grad(dq, q_s, fresh(plgpu.load(norm_s.at[0], layout=ROWS)))
      emit(dq, out_k, dq_r.at[vb, bi, rows_t, h])
      # du = P^T do + kd dS (issued together)
      du_p, kdS = matmuls((cv, [(p_s.T, do_b)]), (cv, [(k_s, dst_b.T)]))
      _, _, e_k = vectors()
      du_s[...] = (du_p + rows(e_k, cv) * kdS).astype(dtype)
      plgpu.commit_smem()
      # dk, first terms: (dP D)^T q + e^(G_C - G) dkd, dkd = u dS^T
      dkd = matmul(un_s, dst_b, ck)
      _, _, e_k = vectors()
      kdv = e_k * jnp.sum(dkd * load_k(), axis=1)
      dk = matmul(a_s.T, q_s, ck, init=dkd * rows(e_k, ck))
      dG = dG - kdv
      # dX = du B_v^T + dW B_k^T = du r^T (dW = -du S^T); dB_v = X^T du -> dv (issued together)
      dX, dBv = matmuls((sq, [(du_s, r_s.T)]), (cv, [(x_s.T, du_s)]))
      dx_s[...] = dX.astype(dtype)
      dbv_s[...] = dBv.astype(dtype)
      plgpu.commit_smem()
      beta, _, _ = vectors()
      emit(dBv * rows(beta, cv), out_v, dv_r.at[bi, rows_t, h, pl.ds(vb * bv, bv)])
      dbeta = jnp.sum(dBv * plgpu.load(v_b, layout=WGMMA).astype(F32), axis=1)
      dBk, beta, e_q, r = dbk_term(dbv_s, st_b, k_s, vectors, ck)
      dk = dk + dBk * rows(beta * e_q, ck)
      dG = dG + beta * r
      dbeta = dbeta + r
      # dM = beta dL (p_s is free again: it stages X^T dX)
      dL, M = dl_and_m(x_s, dx_s, k_s, p_s, decay, dtype, sq)
      dbeta = dbeta + jnp.sum(dL * M, axis=1)
      beta, _, _ = vectors()
      dM = dL * rows(beta, sq)
      A = dM * M
      col_s.at[1][...] = jnp.sum(A, axis=0)
      dG = dG + jnp.sum(A, axis=1)
      dk = dk + dm_k(dM, a_s, k_s, decay, dtype, ck)
      if qk_l2norm:
        dk = l2_normalize_grad(dk, k_s, fresh(plgpu.load(norm_s.at[1], layout=ROWS)))
      emit(dk, out_k, dk_r.at[vb, bi, rows_t, h])
      # the column sums of A, read back one per row
      plgpu.commit_smem()
      dG = dG - plgpu.load(col_s.at[0], layout=ROWS) - plgpu.load(col_s.at[1], layout=ROWS)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      vec_s.at[0][...] = dG
      vec_s.at[1][...] = dbeta
      # the caller sums kdv over the chunk for the last token's dG, which also takes e^(G_C) sum(S dS)
      # (this block's rows of S, folded onto the chunk's rows: bv = C)
      vec_s.at[2][...] = kdv + last_state_term(g_s, m_s, st_b, dst_b, C)
      plgpu.commit_smem()
      for idx, dst in enumerate((dg_r, db_r, kdv_r)):
        plgpu.copy_smem_to_gmem(vec_s.at[idx], dst.at[vb, bi, h, rows_t])

    if blocks == 1:
      block(0)
    else:   # a loop, not unrolled: unrolled, the compiler interleaves the blocks and spills
      wait_q()
      lax.fori_loop(0, blocks, lambda j, c: (block(j), c)[1], None)
    plgpu.wait_smem_to_gmem(0)

  args = [q, k, v, G, b, X, states, dstates, do] + ([masks] if has_seg else [])
  vec = jax.ShapeDtypeStruct((NVB, B, Hv, T_pad), F32)
  partial_k = jax.ShapeDtypeStruct((NVB, B, T_pad, Hv, K), partial_dtype)
  out_type = (partial_k, partial_k,
              jax.ShapeDtypeStruct((B, T_pad, Hv, V), dv_dtype), vec, vec, vec)
  outs = plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=(B, Hv, NC, NVB // blocks), grid_names=("b", "h", "n", "v"),
      compiler_params=compiler_params(approx_math=True), interpret=interpret,
      kernel_name="chunk_grads_delta")(*args)
  return vary_like(outs, args)


def pair_serves(V: int, chunk_size: int, v_dtype, dtype) -> bool:
  """`chunk_grads_pair` covers the call: two (or four: two programs) value blocks of the chunk size,
  16-bit v and operands."""
  return (V in (2 * BLOCK_V, 4 * BLOCK_V) and chunk_size == BLOCK_V and jnp.dtype(v_dtype).itemsize == 2
          and jnp.dtype(dtype).itemsize == 2)


def backward(q, k, v, g, beta, h0, do, dfinal, *, chunk_size: int, dtype, segment_ids=None, interpret=None,
             scale: float = 1.0, sequence_pieces: int | None = None, saved=None, qk_l2norm: bool = False,
             warpgroups: int = 1, programs: int | None = None):
  """`(dq, dk, dv, dg, dbeta, dh0)` of the delta family's op (no or scalar decay) for `do: [B, T, H_v, V]`
  (of o scaled by `scale`) and `dfinal: None | [B, H_v, K, V]`: the preparation kernel (with X), the
  two walks of walk.py, then `chunk_grads`; XLA adds the partial sums, the last-token terms of dG (the
  chunk sums of `kdv`) and the per-chunk reverse cumsum. saved: None, or the forward's `(tensors, X, states, transitions)`
  (`prepare(..., with_inverse=True)` and `walk.forward(..., with_states=True, return_transitions=True)`
  on these inputs), which skips the preparation and the states walk. warpgroups: 2 runs
  `chunk_grads_pair` (both value blocks in one program, their partial sums added inside it) where
  `pair_serves`, 1 (or where it does not serve) `chunk_grads`. programs: `chunk_grads_pair`'s (None: one
  program a chunk)."""
  B, T, H, K = q.shape
  Hv, V = v.shape[2:]
  C = chunk_size
  multiple = sequence_pieces or 1      # explicit pieces: whole pieces of chunks, as the forward padded
  T_pad = prep.padded_length(T, C, multiple)
  NC = T_pad // C
  group = Hv // H
  if saved is None:
    t, X = delta_prep.prepare(q, k, v, g, beta, chunk_size=C, dtype=dtype, segment_ids=segment_ids,
                              interpret=interpret, with_inverse=True, chunk_multiple=multiple,
                              qk_l2norm=qk_l2norm)
    _, states, _, transitions = walk.forward(t, h0, with_o=False, with_states=True, out_dtype=dtype,
                                             interpret=interpret, sequence_pieces=sequence_pieces,
                                             return_transitions=True)
  else:
    t, X, states, transitions = saved
  # the cotangent of the unscaled o in the operand dtype, in o's token layout: the kernels read it there
  pad = lambda x: jnp.pad(x.astype(dtype), [(0, 0), (0, T_pad - T), (0, 0), (0, 0)])
  do_t = pad(do.astype(F32) * scale)
  dstates, dh0 = walk.backward_states(t, do_t, dfinal, interpret=interpret, sequence_pieces=sequence_pieces,
                                      transitions=transitions, token_do=True)
  G = local_cumsum(g, B, T_pad, Hv, C)
  b = jnp.swapaxes(jnp.pad(beta.astype(F32), [(0, 0), (0, T_pad - T), (0, 0)]), 1, 2)
  masks = None if segment_ids is None else segment_vectors(segment_ids, C, T_pad)
  flat = lambda x: x.reshape(x.shape[:2] + (T_pad, x.shape[-1]))
  if warpgroups not in (1, 2):
    raise ValueError(f"warpgroups must be 1 or 2; got {warpgroups}")
  grads_args = (pad(q), pad(k), pad(v), G, b, flat(X), states, dstates, do_t)
  if warpgroups == 2 and pair_serves(V, C, v.dtype, dtype):
    dq, dk, dv, dG, dbeta, kdv = chunk_grads_pair(*grads_args, dtype=dtype, masks=masks, interpret=interpret,
                                                  qk_l2norm=qk_l2norm, programs=programs)
    # each program's pair summed in the kernel; V = 256: two pairs' partial sums
    dq, dk, dG, dbeta, kdv = (x[0] if x.shape[0] == 1 else x.astype(F32).sum(0)
                              for x in (dq, dk, dG, dbeta, kdv))
  else:
    dq, dk, dv, dG, dbeta, kdv = chunk_grads(*grads_args, dtype=dtype, masks=masks, interpret=interpret,
                                             dv_dtype=v.dtype, partial_dtype=dtype, qk_l2norm=qk_l2norm)
    dq, dk, dG, dbeta, kdv = (x.astype(F32).sum(0) for x in (dq, dk, dG, dbeta, kdv))
  last = jnp.sum(kdv.reshape(B, Hv, NC, C), axis=-1)   # with e^(G_C) sum(S dS) (chunk_grads)
  dG = dG.reshape(B, Hv, NC, C).at[..., -1].add(last)
  dg = jnp.flip(jnp.cumsum(jnp.flip(dG, -1), -1), -1).reshape(B, Hv, T_pad)   # G = cumsum(g) per chunk
  per_head = lambda x: x.astype(F32).reshape(B, T_pad, H, group, K).sum(3)[:, :T] if group > 1 else x[:, :T]
  return (per_head(dq).astype(q.dtype), per_head(dk).astype(k.dtype), dv[:, :T].astype(v.dtype),
          None if g is None else jnp.swapaxes(dg, 1, 2)[:, :T].astype(g.dtype),
          jnp.swapaxes(dbeta, 1, 2)[:, :T].astype(beta.dtype), dh0)


