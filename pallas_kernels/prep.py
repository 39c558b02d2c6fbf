"""Everything inside the chunks, in XLA: the per-chunk tensors that a chunk-walk kernel consumes, and
that the XLA chunked form (`linear_attention_jax.ops.chunk`) walks itself (`chunk_tensors`).

Both families and every decay kind reduce to one walk over chunks. With `C` tokens per chunk, `G_i` the
cumulative log-decay from the chunk start (inclusive) and `S` the `[K, V]` state entering a chunk:

    u      = U - W S                              (delta family; additive: W = 0, U = V)
    o      = Qg S + P u                           (unscaled; the caller multiplies by `scale`)
    S_next = Diag(decay) S + Kd^T u

    Qg    = Q * e^G                               rows that read the carried state, else 0
    Kd    = K * e^(G_C - G)                       rows whose write survives to the chunk's end, else 0
    P_ij  = sum_c q_ic k_jc e^(G_ic - G_jc)       j <= i, same segment, else 0
    decay = e^(G_C) per key channel              0 where the chunk's last token left the carried segment
    delta: (I + L) [U | W] = Diag(beta) [V | K * e^G],  L_ij = beta_i sum_c k_ic k_jc e^(G_ic - G_jc), j < i

Scalar decay is per-channel decay broadcast over K; no decay is `G = 0`. `segment_ids` enter only
through the masks above, so the walk needs no packing logic. Decay is never formed as e^G * e^-G: scalar
gates mask `G_i - G_j` before the exponential; per-channel gates use a binary split of the chunk
(`decayed_gram`) in which every exponent is non-positive. `(I + L)^-1` is built by block doubling
(`unit_lower_inverse`), all matmuls, instead of a triangular solve.

Layout of every per-chunk tensor: `[B, H, NC, C, ...]` (head-major, as TPU blocks want), float32.
The kernels take them from `prepare` (matmul operands in a chosen dtype, `decay` full size); the XLA
chunked form calls `chunk_tensors` with the backend's default precision and a compact `decay`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np


class ChunkTensors(NamedTuple):
  """The walk's inputs (shapes with `H = H_v` and `NC` chunks of `C` tokens)."""

  qg: jax.Array              # [B, H, NC, C, K]
  kd: jax.Array              # [B, H, NC, C, K]
  w: jax.Array | None        # [B, H, NC, C, K] for the delta family, None for the additive one
  u: jax.Array               # [B, H, NC, C, V]
  p: jax.Array               # [B, H, NC, C, C]
  decay: jax.Array | None    # [B, H, NC, K] from `prepare`; `chunk_tensors` may keep it smaller


# The floor on the log-decay of one token that every chunked form and kernel takes (`floor_log_decay`):
# `g = -inf` ("forget everything", `log(sigmoid(a))` for a < -104) would make the chunk-local cumsum G hold
# -inf, whose differences are NaN, and a huge finite g (-1e4) makes G so large that the float32
# differences G_i - G_j of the tokens after it lose their small gates (3.7e-4 of accuracy at -1e4).
# e^-20 ~ 2e-9: a token at the floor keeps 2e-9 of the state where exact forgetting keeps 0, far below
# float32's epsilon against what the token writes.
LOG_DECAY_FLOOR = -20.0


def floor_log_decay(g):
  """`max(g, LOG_DECAY_FLOOR)` elementwise (None stays None; NaN stays NaN); the gradient is 0 below
  the floor and passes whole at and above it. A `where`, not `jnp.maximum`: the latter's derivative
  splits ties (0.5 at the floor), which costs the backward a mask and two selects over every gate."""
  return None if g is None else jnp.where(g < LOG_DECAY_FLOOR, jnp.asarray(LOG_DECAY_FLOOR, g.dtype), g)


