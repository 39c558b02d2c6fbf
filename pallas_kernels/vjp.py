"""The custom_vjp wiring: XLA preparation (`prep.py`) + a backend's chunk walk, as one differentiable op.

    forward:   tensors = prepare(q, k, v, g, beta)  ->  walk.forward(tensors, h0)  ->  (o, final)
    backward:  recompute tensors (and the vjp of `prepare`), walk.forward(..., with_states=True) for the
               state entering each chunk, walk.backward(...) in reverse, then the vjp of `prepare`
               turns the per-chunk cotangents into dq, dk, dv, dg, dbeta; the walk gives dh0.

Residuals are the op's inputs only (as flash attention keeps only q, k, v and statistics): the
preparation and the chunk states are recomputed in the backward pass, so nothing of size `T * K * V`
outlives the forward. A backend supplies a `Walk`; nothing here depends on the backend.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import common, prep


class Walk(NamedTuple):
  """A backend's chunk walk.

  forward(tensors, h0, *, options, with_o, with_states, out_dtype) -> (o, states, final):
    `tensors` a `prep.ChunkTensors` in the matmul dtype (decay float32), `h0` None or `[B, H, K, V]`
    float32; `o: [B, H, NC, C, V]` (unscaled) or None, `states` opaque (for `backward`) or None,
    `final: [B, H, K, V]` float32.
  backward(tensors, states, do, dfinal, *, options) -> (float32 ChunkTensors of cotangents, dh0).
  chunks_per_group(NC, options) -> int: T is padded to whole groups of this many chunks.
  fused_forward(q, k, v, g, beta, h0, segment_ids, *, options, chunk_size, compute_dtype, out_dtype,
    scale) -> (o, final) like `chunked` (o `[B, T, H_v, V]`, scaled), computed from the raw inputs with
    no prepared tensors in device memory; or None where the backend has no such kernel for this call
    (the prepared path runs). With `residuals=True` (the forward of a differentiated call) it returns
    `((o, final), saved)` instead, `saved` whatever its `fused_backward` reads to skip recomputation
    (or None), or None where the backend has no fused pair for the call.
  kernel_prepare(q, k, v, g, beta, segment_ids, *, options, chunk_size, compute_dtype) -> the forward's
    `prep.ChunkTensors` in compute_dtype from a kernel instead of XLA (the backward still recomputes
    them in XLA for their vjp); or None (XLA prepares).
  fused_backward(q, k, v, g, beta, h0, segment_ids, do, dfinal, *, options, chunk_size, compute_dtype,
    scale, residuals, fallback) -> (dq, dk, dv, dg, dbeta, dh0) for `do: [B, T, H_v, V]` (of the scaled
    o) without the preparation's vjp (dbeta None for the additive family); or None (the prepared path
    runs). `residuals`: the forward's `saved`, or None (recompute). `fallback()` returns the prepared
    path's tuple (dh0 float32), for a backend whose kernels serve only some values of the inputs (it
    may choose between the two on the data, in a `lax.cond`).
  """

  forward: Callable[..., Any]
  backward: Callable[..., Any]
  chunks_per_group: Callable[[int, Any], int]
  fused_forward: Callable[..., Any] | None = None
  fused_backward: Callable[..., Any] | None = None
  kernel_prepare: Callable[..., Any] | None = None


@dataclasses.dataclass(frozen=True)
class Static:
  """Everything about a call that is not an array (hashable).

  walk: the backend. options: the backend's own settings (block sizes, interpreter), passed through.
  chunk_size: C. compute_dtype: the matmul dtype of the per-chunk tensors. out_dtype: o's dtype.
  inverse_dtype: `prep.prepare`'s operand dtype of the matmuls of `(I + L)^-1` (None: compute_dtype).
  gram_method: `prep.prepare`'s form of per-channel decayed grams (`prep.GRAM_METHODS`).
  scale: the read-out scale applied to o (`chunked_op` sets it).
  """

  walk: Walk
  options: Any
  chunk_size: int
  compute_dtype: Any
  out_dtype: Any
  inverse_dtype: Any = None
  gram_method: str = "auto"
  scale: float = 1.0


def _prepare(static: Static, q, k, v, g, beta, segment_ids):
  NC = -(-q.shape[1] // static.chunk_size)
  return prep.prepare(q, k, v, g, beta, segment_ids, chunk_size=static.chunk_size,
                      chunk_multiple=static.walk.chunks_per_group(NC, static.options),
                      dtype=static.compute_dtype, inverse_dtype=static.inverse_dtype,
                      gram_method=static.gram_method)



def _padded_length(static: Static, T: int) -> int:
  NC = -(-T // static.chunk_size)
  return prep.padded_length(T, static.chunk_size, static.walk.chunks_per_group(NC, static.options))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunked(static: Static, q, k, v, g, beta, h0, segment_ids):
  """The op: `(o [B, T, H_v, V] in static.out_dtype, scaled by static.scale, final [B, H_v, K, V])`.

  Shapes as in `prep.prepare`; `h0` None or `[B, H_v, K, V]` float32; `segment_ids` None or `[B, T]`.
  """
  if static.walk.fused_forward is not None:
    out = static.walk.fused_forward(q, k, v, g, beta, h0, segment_ids, options=static.options,
                                    chunk_size=static.chunk_size, compute_dtype=static.compute_dtype,
                                    out_dtype=static.out_dtype, scale=static.scale)
    if out is not None:
      return out
  t = None
  if static.walk.kernel_prepare is not None:
    t = static.walk.kernel_prepare(q, k, v, g, beta, segment_ids, options=static.options,
                                   chunk_size=static.chunk_size, compute_dtype=static.compute_dtype)
  if t is None:
    t = common.cast_tensors(_prepare(static, q, k, v, g, beta, segment_ids), static.compute_dtype)
  o, _, final = static.walk.forward(t, h0, options=static.options, with_o=True, with_states=False,
                                    out_dtype=static.out_dtype)
  o = prep.from_chunks(o, q.shape[1])
  return (o.astype(jnp.float32) * static.scale).astype(static.out_dtype), final


def _chunked_fwd(static, q, k, v, g, beta, h0, segment_ids):
  if static.walk.fused_forward is not None:
    out = static.walk.fused_forward(q, k, v, g, beta, h0, segment_ids, options=static.options,
                                    chunk_size=static.chunk_size, compute_dtype=static.compute_dtype,
                                    out_dtype=static.out_dtype, scale=static.scale, residuals=True)
    if out is not None:
      out, saved = out
      return out, (q, k, v, g, beta, h0, segment_ids, saved)
  return chunked(static, q, k, v, g, beta, h0, segment_ids), (q, k, v, g, beta, h0, segment_ids, None)


def _chunked_bwd(static, residuals, cotangents):
  q, k, v, g, beta, h0, segment_ids, saved = residuals
  do, dfinal = cotangents
  prepared = functools.partial(_prepared_backward, static, q, k, v, g, beta, h0, segment_ids, do, dfinal)
  if static.walk.fused_backward is not None:
    lean = functools.partial(_prepared_backward_per_head, static, q, k, v, g, beta, h0, segment_ids, do,
                             dfinal)
    out = static.walk.fused_backward(q, k, v, g, beta, h0, segment_ids, do, dfinal,
                                     options=static.options, chunk_size=static.chunk_size,
                                     compute_dtype=static.compute_dtype, scale=static.scale,
                                     residuals=saved, fallback=lean)
    if out is not None:
      dq, dk, dv, dg, dbeta, dh0 = out
      dq, dk, dv = (common.sum_over_extra_axes(d, x) for d, x in ((dq, q), (dk, k), (dv, v)))
      dg = None if g is None else common.sum_over_extra_axes(dg, g)
      dbeta = None if beta is None else common.sum_over_extra_axes(dbeta, beta)
      return dq, dk, dv, dg, dbeta, (None if h0 is None else dh0.astype(h0.dtype)), None
  dq, dk, dv, dg, dbeta, dh0 = prepared()
  return dq, dk, dv, dg, dbeta, (None if h0 is None else dh0.astype(h0.dtype)), None


def _prepared_backward(static, q, k, v, g, beta, h0, segment_ids, do, dfinal):
  """The prepared path's `(dq, dk, dv, dg, dbeta, dh0 float32)`: XLA's vjp of the preparation around
  the backend's walks."""
  t32, prep_vjp = jax.vjp(lambda *x: _prepare(static, *x, segment_ids), q, k, v, g, beta)
  t = common.cast_tensors(t32, static.compute_dtype)
  _, states, _ = static.walk.forward(t, h0, options=static.options, with_o=False, with_states=True,
                                     out_dtype=static.out_dtype)
  # the cotangent of the unscaled o in chunk layout, rounded to o's dtype as autodiff of the forward's
  # last line would round it
  do = (do.astype(jnp.float32) * static.scale).astype(static.out_dtype)
  do = prep.to_chunks(do, static.chunk_size, _padded_length(static, q.shape[1]))
  grads, dh0 = static.walk.backward(t, states, do, dfinal, options=static.options)
  dq, dk, dv, dg, dbeta = prep_vjp(jax.tree.map(common.sum_over_extra_axes, grads, t32))
  return dq, dk, dv, dg, dbeta, dh0.astype(jnp.float32)



