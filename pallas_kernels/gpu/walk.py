"""The sequential walk over chunks as Mosaic GPU (Hopper) kernels: forward and backward.

The per-chunk tensors come from `prep.prepare` (XLA, shared with the TPU kernels); these kernels do only
what is sequential over chunks. Per chunk, with `S` the `[K, V]` state entering it:

    forward                                   backward (chunks in reverse; dS = d loss / d S_next)
    u      = U - W S                          stored: dS, the gradient of the state leaving each chunk
    o      = Qg S + P u                       du  = P^T dO + Kd dS
    S_next = Diag(decay) S + Kd^T u           dS <- Diag(decay) dS + Qg^T dO - W^T du

Every other cotangent (dQg = dO S^T, dP = dO u^T, dKd = u dS^T, dW = -du S^T, dU = du,
ddecay = rowsum(S * dS)) is a batched matmul over all chunks at once, done by XLA in `backward` from the
states the forward stores and the dS the backward kernel stores: the kernels carry nothing they do not
need to carry.

One program per (batch, head, block of `BLOCK_V` value columns); it keeps the state transposed, `S^T`
`[BLOCK_V, K]` float32, in registers (WGMMA layout), and once per chunk writes it in the 16-bit operand
dtype to shared memory, where it is the left operand of the chunk's matmuls (so are `u^T` and `dO^T`, as
transposed views of their tiles). Both wgmma operands come from shared memory because the Mosaic GPU
interpreter that runs the CPU tests takes no register operands: the code tested is the code run. The
next chunk's inputs are fetched by TMA into the other half of a double buffer while the current chunk
computes (`walk_chunks`); outputs leave through a double-buffered staging tile by TMA.

Operands are bfloat16 or float16 with float32 accumulation (the state and its gradient are float32;
what is stored per chunk is in the operand dtype, as the chunk-local tensors are). The value axis splits
with no communication (the walk is independent per value column).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from .once import lowered_once
from .pipeline import (chain_pieces, fetch_chunk, initial, new_values, pieces, program,
                                         store_last, u_block, walk_chunks)
from .tiles import BLOCK_V, COLS, F32, compiler_params, flat, matmul, smem, vary_like
from .tiles import scratch_bytes  # noqa: F401  (the dispatch reads walk.scratch_bytes)
from ..prep import ChunkTensors


def forward(t: ChunkTensors, h0, *, with_o: bool = True, with_states: bool = False, out_dtype=F32,
            interpret=None, block_v: int = BLOCK_V, sequence_pieces: int | None = None,
            return_transitions: bool = False, token_o: bool = False, scale: float = 1.0,
            with_last_start: bool = False):
  """The forward walk.

  Args:
    t: per-chunk tensors in one 16-bit dtype (`decay` float32), shapes as in `prep.ChunkTensors`.
    h0: None or `[B, H, K, V]` float32.
    with_o: compute `o`; with_states: store the (transposed) state entering every chunk.
    sequence_pieces: split each sequence into this many pieces that walk in parallel (None: `pieces`'
      choice; NC must be a multiple). With more than one, a first walk gives every piece's affine map
      `S_end = A S_start + F` (`piece_maps`), XLA chains them for the state entering each piece, and the
      main walk runs all pieces at once.
    return_transitions: also return the pieces' `A` (`[B, H, S, K, K]`, None for one piece), which
      `backward_states` can reuse.
    token_o: write o as `[B, NC * C, H, V]` (the op's token layout; no transpose after the walk) and
      times `scale`, instead of chunk layout and unscaled.
    with_last_start: also return the (transposed) state entering the last chunk in float32,
      `[B, H, V, K]` (`states` holds it in the operand dtype).

  Returns:
    `(o [B, H, NC, C, V] out_dtype or None (token_o: [B, NC * C, H, V]), states [B, H, NC, V, K] or None, final [B, H, K, V] f32)`
    (and the transitions with `return_transitions`, then the last chunk's start with `with_last_start`).
  """
  B, H, NC, C, K = t.qg.shape
  V = t.u.shape[-1]
  bv = min(block_v, V)
  S = pieces(B * H * (V // bv), NC, sequence_pieces)
  if NC % S:
    raise ValueError(f"sequence_pieces={S} must divide the number of chunks, {NC}")
  A = None
  h_in = None if h0 is None else h0.astype(F32)[:, :, None]         # [B, H, S, K, V]
  if S > 1:
    A, F = piece_maps(t, S, interpret=interpret, block_v=block_v)
    mm = functools.partial(jnp.einsum, "bhkj,bhjv->bhkv", precision=lax.Precision.HIGHEST)
    h_in = chain_pieces(h0, F, lambda x, p: mm(A[:, :, p], x))
  h_in = None if h_in is None else jnp.swapaxes(h_in, -1, -2)
  o, states, finals, last = _forward_kernel(t, h_in, S=S, with_o=with_o, with_states=with_states,
                                            out_dtype=out_dtype, interpret=interpret, bv=bv, token_o=token_o,
                                            scale=scale, with_last_start=with_last_start)
  out = (o, states, jnp.swapaxes(finals[:, :, -1], -1, -2))
  out = out + (A,) if return_transitions else out
  return out + (last,) if with_last_start else out


def piece_maps(t: ChunkTensors, S: int, *, interpret=None, block_v: int = BLOCK_V, with_offsets=True):
  """Every piece's affine map of the state, `S_end = A S_start + F`: `(A [B, H, S, K, K], F [B, H, S, K,
  V])` float32 (F None without `with_offsets`).

  Delta family: one walk of `[K, V + K]` states, `F` from a zero start with the chunks' `u`, `A` from
  the identity with `u = 0` (then `S <- (Diag(decay) - Kd^T W) S`). The kernel reads `u` itself and
  zeroes it in the programs of the identity's columns, so no `[..., V + K]` copy of u is formed.
  Additive family: `A = Diag(prod decay)` in XLA, and `F` a walk over the V columns alone."""
  B, H, NC, C, K = t.qg.shape
  V = t.u.shape[-1]
  cols = (V if with_offsets else 0) + (K if t.w is not None else 0)
  bv = min(block_v, V)
  if t.w is None:
    prod = jnp.prod(t.decay.astype(F32).reshape(B, H, S, NC // S, K), axis=3)
    A = prod[..., :, None] * jnp.eye(K, dtype=F32)
    if not with_offsets:
      return A, None
  start = None
  if t.w is not None:
    eye = jnp.eye(K, dtype=F32)
    start = jnp.concatenate([jnp.zeros((K, V), F32), eye], axis=-1) if with_offsets else eye
    start = jnp.broadcast_to(start.T, (B, H, S, cols, K))
  _, _, ends, _ = _forward_kernel(t, start, S=S, with_o=False, with_states=False, out_dtype=F32,
                               interpret=interpret, bv=bv, state_cols=cols,
                               u_blocks=V // bv if with_offsets else 0)
  ends = jnp.swapaxes(ends, -1, -2)                                  # [B, H, S, K, cols]
  F = ends[..., :V] if with_offsets else None
  return (A, F) if t.w is None else (ends[..., cols - K:], F)


@lowered_once()
def _forward_kernel(t: ChunkTensors, h0, *, S, with_o, with_states, out_dtype, interpret, bv,
                    token_o: bool = False, scale: float = 1.0,
                    state_cols: int | None = None, u_blocks: int | None = None, with_last_start=False):
  """The forward walk of `S` pieces of every sequence in parallel; `h0`: None or the transposed state
  entering each piece `[B, H, S, V, K]`. Returns `(o | None, states | None, the transposed state
  leaving each piece [B, H, S, V, K], the transposed float32 state entering the last chunk [B, H, V, K]
  or None)`.

  state_cols, u_blocks (the pieces' maps, delta family): the state has `state_cols` columns (default V),
  of which the first `u_blocks` blocks of `bv` take their u from `t.u` and the rest walk with u = 0."""
  B, H, NC, C, K = t.qg.shape
  V = t.u.shape[-1] if state_cols is None else state_cols
  u_blocks = V // bv if u_blocks is None else u_blocks
  if u_blocks < V // bv and (t.w is None or with_o or with_states):
    raise ValueError("u_blocks: only the delta family's maps walk (no o, no states) zeroes u")
  dtype = t.qg.dtype
  NCs = NC // S
  delta = t.w is not None
  has_h0 = h0 is not None
  qg, kd, u, p = flat(t.qg), flat(t.kd), flat(t.u), flat(t.p)
  w = None if not delta else flat(t.w)
  decay = t.decay.astype(F32)

  out_type = []
  if with_o:
    out_type.append(jax.ShapeDtypeStruct((B, NC * C, H, V) if token_o else (B, H, NC * C, V), out_dtype))
  if with_states:
    out_type.append(jax.ShapeDtypeStruct((B, H, NC, V, K), dtype))
  out_type.append(jax.ShapeDtypeStruct((B, H, S, V, K), F32))
  if with_last_start:
    out_type.append(jax.ShapeDtypeStruct((B, H, V, K), F32))

  n_in = 3 + delta + 2 * with_o  # kd, u, decay, [w], [qg, p]
  scratch = dict(
      kd_s=smem((2, C, K), dtype), u_s=smem((2, C, bv), dtype),
      decay_s=plgpu.SMEM((2, K), F32),
      state_s=smem((bv, K), F32), h_s=smem((2, bv, K), dtype),
      in_bar=plgpu.Barrier(num_arrivals=n_in, num_barriers=2), state_bar=plgpu.Barrier())
  if delta:
    scratch["w_s"] = smem((2, C, K), dtype)
  if with_o:
    scratch.update(qg_s=smem((2, C, K), dtype), p_s=smem((2, C, C), dtype),
                   o_s=smem((2, C, bv), out_dtype))
  if delta:
    scratch["un_s"] = smem((bv, C), dtype)

  def body(*refs, kd_s, u_s, decay_s, state_s, h_s, in_bar, state_bar, w_s=None, qg_s=None, p_s=None,
           o_s=None, un_s=None):
    refs = list(refs)
    take = lambda present=True: refs.pop(0) if present else None
    qg_r, kd_r, w_r, u_r, p_r, decay_r, h0_r = (
        take(with_o), take(), take(delta), take(), take(with_o), take(), take(has_h0))
    o_r, states_r, final_r, last_r = take(with_o), take(with_states), take(), take(with_last_start)
    b, h, vs = program(bv)
    u_vs, u_keep = u_block(bv, u_blocks, V // bv)
    piece = lax.axis_index("s")

    def issue(n, slot):
      fetch_chunk((kd_r, u_r, decay_r, w_r, qg_r, p_r), (kd_s, u_s, decay_s, w_s, qg_s, p_s),
                   piece * NCs + n, slot, in_bar.at[slot], b, h, vs, C, u_vs)

    def chunk(n, slot, s_t):
      n = piece * NCs + n
      # The state is the left operand of the matmuls below, from shared memory (`s_lo`); this slot's
      # staging tiles were last read by the stores issued two chunks ago.
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)
      if with_last_start:   # the last chunk's start in float32, through state_s (free until store_last)
        @pl.when(n == NC - 1)
        def _():
          state_s[...] = s_t
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(state_s, last_r.at[b, h, vs])
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      s_lo = h_s.at[slot]
      s_lo[...] = s_t.astype(dtype)
      plgpu.commit_smem()
      u_lo = u_s.at[slot].T
      if delta:
        u_lo = new_values(u_s.at[slot], s_lo, w_s.at[slot], u_keep, un_s)
      if with_o:  # o^T = S^T Qg^T + u^T P^T
        o_t = matmul(s_lo, qg_s.at[slot].T, (bv, C))
        o_t = matmul(u_lo, p_s.at[slot].T, (bv, C), init=o_t)
        o_s.at[slot].T[...] = (o_t * scale if token_o else o_t).astype(out_dtype)
      if with_o or with_states:
        plgpu.commit_smem()
        if with_o:
          o_dst = (o_r.at[b, pl.ds(n * C, C), h, vs] if token_o
                   else o_r.at[b, h, pl.ds(n * C, C), vs])
          plgpu.copy_smem_to_gmem(o_s.at[slot], o_dst, commit_group=False)
        if with_states:
          plgpu.copy_smem_to_gmem(h_s.at[slot], states_r.at[b, h, n, vs], commit_group=False)
        plgpu.commit_smem_to_gmem_group()
      # S_next^T = S^T Diag(decay) + u^T Kd
      d = lax.broadcast_in_dim(plgpu.load(decay_s.at[slot], layout=COLS), (bv, K), [1])
      return matmul(u_lo, kd_s.at[slot], (bv, K), init=s_t * d)

    init = lambda: initial(h0_r.at[b, h, piece, vs] if has_h0 else None, state_s, state_bar, bv, K)
    store_last(walk_chunks(NCs, issue, in_bar, init, chunk), state_s, final_r.at[b, h, piece, vs])

  name = "chunk_walk_fwd" if with_o else "chunk_walk_states"
  args = [x for x, present in ((qg, with_o), (kd, True), (w, delta), (u, True), (p, with_o),
                               (decay, True), (h0, has_h0))
          if present]
  outs = list(plgpu.kernel(
      body, out_type=tuple(out_type), scratch_types=scratch, grid=(B, H, V // bv, S),
      grid_names=("b", "h", "v", "s"), compiler_params=compiler_params(approx_math=True),
      interpret=interpret, kernel_name=name)(*args))
  outs = vary_like(outs, args)
  o = None
  if with_o:
    o = outs.pop(0)
    o = o if token_o else o.reshape(B, H, NC, C, V)
  states = outs.pop(0) if with_states else None
  final = outs.pop(0)
  return o, states, final, outs.pop(0) if with_last_start else None


def backward_states(t: ChunkTensors, do, dfinal, *, interpret=None, block_v: int = BLOCK_V,
                    sequence_pieces: int | None = None, transitions=None, token_do: bool = False):
  """The reverse walk: `(dstates [B, H, NC, V, K] in the operand dtype, dh0 [B, H, K, V] float32)`,
  `dstates[n]` the (transposed) gradient of the state leaving chunk n.

  `do: [B, H, NC, C, V]` (any float dtype; cast to the operand dtype), `dfinal` None or `[B, H, K, V]`.
  sequence_pieces: as in `forward` (a first reverse walk of every piece from zero gives the gradient at
  its start, `D`; then `dS_start = A^T dS_end + D` chains the pieces backwards). transitions: the
  pieces' `A` if `forward` returned them (else they are computed here). token_do: `do` is given in the
  op's token layout `[B, NC * C, H, V]` (as the forward's `token_o` writes o), read there by the kernel:
  no transpose before the walk.
  """
  B, H, NC, C, K = t.qg.shape
  V = do.shape[-1]
  bv = min(block_v, V)
  S = pieces(B * H * (V // bv), NC, sequence_pieces)
  if NC % S:
    raise ValueError(f"sequence_pieces={S} must divide the number of chunks, {NC}")
  do = do.astype(t.qg.dtype) if token_do else flat(do.astype(t.qg.dtype))
  df = None if dfinal is None else jnp.swapaxes(dfinal.astype(F32), -1, -2)[:, :, None]
  if S > 1:
    A = transitions if transitions is not None else piece_maps(t, S, interpret=interpret,
                                                               block_v=block_v, with_offsets=False)[0]
    _, starts = _reverse_kernel(t, do, None, S=S, with_dstates=False, interpret=interpret, bv=bv,
                                token_do=token_do)
    # transposed: dS_end^T[p - 1] = dS_end^T[p] A[p] + D^T[p]
    mm = functools.partial(jnp.einsum, "bhvk,bhkj->bhvj", precision=lax.Precision.HIGHEST)
    df = chain_pieces(None if df is None else df[:, :, 0], starts, lambda x, p: mm(x, A[:, :, p]),
                      reverse=True)
  dstates, starts = _reverse_kernel(t, do, df, S=S, with_dstates=True, interpret=interpret, bv=bv,
                                    token_do=token_do)
  return dstates, jnp.swapaxes(starts[:, :, 0], -1, -2)


@lowered_once()
def _reverse_kernel(t: ChunkTensors, do, df, *, S, with_dstates, interpret, bv, token_do=False):
  """The reverse walk of `S` pieces in parallel; `do` flat `[B, H, NC * C, V]` (token_do: `[B, NC * C,
  H, V]`) in the operand dtype,
  `df` None or the transposed gradient leaving each piece `[B, H, S, V, K]`. Returns `(dstates | None,
  the transposed gradient at each piece's start [B, H, S, V, K])`."""
  B, H, NC, C, K = t.qg.shape
  V = do.shape[-1]
  dtype = t.qg.dtype
  NCs = NC // S
  do_rows = (lambda do_r, b, h, rows, vs: do_r.at[b, rows, h, vs]) if token_do else (
      lambda do_r, b, h, rows, vs: do_r.at[b, h, rows, vs])
  delta = t.w is not None
  has_df = df is not None
  # the additive family's reverse walk reads qg and decay only (kd, u, p may be None)
  qg, kd, p = flat(t.qg), flat(t.kd) if delta else None, flat(t.p) if delta else None
  w = None if not delta else flat(t.w)
  decay = t.decay.astype(F32)

  out_type = (([jax.ShapeDtypeStruct((B, H, NC, V, K), dtype)] if with_dstates else [])
              + [jax.ShapeDtypeStruct((B, H, S, V, K), F32)])
  n_in = 3 + 3 * delta  # qg, do, decay, [kd, w, p]
  scratch = dict(
      qg_s=smem((2, C, K), dtype), do_s=smem((2, C, bv), dtype), decay_s=plgpu.SMEM((2, K), F32),
      h_s=smem((2, bv, K), dtype), state_s=smem((bv, K), F32),
      in_bar=plgpu.Barrier(num_arrivals=n_in, num_barriers=2), state_bar=plgpu.Barrier())
  if delta:
    scratch.update(kd_s=smem((2, C, K), dtype), w_s=smem((2, C, K), dtype), p_s=smem((2, C, C), dtype),
                   du_s=smem((bv, C), dtype))

  def body(*refs, qg_s, do_s, decay_s, h_s, state_s, in_bar, state_bar, kd_s=None, w_s=None, p_s=None,
           du_s=None):
    refs = list(refs)
    take = lambda present=True: refs.pop(0) if present else None
    qg_r, kd_r, w_r, p_r, do_r, decay_r, df_r = (
        take(), take(delta), take(delta), take(delta), take(), take(), take(has_df))
    ds_r, dh0_r = take(with_dstates), take()
    b, h, vs = program(bv)
    piece = lax.axis_index("s")

    def issue(n, slot):
      n = piece * NCs + n
      rows, bar = pl.ds(n * C, C), in_bar.at[slot]
      plgpu.copy_gmem_to_smem(qg_r.at[b, h, rows], qg_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(do_rows(do_r, b, h, rows, vs), do_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(decay_r.at[b, h, n], decay_s.at[slot], bar)
      if delta:
        plgpu.copy_gmem_to_smem(kd_r.at[b, h, rows], kd_s.at[slot], bar)
        plgpu.copy_gmem_to_smem(w_r.at[b, h, rows], w_s.at[slot], bar)
        plgpu.copy_gmem_to_smem(p_r.at[b, h, rows], p_s.at[slot], bar)

    def chunk(n, slot, ds_t):
      n = piece * NCs + n
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)
      ds_lo = h_s.at[slot]
      ds_lo[...] = ds_t.astype(dtype)
      plgpu.commit_smem()
      if with_dstates:
        plgpu.copy_smem_to_gmem(ds_lo, ds_r.at[b, h, n, vs])
      do_t = do_s.at[slot].T
      # dS^T <- dS^T Diag(decay) + dO^T Qg - du^T W,   du^T = dO^T P + dS^T Kd^T
      d = lax.broadcast_in_dim(plgpu.load(decay_s.at[slot], layout=COLS), (bv, K), [1])
      nxt = matmul(do_t, qg_s.at[slot], (bv, K), init=ds_t * d)
      if delta:
        du_t = matmul(do_t, p_s.at[slot], (bv, C))
        du_t = matmul(ds_lo, kd_s.at[slot].T, (bv, C), init=du_t)
        du_s[...] = du_t.astype(dtype)
        plgpu.commit_smem()
        nxt = nxt - matmul(du_s, w_s.at[slot], (bv, K))
      return nxt

    init = lambda: initial(df_r.at[b, h, piece, vs] if has_df else None, state_s, state_bar, bv, K)
    store_last(walk_chunks(NCs, issue, in_bar, init, chunk, reverse=True), state_s,
                dh0_r.at[b, h, piece, vs])

  args = [x for x, present in ((qg, True), (kd, delta), (w, delta), (p, delta), (do, True),
                               (decay, True), (df, has_df))
          if present]
  outs = list(plgpu.kernel(
      body, out_type=tuple(out_type), scratch_types=scratch, grid=(B, H, V // bv, S),
      grid_names=("b", "h", "v", "s"), compiler_params=compiler_params(approx_math=True),
      interpret=interpret, kernel_name="chunk_walk_bwd" if with_dstates else "chunk_walk_bwd_starts")(*args))
  outs = vary_like(outs, args)
  dstates = outs.pop(0) if with_dstates else None
  return dstates, outs.pop(0)


def backward(t: ChunkTensors, states, do, dfinal, *, interpret=None, block_v: int = BLOCK_V,
             sequence_pieces: int | None = None, transitions=None):
  """Cotangents of the per-chunk tensors (float32 `ChunkTensors`) and dh0, from the reverse walk's
  per-chunk dS and the forward's per-chunk states, by batched matmuls over all chunks (XLA)."""
  dstates, dh0 = backward_states(t, do, dfinal, interpret=interpret, block_v=block_v,
                                 sequence_pieces=sequence_pieces, transitions=transitions)
  ein = functools.partial(jnp.einsum, preferred_element_type=F32)
  S, dS = states, dstates                                   # [B, H, NC, V, K], transposed
  do = do.astype(t.u.dtype)
  du = ein("bhnij,bhnic->bhnjc", t.p, do) + ein("bhnck,bhnvk->bhncv", t.kd, dS)
  u = t.u.astype(F32)
  if t.w is not None:
    u = u - ein("bhnck,bhnvk->bhncv", t.w, S)
  u_lo = u.astype(t.u.dtype)
  grads = ChunkTensors(
      qg=ein("bhncv,bhnvk->bhnck", do, S),
      kd=ein("bhncv,bhnvk->bhnck", u_lo, dS),
      w=None if t.w is None else -ein("bhncv,bhnvk->bhnck", du.astype(t.u.dtype), S),
      u=du,
      p=ein("bhniv,bhnjv->bhnij", do, u_lo),
      decay=jnp.einsum("bhnvk,bhnvk->bhnk", S.astype(F32), dS.astype(F32)))
  return grads, dh0
