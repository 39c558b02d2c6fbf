"""The fused additive forward (`fused.forward`) in three warpgroups per program: one fetches every
chunk's raw tiles into as many input slots as shared memory holds, one carries the state, one forms
P and o (`chunk_walk_fused_fwd_streamed`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from .masks import SEG_ROWS, segment_masks
from .pipeline import deepest_stages, initial, program, store_last, stream_chunks
from .tiles import COLS, F32, ROWS, WGMMA, matmul, smem


def _streamed_scratch(C, K, bv, dtype, out_dtype, has_seg, stages):
  """Shared memory of `streamed_walk`: `stages` input slots (q, k, v, G twice, masks), the
  state's `v e^(G_C - G)` tile, P, two state slots, two output slots, the float32 state tile."""
  scratch = dict(
      q_s=smem((stages, C, K), dtype), k_s=smem((stages, C, K), dtype),
      v_s=smem((stages, C, bv), dtype), g_s=plgpu.SMEM((stages, C), F32),
      gc_s=plgpu.SMEM((stages, C), F32), vd_s=smem((C, bv), dtype), p_s=smem((C, C), dtype),
      h_s=smem((2, bv, K), dtype), o_s=smem((2, C, bv), out_dtype), state_s=smem((bv, K), F32),
      in_bar=plgpu.Barrier(num_arrivals=5 + SEG_ROWS * has_seg, num_barriers=stages),
      in_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages), state_bar=plgpu.Barrier(),
      h_ready=plgpu.Barrier(num_barriers=2), h_free=plgpu.Barrier(num_barriers=2),
      done=plgpu.Barrier(num_arrivals=3))
  if has_seg:
    scratch["m_s"] = plgpu.SMEM((stages, SEG_ROWS, C), F32)
  return scratch


def streamed_stages(C, K, bv, dtype, out_dtype, has_seg) -> int:
  """The deepest input pipeline (2 to 4 slots) of `streamed_walk` that fits a block's shared memory; a
  ValueError if none does (`pipeline.deepest_stages`)."""
  return deepest_stages(lambda stages: _streamed_scratch(C, K, bv, dtype, out_dtype, has_seg, stages),
                        f"the streamed forward (C={C}, K={K}, block_v={bv}, {jnp.dtype(dtype).name})")


