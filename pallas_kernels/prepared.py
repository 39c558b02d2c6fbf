"""The prepared path, shared by every backend: XLA's preparation (`prep.py`) of the per-chunk tensors, and
a backend's kernels that walk them.

    forward:   tensors = prepare(q, k, v, g, beta)  ->  walk.forward(tensors, h0)  ->  (o, final)
    backward:  recompute tensors (and the vjp of `prepare`), walk.forward(..., with_states=True) for the
               state entering each chunk, walk.backward(...) in reverse, then the vjp of `prepare`
               turns the per-chunk cotangents into dq, dk, dv, dg, dbeta; the walk gives dh0.

Its backward keeps nothing of the forward but the op's inputs (as flash attention keeps only q, k, v and
statistics): nothing of size `T * K * V` outlives the forward. A backend supplies a `Walk`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from . import common, prep


class Walk(NamedTuple):
  """A backend's chunk walk over prepared tensors.

  forward(tensors, h0, *, options, with_o, with_states, out_dtype) -> (o, states, final):
    `tensors` a `prep.ChunkTensors` in the matmul dtype (decay float32), `h0` None or `[B, H, K, V]`
    float32; `o: [B, H, NC, C, V]` (unscaled) or None, `states` opaque (for `backward`) or None,
    `final: [B, H, K, V]` float32.
  backward(tensors, states, do, dfinal, *, options) -> (float32 ChunkTensors of cotangents, dh0).
  chunks_per_group(NC, options) -> int: T is padded to whole groups of this many chunks.
  """

  forward: Callable[..., Any]
  backward: Callable[..., Any]
  chunks_per_group: Callable[[int, Any], int]


@dataclasses.dataclass(frozen=True)
class Static:
  """Everything about a call that is not an array (hashable).

  plan: what runs (`pallas_kernels.gpu.plan.Plan`; a backend with only the prepared path uses
    `vjp.PREPARED`). walk: the backend's walk over prepared tensors. options: the backend's own settings
    (block sizes or `GpuConfig`, the interpreter), passed through.
  chunk_size: C. compute_dtype: the matmul dtype of the per-chunk tensors. out_dtype: o's dtype.
  inverse_dtype: `prep.prepare`'s operand dtype of the matmuls of `(I + L)^-1` (None: compute_dtype).
  gram_method: `prep.prepare`'s form of per-channel decayed grams (`prep.GRAM_METHODS`).
  scale: the read-out scale applied to o.
  gate: None (the call's g is its log-decay), or the kind of KDA gate whose pre-activation g is
    (`pallas_kernels.gate`; the op's `gate` argument holds A_log and dt_bias).
  """

  plan: Any
  walk: Walk
  options: Any
  chunk_size: int
  compute_dtype: Any
  out_dtype: Any
  inverse_dtype: Any = None
  gram_method: str = "auto"
  scale: float = 1.0
  gate: Any = None


def chunk_multiple(static: Static, T: int) -> int:
  """The backend's chunks per group: T is padded to whole groups of this many chunks."""
  return static.walk.chunks_per_group(-(-T // static.chunk_size), static.options)


def prepare(static: Static, q, k, v, g, beta, segment_ids):
  """XLA's float32 `prep.ChunkTensors` of the call."""
  return prep.prepare(q, k, v, g, beta, segment_ids, chunk_size=static.chunk_size,
                      chunk_multiple=chunk_multiple(static, q.shape[1]), dtype=static.compute_dtype,
                      inverse_dtype=static.inverse_dtype,
                      gram_method=static.gram_method)


def forward(static: Static, q, k, v, g, beta, h0, segment_ids):
  """`(o [B, T, H_v, V] in static.out_dtype, scaled by static.scale, final [B, H_v, K, V] float32)`."""
  t = common.cast_tensors(prepare(static, q, k, v, g, beta, segment_ids), static.compute_dtype)
  o, _, final = static.walk.forward(t, h0, options=static.options, with_o=True, with_states=False,
                                    out_dtype=static.out_dtype)
  o = prep.from_chunks(o, q.shape[1])
  return (o.astype(jnp.float32) * static.scale).astype(static.out_dtype), final


def backward(static: Static, q, k, v, g, beta, h0, segment_ids, do, dfinal):
  """`(dq, dk, dv, dg, dbeta, dh0 float32)`: XLA's vjp of the preparation around the backend's walks."""
  t32, prep_vjp = jax.vjp(lambda *x: prepare(static, *x, segment_ids), q, k, v, g, beta)
  t = common.cast_tensors(t32, static.compute_dtype)
  _, states, _ = static.walk.forward(t, h0, options=static.options, with_o=False, with_states=True,
                                     out_dtype=static.out_dtype)
  # the cotangent of the unscaled o in chunk layout, rounded to o's dtype as autodiff of the forward's
  # last line would round it
  do = (do.astype(jnp.float32) * static.scale).astype(static.out_dtype)
  T_pad = prep.padded_length(q.shape[1], static.chunk_size, chunk_multiple(static, q.shape[1]))
  grads, dh0 = static.walk.backward(t, states, prep.to_chunks(do, static.chunk_size, T_pad), dfinal,
                                    options=static.options)
  dq, dk, dv, dg, dbeta = prep_vjp(jax.tree.map(common.sum_over_extra_axes, grads, t32))
  return dq, dk, dv, dg, dbeta, dh0.astype(jnp.float32)


def backward_per_head(static: Static, q, k, v, g, beta, h0, segment_ids, do, dfinal):
  """`backward`, one (batch row, value head) at a time (`lax.map`): what a per-channel call beyond the
  kernels' bound takes. XLA allocates the scratch of both
  branches of a `lax.cond` whichever runs, and the merge form needs several times the kernels' scratch;
  one head at a time needs 1 / (B H_v) of it, at the cost of B H_v sequential calls where it runs."""
  B, T, H, K = q.shape
  Hv, V = v.shape[2:]
  group = Hv // H

  def one(i):
    h, row, head = common.row_and_head(i, Hv)
    dq, dk, dv, dg, dbeta, dh0 = backward(
        static, head(q, h // group, 2), head(k, h // group, 2), head(v, h, 2), head(g, h, 2),
        head(beta, h, 2), head(h0, h, 1), row(segment_ids), head(do, h, 2), head(dfinal, h, 1))
    return (dq[0, :, 0].astype(jnp.float32), dk[0, :, 0].astype(jnp.float32), dv[0, :, 0],
            None if dg is None else dg[0, :, 0], None if dbeta is None else dbeta[0, :, 0], dh0[0, 0])

  dq, dk, dv, dg, dbeta, dh0 = lax.map(one, jnp.arange(B * Hv))
  heads = lambda x: jnp.moveaxis(x.reshape((B, Hv) + x.shape[1:]), 1, 2)   # [B, T, H_v, ...]
  per_q_head = lambda x, like: heads(x).reshape(B, T, H, group, K).sum(3).astype(like.dtype)
  return (per_q_head(dq, q), per_q_head(dk, k), heads(dv), None if dg is None else heads(dg),
          None if dbeta is None else heads(dbeta), dh0.reshape(B, Hv, K, V))


def merge_tensors_per_head(q, k, v, g, beta, segment_ids, *, chunk_size: int, chunk_multiple: int, dtype):
  """`prep.prepare` with the merge form, cast to `dtype`, one (batch row, value head) at a time
  (`lax.map`): the per-channel forward's tensors beyond the kernels' bound (XLA allocates the scratch of
  both branches of the `lax.cond`, and the merge form's levels need several times the kernel's)."""
  B, T, H, K = q.shape
  Hv = v.shape[2]
  group = Hv // H

  def one(i):
    h, row, head = common.row_and_head(i, Hv)
    t = prep.prepare(head(q, h // group), head(k, h // group), head(v, h), head(g, h), head(beta, h),
                     row(segment_ids), chunk_size=chunk_size, chunk_multiple=chunk_multiple, dtype=dtype,
                     inverse_dtype=jnp.float32, gram_method="merge")
    return jax.tree.map(lambda x: x[0, 0], common.cast_tensors(t, dtype))

  t = lax.map(one, jnp.arange(B * Hv))
  heads = lambda x: None if x is None else x.reshape((B, Hv) + x.shape[1:])
  return prep.ChunkTensors(*(heads(x) for x in t))
