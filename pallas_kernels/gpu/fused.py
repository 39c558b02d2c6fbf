"""The additive family in fused Mosaic GPU kernels: forward and backward with no XLA preparation.

For scalar or no decay, packed or not, the per-chunk tensors of the additive family are cheap to form
from the raw tiles, so the kernel reads q, k, v and the chunk-local cumulative log-decay `G` once and
never writes `qg`, `kd` or `P` to device memory (prep.py's tensors, formed in shared memory instead):

    P    = (q k^T) * e^(G_i - G_j)   on j <= i, else 0      (exponent masked before the exponential)
    o    = scale ((q * e^G) S + P v)
    S   <- e^(G_C) S + (k * e^(G_C - G))^T v

Every exponent is <= 0 (G is non-increasing). Packed rows (`segment_ids`) enter as per-token masks
(`segment_vectors`), as in prep.py. Per program (batch, value head, 64 value columns) the walk
is that of `walk.forward`; q and k are read from their `[B, T, H, K]` layout (grouped value heads read
their q/k head), v from `[B, T, H_v, V]`. The backward (`backward`) runs the states walk
(`forward(..., with_o=False, with_states=True)`), the reverse walk (`backward_states`) and
`backward_chunks`, which forms every chunk's gradients in parallel: no XLA preparation either.
`chunked_attention` takes this path for every call it covers (`fused=False` forces the prepared one).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import prep
from pallas_kernels.gpu.walk import (BLOCK_V, COLS, F32, SMEM_BYTES, WGMMA, _initial, _program, _store_last,
                                     _vary_like, _walk_chunks, chain_pieces, matmul, pieces, scratch_bytes,
                                     smem, stream_chunks)

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


def _row_scales(g_s, m_s, C):
  """`(e^G, e^(G_C - G))` `[C]` of one chunk (rows layout): what the carried state contributes to each
  token and what each token's write contributes to the chunk's end (zero across runs when `m_s` holds
  `segment_vectors`). The loads pass an optimisation barrier, so a kernel that calls this again where
  it needs the vectors does not have CSE merge them into one long-lived value."""
  G_rows = lax.optimization_barrier(plgpu.load(g_s, layout=ROWS))
  G_last = g_s[C - 1]
  e_q, e_k = jnp.exp(G_rows), jnp.exp(G_last - G_rows)
  if m_s is not None:
    _, carry, to_last, _ = _segment_masks(m_s, None, C)
    e_q, e_k = e_q * carry, e_k * to_last
  return e_q, e_k


def _decay_tile(g_s, gc_s, m_s, C, *, lower: bool = True, strict: bool):
  """`exp(G_i - G_j)` `[C, C]` on the (strictly) lower triangle, or its transpose on the upper one
  (`lower=False`), pairs of one run only when `m_s` holds `segment_vectors`; zero elsewhere. Loads
  behind an optimisation barrier, as `_row_scales`."""
  G_rows, G_cols = lax.optimization_barrier((plgpu.load(g_s, layout=ROWS), plgpu.load(gc_s, layout=COLS)))
  i = plgpu.broadcasted_iota(jnp.int32, (C, C), 0, layout=WGMMA)
  j = plgpu.broadcasted_iota(jnp.int32, (C, C), 1, layout=WGMMA)
  diff = lax.broadcast_in_dim(G_rows, (C, C), [0]) - lax.broadcast_in_dim(G_cols, (C, C), [1])
  if lower:
    mask = (i > j) if strict else (i >= j)
  else:
    mask, diff = ((i < j) if strict else (i <= j)), -diff
  if m_s is not None:
    mask = mask & _segment_masks(m_s, None, C)[0]
  return jnp.exp(jnp.where(mask, diff, -jnp.inf))


def _last_state_term(g_s, m_s, st_s, dst_s, C):
  """`e^(G_C) rowsum(S * dS)` of one chunk as a `[C]` vector, the `[R, K]` S and dS tiles' rows folded
  onto the chunk's C rows (R a multiple of C): its sum is the last token's dG term from the carried
  state (zero where the chunk's last token left the carried run)."""
  s_decay = jnp.exp(g_s[C - 1])
  if m_s is not None:
    s_decay = s_decay * _segment_masks(m_s, None, C)[3]
  load = lambda ref, r: plgpu.load(ref.at[pl.ds(r, C)], layout=WGMMA).astype(F32)
  total = sum(jnp.sum(load(st_s, r) * load(dst_s, r), axis=1) for r in range(0, st_s.shape[0], C))
  return s_decay * total


L2_EPS = 1e-6   # `x * rsqrt(sum(x^2) + eps)`, as linear_attention_jax.ops.l2_normalize


def _l2_normalize_rows(ref, C):
  """Normalises the rows of the 16-bit `[C, K]` shared-memory tile `ref` in place (float32 sums, then
  rounded to the tile's dtype, as an XLA l2 norm before the kernel would round); returns the `[C]`
  reciprocal norms (rows layout) for the gradient, `dx = r (dy - y rowsum(y dy))`."""
  x = plgpu.load(ref, layout=WGMMA).astype(jnp.float32)
  r = lax.rsqrt(jnp.sum(x * x, axis=1) + L2_EPS)
  ref[...] = (x * lax.broadcast_in_dim(r, x.shape, [0])).astype(ref.dtype)
  plgpu.commit_smem()
  return r


def _l2_normalize_grad(dy, y_ref, r):
  """`dx` of `y = l2_normalize(x)` for the float32 `[C, K]` tile `dy`, `y` the normalised tile in shared
  memory and `r` the rows' reciprocal norms."""
  y = plgpu.load(y_ref, layout=WGMMA).astype(jnp.float32)
  dot = jnp.sum(dy * y, axis=1)
  rows = lambda x: lax.broadcast_in_dim(x, dy.shape, [0])
  return rows(r) * (dy - y * rows(dot))


def local_cumsum(g, B: int, T_pad: int, Hv: int, C: int):
  """`[B, H_v, T_pad]` float32: the cumulative log-decay from each chunk's start (zeros for no decay)."""
  if g is None:
    return jnp.zeros((B, Hv, T_pad), F32)
  g = jnp.pad(g.astype(F32), [(0, 0), (0, T_pad - g.shape[1]), (0, 0)])
  return jnp.cumsum(jnp.swapaxes(g, 1, 2).reshape(B, Hv, T_pad // C, C), axis=-1).reshape(B, Hv, T_pad)


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
  end state, `walk.chain_pieces` the state entering each piece, and the main walk runs all pieces in
  parallel. warpgroups: 3 runs the main walk (with o) in three warpgroups per program
  (`_streamed_walk`: one fetches into as many input stages as shared memory holds, one
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
  walk_ = functools.partial(_forward_walk, q, k, v, G, masks, chunk_size=C, dtype=dtype,
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


def _forward_walk(q, k, v, G, masks, h0, *, chunk_size, dtype, out_dtype, interpret, bv, S, scale,
                  with_o, with_states, warpgroups: int = 1):
  """The forward kernel over `S` pieces of every sequence in parallel; `h0`: None or the transposed
  state entering each piece `[B, H_v, S, V, K]`. Returns `(o | None, states | None, the transposed
  state leaving each piece [B, H_v, S, V, K])`. warpgroups: 3 (with o) specialises them
  (`_streamed_walk`)."""
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
      kd_s=smem((C, K), dtype), h_s=smem((2, bv, K), dtype), state_s=plgpu.SMEM((bv, K), F32),
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
    b, h, vs = _program(bv)
    piece = lax.axis_index("s")
    hk = lax.div(h, group)

    def issue(n, slot):
      rows, bar = pl.ds((piece * NCs + n) * C, C), in_bar.at[slot]
      plgpu.copy_gmem_to_smem(k_r.at[b, rows, hk], k_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(v_r.at[b, rows, h, vs], v_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(g_r.at[b, h, rows], g_s.at[slot], bar)
      if with_o:
        plgpu.copy_gmem_to_smem(q_r.at[b, rows, hk], q_s.at[slot], bar)
        # the same G again: Mosaic GPU's layout inference wants one layout per buffer (rows, columns)
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
        same, carry, to_last, carry_last = _segment_masks(m_s, slot, C)
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

    init = lambda: _initial(h0_r.at[b, h, piece, vs] if has_h0 else None, state_s, state_bar, bv, K)
    _store_last(_walk_chunks(NCs, issue, in_bar, init, chunk), state_s, final_r.at[b, h, piece, vs])

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
    body, scratch = _streamed_walk(K=K, bv=bv, C=C, NCs=NCs, group=group, has_h0=has_h0, has_seg=has_seg,
                                   dtype=dtype, out_dtype=out_dtype, scale=scale, with_states=with_states)
    threads, name = dict(num_threads=3, thread_name="wg"), name + "_streamed"
  outs = plgpu.kernel(
      body, out_type=tuple(out_type), scratch_types=scratch, grid=(B, Hv, V // bv, S),
      grid_names=("b", "h", "v", "s"), compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret, kernel_name=name, **threads)(*args)
  outs = list(_vary_like(outs, args))
  o = outs.pop(0) if with_o else None
  states = outs.pop(0) if with_states else None
  return o, states, outs.pop(0)


def _streamed_scratch(C, K, bv, dtype, out_dtype, has_seg, stages):
  """Shared memory of `_streamed_walk`: `stages` input slots (q, k, v, G twice, masks), the
  state's `v e^(G_C - G)` tile, P, two state slots, two output slots, the float32 state tile."""
  scratch = dict(
      q_s=smem((stages, C, K), dtype), k_s=smem((stages, C, K), dtype),
      v_s=smem((stages, C, bv), dtype), g_s=plgpu.SMEM((stages, C), F32),
      gc_s=plgpu.SMEM((stages, C), F32), vd_s=smem((C, bv), dtype), p_s=smem((C, C), dtype),
      h_s=smem((2, bv, K), dtype), o_s=smem((2, C, bv), out_dtype), state_s=plgpu.SMEM((bv, K), F32),
      in_bar=plgpu.Barrier(num_arrivals=5 + SEG_ROWS * has_seg, num_barriers=stages),
      in_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages), state_bar=plgpu.Barrier(),
      h_ready=plgpu.Barrier(num_barriers=2), h_free=plgpu.Barrier(num_barriers=2),
      done=plgpu.Barrier(num_arrivals=3))
  if has_seg:
    scratch["m_s"] = plgpu.SMEM((stages, SEG_ROWS, C), F32)
  return scratch


def streamed_stages(C, K, bv, dtype, out_dtype, has_seg) -> int:
  """The deepest input pipeline (2 to 4 slots) whose shared memory fits a block."""
  for stages in (4, 3, 2):
    if scratch_bytes(_streamed_scratch(C, K, bv, dtype, out_dtype, has_seg, stages)) <= SMEM_BYTES:
      return stages
  raise ValueError(f"the streamed forward does not fit {SMEM_BYTES} bytes of shared memory "
                   f"(C={C}, K={K}, block_v={bv}, {jnp.dtype(dtype).name})")


def _streamed_walk(*, K, bv, C, NCs, group, has_h0, has_seg, dtype, out_dtype, scale, with_states):
  """`(body, scratch)` of `_forward_walk` with o in three warpgroups per program (`warpgroups=3`):

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
    b, h, vs = _program(bv)
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
        _, _, to_last, carry_last = _segment_masks(m_s, slot, C)
        v_row, s_decay = v_row * to_last, s_decay * carry_last
      return v_row, s_decay

    @pl.when(wg == 0)
    def _state():
      s_t = _initial(h0_r.at[b, h, piece, vs] if has_h0 else None, state_s, state_bar, bv, K)

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
      _store_last(s_t, state_s, final_r.at[b, h, piece, vs])

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
          causal = causal & _segment_masks(m_s, slot, C)[0]
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


def backward_states(q, g, do, dfinal, *, chunk_size: int, dtype, segment_ids=None, interpret=None,
                    block_v: int = BLOCK_V, sequence_pieces: int | None = None, scale: float = 1.0):
  """The reverse walk of the additive family from the raw q and gates (`walk.backward_states` without
  the prepared `qg`): `(dstates [B, H_v, NC, V, K] in dtype, dh0 [B, H_v, K, V] float32)`, `dstates[n]`
  the (transposed) gradient of the state leaving chunk n:  dS^T <- e^(G_C) dS^T + scale do^T (q e^G).

  q: `[B, T, H, K]`; g: None or `[B, T, H_v]`; do: `[B, T_pad, H_v, V]` (T_pad as `forward` padded it);
  dfinal: None or `[B, H_v, K, V]`. sequence_pieces: as in `forward` (a first reverse walk of every
  piece from zero gives the gradient at its start, `walk.chain_pieces` the gradient leaving each piece).
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
  walk_ = functools.partial(_reverse_walk, q, do, G, masks, chunk_size=C, dtype=dtype, interpret=interpret,
                            bv=bv, S=S, scale=scale)
  if S > 1:
    _, starts = walk_(None, with_dstates=False)
    decay = _piece_decay(G, masks, NC, S)
    dfinal = chain_pieces(dfinal, starts, lambda x, p: decay[:, :, p, None, None] * x, reverse=True)
  elif dfinal is not None:
    dfinal = dfinal[:, :, None]
  dstates, starts = walk_(dfinal, with_dstates=True)
  return dstates, jnp.swapaxes(starts[:, :, 0], -1, -2)


def _reverse_walk(q, do, G, masks, dfinal, *, chunk_size, dtype, interpret, bv, S, scale, with_dstates):
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
      qg_s=smem((C, K), dtype), h_s=smem((2, bv, K), dtype), state_s=plgpu.SMEM((bv, K), F32),
      in_bar=plgpu.Barrier(num_arrivals=3 + SEG_ROWS * has_seg, num_barriers=2), state_bar=plgpu.Barrier())
  if has_seg:
    scratch["m_s"] = plgpu.SMEM((2, SEG_ROWS, C), F32)

  def body(*refs, q_s, do_s, g_s, qg_s, h_s, state_s, in_bar, state_bar, m_s=None):
    refs = list(refs)
    take = lambda present=True: refs.pop(0) if present else None
    q_r, do_r, g_r, m_r, df_r = take(), take(), take(), take(has_seg), take(has_df)
    ds_r, dh0_r = take(with_dstates), take()
    b, h, vs = _program(bv)
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
        _, carry, _, carry_last = _segment_masks(m_s, slot, C)
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

    init = lambda: _initial(df_r.at[b, h, piece, vs] if has_df else None, state_s, state_bar, bv, K)
    _store_last(_walk_chunks(NCs, issue, in_bar, init, chunk, reverse=True), state_s,
                dh0_r.at[b, h, piece, vs])

  args = [q, do, G] + ([masks] if has_seg else []) + ([dfinal] if has_df else [])
  out_type = (([jax.ShapeDtypeStruct((B, Hv, NC, V, K), dtype)] if with_dstates else [])
              + [jax.ShapeDtypeStruct((B, Hv, S, V, K), F32)])
  outs = plgpu.kernel(
      body, out_type=tuple(out_type), scratch_types=scratch, grid=(B, Hv, V // bv, S),
      grid_names=("b", "h", "v", "s"), compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret, kernel_name="chunk_walk_fused_bwd" if with_dstates
      else "chunk_walk_fused_bwd_starts")(*args)
  outs = list(_vary_like(outs, args))
  dstates = outs.pop(0) if with_dstates else None
  return dstates, outs.pop(0)


def backward_chunks(q, k, v, G, states, dstates, do, *, dtype, masks=None, interpret=None,
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
      # (16-bit tiles swizzled for TMA, as the preparation kernel's; float32 ones plain)
      out_s={f"{jnp.dtype(t).name}_{n}": (plgpu.SMEM((C, n), F32) if jnp.dtype(t) == F32
                                          else smem((C, n), t))
             for t, n in zip(grad_dtypes, (K, K, V))},
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
      same, carry, to_last, _ = _segment_masks(m_s, None, C)
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
    vec_s.at[1][...] = kdv + _last_state_term(g_s, m_s, st_s, dst_s, C)
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
      compiler_params=plgpu.CompilerParams(approx_math=True), interpret=interpret,
      kernel_name="chunk_grads_fused")(*args)
  return _vary_like(outs, args)


def backward(q, k, v, g, h0, do, dfinal, *, chunk_size: int, dtype, segment_ids=None, interpret=None,
             sequence_pieces: int | None = None, scale: float = 1.0, states=None):
  """`(dq, dk, dv, dg, None, dh0)` of `forward` (in q, k, v, g's dtypes; dh0 float32; no dbeta in this
  family), for the cotangents
  `do: [B, T, H_v, V]` (of o, which `forward` multiplied by `scale`) and `dfinal: None | [B, H_v, K, V]`.

  Three kernels, none of which reads a prepared tensor: the forward walk storing the state entering
  every chunk (`forward(..., with_o=False, with_states=True)`), the reverse walk storing the gradient of
  the state leaving every chunk (`backward_states`), then every chunk's gradients in parallel
  (`backward_chunks`). XLA adds the last-token terms of dG, the per-chunk reverse cumsum and, for grouped
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
  dq, dk, dv, dG, kdv = backward_chunks(qp, kp, vp, G, states, dstates, do, dtype=dtype, masks=masks,
                                        interpret=interpret, grad_dtypes=(summed(q), summed(k), v.dtype),
                                        scale=scale)
  last = jnp.sum(kdv.reshape(B, Hv, NC, C), axis=-1)   # with e^(G_C) sum(S dS) (backward_chunks)
  dG = dG.reshape(B, Hv, NC, C).at[..., -1].add(last)
  dg = jnp.flip(jnp.cumsum(jnp.flip(dG, -1), -1), -1).reshape(B, Hv, T_pad)   # G = cumsum(g) per chunk
  per_head = lambda x: x.reshape(B, T_pad, H, group, K).sum(3)[:, :T] if group > 1 else x[:, :T]
  return (per_head(dq).astype(q.dtype), per_head(dk).astype(k.dtype), dv[:, :T].astype(v.dtype),
          None if g is None else jnp.swapaxes(dg, 1, 2)[:, :T].astype(g.dtype), None, dh0)