def local_cumsum(x, axis: int, *, reverse: bool = False, block: int = 8, method: str = "blocks"):
  """The cumulative sum of `x` along `axis` (a chunk's tokens; from the end where `reverse`), the same
  sums as `lax.cumsum` up to float32 rounding. XLA on GPU turns one scan longer than 16 into a tree of
  16-token reduce-windows and a transposed add (0.22 ms alone for kda's g `[8, 4096, 8, 128]` on the
  H200, 0.30 ms in its layer: NOTES.md v48, v49).

  method: "blocks", two short scans: within blocks of `block` tokens, then over the blocks' sums,
  shifted one block (the sums before a block, exactly, not the inclusive sums less the block's own);
  scans of 8 stay single reduce-windows (0.18 ms alone). "matmul", one batched product with the
  triangle of ones over the axis, float32 at HIGHEST precision (every dimension before the axis a
  batch, those after it one free dimension: no transpose; 0.13 ms alone)."""
  axis = axis % x.ndim
  n = x.shape[axis]
  if method == "matmul":
    ones = np.tril(np.ones((n, n), np.float32)) if not reverse else np.triu(np.ones((n, n), np.float32))
    lead = x.shape[:axis]
    tri = jnp.broadcast_to(jnp.asarray(ones, x.dtype), lead + (n, n))
    batch = tuple(range(axis))
    y = lax.dot_general(tri, x.reshape(lead + (n, -1)), (((axis + 1,), (axis,)), (batch, batch)),
                        precision=lax.Precision.HIGHEST, preferred_element_type=x.dtype)
    return y.reshape(x.shape)
  if method != "blocks":
    raise ValueError(f"method must be 'blocks' or 'matmul'; got {method!r}")
  if n % block or n <= block:
    return lax.cumsum(x, axis, reverse=reverse)
  xb = x.reshape(x.shape[:axis] + (n // block, block) + x.shape[axis + 1:])
  within = lax.cumsum(xb, axis + 1, reverse=reverse)
  sums = jnp.sum(xb, axis=axis + 1)
  edge = [(0, 0)] * sums.ndim
  edge[axis] = (0, 1) if reverse else (1, 0)
  start = 1 if reverse else 0
  shifted = lax.slice_in_dim(jnp.pad(lax.cumsum(sums, axis, reverse=reverse), edge), start,
                             start + n // block, axis=axis)
  return (within + jnp.expand_dims(shifted, axis + 1)).reshape(x.shape)


def padded_length(T: int, chunk_size: int, chunk_multiple: int = 1) -> int:
  """T rounded up to whole groups of `chunk_multiple` chunks."""
  step = chunk_size * chunk_multiple
  return -(-T // step) * step


def to_chunks(x, C: int, T_pad: int | None = None):
  """`[B, T, H, ...]` -> `[B, H, NC, C, ...]`, zero-padded along T to `T_pad` (None: T, a multiple of C)."""
  B, T, H = x.shape[:3]
  T_pad = T if T_pad is None else T_pad
  if T_pad != T:
    x = jnp.pad(x, [(0, 0), (0, T_pad - T)] + [(0, 0)] * (x.ndim - 2))
  return jnp.moveaxis(x.reshape((B, T_pad // C, C, H) + x.shape[3:]), 3, 1)


def from_chunks(x, T: int):
  """`[B, H, NC, C, ...]` -> `[B, T, H, ...]` (drops the padding)."""
  B, H, NC, C = x.shape[:4]
  return jnp.moveaxis(x, 1, 3).reshape((B, NC * C, H) + x.shape[4:])[:, :T]


def canonical_segments(segment_ids):
  """`[B, T]` ids -> 0, 1, 2, ... counting changes along T (equal ids then mean "same run")."""
  ids = jnp.asarray(segment_ids)
  changes = (ids[:, 1:] != ids[:, :-1]).astype(jnp.int32)
  return jnp.concatenate([jnp.zeros_like(changes[:, :1]), jnp.cumsum(changes, axis=1)], axis=1)


def prepare(q, k, v, g, beta, segment_ids, *, chunk_size: int, chunk_multiple: int = 1,
            dtype=jnp.float32, inverse_dtype=None, gram_method: str = "auto") -> ChunkTensors:
  """The per-chunk tensors of one call (module docstring), in float32: the call cast to float32, q/k
  heads repeated over their value heads, cut into chunks (`chunk_tensors`), `decay` as `[B, H_v, NC, K]`.

  Args:
    q, k: `[B, T, H, K]`; v: `[B, T, H_v, V]` with `H_v % H == 0` (q/k head h serves value heads
      `h * H_v / H ... (h + 1) * H_v / H - 1`).
    g: None, `[B, T, H_v]` (scalar) or `[B, T, H_v, K]` (per channel) natural-log decay.
    beta: None (additive family) or `[B, T, H_v]` (delta family).
    segment_ids: None or `[B, T]` int; the state restarts wherever the id changes along T.
    chunk_size: C. chunk_multiple: T is padded to whole groups of this many chunks (neutral tokens:
      k = 0, g = 0, beta = 0 change neither the outputs nor the final state).
    dtype: operand dtype of the matmuls (float32: exact; bfloat16: one MXU pass, float32 results;
      None: the backend's default precision, see `_matmul`). Everything else, and every result, is
      float32.
    inverse_dtype: operand dtype of the many small matmuls of `(I + L)^-1` (None: `dtype`). On the
      H200 float32 is both exact and faster there than bfloat16 (no cast passes between the levels;
      pallas_kernels/gpu/NOTES.md); on a TPU bfloat16 is one MXU pass.
    gram_method: how per-channel gates' decayed grams are formed (`decayed_gram`'s `method`).
  """
  B, T, H, K = q.shape
  Hv = v.shape[2]
  T_pad = padded_length(T, chunk_size, chunk_multiple)
  f32 = lambda x: None if x is None else x.astype(jnp.float32)
  q, k, v, g, beta = map(f32, (q, k, v, g, beta))
  if Hv != H:
    q, k = jnp.repeat(q, Hv // H, axis=2), jnp.repeat(k, Hv // H, axis=2)
  chunks = lambda x: None if x is None else to_chunks(x, chunk_size, T_pad)
  seg = None
  if segment_ids is not None:
    seg = jnp.pad(canonical_segments(segment_ids), [(0, 0), (0, T_pad - T)], mode="edge")
  t = chunk_tensors(*map(chunks, (q, k, v, g, beta)), seg, dtype=dtype, inverse_dtype=inverse_dtype,
                    gram_method=gram_method)
  shape = (B, Hv, T_pad // chunk_size, K)
  if t.decay is None:
    return t._replace(decay=jnp.ones(shape, jnp.float32))
  return t._replace(decay=jnp.broadcast_to(t.decay[..., None] if t.decay.ndim == 3 else t.decay, shape))


def chunk_tensors(qc, kc, vc, gc, bc, seg=None, seg_before=None, *, dtype=jnp.float32,
                  inverse_dtype=None, gram_method: str = "auto") -> ChunkTensors:
  """The per-chunk tensors (module docstring) of a call already cut into chunks, all chunks at once:
  what `prepare` gives the kernels and what the XLA chunked form (`linear_attention_jax.ops.chunk`)
  walks, written once.

  Args:
    qc, kc: `[B, H, NC, C, K]`; vc: `[B, H, NC, C, V]`; gc: None, `[B, H, NC, C]` (scalar) or
      `[B, H, NC, C, K]` (per channel); bc: None or `[B, H, NC, C]`. float32, one head axis (q/k heads
      already repeated over their value heads).
    seg: None or `[B, NC * C]` canonical segment ids (`canonical_segments`).
    seg_before: None or `[B]`: the segment of the state entering the first chunk (None: the first
      token's, so the initial state belongs to each row's first segment). The XLA chunked form walks
      T in blocks of chunks, and a block's state comes from the segment that ended the previous block.
    dtype, inverse_dtype, gram_method: as in `prepare`.

  Returns `ChunkTensors` with `decay` as small as the gates allow: None (no decay, no segments),
  `[B, H or 1, NC]` (scalar decay, or segments alone) or `[B, H, NC, K]` (per channel). `prepare`
  broadcasts it to `[B, H, NC, K]` for the kernels; the XLA chunked form scales its state by it as it
  is (a scalar per head, not a `[K]` row, in its walk).
  """
  B, _, NC, C = qc.shape[:4]
  causal = np.tril(np.ones((C, C), bool))
  strict = np.tril(np.ones((C, C), bool), -1)
  carry = to_last = carry_last = None
  incl, excl = causal, strict
  if seg is not None:
    seg = seg.reshape(B, 1, NC, C)
    first = seg[:, :, :1, 0] if seg_before is None else seg_before[:, None, None]
    before = jnp.concatenate([first, seg[:, :, :-1, -1]], axis=2)  # the segment of each chunk's state
    same = seg[..., :, None] == seg[..., None, :]
    carry = seg == before[..., None]             # token reads the state carried into its chunk
    to_last = seg == seg[..., -1:]               # token's write survives to the chunk's end
    carry_last = carry[..., -1]
    incl, excl = causal & same, strict & same

  L = decay = None
  if gc is None:
    qg, kg, kd = qc, kc, kc
    P = jnp.where(incl, _gram(qc, kc, dtype), 0.0)
    if bc is not None:
      L = jnp.where(excl, _gram(kc, kc, dtype), 0.0)
    if carry_last is not None:
      decay = carry_last.astype(jnp.float32)
  else:
    # per-channel gates: two short scans (`local_cumsum`); scalar gates (1 / K of the elements) keep
    # one scan, the sums the kernels' own `decay.local_cumsum` forms
    G = local_cumsum(gc, 3) if gc.ndim == 5 else jnp.cumsum(gc, axis=3)
    G_last = G[:, :, :, -1]
    if gc.ndim == 4:  # scalar gate: G [B, H, NC, C]
      diff = G[..., :, None] - G[..., None, :]
      P = _gram(qc, kc, dtype) * jnp.exp(jnp.where(incl, diff, -jnp.inf))
      if bc is not None:
        L = _gram(kc, kc, dtype) * jnp.exp(jnp.where(excl, diff, -jnp.inf))
      Ge, Gd = G[..., None], (G_last[..., None] - G)[..., None]
    else:  # per-channel gate: G [B, H, NC, C, K]
      P = jnp.where(incl, decayed_gram(qc, kc, G, inclusive=True, dtype=dtype, method=gram_method), 0.0)
      if bc is not None:
        L = jnp.where(excl, decayed_gram(kc, kc, G, inclusive=False, dtype=dtype, method=gram_method),
                      0.0)
      Ge, Gd = G, G_last[..., None, :] - G
    qg, kg, kd = qc * jnp.exp(Ge), kc * jnp.exp(Ge), kc * jnp.exp(Gd)
    decay = jnp.exp(G_last)
    if carry_last is not None:
      decay = jnp.where(carry_last if gc.ndim == 4 else carry_last[..., None], decay, 0.0)
  if carry is not None:
    rows = lambda x, m: jnp.where(m[..., None], x, 0.0)
    qg, kg, kd = rows(qg, carry), rows(kg, carry), rows(kd, to_last)

  if bc is None:
    return ChunkTensors(qg=qg, kd=kd, w=None, u=vc, p=P, decay=decay)
  V = vc.shape[-1]
  b = bc[..., None]
  inverse_dtype = dtype if inverse_dtype is None else inverse_dtype
  X = _gram_t(unit_lower_inverse(b * L, inverse_dtype), jnp.concatenate([b * vc, b * kg], axis=-1), dtype)
  return ChunkTensors(qg=qg, kd=kd, w=X[..., V:], u=X[..., :V], p=P, decay=decay)


def _matmul(spec, a, b, dtype):
  """einsum with operands in `dtype` and float32 results: one MXU pass for bfloat16, the exact float32
  algorithm (`Precision.HIGHEST`) for float32. The casts are explicit so that a CPU computes what a
  TPU would. `dtype=None`: the backend's default precision, no casts (the XLA chunked form)."""
  if dtype is None:
    return jnp.einsum(spec, a, b)
  if dtype == jnp.float32:
    return jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST)
  return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)


def _gram(a, b, dtype):
  return _matmul("...ik,...jk->...ij", a, b, dtype)


def _gram_t(a, b, dtype):
  return _matmul("...ij,...jk->...ik", a, b, dtype)


def _join_blocks(upper_left, lower_left, lower_right):
  """`[[A, 0], [E, D]]` from `[..., s, s]` blocks."""
  return jnp.concatenate([jnp.concatenate([upper_left, jnp.zeros_like(upper_left)], axis=-1),
                          jnp.concatenate([lower_left, lower_right], axis=-1)], axis=-2)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def unit_lower_inverse(L, dtype=jnp.float32):
  """`(I + L)^-1` for strictly lower-triangular `L: [..., C, C]` (C a power of two), by merging blocks.

  Start from the inverses of the 1 x 1 diagonal blocks (ones); at each level pair every diagonal block
  with the next: `[[A, 0], [E, D]]^-1 = [[A^-1, 0], [-D^-1 E A^-1, D^-1]]`. log2(C) levels of small
  batched matmuls: the arithmetic of forward substitution without C dependent steps (on a TPU, MXU work).
  `dtype`: the matmul operand dtype (see `_matmul`). Entries of `L` on and above the diagonal are not
  read (their derivative is zero). The derivative is the closed form `dX = -X dL X` (dL's strictly
  lower part), two matmuls instead of differentiating every level; as a JVP rule it serves forward
  mode (`jax.jvp`, `jax.jacfwd`) and, transposed, reverse mode (`dL = -X^T dX X^T`).
  """
  return _unit_lower_inverse(L, dtype)


@unit_lower_inverse.defjvp
def _unit_lower_inverse_jvp(dtype, primals, tangents):
  (L,), (dL,) = primals, tangents
  X = _unit_lower_inverse(L, dtype)
  dL = jnp.where(np.tril(np.ones(L.shape[-2:], bool), -1), dL, 0.0)
  return X, -_gram_t(_gram_t(X, dL, dtype), X, dtype)


def _unit_lower_inverse(L, dtype):
  C = L.shape[-1]
  batch = L.shape[:-2]
  X = jnp.ones(batch + (C, 1, 1), jnp.float32)  # inverses of the diagonal blocks, [..., C / s, s, s]
  s = 1
  while s < C:
    nb = C // (2 * s)
    # the diagonal blocks by a strided slice of the block grid (`jnp.diagonal` would be a gather)
    grid = jnp.swapaxes(L.reshape(batch + (nb, 2 * s, nb, 2 * s)), -3, -2)
    grid = grid.reshape(batch + (nb * nb, 2 * s, 2 * s))
    E = grid[..., ::nb + 1, s:, :s]   # [..., nb, s, s]
    pairs = X.reshape(batch + (nb, 2, s, s))
    A_inv, D_inv = pairs[..., 0, :, :], pairs[..., 1, :, :]
    X = _join_blocks(A_inv, -_gram_t(_gram_t(D_inv, E, dtype), A_inv, dtype), D_inv)
    s *= 2
  return X.reshape(batch + (C, C))


# `decayed_gram(method="auto")`: the one-reference form serves a call when no chunk's channel decays by
# more than twice the bound (natural log) across the chunk: every exponent it forms is then within
# [-bound, bound]. bfloat16 and float32 operands have float32's range, so no factor (e^60 ~ 1e26) and no
# gradient intermediate leaves it; float16 operands (largest 65504 ~ e^11, normal down to e^-9.7) take
# a bound of 8.
REF_BOUND = 60.0
REF_BOUND_F16 = 8.0
# The forward's bound where q and k are l2-normalised (every entry within [-1, 1]) and the operands are
# bfloat16 (float32's range): a factor `x e^(G - R)` is then at most e^76 (~1e33, far below bfloat16's
# e^88.7) and at least e^-76 |x| (a normal number down to |x| ~ 1e-5; smaller entries of a unit vector
# add less than the operands' rounding). The forward's kept gram entries are sums of unit vectors'
# products, so no accumulator leaves float32's range either. Only the forward takes it: the backward's
# products multiply the factors by cotangents, whose size nothing bounds (NOTES.md v53).
UNIT_REF_BOUND = 76.0
GRAM_METHODS = ("auto", "merge")


def ref_bound(dtype, unit: bool = False) -> float:
  """The one-reference form's bound on `|G - R|` for matmul operands of `dtype`; `unit`: the forward
  of l2-normalised q and k (`UNIT_REF_BOUND` for bfloat16 and float32 operands)."""
  if jnp.dtype(dtype) == jnp.float16:
    return REF_BOUND_F16
  return UNIT_REF_BOUND if unit else REF_BOUND


def decayed_gram(a, b, G, *, inclusive: bool, dtype=jnp.float32, method: str = "auto"):
  """`M_ij = sum_c a_ic b_jc exp(G_ic - G_jc)` for j < i (and j == i if `inclusive`); zero above.

  `a, b, G: [..., C, K]` (C a power of two), G non-increasing along C. e^G and e^-G are never formed
  apart (at g = -20 a token the second overflows after five tokens).

  method:
    "merge": like a merge sort. The diagonal blocks of 2^p tokens are known; pairing each with the
      next, the new lower-left block is `(a_later * e^(G_later - G_r)) (b_earlier * e^(G_r - G_earlier))^T`
      with r the last token of the earlier block, so both exponents are <= 0: exact wherever the true
      value is representable, at any decay strength. Batched `s x s` products (C K log2(C) / 2
      multiply-adds a row).
    "auto" (default): where every chunk's per-channel decay spans at most `2 * ref_bound(dtype)` (120
      nats for bfloat16 and float32 operands, 16 for float16), ONE product
      `(a e^(G - R)) (b e^(R - G))^T` with `R_c = (max_i G_ic + min_i G_ic) / 2` per chunk and channel,
      the middle of the channel's range: every exponent lies within the bound and the masked
      product is exact (the factor e^(G_ic - R_c) is common to row i's terms of channel c, so the sum
      loses nothing to the split); one C x C x K product and two elementwise passes, forward and
      backward. Otherwise (some chunk decays faster, e.g. g = -20 a token) the whole call takes "merge".
      The choice is one `lax.cond` on the data; under `vmap` both branches run (a select), the
      one-reference branch with its exponents clamped to the bound so that neither branch makes NaN.
  """
  if method not in GRAM_METHODS:
    raise ValueError(f"method must be one of {GRAM_METHODS}; got {method!r}")
  if method == "auto":
    bound = ref_bound(jnp.result_type(a, b) if dtype is None else dtype)
    return lax.cond(one_reference_fits(G, bound),
                    lambda a, b, G: _decayed_gram_one_reference(a, b, G, inclusive=inclusive, dtype=dtype,
                                                                bound=bound),
                    lambda a, b, G: _decayed_gram_merge(a, b, G, inclusive=inclusive, dtype=dtype),
                    a, b, G)
  return _decayed_gram_merge(a, b, G, inclusive=inclusive, dtype=dtype)


def one_reference_fits(G, bound: float = REF_BOUND):
  """True when every chunk and channel of `G: [..., C, K]` spans at most `2 * bound` (`ref_bound`)."""
  span = jnp.max(G, axis=-2) - jnp.min(G, axis=-2)
  return jnp.all(span <= 2.0 * bound)


def reference(G, axis: int = -2):
  """The one-reference form's `R = (max + min) / 2` of G over the chunk's tokens (`axis`), per channel,
  the axis kept (stop_gradient: any R is exact). The GPU kernels take the same R."""
  return lax.stop_gradient((jnp.max(G, axis=axis, keepdims=True) + jnp.min(G, axis=axis, keepdims=True)) / 2)


def _decayed_gram_one_reference(a, b, G, *, inclusive: bool, dtype, bound: float):
  C = a.shape[-2]
  R = reference(G)
  A = a * jnp.exp(jnp.minimum(G - R, bound))
  Bm = b * jnp.exp(jnp.minimum(R - G, bound))
  keep = np.tril(np.ones((C, C), bool), 0 if inclusive else -1)
  # above the diagonal the factors do not cancel (and may overflow): the where drops them, and its
  # cotangent there is zero, so they reach no gradient
  return jnp.where(keep, _gram(A, Bm, dtype), 0.0)


def _decayed_gram_merge(a, b, G, *, inclusive: bool, dtype):
  C, K = a.shape[-2:]
  batch = a.shape[:-2]
  diag = jnp.sum(a * b, axis=-1) if inclusive else jnp.zeros(batch + (C,), jnp.float32)
  M = diag[..., None, None]  # the diagonal blocks, [..., C / s, s, s]
  s = 1
  while s < C:
    nb = C // (2 * s)
    split = lambda x: x.reshape(batch + (nb, 2, s, K))
    a2, b2, G2 = split(a), split(b), split(G)
    G_ref = G2[..., 0, s - 1:s, :]
    later = a2[..., 1, :, :] * jnp.exp(G2[..., 1, :, :] - G_ref)
    earlier = b2[..., 0, :, :] * jnp.exp(G_ref - G2[..., 0, :, :])
    pairs = M.reshape(batch + (nb, 2, s, s))
    M = _join_blocks(pairs[..., 0, :, :], _gram(later, earlier, dtype), pairs[..., 1, :, :])
    s *= 2
  return M.reshape(batch + (C, C))
