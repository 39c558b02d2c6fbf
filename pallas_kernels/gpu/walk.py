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
computes (`_walk_chunks`); outputs leave through a double-buffered staging tile by TMA.

Operands are bfloat16 or float16 with float32 accumulation (the state and its gradient are float32;
what is stored per chunk is in the operand dtype, as the chunk-local tensors are). The value axis splits
with no communication (the walk is independent per value column).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.prep import ChunkTensors

F32 = jnp.float32
BLOCK_V = 64          # value columns per program: the WGMMA M dimension of the state
WGMMA = plgpu.Layout.WGMMA
COLS = plgpu.Layout.WGMMA.reduce(0)   # one value per column of a WGMMA-layout tile


SM_COUNT = 132   # an H200's multiprocessors: walks with fewer programs split the sequence (`pieces`)
SMEM_BYTES = 227 * 1024   # an H100/H200 block's dynamic shared memory


def scratch_bytes(scratch) -> int:
  """Shared memory of a kernel's scratch dict (buffers, plus 2 KB for barriers and alignment)."""
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
             for x in scratch.values() if not isinstance(x, plgpu.Barrier)) + 2048


def pieces(programs: int, NC: int, pieces_: int | None = None) -> int:
  """How many pieces each sequence's walk is split into: the given number, or (None) the largest power
  of two that divides NC, keeps `programs * pieces` within one wave of the GPU and leaves at least 16
  chunks per piece. A walk is sequential over its chunks, so at (1, 32768, 16, 128) the 32 programs of
  an unsplit walk would leave three quarters of the multiprocessors idle."""
  if pieces_ is not None:
    if pieces_ < 1:
      raise ValueError(f"sequence_pieces must be >= 1; got {pieces_}")
    return pieces_
  S = 1
  while programs * S * 2 <= SM_COUNT and NC >= 2 * S * 16 and NC % (2 * S) == 0:
    S *= 2
  return S


def smem(shape, dtype):
  """A shared-memory buffer tiled and swizzled for TMA and WGMMA along its last dim."""
  dtype = jnp.dtype(dtype)
  swizzle = plgpu.find_swizzle(shape[-1] * dtype.itemsize * 8)
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle // dtype.itemsize)),
                                              plgpu.SwizzleTransform(swizzle)))


def matmul(a, b, shape, init=None):
  """`init + a @ b` on the tensor cores, float32 result (`a`, `b`: 16-bit shared-memory refs, possibly
  transposed views).

  The result passes an optimisation barrier: reading the accumulator lowers to a `wgmma.wait_group` that
  has no data dependency on the registers, so without it arithmetic on the result could be scheduled
  before the wait."""
  def scoped(acc):
    plgpu.wgmma(acc, a, b)
    return acc[...]
  out = lax.optimization_barrier(pl.run_scoped(scoped, plgpu.ACC(shape, F32)))
  return out if init is None else init + out


def matmuls(*specs):
  """Several products issued before one wait, so the tensor cores pipeline them: each spec is
  `(shape, [(a, b), ...])` and yields `sum(a @ b)` (float32, one accumulator per spec; the terms of a
  spec chain in it). Returns the results as a tuple, past one optimisation barrier (see `matmul`)."""
  def scoped(*accs):
    for acc, (_, pairs) in zip(accs, specs):
      for a, b in pairs:
        plgpu.wgmma(acc, a, b)
    return tuple(acc[...] for acc in accs)
  return lax.optimization_barrier(pl.run_scoped(scoped, *(plgpu.ACC(shape, F32) for shape, _ in specs)))


def _flat(x):
  """`[B, H, NC, C, D]` -> `[B, H, NC * C, D]` (free: a reshape of contiguous dims)."""
  return None if x is None else x.reshape(x.shape[:2] + (-1,) + x.shape[4:])


def _vary_like(outs, args):
  """Under `jax.shard_map(check_vma=True)`: the kernel's outputs vary over the mesh axes its inputs vary
  over (`plgpu.kernel` itself does not track them)."""
  axes = common.varying_axes(args)
  return [common.vary_over(x, axes) for x in outs]


def _program(bv):
  """This program's batch row, head and slice of value columns."""
  return lax.axis_index("b"), lax.axis_index("h"), pl.ds(lax.axis_index("v") * bv, bv)