def streamed_walk(*, K, bv, C, NCs, group, has_h0, has_seg, dtype, out_dtype, scale, with_states):
  """`(body, scratch)` of `fused._forward_kernel` with o in three warpgroups per program (`warpgroups=3`):

  - warpgroup 2 only fetches: chunk n's tiles into input slot `n % stages` (2-4 slots, as many as
    shared memory holds), once warpgroups 0 and 1 have both freed that slot (`in_free`);
  - warpgroup 0 carries the state `S^T` in registers: per chunk it publishes the state entering the
    chunk in `h_s[n % 2]` (`h_ready`; it waits for warpgroup 1 to free that slot, `h_free`) and runs
    `S^T <- e^(G_C) S^T + (v e^(G_C - G))^T k`;
  - warpgroup 1 forms `P = (q k^T) e^(G_i - G_j)` while the state is on its way, then
    `o^T = (S^T q^T) e^(G_j) + v^T P^T`: the decay of the carried state scales o's columns after the
    product instead of forming `q e^G` as a tile.

  The fetches run up to `stages` chunks ahead of the computation. Every barrier's waiter sees each of
  its phases before the next can complete (a slot is refilled only after both readers freed it), and
  every warpgroup waits for the others before it exits (`done`). The roundings differ from the
  one-warpgroup walk's: `v e^(G_C - G)` instead of `k e^(G_C - G)` is rounded to the operand dtype, and
  `q e^G` not at all. Needs `NPROC >= 4` in the interpreter on a 2-core machine."""
  stages = streamed_stages(C, K, bv, dtype, out_dtype, has_seg)
  scratch = _streamed_scratch(C, K, bv, dtype, out_dtype, has_seg, stages)

  def body(*refs, q_s, k_s, v_s, g_s, gc_s, vd_s, p_s, h_s, o_s, state_s, in_bar, in_free, state_bar,
           h_ready, h_free, done, m_s=None):
    refs = list(refs)
    take = lambda present=True: refs.pop(0) if present else None
    q_r, k_r, v_r, g_r, m_r, h0_r = take(), take(), take(), take(), take(has_seg), take(has_h0)
    o_r, states_r, final_r = take(), take(with_states), take()
    b, h, vs = program(bv)
    piece, wg = lax.axis_index("s"), lax.axis_index("wg")
    hk = lax.div(h, group)
    rows = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])
    cols = lambda x, shape: lax.broadcast_in_dim(x, shape, [1])
    sq = (C, C)

    @pl.when(wg == 2)
    def _fetch():
      def issue(n):
        slot, rows_n = lax.rem(n, stages), pl.ds((piece * NCs + n) * C, C)
        bar = in_bar.at[slot]
        plgpu.copy_gmem_to_smem(k_r.at[b, rows_n, hk], k_s.at[slot], bar)
        plgpu.copy_gmem_to_smem(v_r.at[b, rows_n, h, vs], v_s.at[slot], bar)
        plgpu.copy_gmem_to_smem(g_r.at[b, h, rows_n], g_s.at[slot], bar)
        plgpu.copy_gmem_to_smem(q_r.at[b, rows_n, hk], q_s.at[slot], bar)
        plgpu.copy_gmem_to_smem(g_r.at[b, h, rows_n], gc_s.at[slot], bar)
        for i in range(SEG_ROWS if has_seg else 0):
          plgpu.copy_gmem_to_smem(m_r.at[b, i, rows_n], m_s.at[slot, i], bar)

      stream_chunks(NCs, stages, issue, in_free)

    def state_decays(slot):
      """(v's row scale e^(G_C - G), the state's decay e^(G_C)) of a chunk."""
      G_rows = plgpu.load(g_s.at[slot], layout=ROWS)
      G_last = g_s[slot, C - 1]
      v_row, s_decay = jnp.exp(G_last - G_rows), jnp.exp(G_last)
      if has_seg:  # a token's write survives to the chunk's end within its run only
        _, _, to_last, carry_last = segment_masks(m_s, slot, C)
        v_row, s_decay = v_row * to_last, s_decay * carry_last
      return v_row, s_decay

    @pl.when(wg == 0)
    def _state():
      s_t = initial(h0_r.at[b, h, piece, vs] if has_h0 else None, state_s, state_bar, bv, K)

      def step(n, s_t):
        slot, hs = lax.rem(n, stages), lax.rem(n, 2)
        plgpu.barrier_wait(in_bar.at[slot])
        v_row, s_decay = state_decays(slot)
        vd_s[...] = (plgpu.load(v_s.at[slot], layout=WGMMA).astype(F32) * rows(v_row, (C, bv))).astype(dtype)

        @pl.when(n >= 2)
        def _():
          plgpu.barrier_wait(h_free.at[hs])   # warpgroup 1 is done with chunk n - 2's state

        if with_states:
          plgpu.wait_smem_to_gmem(1, wait_read_only=True)   # the store of chunk n - 2's state read h_s
        h_s.at[hs][...] = s_t.astype(dtype)
        plgpu.commit_smem()
        plgpu.barrier_arrive(h_ready.at[hs])
        if with_states:
          plgpu.copy_smem_to_gmem(h_s.at[hs], states_r.at[b, h, piece * NCs + n, vs])
        s_t = matmul(vd_s.T, k_s.at[slot], (bv, K), init=s_t * s_decay)
        plgpu.barrier_arrive(in_free.at[slot])
        return s_t

      s_t = lax.fori_loop(0, NCs, step, s_t)
      for n in range(max(NCs - 2, 0), NCs):   # the frees the loop did not wait for
        plgpu.barrier_wait(h_free.at[n % 2])
      store_last(s_t, state_s, final_r.at[b, h, piece, vs])

    @pl.when(wg == 1)
    def _output():
      def step(n, carry):
        slot, hs = lax.rem(n, stages), lax.rem(n, 2)
        plgpu.barrier_wait(in_bar.at[slot])
        G_rows = plgpu.load(g_s.at[slot], layout=ROWS)
        G_cols = plgpu.load(gc_s.at[slot], layout=COLS)
        causal = (plgpu.broadcasted_iota(jnp.int32, sq, 0, layout=WGMMA)
                  >= plgpu.broadcasted_iota(jnp.int32, sq, 1, layout=WGMMA))
        q_col = jnp.exp(G_cols)   # what the carried state contributes to each token (o's columns)
        if has_seg:   # pairs of one run only; the carried state reaches its own run
          causal = causal & segment_masks(m_s, slot, C)[0]
          q_col = q_col * plgpu.load(m_s.at[slot, 2], layout=COLS)
        expo = jnp.where(causal, rows(G_rows, sq) - cols(G_cols, sq), -jnp.inf)
        p_s[...] = (matmul(q_s.at[slot], k_s.at[slot].T, sq) * jnp.exp(expo)).astype(dtype)
        plgpu.commit_smem()
        plgpu.barrier_wait(h_ready.at[hs])
        o_t = matmul(h_s.at[hs], q_s.at[slot].T, (bv, C)) * cols(q_col, (bv, C))
        plgpu.barrier_arrive(h_free.at[hs])
        o_t = matmul(v_s.at[slot].T, p_s.T, (bv, C), init=o_t)
        plgpu.barrier_arrive(in_free.at[slot])
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)   # chunk n - 2's o left o_s[hs]
        o_s.at[hs].T[...] = (o_t * scale).astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s.at[hs], o_r.at[b, pl.ds((piece * NCs + n) * C, C), h, vs])
        return carry

      lax.fori_loop(0, NCs, step, 0)
      plgpu.wait_smem_to_gmem(0)

    plgpu.barrier_arrive(done)   # no warpgroup exits while another still issues products
    plgpu.barrier_wait(done)

  return body, scratch
