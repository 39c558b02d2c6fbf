"""The prepared forward walk (`walk.forward`) with specialised warpgroups: one fetches every chunk's
tensors into as many input slots as shared memory holds, one carries the state, one (with o) forms
the output (`chunk_walk_{fwd,states}_streamed`). Same products and roundings as `walk.py`'s walk in
one warpgroup.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.gpu.pipeline import (deepest_stages, fetch_chunk, initial, new_values, program,
                                         store_last, stream_chunks, u_block)
from pallas_kernels.gpu.tiles import COLS, F32, matmul, smem
from pallas_kernels.prep import ChunkTensors


def _streamed_scratch(C, K, bv, dtype, out_dtype, *, delta, with_o, stages):
  """Shared memory of `streamed_walk`: `stages` input slots, two slots each of the state
  (and of u_new and o with o), the float32 state tile."""
  scratch = dict(
      kd_s=smem((stages, C, K), dtype), u_s=smem((stages, C, bv), dtype),
      decay_s=plgpu.SMEM((stages, K), F32), h_s=smem((2, bv, K), dtype),
      state_s=plgpu.SMEM((bv, K), F32),
      in_bar=plgpu.Barrier(num_arrivals=3 + delta + 2 * with_o, num_barriers=stages),
      in_free=plgpu.Barrier(num_arrivals=1 + with_o, num_barriers=stages), state_bar=plgpu.Barrier(),
      h_ready=plgpu.Barrier(num_barriers=2), h_free=plgpu.Barrier(num_barriers=2),
      done=plgpu.Barrier(num_arrivals=2 + with_o))
  if delta:
    scratch.update(w_s=smem((stages, C, K), dtype), un_s=smem((2, bv, C), dtype))
  if with_o:
    scratch.update(qg_s=smem((stages, C, K), dtype), p_s=smem((stages, C, C), dtype),
                   o_s=smem((2, C, bv), out_dtype))
  return scratch


def streamed_stages(C, K, bv, dtype, out_dtype, *, delta, with_o) -> int:
  """The deepest input pipeline (2 to 4 slots) of `streamed_walk` that fits a block's shared memory; a
  ValueError if none does (`pipeline.deepest_stages`)."""
  return deepest_stages(
      lambda stages: _streamed_scratch(C, K, bv, dtype, out_dtype, delta=delta, with_o=with_o, stages=stages),
      f"the streamed walk (C={C}, K={K}, block_v={bv}, {jnp.dtype(dtype).name})")


def streamed_walk(t: ChunkTensors, *, S, with_o, with_states, has_h0, out_dtype, bv, token_o, scale,
                  blocks):
  """`(body, scratch)` of `walk._forward_kernel` with specialised warpgroups (`warpgroups=3`): the last one
  only fetches chunk n's tensors into input slot `n % stages`, refilling a slot once every reader has
  freed it (`in_free`); warpgroup 0 carries the state: per chunk it writes the state entering it to
  `h_s[n % 2]`, forms `u^T = U^T - S^T W^T` into `un_s[n % 2]` (delta family) and signals `h_ready`,
  then updates the state; with o, warpgroup 1 forms `o^T = S^T Qg^T + u^T P^T` from those two slots and
  frees them (`h_free`). Without o there are two warpgroups (fetch and state), which still lets the
  fetches run `stages` chunks ahead. Same products and roundings as one warpgroup. Every barrier's
  waiter sees each phase before the next can complete, and every warpgroup waits for the others before
  it exits (`done`). Needs `NPROC >= 4` in the interpreter on a 2-core machine."""
  B, H, NC, C, K = t.qg.shape
  dtype = t.qg.dtype
  NCs = NC // S
  delta = t.w is not None
  stages = streamed_stages(C, K, bv, dtype, out_dtype, delta=delta, with_o=with_o)
  scratch = _streamed_scratch(C, K, bv, dtype, out_dtype, delta=delta, with_o=with_o, stages=stages)
  fetcher = 1 + with_o

  def body(*refs, kd_s, u_s, decay_s, h_s, state_s, in_bar, in_free, state_bar, h_ready, h_free, done,
           w_s=None, un_s=None, qg_s=None, p_s=None, o_s=None):
    refs = list(refs)
    take = lambda present=True: refs.pop(0) if present else None
    qg_r, kd_r, w_r, u_r, p_r, decay_r, h0_r = (
        take(with_o), take(), take(delta), take(), take(with_o), take(), take(has_h0))
    o_r, states_r, final_r = take(with_o), take(with_states), take()
    b, h, vs = program(bv)
    u_vs, u_keep = u_block(bv, *blocks)
    piece, wg = lax.axis_index("s"), lax.axis_index("wg")

    @pl.when(wg == fetcher)
    def _fetch():
      def issue(n):
        slot = lax.rem(n, stages)
        fetch_chunk((kd_r, u_r, decay_r, w_r, qg_r, p_r), (kd_s, u_s, decay_s, w_s, qg_s, p_s),
                     piece * NCs + n, slot, in_bar.at[slot], b, h, vs, C, u_vs)

      stream_chunks(NCs, stages, issue, in_free)

    @pl.when(wg == 0)
    def _state():
      s_t = initial(h0_r.at[b, h, piece, vs] if has_h0 else None, state_s, state_bar, bv, K)

      def step(n, s_t):
        slot, hs = lax.rem(n, stages), lax.rem(n, 2)
        plgpu.barrier_wait(in_bar.at[slot])
        # the decay is read first: read at its use, the interpreter's race detector places the read after
        # this warpgroup's free of the slot (and so reports the next fetch into it as a race)
        decay_cols = plgpu.load(decay_s.at[slot], layout=COLS)
        if with_o:
          @pl.when(n >= 2)
          def _():
            plgpu.barrier_wait(h_free.at[hs])   # warpgroup 1 is done with chunk n - 2's slots
        if with_states:
          plgpu.wait_smem_to_gmem(1, wait_read_only=True)   # chunk n - 2's state store read h_s[hs]
        s_lo = h_s.at[hs]
        s_lo[...] = s_t.astype(dtype)
        plgpu.commit_smem()
        u_lo = u_s.at[slot].T
        if delta:
          u_lo = new_values(u_s.at[slot], s_lo, w_s.at[slot], u_keep, un_s.at[hs])
        if with_o:
          plgpu.barrier_arrive(h_ready.at[hs])
        if with_states:
          plgpu.copy_smem_to_gmem(s_lo, states_r.at[b, h, piece * NCs + n, vs])
        d = lax.broadcast_in_dim(decay_cols, (bv, K), [1])
        s_t = matmul(u_lo, kd_s.at[slot], (bv, K), init=s_t * d)   # S^T Diag(decay) + u^T Kd
        plgpu.barrier_arrive(in_free.at[slot])
        return s_t

      s_t = lax.fori_loop(0, NCs, step, s_t)
      for n in range(max(NCs - 2, 0) if with_o else NCs, NCs):   # the frees the loop did not wait for
        plgpu.barrier_wait(h_free.at[n % 2])
      store_last(s_t, state_s, final_r.at[b, h, piece, vs])

    if with_o:
      @pl.when(wg == 1)
      def _output():
        def step(n, carry):
          slot, hs = lax.rem(n, stages), lax.rem(n, 2)
          m = piece * NCs + n
          plgpu.barrier_wait(in_bar.at[slot])
          plgpu.barrier_wait(h_ready.at[hs])
          u_lo = un_s.at[hs] if delta else u_s.at[slot].T
          o_t = matmul(h_s.at[hs], qg_s.at[slot].T, (bv, C))   # o^T = S^T Qg^T + u^T P^T
          o_t = matmul(u_lo, p_s.at[slot].T, (bv, C), init=o_t)
          plgpu.barrier_arrive(h_free.at[hs])
          plgpu.barrier_arrive(in_free.at[slot])
          plgpu.wait_smem_to_gmem(1, wait_read_only=True)   # chunk n - 2's o left o_s[hs]
          o_s.at[hs].T[...] = (o_t * scale if token_o else o_t).astype(out_dtype)
          plgpu.commit_smem()
          o_dst = (o_r.at[b, pl.ds(m * C, C), h, vs] if token_o else o_r.at[b, h, pl.ds(m * C, C), vs])
          plgpu.copy_smem_to_gmem(o_s.at[hs], o_dst)
          return carry

        lax.fori_loop(0, NCs, step, 0)
        plgpu.wait_smem_to_gmem(0)

    plgpu.barrier_arrive(done)   # no warpgroup exits while another still issues products
    plgpu.barrier_wait(done)

  return body, scratch