def _u_block(bv, u_blocks, blocks):
  """`(u's columns for this program, None or a float32 0/1 factor)`: programs of the first `u_blocks`
  of `blocks` value blocks read theirs; the others read block 0's (any block: the TMA's arrivals stay
  the same) and multiply it by 0."""
  v = lax.axis_index("v")
  if u_blocks >= blocks:
    return pl.ds(v * bv, bv), None
  return pl.ds(jnp.minimum(v, max(u_blocks - 1, 0)) * bv, bv), (v < u_blocks).astype(F32)


def _new_values(u_ref, s_lo, w_ref, keep, dst):
  """The delta family's `u_new^T = U^T - S^T W^T` (`U` times the 0/1 factor `keep` of `_u_block`,
  unless None) written to the `[bv, C]` shared-memory tile `dst` in its dtype; returns dst."""
  u = plgpu.load(u_ref.T, layout=WGMMA).astype(F32)
  dst[...] = ((u if keep is None else u * keep) - matmul(s_lo, w_ref.T, dst.shape)).astype(dst.dtype)
  plgpu.commit_smem()
  return dst


def _initial(src, state_s, bar, bv, K):
  """The float32 `[bv, K]` tile `src` (a GMEM ref, or None for zeros) in registers, WGMMA layout."""
  if src is None:
    return plgpu.layout_cast(jnp.zeros((bv, K), F32), WGMMA)
  plgpu.copy_gmem_to_smem(src, state_s, bar)
  plgpu.barrier_wait(bar)
  return plgpu.load(state_s, layout=WGMMA)


def _store_last(x, state_s, dst):
  """Writes the float32 registers `x` to the GMEM ref `dst` through `state_s`, and waits for every
  store of the program."""
  state_s[...] = x
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(state_s, dst)
  plgpu.wait_smem_to_gmem(0)


def stream_chunks(NC, stages, issue, in_free):
  """A fetching warpgroup's loop over chunks 0 .. NC-1: `issue(n)` fetches chunk n into slot
  `n % stages`; the first `stages` at once, then chunk n + stages once every reader has freed chunk n's
  slot (`in_free`, one phase per chunk). It then waits for the frees it did not need, so that it has
  seen every phase of `in_free` (the interpreter checks that no phase goes unobserved)."""
  for n in range(min(stages, NC)):
    issue(n)

  def refill(n, carry):
    plgpu.barrier_wait(in_free.at[lax.rem(n, stages)])
    issue(n + stages)
    return carry

  if NC > stages:
    lax.fori_loop(0, NC - stages, refill, 0)
  for n in range(max(NC - stages, 0), NC):
    plgpu.barrier_wait(in_free.at[n % stages])


def _walk_chunks(NC, issue, in_bar, init, chunk, *, reverse: bool = False):
  """`chunk(n, slot, carry) -> carry` over chunks 0 .. NC-1 (or NC-1 .. 0), double-buffered: the inputs
  of the next chunk are fetched by `issue(n, slot)` (TMA, arriving on `in_bar.at[slot]`) into the other
  slot while this one computes. `init()` gives the first carry; it runs after the first fetch is issued,
  so that its own load overlaps it."""
  first = NC - 1 if reverse else 0
  issue(first, first % 2)
  carry = init()

  def step(i, carry):
    n = NC - 1 - i if reverse else i
    slot = lax.rem(n, 2)
    plgpu.barrier_wait(in_bar.at[slot])

    @pl.when(n > 0 if reverse else n + 1 < NC)
    def _prefetch():
      issue(n - 1 if reverse else n + 1, 1 - slot)

    return chunk(n, slot, carry)

  return lax.fori_loop(0, NC, step, carry)