def _prepared_backward_per_head(static, q, k, v, g, beta, h0, segment_ids, do, dfinal):
  """`_prepared_backward`, one (batch row, value head) at a time (`lax.map`): the fallback of a backend's
  kernels. XLA allocates the scratch of both branches of a `lax.cond` whichever runs, and the prepared
  path's vjp (the merge form of per-channel grams above all) needs several times the kernels' scratch;
  one head at a time needs 1 / (B H_v) of it, at the cost of B H_v sequential calls where it runs."""
  B, T, H, K = q.shape
  Hv, V = v.shape[2:]
  group = Hv // H

  def one(i):
    h, row, head = common.row_and_head(i, Hv)
    dq, dk, dv, dg, dbeta, dh0 = _prepared_backward(
        static, head(q, h // group, 2), head(k, h // group, 2), head(v, h, 2), head(g, h, 2),
        head(beta, h, 2), head(h0, h, 1), row(segment_ids), head(do, h, 2), head(dfinal, h, 1))
    return (dq[0, :, 0].astype(jnp.float32), dk[0, :, 0].astype(jnp.float32), dv[0, :, 0],
            None if dg is None else dg[0, :, 0], None if dbeta is None else dbeta[0, :, 0], dh0[0, 0])

  dq, dk, dv, dg, dbeta, dh0 = lax.map(one, jnp.arange(B * Hv))
  heads = lambda x: jnp.moveaxis(x.reshape((B, Hv) + x.shape[1:]), 1, 2)   # [B, T, H_v, ...]
  per_q_head = lambda x, like: heads(x).reshape(B, T, H, group, K).sum(3).astype(like.dtype)
  return (per_q_head(dq, q), per_q_head(dk, k), heads(dv), None if dg is None else heads(dg),
          None if dbeta is None else heads(dbeta), dh0.reshape(B, Hv, K, V))




chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_op(static: Static, q, k, v, g, beta, *, scale: float, initial_state, segment_ids):
  """`chunked` with the read-out scale: `(o [B, T, H_v, V] out_dtype, final [B, H_v, K, V] float32)`."""
  h0 = None if initial_state is None else jnp.asarray(initial_state, jnp.float32)
  return chunked(dataclasses.replace(static, scale=float(scale)), q, k, v, g, beta, h0, segment_ids)
