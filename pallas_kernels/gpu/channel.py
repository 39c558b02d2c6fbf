"""Per-channel decay's pieces in XLA that its preparation and gradient kernels share: the
chunk-local cumulative log-decay with each chunk's reference (`chunk_cumsum`), the one-reference
bound (`fits`), the key channels per pass (`HALF`) and the gradients' last steps (`key_grads`, and
`final_state_grads`: the final state's cotangent through the delta kernels' last chunk, in float32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import common, prep
from ..gate import Gate
from . import cumsum, groups
from .tiles import F32

HALF = 64   # key channels per pass


def chunk_cumsum(g, T_pad: int, C: int, *, kernel: bool = False, interpret=None, gate: Gate | None = None):
  """`(G [B, T_pad, H_v, K], refs [B, NC, 2 + NG, H_v, K])` float32: the chunk-local cumulative
  log-decay in g's token layout (g floored at `prep.LOG_DECAY_FLOOR`), and per chunk and channel the
  reference `R` (`prep.reference`, row 0), the last token's `G_C` (row 1) and the last row of each
  8-token group (`groups.ref_rows`). `kernel`: by `cumsum.forward`'s token walk where it serves the
  shape (`cumsum.serves`; the `Plan.cumsums` of the call), else XLA's batched product. With `gate`, g is
  the gate's pre-activation f: the kernel computes g on load (`cumsum.gated_forward`), XLA first."""
  B, T, Hv, K = g.shape
  if gate is not None and kernel and cumsum.serves(Hv * K, C):
    flat = jnp.pad(g, [(0, 0), (0, T_pad - T), (0, 0), (0, 0)]).reshape(B, T_pad, Hv * K)
    G, refs = cumsum.gated_forward(flat, *gate.columns(K), C=C, kind=gate.kind, T=T, interpret=interpret)
    return G.reshape(B, T_pad, Hv, K), refs.reshape(B, T_pad // C, -1, Hv, K)
  if gate is not None:
    g = gate.values(g)
  if kernel and cumsum.serves(Hv * K, C):
    g = g if g.dtype in (jnp.bfloat16, jnp.float16, F32) else g.astype(F32)   # the kernel's tile dtypes
    flat = jnp.pad(g, [(0, 0), (0, T_pad - T), (0, 0), (0, 0)]).reshape(B, T_pad, Hv * K)
    G, refs = cumsum.forward(flat, C=C, interpret=interpret)
    return G.reshape(B, T_pad, Hv, K), refs.reshape(B, T_pad // C, -1, Hv, K)
  g = jnp.pad(prep.floor_log_decay(g.astype(F32)), [(0, 0), (0, T_pad - T), (0, 0), (0, 0)])
  G = prep.local_cumsum(g.reshape(B, T_pad // C, C, Hv, K), 2, method="matmul")
  refs = [prep.reference(G, axis=2), G[:, :, -1:], lax.stop_gradient(groups.ref_rows(G))]
  return G.reshape(B, T_pad, Hv, K), jnp.concatenate(refs, axis=2)


def ref_count(C: int) -> int:
  """Rows of `chunk_cumsum`'s refs for chunks of C tokens."""
  return groups.FIRST_ROW + groups.groups(C)


def form_row(C: int) -> int:
  """The refs row of `with_form_row`: after `chunk_cumsum`'s rows."""
  return ref_count(C)


ONE, HALVES, GROUPS = 0, 1, 2   # each chunk's form (`chunk_forms`)


def channels_beyond(refs, dtype, bound: float | None = None):
  """`[B, NC, H_v, K]` bool: the channels of each chunk that do not fit one reference, their half span
  `R - G_C` (refs rows 0 and 1; G is non-increasing down a chunk) above `bound` (a number or one per
  chunk `[B, NC, H_v]`, default `prep.ref_bound(dtype)`)."""
  bound = prep.ref_bound(dtype) if bound is None else bound
  if jnp.ndim(bound):   # one per chunk, [B, NC, H_v]
    bound = jnp.asarray(bound)[..., None]
  return ~(refs[:, :, 0] - refs[:, :, 1] <= bound)


def blocks_fit(refs, C: int, dtype, block: int, width: int | None = None):
  """`[B, NC, H_v]` bool (`[B, NC, H_v, K // width]` with `width`: each part of `width` channels apart):
  every block of `block` tokens (a multiple of `groups.GROUP`) of the chunk spans, on every channel, at
  most twice the diagonal bound (`groups.group_bound(dtype)`): the chunks whose diagonal blocks of that
  size one product each serves. From the groups' end rows of refs."""
  per = block // groups.GROUP
  ends = [refs[:, :, groups.FIRST_ROW + (b + 1) * per - 1] for b in range(C // block)]
  spans = [-ends[0]] + [ends[b - 1] - ends[b] for b in range(1, len(ends))]
  fit = jnp.all(jnp.stack(spans) <= 2.0 * groups.group_bound(dtype), axis=0)   # [B, NC, H_v, K]
  return jnp.all(_parts(fit, width), axis=-1)


def _parts(x, width: int | None):
  """`x [..., K]` as `[..., K // width, width]`, or unchanged (`width` None: the whole K, one part)."""
  if width is None:
    return x
  if x.shape[-1] % width:
    raise ValueError(f"width must divide K = {x.shape[-1]}; got {width}")
  return x.reshape(*x.shape[:-1], x.shape[-1] // width, width)


def chunk_forms(refs, C: int, dtype, bound: float | None = None, width: int | None = None):
  """`[B, NC, H_v]` int32, each chunk's form: ONE where every channel spans at most twice the
  one-reference bound (`bound`: a number or one per chunk `[B, NC, H_v]`, default
  `prep.ref_bound(dtype)`; G is non-increasing down a chunk, so `R - G_C`, refs rows 0 and 1, is half
  its span), else HALVES where each block of `groups.HALVES` tokens spans at most twice the diagonal
  bound (`blocks_fit`), else GROUPS. With `width`, `[B, NC, H_v, K // width]`: the form of each part
  of `width` channels of the chunk on its own (a kernel that takes the key channels a part at a time
  gives each part the products its channels need; the chunk's form is the largest of its parts')."""
  one = ~jnp.any(_parts(channels_beyond(refs, dtype, bound), width), axis=-1)
  halves = blocks_fit(refs, C, dtype, groups.HALVES, width)
  return lax.stop_gradient(jnp.where(one, ONE, jnp.where(halves, HALVES, GROUPS)).astype(jnp.int32))


def with_form_row(refs, C: int, dtype, bound: float | None = None, width: int | None = None):
  """`refs [B, NC, 2 + NG, H_v, K]` with one more row (`form_row`): the chunk's form (`chunk_forms`,
  one-reference `bound`) as a float across K, or with `width` on each channel the form of its part of
  `width` channels; the preparation kernel's `grams="chunk"` reads it."""
  if width is None:
    form = jnp.broadcast_to(chunk_forms(refs, C, dtype, bound)[..., None], refs[:, :, 0].shape)
  else:
    form = jnp.repeat(chunk_forms(refs, C, dtype, bound, width), width, axis=-1)   # [B, NC, H_v, K]
  return jnp.concatenate([refs, form[:, :, None].astype(F32)], axis=2)


def form_tokens(refs, C: int, dtype, bound=None, width: int | None = None):
  """`[B, H_v, T_pad]` float32: `chunk_forms` (one-reference `bound`) on each of the chunk's tokens, the
  layout of the gradient kernels' per-token vectors (their `grams="chunk"` reads it). With `width`, the
  chunk's token p holds the form of its part p of `width` channels (`chunk_forms(..., width)`), and its
  tokens after the last part the chunk's form."""
  if width is None:
    return jnp.repeat(jnp.swapaxes(chunk_forms(refs, C, dtype, bound), 1, 2).astype(F32), C, axis=2)
  parts = chunk_forms(refs, C, dtype, bound, width)   # [B, NC, H_v, P]
  if parts.shape[-1] > C:
    raise ValueError(f"at most C = {C} parts of width {width}; got {parts.shape[-1]}")
  rest = jnp.broadcast_to(jnp.max(parts, axis=-1, keepdims=True), parts.shape[:-1] + (C - parts.shape[-1],))
  tokens = jnp.concatenate([parts, rest], axis=-1)   # [B, NC, H_v, C]
  B, NC, Hv = parts.shape[:3]
  return jnp.swapaxes(tokens, 1, 2).reshape(B, Hv, NC * C).astype(F32)


def cotangent_bound(dP, dM, C: int):
  """`[B, NC, H_v]` float32: the backward's one-reference bound for each chunk of l2-normalised q, k,
  from its cotangents dP, dM `[B, H_v, T_pad, C]` in the operand dtype. The key side's products `dP Kr`,
  `dP^T Qr + dM^T Ar` and `dM Kr` sum C terms of a cotangent times a factor up to e^bound (q, k within
  [-1, 1]); they stay within float32 (e^88.72) while `2 C max|dP, dM| e^bound` does, with a nat to
  spare: `min(prep.ref_bound(dtype, unit=True), 87.72 - log(2 C max))` (the unit bound of the
  operands' dtype where the cotangents are zero)."""
  B, Hv, T_pad, _ = dP.shape
  big = jnp.maximum(jnp.max(jnp.abs(dP.astype(F32)).reshape(B, Hv, T_pad // C, -1), axis=-1),
                    jnp.max(jnp.abs(dM.astype(F32)).reshape(B, Hv, T_pad // C, -1), axis=-1))
  ceiling = prep.ref_bound(dP.dtype, unit=True)
  bound = jnp.minimum(ceiling, 87.72 - jnp.log(2.0 * C * jnp.maximum(big, 1e-30)))
  return lax.stop_gradient(jnp.swapaxes(bound, 1, 2))


def fits_refs(refs, dtype, bound: float | None = None):
  """`fits` from `chunk_cumsum`'s refs (`[B, NC, rows, H_v, K]`, rows 0 and 1 R and G_C) instead of G: G
  is non-increasing down a chunk (g <= 0, floored), so a channel's span is `2 (R - G_C)`, as the
  kernels' per-chunk forms read it (`channels_beyond`); a read of 2 rows a chunk where `fits` reads G."""
  return ~jnp.any(channels_beyond(refs, dtype, bound))


def fits(G, C: int, dtype, bound: float | None = None):
  """`prep.one_reference_fits` for `G [B, T_pad, H_v, K]` in token layout and operands of `dtype`, about
  `bound` (default `prep.ref_bound(dtype)`)."""
  B, T_pad, Hv, K = G.shape
  return prep.one_reference_fits(jnp.moveaxis(G.reshape(B, T_pad // C, C, Hv, K), 2, -2),
                                 prep.ref_bound(dtype) if bound is None else bound)


def channel_order(g, H: int):
  """`(order, inverse)` int32 `[B, H, K]`: each batch row's and key head's channels by how much they
  decay over the row (`-sum_t g`, summed over the head's value heads), strongest first, and the
  inverse permutation (`GpuConfig.order_channels`). Not differentiated (an order is piecewise
  constant)."""
  B, T, Hv, K = g.shape
  decay = -jnp.sum(lax.stop_gradient(g).astype(F32), axis=1).reshape(B, H, Hv // H, K).sum(axis=2)
  order = jnp.argsort(-decay, axis=-1, stable=True).astype(jnp.int32)
  return order, jnp.argsort(order, axis=-1).astype(jnp.int32)


def permute_channels(x, order, inverse, heads_axis: int, axis: int):
  """`x` with its channel `axis` taken in `order` (`[B, H', K]`, one order a batch row and head along
  `heads_axis`, repeated over grouped heads where x has more heads than order); differentiable, its
  cotangent taken back by `inverse` (a gather, not a scatter-add)."""
  return _permute(x, order, inverse, heads_axis, axis)


def _take(x, order, heads_axis: int, axis: int):
  """`x` gathered along `axis` by `order [B, H', K]` (batch on axis 0, heads on `heads_axis < axis`)."""
  B, Hp, K = order.shape
  reps = x.shape[heads_axis] // Hp
  idx = jnp.repeat(order, reps, axis=1) if reps > 1 else order   # [B, H_x, K]
  shape = [1] * x.ndim
  shape[0], shape[heads_axis], shape[axis] = B, x.shape[heads_axis], K
  return jnp.take_along_axis(x, jnp.broadcast_to(idx.reshape(shape), x.shape), axis=axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _permute(x, order, inverse, heads_axis, axis):
  return _take(x, order, heads_axis, axis)


def _permute_fwd(x, order, inverse, heads_axis, axis):
  return _take(x, order, heads_axis, axis), (order, inverse)


def _permute_bwd(heads_axis, axis, res, ct):
  order, inverse = res
  zero = lambda a: np.zeros(a.shape, jax.dtypes.float0)
  return _take(ct, inverse, heads_axis, axis), zero(order), zero(inverse)


_permute.defvjp(_permute_fwd, _permute_bwd)


def key_grads(dq, dk, dG, q, k, g, C: int, summed: bool = False, *, kernel: bool = False,
              interpret=None, gate: Gate | None = None):
  """`(dq, dk, dg)` in q, k, g's dtypes and lengths from the kernels' per-value-head dq, dk `[B, T_pad,
  H_v, K]` and per-token dG: dg is dG's reverse cumsum within each chunk (G = cumsum(g) there; `summed`:
  the kernel took it, and dG is that sum; `kernel`: `cumsum.reverse`'s token walk where it serves the
  shape, else XLA's batched product), zero below the gate's floor, and grouped heads add their value
  heads' dq, dk. With `gate` (g is the gate's pre-activation f), the third is `(df, dA_log, ddt_bias)`:
  by `cumsum.gated_reverse` where the kernel takes dG's sums, else by XLA through `gate.values`."""
  B, T, H, K = q.shape
  T_pad, Hv = dG.shape[1:3]
  group = Hv // H
  per_head = lambda x: (x[:, :T].astype(F32).reshape(B, T, H, group, K).sum(3) if group > 1
                        else x[:, :T])
  key = lambda: (per_head(dq).astype(q.dtype), per_head(dk).astype(k.dtype))
  if gate is not None and kernel and not summed and cumsum.serves(Hv * K, C):
    f = jnp.pad(g, [(0, 0), (0, T_pad - T), (0, 0), (0, 0)]).reshape(B, T_pad, Hv * K)
    df, parts = cumsum.gated_reverse(dG.reshape(B, T_pad, Hv * K), f, *gate.columns(K), C=C, kind=gate.kind,
                                     T=T, interpret=interpret)
    dA_log = parts[:, :, 0].reshape(-1, Hv, K).sum((0, 2)).astype(gate.A_log.dtype)
    return key() + ((df.reshape(B, T_pad, Hv, K)[:, :T], dA_log,
                     parts[:, :, 1].sum((0, 1)).astype(gate.dt_bias.dtype)),)
  f, g = (g, gate.values(g)) if gate is not None else (None, g)
  if summed:
    dg = dG[:, :T]
  elif kernel and cumsum.serves(Hv * K, C):
    dg = cumsum.reverse(dG.reshape(B, T_pad, Hv * K), C=C, interpret=interpret).reshape(dG.shape)[:, :T]
  else:
    dG = dG.reshape(B, T_pad // C, C, Hv, K)
    dg = prep.local_cumsum(dG, 2, reverse=True, method="matmul").reshape(B, T_pad, Hv, K)[:, :T]
  dg = jnp.where(g >= prep.LOG_DECAY_FLOOR, dg, 0.0)   # the floor's gradient (chunk_cumsum)
  return key() + ((gate.vjp(f, dg) if gate is not None else dg.astype(g.dtype)),)



def final_state_grads(dfinal, last_start, G, k, v, b, seg=None, seg_before=None, *, normalise: bool = False,
                      operand_dtype=jnp.bfloat16):
  """The last chunk's `(dk, dv, dbeta, dG)` of the final state's cotangent `dfinal` `[B, H_v, K, V]`
  alone, in float32: the vjp of the chunk's map from its inputs to the final state (`prep.chunk_tensors`'
  exact form, float32 operands) at the float32 state entering it (`last_start`, `[B, H_v, V, K]`). The
  backward is linear in its cotangents: the kernels take o's and the chunks before, these add to theirs.
  k `[B, C, H_v, K]` in the kernels' basis (raw with `normalise`: the kernels normalised it and took the
  rows in `operand_dtype`), v `[B, C, H_v, V]`, b `[B, H_v, C]`, G the chunk-local cumulative log-decay
  `[B, C, H_v, K]`; seg None or the chunk's canonical segment ids `[B, C]` and `[B]` the one of the
  state entering it. dG is in G's basis (not reverse-summed)."""
  S0 = jnp.swapaxes(last_start.astype(F32), -1, -2)                 # [B, H_v, K, V]
  hi = lax.Precision.HIGHEST
  chunked = lambda x: jnp.moveaxis(x, 2, 1)[:, :, None]            # [B, C, H, ...] -> [B, H, 1, C, ...]

  def final(k, v, b, G):
    if normalise:   # the rows the kernels' products took: rounded to their operand dtype
      k = common.l2_normalize(k)
      k = k + lax.stop_gradient(k.astype(operand_dtype).astype(F32) - k)
    g = G - jnp.concatenate([jnp.zeros_like(G[:, :1]), G[:, :-1]], axis=1)
    kc = chunked(k)
    # the merge form at any strength: "auto"'s `lax.cond` would wait for its predicate on the host
    t = prep.chunk_tensors(jnp.zeros_like(kc), kc, chunked(v), chunked(g), b[:, :, None], seg, seg_before,
                           dtype=F32, gram_method="merge")
    u = t.u[:, :, 0] - jnp.einsum("bhck,bhkv->bhcv", t.w[:, :, 0], S0, precision=hi)
    return t.decay[:, :, 0, :, None] * S0 + jnp.einsum("bhck,bhcv->bhkv", t.kd[:, :, 0], u, precision=hi)

  args = tuple(x.astype(F32) for x in (k, v, b, G))
  return jax.vjp(final, *args)[1](dfinal.astype(F32))


def add_final_state_grads(grads, dfinal, last_start, G, k, v, b, segment_ids, C: int, *, summed: bool,
                          k_basis: str):
  """The kernels' `(dk [B, T_pad, H_v, K], dv [B, T_pad, H_v, V], dbeta [B, H_v, T_pad], dG)` with the
  last chunk's `final_state_grads` added (float32): k, v `[B, T_pad, H, K]`, `[B, T_pad, H_v, V]` as
  the kernels took them, b `[B, H_v, T_pad]`; `k_basis`: the kernels' dk is of k "as_given", of its
  l2-normalised rows ("normalised") or of the raw k they normalised ("raw"); `summed`: dG is already
  reverse-summed within the chunks."""
  dk, dv, db, dG = grads
  B, T_pad, H = k.shape[:3]
  k_last = jnp.repeat(k[:, -C:], dG.shape[2] // H, axis=2)
  if k_basis == "normalised":   # rounded to k's dtype, as the kernels took it
    k_last = common.l2_normalize(k_last)
  seg = seg_before = None
  if segment_ids is not None:
    T = segment_ids.shape[1]
    seg = jnp.pad(prep.canonical_segments(segment_ids), [(0, 0), (0, T_pad - T)], mode="edge")
    seg, seg_before = seg[:, -C:], seg[:, -C - 1 if T_pad > C else 0]
  dk_f, dv_f, db_f, dG_f = final_state_grads(dfinal, last_start, G[:, -C:], k_last, v[:, -C:], b[:, :, -C:],
                                             seg, seg_before, normalise=k_basis == "raw",
                                             operand_dtype=k.dtype)
  dG_f = jnp.cumsum(dG_f[:, ::-1], axis=1)[:, ::-1] if summed else dG_f
  return (dk.astype(F32).at[:, -C:].add(dk_f), dv.astype(F32).at[:, -C:].add(dv_f),
          db.at[:, :, -C:].add(db_f), dG.at[:, -C:].add(dG_f))
