"""The additive family in fused Mosaic GPU kernels: forward and backward with no XLA preparation.

For scalar or no decay, packed or not, the per-chunk tensors of the additive family are cheap to form
from the raw tiles, so the kernel reads q, k, v and the chunk-local cumulative log-decay `G` once and
never writes `qg`, `kd` or `P` to device memory (prep.py's tensors, formed in shared memory instead):

    P    = (q k^T) * e^(G_i - G_j)   on j <= i, else 0      (exponent masked before the exponential)
    o    = scale ((q * e^G) S + P v)
    S   <- e^(G_C) S + (k * e^(G_C - G))^T v

Every exponent is <= 0 (G is non-increasing). Packed rows (`segment_ids`) enter as per-token masks
(`masks.segment_vectors`), as in prep.py. Per program (batch, value head, 64 value columns) the walk
is that of `walk.forward`; q and k are read from their `[B, T, H, K]` layout (grouped value heads read
their q/k head), v from `[B, T, H_v, V]`. The backward (`backward`) runs the states walk
(`forward(..., with_o=False, with_states=True)`), the reverse walk (`backward_states`) and
`fused_grads.chunk_grads`, which forms every chunk's gradients in parallel: no XLA preparation either.
The forward in three warpgroups per program is in fused_streamed.py.
`chunked_attention` takes this path for every call it covers (`fused=False` forces the prepared one).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from .decay import local_cumsum
from .fused_grads import chunk_grads
from .fused_streamed import streamed_walk
from .masks import SEG_ROWS, segment_masks, segment_vectors
from .once import lowered_once
from .pipeline import chain_pieces, initial, pieces, program, store_last, walk_chunks
from .tiles import BLOCK_V, COLS, F32, ROWS, WGMMA, compiler_params, matmul, smem, vary_like


def serves(g, beta, segment_ids) -> bool:
  """True for the calls these kernels take: additive family, no or scalar decay (packed or not)."""
  del segment_ids  # packed rows are served (`segment_vectors`)
  return beta is None and (g is None or g.ndim == 3)


def padded_chunks(B: int, T: int, Hv: int, V: int, chunk_size: int, sequence_pieces=None,
                  block_v: int = BLOCK_V) -> tuple[int, int]:
  """`(NC, S)`: the chunks a sequence is padded to (whole pieces) and the number of pieces."""
  NC = -(-T // chunk_size)
  S = pieces(B * Hv * (V // min(block_v, V)), NC, sequence_pieces)
  return -(-NC // S) * S, S


def _piece_decay(G, masks, NC: int, S: int):
  """`[B, H_v, S]` float32: the factor by which the state entering each piece is scaled on its way to
  the piece's end (`e^(G_C)` per chunk, 0 where a packed row ends inside the piece)."""
  B, Hv = G.shape[:2]
  C = G.shape[2] // NC
  G_last = G.reshape(B, Hv, S, NC // S, C)[..., -1]
  decay = jnp.exp(jnp.sum(G_last, axis=-1))
  if masks is not None:
    carry_last = masks[:, 2].reshape(B, 1, S, NC // S, C)[..., -1]
    decay = decay * jnp.prod(carry_last, axis=-1)
  return decay


def forward(q, k, v, g, h0, *, chunk_size: int, dtype, out_dtype, segment_ids=None, interpret=None,
            block_v: int = BLOCK_V, with_o: bool = True, with_states: bool = False,
            sequence_pieces: int | None = None, scale: float = 1.0, warpgroups: int = 1):
  """`(o [B, T_pad, H_v, V] in out_dtype, times `scale`, or None; states [B, H_v, NC, V, K] in dtype or
  None; final [B, H_v, K, V] float32)`, T_pad = NC * C (the caller drops the padded rows of o).

  q, k: `[B, T, H, K]`; v: `[B, T, H_v, V]`; g: None or `[B, T, H_v]`; h0: None or `[B, H_v, K, V]`;
  segment_ids: None or `[B, T]`. Matmul operands in `dtype` (bfloat16 or float16), accumulation and
  state in float32. with_o: compute o (else q is not read and no P is formed); with_states: store the
  (transposed) state entering every chunk, as `walk.forward` does, for the backward.
  sequence_pieces: split each sequence's walk into this many pieces (None: `pieces`' choice; NC is
  padded to a multiple). With more than one, a first walk of every piece from a zero state gives its
  end state, `pipeline.chain_pieces` the state entering each piece, and the main walk runs all pieces in
  parallel. warpgroups: 3 runs the main walk (with o) in three warpgroups per program
  (`fused_streamed.py`: one fetches into as many input stages as shared memory holds, one
  carries the state, one forms P and o); 1 in one.
  """
  if warpgroups not in (1, 3):
    raise ValueError(f"warpgroups must be 1 or 3; got {warpgroups!r}")
  B, T, H, K = q.shape
  Hv, V = v.shape[2:]
  C = chunk_size
  bv = min(block_v, V)
  NC, S = padded_chunks(B, T, Hv, V, C, sequence_pieces, block_v)
  T_pad = NC * C
  pad = lambda x: jnp.pad(x.astype(dtype), [(0, 0), (0, T_pad - T), (0, 0), (0, 0)])
  q, k, v = pad(q), pad(k), pad(v)
  G = local_cumsum(g, B, T_pad, Hv, C)
  masks = None if segment_ids is None else segment_vectors(segment_ids, C, T_pad)
  h0 = None if h0 is None else jnp.swapaxes(h0.astype(F32), -1, -2)   # [B, H_v, V, K]
  walk_ = functools.partial(_forward_kernel, q, k, v, G, masks, chunk_size=C, dtype=dtype,
                            out_dtype=out_dtype, interpret=interpret, bv=bv, S=S, scale=scale)
  if S > 1:
    _, _, ends = walk_(None, with_o=False, with_states=False)
    decay = _piece_decay(G, masks, NC, S)
    h0 = chain_pieces(h0, ends, lambda x, p: decay[:, :, p, None, None] * x)
  elif h0 is not None:
    h0 = h0[:, :, None]
  o, states, finals = walk_(h0, with_o=with_o, with_states=with_states,
                             warpgroups=warpgroups if with_o else 1)
  return o, states, jnp.swapaxes(finals[:, :, -1], -1, -2)


@lowered_once()
def _forward_kernel(q, k, v, G, masks, h0, *, chunk_size, dtype, out_dtype, interpret, bv, S, scale,
                  with_o, with_states, warpgroups: int = 1):
  """The forward kernel over `S` pieces of every sequence in parallel; `h0`: None or the transposed
  state entering each piece `[B, H_v, S, V, K]`. Returns `(o | None, states | None, the transposed
  state leaving each piece [B, H_v, S, V, K])`. warpgroups: 3 (with o) specialises them
  (`fused_streamed.py`)."""
  B, T_pad, H, K = q.shape
  Hv, V = v.shape[2:]
  C = chunk_size
  NC = T_pad // C
  NCs = NC // S
  group = Hv // H
  has_h0 = h0 is not None
  has_seg = masks is not None

  scratch = dict(
      k_s=smem((2, C, K), dtype), v_s=smem((2, C, bv), dtype), g_s=plgpu.SMEM((2, C), F32),
      kd_s=smem((C, K), dtype), h_s=smem((2, bv, K), dtype), state_s=smem((bv, K), F32),
      in_bar=plgpu.Barrier(num_arrivals=3 + 2 * with_o + SEG_ROWS * has_seg, num_barriers=2),
      state_bar=plgpu.Barrier())
  if with_o:
    scratch.update(q_s=smem((2, C, K), dtype), gc_s=plgpu.SMEM((2, C), F32), qg_s=smem((C, K), dtype),
                   p_s=smem((C, C), dtype), o_s=smem((2, C, bv), out_dtype))
  if has_seg:
    scratch["m_s"] = plgpu.SMEM((2, SEG_ROWS, C), F32)

  def body(*refs, k_s, v_s, g_s, kd_s, h_s, state_s, in_bar, state_bar, q_s=None, gc_s=None, qg_s=None,
           p_s=None, o_s=None, m_s=None):
    refs = list(refs)
    take = lambda present=True: refs.pop(0) if present else None
    q_r, k_r, v_r, g_r, m_r, h0_r = take(with_o), take(), take(), take(), take(has_seg), take(has_h0)
    o_r, states_r, final_r = take(with_o), take(with_states), take()
    b, h, vs = program(bv)
    piece = lax.axis_index("s")
    hk = lax.div(h, group)

    def issue(n, slot):
      rows, bar = pl.ds((piece * NCs + n) * C, C), in_bar.at[slot]
      plgpu.copy_gmem_to_smem(k_r.at[b, rows, hk], k_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(v_r.at[b, rows, h, vs], v_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(g_r.at[b, h, rows], g_s.at[slot], bar)
      if with_o:
        plgpu.copy_gmem_to_smem(q_r.at[b, rows, hk], q_s.at[slot], bar)
        # the same G again, read in columns: layout inference (before lane semantics) wanted one layout
        # per buffer; one copy for both layouts is untried
        plgpu.copy_gmem_to_smem(g_r.at[b, h, rows], gc_s.at[slot], bar)
      for i in range(SEG_ROWS if has_seg else 0):
        plgpu.copy_gmem_to_smem(m_r.at[b, i, rows], m_s.at[slot, i], bar)

    def chunk(n, slot, s_t):
      n = piece * NCs + n
      # The chunk's tensors, in shared memory: P, q e^G and k e^(G_C - G).
      G_rows = plgpu.load(g_s.at[slot], layout=ROWS)
      G_last = g_s[slot, C - 1]
      rows = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])
      sq, qk = (C, C), (C, K)
      q_scale, k_scale, s_decay = jnp.exp(G_rows), jnp.exp(G_last - G_rows), jnp.exp(G_last)
      if has_seg:  # pairs of one run only; the carried state reaches its own run
        same, carry, to_last, carry_last = segment_masks(m_s, slot, C)
        q_scale, k_scale, s_decay = q_scale * carry, k_scale * to_last, s_decay * carry_last
      if with_o:
        G_cols = plgpu.load(gc_s.at[slot], layout=COLS)
        causal = (plgpu.broadcasted_iota(jnp.int32, sq, 0, layout=WGMMA)
                  >= plgpu.broadcasted_iota(jnp.int32, sq, 1, layout=WGMMA))
        if has_seg:
          causal = causal & same
        expo = jnp.where(causal, rows(G_rows, sq) - lax.broadcast_in_dim(G_cols, sq, [1]), -jnp.inf)
        p_s[...] = (matmul(q_s.at[slot], k_s.at[slot].T, sq) * jnp.exp(expo)).astype(dtype)
        qg_s[...] = (plgpu.load(q_s.at[slot], layout=WGMMA).astype(F32) * rows(q_scale, qk)).astype(dtype)
      kd_s[...] = (plgpu.load(k_s.at[slot], layout=WGMMA).astype(F32) * rows(k_scale, qk)).astype(dtype)
      # The walk (walk.forward, additive): o^T = S^T Qg^T + v^T P^T, S^T <- e^(G_C) S^T + v^T Kd.
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)
      s_lo = h_s.at[slot]
      s_lo[...] = s_t.astype(dtype)
      plgpu.commit_smem()
      v_t = v_s.at[slot].T
      if with_o:
        o_t = matmul(s_lo, qg_s.T, (bv, C))
        o_t = matmul(v_t, p_s.T, (bv, C), init=o_t)
        o_s.at[slot].T[...] = (o_t * scale).astype(out_dtype)
        plgpu.commit_smem()
      if with_o or with_states:
        if with_o:
          plgpu.copy_smem_to_gmem(o_s.at[slot], o_r.at[b, pl.ds(n * C, C), h, vs], commit_group=False)
        if with_states:
          plgpu.copy_smem_to_gmem(s_lo, states_r.at[b, h, n, vs], commit_group=False)
        plgpu.commit_smem_to_gmem_group()
      return matmul(v_t, kd_s, (bv, K), init=s_t * s_decay)

    init = lambda: initial(h0_r.at[b, h, piece, vs] if has_h0 else None, state_s, state_bar, bv, K)
    store_last(walk_chunks(NCs, issue, in_bar, init, chunk), state_s, final_r.at[b, h, piece, vs])

  args = (([q] if with_o else []) + [k, v, G] + ([masks] if has_seg else [])
          + ([h0] if has_h0 else []))
  out_type = ([jax.ShapeDtypeStruct((B, T_pad, Hv, V), out_dtype)] if with_o else []) + (
      [jax.ShapeDtypeStruct((B, Hv, NC, V, K), dtype)] if with_states else []) + [
      jax.ShapeDtypeStruct((B, Hv, S, V, K), F32)]
  name = "chunk_walk_fused_fwd" if with_o else ("chunk_walk_fused_states" if with_states
                                                else "chunk_walk_fused_ends")
  threads = {}
  if warpgroups == 3:
    if not with_o:
      raise ValueError("the streamed walk computes o (warpgroups=3 needs with_o)")
    body, scratch = streamed_walk(K=K, bv=bv, C=C, NCs=NCs, group=group, has_h0=has_h0, has_seg=has_seg,
                                  dtype=dtype, out_dtype=out_dtype, scale=scale, with_states=with_states)
    threads, name = dict(num_threads=3, thread_name="wg"), name + "_streamed"
  outs = plgpu.kernel(
      body, out_type=tuple(out_type), scratch_types=scratch, grid=(B, Hv, V // bv, S),
      grid_names=("b", "h", "v", "s"), compiler_params=compiler_params(approx_math=True),
      interpret=interpret, kernel_name=name, **threads)(*args)
  outs = list(vary_like(outs, args))
  o = outs.pop(0) if with_o else None
  states = outs.pop(0) if with_states else None
  return o, states, outs.pop(0)


def backward_states(q, g, do, dfinal, *, chunk_size: int, dtype, segment_ids=None, interpret=None,
                    block_v: int = BLOCK_V, sequence_pieces: int | None = None, scale: float = 1.0):
  """The reverse walk of the additive family from the raw q and gates (`walk.backward_states` without
  the prepared `qg`): `(dstates [B, H_v, NC, V, K] in dtype, dh0 [B, H_v, K, V] float32)`, `dstates[n]`
  the (transposed) gradient of the state leaving chunk n:  dS^T <- e^(G_C) dS^T + scale do^T (q e^G).

  q: `[B, T, H, K]`; g: None or `[B, T, H_v]`; do: `[B, T_pad, H_v, V]` (T_pad as `forward` padded it);
  dfinal: None or `[B, H_v, K, V]`. sequence_pieces: as in `forward` (a first reverse walk of every
  piece from zero gives the gradient at its start, `pipeline.chain_pieces` the gradient leaving each piece).
  """
  B, T, H, K = q.shape
  T_pad, Hv, V = do.shape[1:]
  C = chunk_size
  NC = T_pad // C
  bv = min(block_v, V)
  S = pieces(B * Hv * (V // bv), -(-T // C), sequence_pieces)
  if NC % S:
    raise ValueError(f"do has {NC} chunks, not a multiple of the {S} sequence pieces")
  q = jnp.pad(q.astype(dtype), [(0, 0), (0, T_pad - T), (0, 0), (0, 0)])
  G = local_cumsum(g, B, T_pad, Hv, C)
  masks = None if segment_ids is None else segment_vectors(segment_ids, C, T_pad)
  do = do.astype(dtype)
  dfinal = None if dfinal is None else jnp.swapaxes(dfinal.astype(F32), -1, -2)
  walk_ = functools.partial(_reverse_kernel, q, do, G, masks, chunk_size=C, dtype=dtype, interpret=interpret,
                            bv=bv, S=S, scale=scale)
  if S > 1:
    _, starts = walk_(None, with_dstates=False)
    decay = _piece_decay(G, masks, NC, S)
    dfinal = chain_pieces(dfinal, starts, lambda x, p: decay[:, :, p, None, None] * x, reverse=True)
  elif dfinal is not None:
    dfinal = dfinal[:, :, None]
  dstates, starts = walk_(dfinal, with_dstates=True)
  return dstates, jnp.swapaxes(starts[:, :, 0], -1, -2)


@lowered_once()
def _reverse_kernel(q, do, G, masks, dfinal, *, chunk_size, dtype, interpret, bv, S, scale, with_dstates):
  """The reverse kernel over `S` pieces in parallel; `dfinal`: None or the transposed gradient leaving
  each piece `[B, H_v, S, V, K]`. Returns `(dstates | None, the gradient at each piece's start)`."""
  B, T_pad, H, K = q.shape
  Hv, V = do.shape[2:]
  C = chunk_size
  NC = T_pad // C
  NCs = NC // S
  group = Hv // H
  has_df = dfinal is not None
  has_seg = masks is not None
  scratch = dict(
      q_s=smem((2, C, K), dtype), do_s=smem((2, C, bv), dtype), g_s=plgpu.SMEM((2, C), F32),
      qg_s=smem((C, K), dtype), h_s=smem((2, bv, K), dtype), state_s=smem((bv, K), F32),
      in_bar=plgpu.Barrier(num_arrivals=3 + SEG_ROWS * has_seg, num_barriers=2), state_bar=plgpu.Barrier())
  if has_seg:
    scratch["m_s"] = plgpu.SMEM((2, SEG_ROWS, C), F32)

  def body(*refs, q_s, do_s, g_s, qg_s, h_s, state_s, in_bar, state_bar, m_s=None):
    refs = list(refs)
    take = lambda present=True: refs.pop(0) if present else None
    q_r, do_r, g_r, m_r, df_r = take(), take(), take(), take(has_seg), take(has_df)
    ds_r, dh0_r = take(with_dstates), take()
    b, h, vs = program(bv)
    piece = lax.axis_index("s")
    hk = lax.div(h, group)

    def issue(n, slot):
      rows, bar = pl.ds((piece * NCs + n) * C, C), in_bar.at[slot]
      plgpu.copy_gmem_to_smem(q_r.at[b, rows, hk], q_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(do_r.at[b, rows, h, vs], do_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(g_r.at[b, h, rows], g_s.at[slot], bar)
      for i in range(SEG_ROWS if has_seg else 0):
        plgpu.copy_gmem_to_smem(m_r.at[b, i, rows], m_s.at[slot, i], bar)

    def chunk(n, slot, ds_t):
      G_rows = plgpu.load(g_s.at[slot], layout=ROWS)
      q_scale, s_decay = jnp.exp(G_rows) * scale, jnp.exp(g_s[slot, C - 1])
      if has_seg:
        _, carry, _, carry_last = segment_masks(m_s, slot, C)
        q_scale, s_decay = q_scale * carry, s_decay * carry_last
      qg_s[...] = (plgpu.load(q_s.at[slot], layout=WGMMA).astype(F32)
                   * lax.broadcast_in_dim(q_scale, (C, K), [0])).astype(dtype)
      plgpu.commit_smem()
      if with_dstates:
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        ds_lo = h_s.at[slot]
        ds_lo[...] = ds_t.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(ds_lo, ds_r.at[b, h, piece * NCs + n, vs])
      return matmul(do_s.at[slot].T, qg_s, (bv, K), init=ds_t * s_decay)

    init = lambda: initial(df_r.at[b, h, piece, vs] if has_df else None, state_s, state_bar, bv, K)
    store_last(walk_chunks(NCs, issue, in_bar, init, chunk, reverse=True), state_s,
                dh0_r.at[b, h, piece, vs])

  args = [q, do, G] + ([masks] if has_seg else []) + ([dfinal] if has_df else [])
  out_type = (([jax.ShapeDtypeStruct((B, Hv, NC, V, K), dtype)] if with_dstates else [])
              + [jax.ShapeDtypeStruct((B, Hv, S, V, K), F32)])
  outs = plgpu.kernel(
      body, out_type=tuple(out_type), scratch_types=scratch, grid=(B, Hv, V // bv, S),
      grid_names=("b", "h", "v", "s"), compiler_params=compiler_params(approx_math=True),
      interpret=interpret, kernel_name="chunk_walk_fused_bwd" if with_dstates
      else "chunk_walk_fused_bwd_starts")(*args)
  outs = list(vary_like(outs, args))
  dstates = outs.pop(0) if with_dstates else None
  return dstates, outs.pop(0)


def backward(q, k, v, g, h0, do, dfinal, *, chunk_size: int, dtype, segment_ids=None, interpret=None,
             sequence_pieces: int | None = None, scale: float = 1.0, states=None):
  """`(dq, dk, dv, dg, None, dh0)` of `forward` (in q, k, v, g's dtypes; dh0 float32; no dbeta in this
  family), for the cotangents
  `do: [B, T, H_v, V]` (of o, which `forward` multiplied by `scale`) and `dfinal: None | [B, H_v, K, V]`.

  Three kernels, none of which reads a prepared tensor: the forward walk storing the state entering
  every chunk (`forward(..., with_o=False, with_states=True)`), the reverse walk storing the gradient of
  the state leaving every chunk (`backward_states`), then every chunk's gradients in parallel
  (`chunk_grads`). XLA adds the last-token terms of dG, the per-chunk reverse cumsum and, for grouped
  heads, the per-value-head dq, dk. states: None, or the forward's states on these inputs
  (`forward(..., with_states=True)`), which skips the first kernel.
  """
  B, T, H, K = q.shape
  Hv, V = v.shape[2:]
  C = chunk_size
  NC, _ = padded_chunks(B, T, Hv, V, C, sequence_pieces)   # as `forward` padded it
  T_pad = NC * C
  group = Hv // H
  pad = lambda x: jnp.pad(x.astype(dtype), [(0, 0), (0, T_pad - T), (0, 0), (0, 0)])
  qp, kp, vp, do = pad(q), pad(k), pad(v), pad(do)
  G = local_cumsum(g, B, T_pad, Hv, C)
  masks = None if segment_ids is None else segment_vectors(segment_ids, C, T_pad)
  if states is None:
    _, states, _ = forward(q, k, v, g, h0, chunk_size=C, dtype=dtype, out_dtype=dtype,
                           segment_ids=segment_ids, interpret=interpret, with_o=False, with_states=True,
                           sequence_pieces=sequence_pieces)
  dstates, dh0 = backward_states(q, g, do, dfinal, chunk_size=C, dtype=dtype, segment_ids=segment_ids,
                                 interpret=interpret, sequence_pieces=sequence_pieces, scale=scale)
  summed = lambda x: F32 if group > 1 else x.dtype   # grouped heads' dq, dk are added up in float32
  dq, dk, dv, dG, kdv = chunk_grads(qp, kp, vp, G, states, dstates, do, dtype=dtype, masks=masks,
                                    interpret=interpret, grad_dtypes=(summed(q), summed(k), v.dtype),
                                    scale=scale)
  last = jnp.sum(kdv.reshape(B, Hv, NC, C), axis=-1)   # with e^(G_C) sum(S dS) (chunk_grads)
  dG = dG.reshape(B, Hv, NC, C).at[..., -1].add(last)
  dg = jnp.flip(jnp.cumsum(jnp.flip(dG, -1), -1), -1).reshape(B, Hv, T_pad)   # G = cumsum(g) per chunk
  per_head = lambda x: x.reshape(B, T_pad, H, group, K).sum(3)[:, :T] if group > 1 else x[:, :T]
  return (per_head(dq).astype(q.dtype), per_head(dk).astype(k.dtype), dv[:, :T].astype(v.dtype),
          None if g is None else jnp.swapaxes(dg, 1, 2)[:, :T].astype(g.dtype), None, dh0)
