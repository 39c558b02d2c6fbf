"""The chunked parallel form of both families, in XLA.

Tokens are cut into chunks of `C` (a power of two). With `G_i` the cumulative log-decay from the chunk
start (inclusive) and `S` the state entering the chunk:

    P_ij = sum_c q_ic k_jc exp(G_ic - G_jc)             (j <= i; intra-chunk "attention")
    additive:  U = V
    delta:     (I + L) U = Diag(beta) V - Diag(beta) (K * e^G) S,   L_ij = beta_i sum_c k_ic k_jc e^(G_ic - G_jc), j < i
               so U = U~ - W S with U~ = (I + L)^-1 Diag(beta) V,  W = (I + L)^-1 Diag(beta) (K * e^G)
    o = scale * ((Q * e^G) S + P U)
    S_next = Diag(e^G_C) S + (K * e^(G_C - G))^T U

Everything inside the chunks (P, Q * e^G, K * e^(G_C - G), e^G_C, U~, W and the segment masks) is
`pallas_kernels.prep.chunk_tensors`, the function that also prepares the kernels' inputs; `prep`'s
module docstring has the masks and how decay never overflows (never e^G * e^-G; per-channel gates
through `decayed_gram`). This form differs only in what it asks of it: the backend's default matmul
precision (`dtype=None`; the kernels pick an operand dtype), `decay` kept per head for scalar gates, and
each block's incoming segment (`seg_before`). `cu_seqlens` never reach it: each sequence is laid out
from a chunk boundary (`packing.cu_layout`) and the walk swaps in its initial state at its first chunk.

Everything but the walk over chunks is batched over all chunks at once; the walk is a `lax.scan` that
carries one `[B, H, K, V]` state and keeps one state per chunk (never one per token).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from linear_attention_jax.ops.packing import Packing, cu_layout
from linear_attention_jax.pallas_kernels.prep import chunk_tensors, to_chunks


def chunk_form(q, k, v, g, beta, *, scale, initial_state, packing: Packing, chunk_size: int):
  """Chunked form of either family (shapes as in `recurrent.recurrent_form`).

  Returns `(o [B, T, H, V] float32, final_state)`: `[B, H, K, V]`, or `[N, H, K, V]` for `cu_seqlens`.
  """
  B, T, H, K = k.shape
  V = v.shape[-1]
  if packing.kind == "cu_seqlens":
    C = chunk_size
    lay = cu_layout(packing.cu, T, C)
    gather = lambda x: None if x is None else jnp.where(
        lay.valid.reshape((1, -1) + (1,) * (x.ndim - 2)), x[:, lay.src], 0.0)
    q, k, v, g, beta = map(gather, (q, k, v, g, beta))
    N = packing.num_sequences
    table = jnp.zeros((N, H, K, V), jnp.float32) if initial_state is None else initial_state
    o, states, final = _blocked_walk(q, k, v, g, beta, scale, jnp.zeros((1, H, K, V), jnp.float32),
                                     None, C, (lay.reset, lay.reset_seq, table))
    all_states = jnp.concatenate([states, final[:, None]], axis=1)[0]  # [NC + 1, H, K, V]
    ends = all_states[lay.first_chunk + lay.num_chunks_of]
    final = jnp.where((lay.num_chunks_of > 0)[:, None, None, None], ends, table)
    return o[:, lay.dst], final

  C = min(chunk_size, 1 << max(0, math.ceil(math.log2(T))))
  pad = (-T) % C
  padder = lambda x: None if x is None else jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  q, k, v, g, beta = map(padder, (q, k, v, g, beta))
  seg = None
  if packing.kind == "segments":
    seg = jnp.pad(packing.seg, [(0, 0), (0, pad)], mode="edge")
  h0 = jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None else initial_state
  o, _, final = _blocked_walk(q, k, v, g, beta, scale, h0, seg, C, None)
  return o[:, :T], final


# Token-heads (B * H * tokens) per block of the outer walk: bounds the memory of the intra-chunk work
# (about 15 KB per token-head for per-channel gates at K = 128) whatever T is. With more than one block
# the block body is rematerialised in the backward pass. None: by backend (`_walk_settings`).
BLOCK_TOKEN_HEADS = None
# Chunks per trip of the sequential walk's loop (None: by backend). On a GPU every trip of an XLA loop
# costs a launch round trip, and an unrolled walk is compiled twice (forward and transpose). Measured on
# an H200 (experiments/compile_time.py, Gated DeltaNet LM, width 1024, depth 4, batch 8 x 4096, bf16,
# train step): unroll 128 compiled in 105 s and stepped in 112 ms; 8 in 6.8 s and 99 ms; 32 in 12.9 s
# and 110 ms; 1 in 12.6 s (the process's first compile) and 106 ms.
SCAN_UNROLL = None
ACCELERATOR_UNROLL = 8


def _walk_settings() -> tuple[int, int]:
  """`(block token-heads, scan unroll)`: small blocks and a rolled loop on CPU (memory, compile time);
  large blocks and an unrolled walk on accelerators (2^20 token-heads: ~15 GB at most for KDA, K=128)."""
  cpu = jax.default_backend() == "cpu"
  budget = BLOCK_TOKEN_HEADS or ((1 << 15) if cpu else (1 << 20))
  unroll = SCAN_UNROLL or (1 if cpu else ACCELERATOR_UNROLL)
  return budget, unroll


def _blocked_walk(q, k, v, g, beta, scale, h0, seg, C, resets):
  """Cuts T (a multiple of C) into blocks of whole chunks and walks them with a `lax.scan` whose body
  (`_chunk_walk`) is rematerialised in the backward pass: only one state per block is kept for it.
  Same arguments and results as `_chunk_walk`."""
  B, T, H, K = k.shape
  NC = T // C
  budget, unroll = _walk_settings()
  per_block = max(1, min(NC, budget // (B * H * C)))
  NB = -(-NC // per_block)
  pad = NB * per_block * C - T
  padder = lambda x: None if x is None else jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  q, k, v, g, beta = map(padder, (q, k, v, g, beta))
  blocks = lambda x: None if x is None else jnp.moveaxis(
      x.reshape((B, NB, per_block * C) + x.shape[2:]), 1, 0)
  xs = {"q": blocks(q), "k": blocks(k), "v": blocks(v), "g": blocks(g), "beta": blocks(beta)}
  if seg is not None:
    seg = jnp.pad(seg, [(0, 0), (0, pad)], mode="edge")
    before = jnp.concatenate([seg[:, :1], seg[:, per_block * C - 1:-1:per_block * C]], axis=1)
    xs.update(seg=blocks(seg), before=jnp.moveaxis(before, 1, 0))
  if resets is not None:
    reset, reset_seq, table = resets
    extra = NB * per_block - NC
    xs.update(reset=jnp.pad(reset, (0, extra)).reshape(NB, per_block),
              reset_seq=jnp.pad(reset_seq, (0, extra)).reshape(NB, per_block))

  def body(state, x):
    r = None if resets is None else (x["reset"], x["reset_seq"], table)
    o, prev, final = _chunk_walk(x["q"], x["k"], x["v"], x.get("g"), x.get("beta"), scale, state,
                                 x.get("seg"), x.get("before"), C, r, unroll)
    return final, (o, prev)

  final, (o, prev) = jax.lax.scan(jax.checkpoint(body) if NB > 1 else body, h0, xs)
  o = jnp.moveaxis(o, 0, 1).reshape((B, NB * per_block * C) + o.shape[3:])[:, :T]
  prev = jnp.moveaxis(prev, 0, 1).reshape((B, NB * per_block) + prev.shape[3:])[:, :NC]
  return o, prev, final


def _chunk_walk(q, k, v, g, beta, scale, h0, seg, seg_before, C, resets, unroll=1):
  """Intra-chunk work for all chunks (`prep.chunk_tensors`), then the scan over chunks.

  `seg`: None or `[B, T]` canonical segment ids (masks pairs across segments and the carried state);
  `seg_before`: `[B]` the segment of the token before the first (the one `h0` belongs to).
  `resets`: None or `(reset [NC] bool, reset_seq [NC] int, table [N, H, K, V])`: at a reset chunk the
  carried state is replaced by `table[reset_seq]` (cu_seqlens, B == 1).
  Returns `(o [B, T, H, V], state after each previous chunk [B, NC, H, K, V] (before any reset),
  final state [B, H, K, V])`.
  """
  B, T, H, K = k.shape
  V = v.shape[-1]
  NC = T // C
  chunks = lambda x: None if x is None else to_chunks(x, C)
  # dtype=None: the backend's default matmul precision, no casts (the kernels choose theirs)
  t = chunk_tensors(*map(chunks, (q, k, v, g, beta)), seg, seg_before, dtype=None)
  starts = None
  if seg is not None:  # chunks whose first token starts a segment: none of their tokens reads the state
    segc = seg.reshape(B, NC, C)
    before = jnp.concatenate([segc[:, :1, 0] if seg_before is None else seg_before[:, None],
                              segc[:, :-1, -1]], axis=1)
    starts = jnp.moveaxis(segc[:, :, 0] != before, 1, 0)  # [NC, B]

  def body(state, xs):
    s_prev = state  # the state after the previous chunk, before any reset
    if resets is not None:
      reset_n, seq_n, table = xs["reset"], xs["seq"], resets[2]
      state = jnp.where(reset_n, table[seq_n][None], state)
    if starts is not None:
      # Zeros where a segment starts with the chunk: the masks already drop the carried state there,
      # and a where (not a multiply by the zero masks) keeps a NaN or inf in an earlier segment out
      # of this chunk, so it reaches no segment that starts in a later chunk.
      state = jnp.where(xs["start"][:, None, None, None], 0.0, state)
    s_in = state
    decay = 1.0 if xs["decay"] is None else (
        xs["decay"][..., None] if xs["decay"].ndim == 3 else xs["decay"][..., None, None])
    if t.w is None:
      state = decay * s_in + xs["dS"]
      return state, (s_in, s_prev, None)
    u = xs["U"] - jnp.einsum("bhck,bhkv->bhcv", xs["W"], s_in)
    state = decay * s_in + jnp.einsum("bhck,bhcv->bhkv", xs["kd"], u)
    return state, (s_in, s_prev, u)

  first = lambda x: None if x is None else jnp.moveaxis(x, 2, 0)
  xs = {"decay": first(t.decay)}
  if t.w is None:  # the additive family's chunk increments K~^T V need no state: all at once
    xs["dS"] = first(jnp.einsum("bhnck,bhncv->bhnkv", t.kd, t.u))
  else:
    xs.update(U=first(t.u), W=first(t.w), kd=first(t.kd))
  if resets is not None:
    xs.update(reset=resets[0], seq=resets[1])
  if starts is not None:
    xs["start"] = starts
  final, (states, prev, U) = jax.lax.scan(body, h0, xs, unroll=max(1, min(unroll, NC)))
  states = jnp.moveaxis(states, 0, 2)  # [B, H, NC, K, V]
  U = t.u if U is None else jnp.moveaxis(U, 0, 2)
  o = scale * (jnp.einsum("bhnck,bhnkv->bhncv", t.qg, states) + jnp.einsum("bhnij,bhnjv->bhniv", t.p, U))
  o = jnp.moveaxis(o, 1, 3).reshape(B, T, H, V)
  return o, jnp.moveaxis(prev, 0, 1), final