def forward(t: ChunkTensors, h0, *, with_o: bool = True, with_states: bool = False, out_dtype=F32,
            interpret=None, block_v: int = BLOCK_V, sequence_pieces: int | None = None,
            return_transitions: bool = False, token_o: bool = False, scale: float = 1.0,
            warpgroups: int = 1):
  """The forward walk.

  Args:
    t: per-chunk tensors in one 16-bit dtype (`decay` float32), shapes as in `prep.ChunkTensors`.
    h0: None or `[B, H, K, V]` float32.
    with_o: compute `o`; with_states: store the (transposed) state entering every chunk.
    sequence_pieces: split each sequence into this many pieces that walk in parallel (None: `pieces`'
      choice; NC must be a multiple). With more than one, a first walk gives every piece's affine map
      `S_end = A S_start + F` (`piece_maps`), XLA chains them for the state entering each piece, and the
      main walk runs all pieces at once.
    warpgroups: 3 runs the walks (the main one and the pieces' maps) with specialised warpgroups
      (`_streamed_walk`: fetch / state / output); 1 in one.
    return_transitions: also return the pieces' `A` (`[B, H, S, K, K]`, None for one piece), which
      `backward_states` can reuse.
    token_o: write o as `[B, NC * C, H, V]` (the op's token layout; no transpose after the walk) and
      times `scale`, instead of chunk layout and unscaled.

  Returns:
    `(o [B, H, NC, C, V] out_dtype or None (token_o: [B, NC * C, H, V]), states [B, H, NC, V, K] or None, final [B, H, K, V] f32)`
    (and the transitions with `return_transitions`).
  """
  B, H, NC, C, K = t.qg.shape
  V = t.u.shape[-1]
  bv = min(block_v, V)
  if warpgroups not in (1, 3):
    raise ValueError(f"warpgroups must be 1 or 3; got {warpgroups!r}")
  S = pieces(B * H * (V // bv), NC, sequence_pieces)
  if NC % S:
    raise ValueError(f"sequence_pieces={S} must divide the number of chunks, {NC}")
  A = None
  h_in = None if h0 is None else h0.astype(F32)[:, :, None]         # [B, H, S, K, V]
  if S > 1:
    A, F = piece_maps(t, S, interpret=interpret, block_v=block_v, warpgroups=warpgroups)
    mm = functools.partial(jnp.einsum, "bhkj,bhjv->bhkv", precision=lax.Precision.HIGHEST)
    h_in = chain_pieces(h0, F, lambda x, p: mm(A[:, :, p], x))
  h_in = None if h_in is None else jnp.swapaxes(h_in, -1, -2)
  o, states, finals = _forward_kernel(t, h_in, S=S, with_o=with_o, with_states=with_states,
                                      out_dtype=out_dtype, interpret=interpret, bv=bv, token_o=token_o,
                                      scale=scale, warpgroups=warpgroups)
  out = (o, states, jnp.swapaxes(finals[:, :, -1], -1, -2))
  return out + (A,) if return_transitions else out


def piece_maps(t: ChunkTensors, S: int, *, interpret=None, block_v: int = BLOCK_V, with_offsets=True,
               warpgroups: int = 1):
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
  _, _, ends = _forward_kernel(t, start, S=S, with_o=False, with_states=False, out_dtype=F32,
                               interpret=interpret, bv=bv, warpgroups=warpgroups, state_cols=cols,
                               u_blocks=V // bv if with_offsets else 0)
  ends = jnp.swapaxes(ends, -1, -2)                                  # [B, H, S, K, cols]
  F = ends[..., :V] if with_offsets else None
  return (A, F) if t.w is None else (ends[..., cols - K:], F)


def chain_pieces(first, offsets, apply, *, reverse: bool = False):
  """`[B, H, S, ...]`: the state entering every piece (`reverse`: the gradient leaving it) from the one
  entering the first (leaving the last), `first` None (zeros) or `[B, H, ...]`; each piece's linear map
  `apply(x, p)` and its own contribution from a zero start `offsets[:, :, p]`:
  `in[p + 1] = apply(in[p], p) + offsets[p]` (reverse: `out[p - 1] = apply(out[p], p) + offsets[p]`).
  The pieces are few: a loop in XLA over single states."""
  S = offsets.shape[2]
  carry = jnp.zeros_like(offsets[:, :, 0]) if first is None else first.astype(F32)
  out = [None] * S
  for p in (range(S - 1, -1, -1) if reverse else range(S)):
    out[p] = carry
    carry = apply(carry, p) + offsets[:, :, p]
  return jnp.stack(out, axis=2)


def _fetch_chunk(srcs, dsts, n, slot, bar, b, h, vs, C, u_vs=None):
  """TMA copies of chunk n's walk inputs (kd, u, decay, w, qg, p; the absent ones None) of batch row b,
  head h and value columns vs (u: `u_vs`, default vs) into input slot `slot`, arriving on `bar`."""
  kd_r, u_r, decay_r, w_r, qg_r, p_r = srcs
  kd_s, u_s, decay_s, w_s, qg_s, p_s = dsts
  rows = pl.ds(n * C, C)
  plgpu.copy_gmem_to_smem(kd_r.at[b, h, rows], kd_s.at[slot], bar)
  plgpu.copy_gmem_to_smem(u_r.at[b, h, rows, vs if u_vs is None else u_vs], u_s.at[slot], bar)
  plgpu.copy_gmem_to_smem(decay_r.at[b, h, n], decay_s.at[slot], bar)
  for src, dst in ((w_r, w_s), (qg_r, qg_s), (p_r, p_s)):
    if src is not None:
      plgpu.copy_gmem_to_smem(src.at[b, h, rows], dst.at[slot], bar)


def _forward_kernel(t: ChunkTensors, h0, *, S, with_o, with_states, out_dtype, interpret, bv,
                    token_o: bool = False, scale: float = 1.0, warpgroups: int = 1,
                    state_cols: int | None = None, u_blocks: int | None = None):
  """The forward walk of `S` pieces of every sequence in parallel; `h0`: None or the transposed state
  entering each piece `[B, H, S, V, K]`. Returns `(o | None, states | None, the transposed state
  leaving each piece [B, H, S, V, K])`. warpgroups: 3 specialises them (`_streamed_walk`).

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
  qg, kd, u, p = _flat(t.qg), _flat(t.kd), _flat(t.u), _flat(t.p)
  w = None if not delta else _flat(t.w)
  decay = t.decay.astype(F32)

  out_type = []
  if with_o:
    out_type.append(jax.ShapeDtypeStruct((B, NC * C, H, V) if token_o else (B, H, NC * C, V), out_dtype))
  if with_states:
    out_type.append(jax.ShapeDtypeStruct((B, H, NC, V, K), dtype))
  out_type.append(jax.ShapeDtypeStruct((B, H, S, V, K), F32))

  n_in = 3 + delta + 2 * with_o  # kd, u, decay, [w], [qg, p]
  scratch = dict(
      kd_s=smem((2, C, K), dtype), u_s=smem((2, C, bv), dtype),
      decay_s=plgpu.SMEM((2, K), F32),
      state_s=plgpu.SMEM((bv, K), F32), h_s=smem((2, bv, K), dtype),
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
    o_r, states_r, final_r = take(with_o), take(with_states), take()
    b, h, vs = _program(bv)
    u_vs, u_keep = _u_block(bv, u_blocks, V // bv)
    piece = lax.axis_index("s")

    def issue(n, slot):
      _fetch_chunk((kd_r, u_r, decay_r, w_r, qg_r, p_r), (kd_s, u_s, decay_s, w_s, qg_s, p_s),
                   piece * NCs + n, slot, in_bar.at[slot], b, h, vs, C, u_vs)

    def chunk(n, slot, s_t):
      n = piece * NCs + n
      # The state is the left operand of the matmuls below, from shared memory (`s_lo`); this slot's
      # staging tiles were last read by the stores issued two chunks ago.
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)
      s_lo = h_s.at[slot]
      s_lo[...] = s_t.astype(dtype)
      plgpu.commit_smem()
      u_lo = u_s.at[slot].T
      if delta:
        u_lo = _new_values(u_s.at[slot], s_lo, w_s.at[slot], u_keep, un_s)
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

    init = lambda: _initial(h0_r.at[b, h, piece, vs] if has_h0 else None, state_s, state_bar, bv, K)
    _store_last(_walk_chunks(NCs, issue, in_bar, init, chunk), state_s, final_r.at[b, h, piece, vs])

  threads, name = {}, "chunk_walk_fwd" if with_o else "chunk_walk_states"
  if warpgroups == 3:
    body, scratch = _streamed_walk(t, S=S, with_o=with_o, with_states=with_states, has_h0=has_h0,
                                   out_dtype=out_dtype, bv=bv, token_o=token_o, scale=scale,
                                   blocks=(u_blocks, V // bv))
    threads, name = dict(num_threads=2 + with_o, thread_name="wg"), name + "_streamed"
  args = [x for x, present in ((qg, with_o), (kd, True), (w, delta), (u, True), (p, with_o),
                               (decay, True), (h0, has_h0))
          if present]
  outs = list(plgpu.kernel(
      body, out_type=tuple(out_type), scratch_types=scratch, grid=(B, H, V // bv, S),
      grid_names=("b", "h", "v", "s"), compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret, kernel_name=name, **threads)(*args))
  outs = _vary_like(outs, args)
  o = None
  if with_o:
    o = outs.pop(0)
    o = o if token_o else o.reshape(B, H, NC, C, V)
  states = outs.pop(0) if with_states else None
  return o, states, outs.pop(0)


def _streamed_scratch(C, K, bv, dtype, out_dtype, *, delta, with_o, stages):
  """Shared memory of `_streamed_walk`: `stages` input slots, two slots each of the state
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


def streamed_stages(C, K, bv, dtype, out_dtype, *, delta, with_o) -> int | None:
  """The deepest input pipeline (2 to 4 slots) of `_streamed_walk` that fits a block's shared
  memory, or None."""
  for stages in (4, 3, 2):
    scratch = _streamed_scratch(C, K, bv, dtype, out_dtype, delta=delta, with_o=with_o, stages=stages)
    if scratch_bytes(scratch) <= SMEM_BYTES:
      return stages
  return None


def _streamed_walk(t: ChunkTensors, *, S, with_o, with_states, has_h0, out_dtype, bv, token_o, scale,
                   blocks):
  """`(body, scratch)` of `_forward_kernel` with specialised warpgroups (`warpgroups=3`): the last one
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
  if stages is None:
    raise ValueError(f"the streamed walk does not fit {SMEM_BYTES} bytes of shared memory (C={C}, K={K}, "
                     f"block_v={bv}, {jnp.dtype(dtype).name}); use warpgroups=1")
  scratch = _streamed_scratch(C, K, bv, dtype, out_dtype, delta=delta, with_o=with_o, stages=stages)
  fetcher = 1 + with_o

  def body(*refs, kd_s, u_s, decay_s, h_s, state_s, in_bar, in_free, state_bar, h_ready, h_free, done,
           w_s=None, un_s=None, qg_s=None, p_s=None, o_s=None):
    refs = list(refs)
    take = lambda present=True: refs.pop(0) if present else None
    qg_r, kd_r, w_r, u_r, p_r, decay_r, h0_r = (
        take(with_o), take(), take(delta), take(), take(with_o), take(), take(has_h0))
    o_r, states_r, final_r = take(with_o), take(with_states), take()
    b, h, vs = _program(bv)
    u_vs, u_keep = _u_block(bv, *blocks)
    piece, wg = lax.axis_index("s"), lax.axis_index("wg")

    @pl.when(wg == fetcher)
    def _fetch():
      def issue(n):
        slot = lax.rem(n, stages)
        _fetch_chunk((kd_r, u_r, decay_r, w_r, qg_r, p_r), (kd_s, u_s, decay_s, w_s, qg_s, p_s),
                     piece * NCs + n, slot, in_bar.at[slot], b, h, vs, C, u_vs)

      stream_chunks(NCs, stages, issue, in_free)

    @pl.when(wg == 0)
    def _state():
      s_t = _initial(h0_r.at[b, h, piece, vs] if has_h0 else None, state_s, state_bar, bv, K)

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
          u_lo = _new_values(u_s.at[slot], s_lo, w_s.at[slot], u_keep, un_s.at[hs])
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
      _store_last(s_t, state_s, final_r.at[b, h, piece, vs])

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


def backward_states(t: ChunkTensors, do, dfinal, *, interpret=None, block_v: int = BLOCK_V,
                    sequence_pieces: int | None = None, transitions=None):
  """The reverse walk: `(dstates [B, H, NC, V, K] in the operand dtype, dh0 [B, H, K, V] float32)`,
  `dstates[n]` the (transposed) gradient of the state leaving chunk n.

  `do: [B, H, NC, C, V]` (any float dtype; cast to the operand dtype), `dfinal` None or `[B, H, K, V]`.
  sequence_pieces: as in `forward` (a first reverse walk of every piece from zero gives the gradient at
  its start, `D`; then `dS_start = A^T dS_end + D` chains the pieces backwards). transitions: the
  pieces' `A` if `forward` returned them (else they are computed here).
  """
  B, H, NC, C, K = t.qg.shape
  V = do.shape[-1]
  bv = min(block_v, V)
  S = pieces(B * H * (V // bv), NC, sequence_pieces)
  if NC % S:
    raise ValueError(f"sequence_pieces={S} must divide the number of chunks, {NC}")
  do = _flat(do.astype(t.qg.dtype))
  df = None if dfinal is None else jnp.swapaxes(dfinal.astype(F32), -1, -2)[:, :, None]
  if S > 1:
    A = transitions if transitions is not None else piece_maps(t, S, interpret=interpret,
                                                               block_v=block_v, with_offsets=False)[0]
    _, starts = _reverse_kernel(t, do, None, S=S, with_dstates=False, interpret=interpret, bv=bv)
    # transposed: dS_end^T[p - 1] = dS_end^T[p] A[p] + D^T[p]
    mm = functools.partial(jnp.einsum, "bhvk,bhkj->bhvj", precision=lax.Precision.HIGHEST)
    df = chain_pieces(None if df is None else df[:, :, 0], starts, lambda x, p: mm(x, A[:, :, p]),
                      reverse=True)
  dstates, starts = _reverse_kernel(t, do, df, S=S, with_dstates=True, interpret=interpret, bv=bv)
  return dstates, jnp.swapaxes(starts[:, :, 0], -1, -2)


def _reverse_kernel(t: ChunkTensors, do, df, *, S, with_dstates, interpret, bv):
  """The reverse walk of `S` pieces in parallel; `do` flat `[B, H, NC * C, V]` in the operand dtype,
  `df` None or the transposed gradient leaving each piece `[B, H, S, V, K]`. Returns `(dstates | None,
  the transposed gradient at each piece's start [B, H, S, V, K])`."""
  B, H, NC, C, K = t.qg.shape
  V = do.shape[-1]
  dtype = t.qg.dtype
  NCs = NC // S
  delta = t.w is not None
  has_df = df is not None
  # the additive family's reverse walk reads qg and decay only (kd, u, p may be None)
  qg, kd, p = _flat(t.qg), _flat(t.kd) if delta else None, _flat(t.p) if delta else None
  w = None if not delta else _flat(t.w)
  decay = t.decay.astype(F32)

  out_type = (([jax.ShapeDtypeStruct((B, H, NC, V, K), dtype)] if with_dstates else [])
              + [jax.ShapeDtypeStruct((B, H, S, V, K), F32)])
  n_in = 3 + 3 * delta  # qg, do, decay, [kd, w, p]
  scratch = dict(
      qg_s=smem((2, C, K), dtype), do_s=smem((2, C, bv), dtype), decay_s=plgpu.SMEM((2, K), F32),
      h_s=smem((2, bv, K), dtype), state_s=plgpu.SMEM((bv, K), F32),
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
    b, h, vs = _program(bv)
    piece = lax.axis_index("s")

    def issue(n, slot):
      n = piece * NCs + n
      rows, bar = pl.ds(n * C, C), in_bar.at[slot]
      plgpu.copy_gmem_to_smem(qg_r.at[b, h, rows], qg_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(do_r.at[b, h, rows, vs], do_s.at[slot], bar)
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

    init = lambda: _initial(df_r.at[b, h, piece, vs] if has_df else None, state_s, state_bar, bv, K)
    _store_last(_walk_chunks(NCs, issue, in_bar, init, chunk, reverse=True), state_s,
                dh0_r.at[b, h, piece, vs])

  args = [x for x, present in ((qg, True), (kd, delta), (w, delta), (p, delta), (do, True),
                               (decay, True), (df, has_df))
          if present]
  outs = list(plgpu.kernel(
      body, out_type=tuple(out_type), scratch_types=scratch, grid=(B, H, V // bv, S),
      grid_names=("b", "h", "v", "s"), compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret, kernel_name="chunk_walk_bwd" if with_dstates else "chunk_walk_bwd_starts")(*args))
  outs = _vary_like(outs, args)
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
