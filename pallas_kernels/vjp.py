"""The custom_vjp that makes one differentiable op of a backend's kernels: the forward is one `match` on
the call's plan (`pallas_kernels.gpu.plan`), the backward another, and the plan rides in the op's static
argument, so the backward never repeats the choice.

    forward:   match plan.forward    -> (o, final), and for a differentiated call what plan.backward reads
    backward:  match plan.backward   -> dq, dk, dv, dg, dbeta, dh0

"xla_prep" / "xla_vjp" are the prepared path (`prepared.py`: XLA's preparation and the backend's walk),
which every backend has (the TPU's plan is `PREPARED`); the other stages are Mosaic GPU kernels. A
per-channel stage chooses on the data, in one `lax.cond` here, between its kernels' one-reference grams
and the plan's `forward_beyond`, `backward_beyond`: the same kernels choosing per chunk ("chunk") or
with the 8-token groups' products on every chunk ("groups"); float16 operands beyond the groups' bound
take XLA's merge form one head at a time (`Plan.per_head_beyond`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import CustomVJPPrimal as Primal, SymbolicZero

from . import common, prep, prepared
from .gate import Gate
from .gpu import channel, channel_delta_grads, channel_grads, channel_prep, delta_grads, delta_prep
from .gpu import fused, groups, walk
from .gpu.plan import Plan

Static = prepared.Static
PREPARED = Plan(cell="prepared", forward="xla_prep", keeps="inputs", backward="xla_vjp", forward_beyond=None,
                backward_beyond=None, l2="xla", forward_warpgroups=1, grads_warpgroups=1)


def _walk(static: Static, t, h0, *, with_states: bool, with_last_start: bool = False):
  """The GPU walk over prepared tensors writing o scaled in the token layout: `(o [B, T_pad, H_v, V],
  (states, transitions) or None, final)`; with `with_last_start`, the second is `(states, transitions,
  the last chunk's float32 start)` (`walk.forward`'s)."""
  o, states, final, transitions, *last = walk.forward(
      t, h0, with_o=True, with_states=with_states, out_dtype=static.out_dtype,
      interpret=static.options.interpret, sequence_pieces=static.plan.sequence_pieces,
      return_transitions=True, token_o=True, scale=static.scale, with_last_start=with_last_start)
  return o, (states, transitions, *last) if with_states else None, final


def _pieces(static: Static) -> int:
  return static.plan.sequence_pieces or 1


def channel_tensors(q, k, v, g, beta, *, chunk_size: int, dtype, segment_ids=None, interpret=None,
                    chunk_multiple: int = 1, cumsum=None, with_inverse: bool = False, beyond: str = "chunk",
                    bound: float | None = None, call_test: bool = True, half_forms: bool = False,
                    qk_l2norm: bool = False, warpgroups: int = 1):
  """The per-channel forward's chunk tensors (the plan's "channel_prep" stage and its `forward_beyond`),
  arguments as `channel_prep.prepare`'s: the preparation kernel with one reference per chunk and channel
  where every chunk's decay fits that bound, else with the 8-token groups' products (groups.py; one
  `lax.cond`). Float16 operands beyond the groups' bound take XLA's merge form one (batch row, value
  head) at a time (a second `lax.cond`; bfloat16 operands always fit). `beyond`: the kernel's grams
  beyond the bound (the plan's `forward_beyond`: "chunk", each chunk its own form, or "groups").
  `with_inverse` returns `(tensors, X, M)` (`channel_prep.prepare`'s), X and M zeros in the merge-form
  branch (whose backward recomputes). `bound`: the one-reference form's (`channel_prep.prepare`'s),
  in both the test and the kernels. `call_test=False` (`Plan.call_test`) calls the `beyond` kernels
  without the test where they choose per chunk ("chunk") and the operands always fit the groups.
  `half_forms`: the "chunk" kernel chooses for each half of a chunk's key channels apart (the plan's
  `half_forms`). `qk_l2norm`: q, k are l2-normalised here (on load in the kernels, in XLA for the
  merge form). `warpgroups`: the kernel's (`channel_prep.prepare`'s; the plan's `prep_warpgroups`)."""
  C = chunk_size
  if cumsum is None:
    cumsum = channel.chunk_cumsum(g, prep.padded_length(q.shape[1], C, chunk_multiple), C)
  kernel = lambda grams: lambda: channel_prep.prepare(
      q, k, v, g, beta, chunk_size=C, dtype=dtype, segment_ids=segment_ids, interpret=interpret,
      chunk_multiple=chunk_multiple, cumsum=cumsum, with_inverse=with_inverse, grams=grams, bound=bound,
      half_forms=half_forms and grams == "chunk", qk_l2norm=qk_l2norm, warpgroups=warpgroups)

  def per_head():
    qn, kn = (common.l2_normalize(q), common.l2_normalize(k)) if qk_l2norm else (q, k)
    t = prepared.merge_tensors_per_head(qn, kn, v, prep.floor_log_decay(g), beta, segment_ids, chunk_size=C,
                                        chunk_multiple=chunk_multiple, dtype=dtype)
    zeros = jnp.zeros(t.qg.shape[:3] + (C, C), dtype)
    return (t, zeros, zeros) if with_inverse else t

  # under shard_map both branches' tensors vary over every mesh axis the inputs vary over (the kernel's
  # results say so of all of them; the types of a lax.cond's branches must match)
  axes = common.varying_axes([x for x in (q, k, v, g, beta, segment_ids) if x is not None])
  varying = lambda branch: lambda: jax.tree.map(lambda x: common.vary_over(x, axes), branch())
  return _by_bound(cumsum, C, dtype, varying(kernel("one")), varying(kernel(beyond)), varying(per_head),
                   bound=bound, test=call_test or beyond != "chunk")


def _by_bound(cumsum, C: int, dtype, one, grouped, per_head, bound: float | None = None, test: bool = True):
  """`one()` where every chunk of `cumsum = (G, refs)` (`channel.chunk_cumsum`'s) fits one reference
  (about `bound`, default `prep.ref_bound`; from the refs' rows, `channel.fits_refs`), else `grouped()`
  where every 8-token group fits the groups' bound (always, for bfloat16 operands), else `per_head()`.
  Without `test` (kernels that choose per chunk, `GpuConfig.call_test=False`): `grouped()` where the
  operands always fit the groups, with no `lax.cond` (whose branches are all compiled)."""
  G, refs = cumsum
  if not test and groups.always_fits(dtype):
    return grouped()
  beyond = grouped if groups.always_fits(dtype) else (
      lambda: lax.cond(groups.fits(G, C, dtype), grouped, per_head))
  return lax.cond(channel.fits_refs(refs, dtype, bound), one, beyond)


def _gate(static: Static, gate_arrays) -> Gate | None:
  """The call's `Gate` (g is its pre-activation), or None. The kernels take it in the per-channel delta
  plan's cumsum walks only (`gpu.ops.chunked_attention` computes g in XLA for any other)."""
  if static.gate is None:
    return None
  plan = static.plan
  if (plan.forward, plan.backward, plan.cumsums) != ("channel_prep", "channel_delta_grads", "kernel"):
    raise ValueError(f"a gate's pre-activation takes the per-channel delta plan with the cumsum walks; got "
                     f"{plan.forward}, {plan.backward}, cumsums {plan.cumsums}")
  return Gate(*gate_arrays, static.gate)


def _forward(static: Static, q, k, v, g, beta, h0, segment_ids, gate_arrays=None, *, keep: bool):
  """`((o [B, T, H_v, V], final), saved)`: `saved` is what `plan.backward` reads (`plan.keeps`) where
  `keep` (a differentiated call), else None. With a gate (`static.gate`), g is its pre-activation."""
  plan, T = static.plan, q.shape[1]
  gate = _gate(static, gate_arrays)
  C, dtype, interpret = static.chunk_size, static.compute_dtype, static.options.interpret
  saves = keep and plan.keeps != "inputs"
  match plan.forward:
    case "xla_prep" if not saves:
      return prepared.forward(static, q, k, v, g, beta, h0, segment_ids), None
    case "xla_prep":   # gla's gradient kernels read the walk's states and the tensors they walked
      cumsum = channel.chunk_cumsum(g, prep.padded_length(T, C, _pieces(static)), C,
                                     kernel=plan.cumsums == "kernel", interpret=interpret)
      t = common.cast_tensors(prepared.prepare(static, q, k, v, g, beta, segment_ids), dtype)
      o, states, final = _walk(static, t, h0, with_states=True)
      saved = channel_grads.Saved(*states, qg=t.qg, decay=t.decay, G=cumsum[0], refs=cumsum[1])
    case "fused":
      o, saved, final = fused.forward(q, k, v, g, h0, chunk_size=C, dtype=dtype, out_dtype=static.out_dtype,
                                      segment_ids=segment_ids, interpret=interpret, with_states=saves,
                                      sequence_pieces=plan.sequence_pieces, scale=static.scale,
                                      warpgroups=plan.forward_warpgroups)
    case "delta_prep":
      out = delta_prep.prepare(q, k, v, g, beta, chunk_size=C, dtype=dtype, segment_ids=segment_ids,
                               interpret=interpret, with_inverse=saves, chunk_multiple=_pieces(static),
                               qk_l2norm=plan.l2 == "on_load")
      t, X = out if saves else (out, None)
      o, states, final = _walk(static, t, h0, with_states=saves)
      saved = (t, X) + states if saves else None
    case "channel_prep":
      cumsum = channel.chunk_cumsum(g, prep.padded_length(T, C, _pieces(static)), C,
                                     kernel=plan.cumsums == "kernel", interpret=interpret, gate=gate)
      inverse = saves and plan.backward == "channel_delta_grads"
      # g itself only in the float16 branch beyond the groups' bound (XLA drops it elsewhere)
      out = channel_tensors(q, k, v, g if gate is None else gate.values(g), beta, chunk_size=C, dtype=dtype,
                            segment_ids=segment_ids, interpret=interpret, chunk_multiple=_pieces(static),
                            cumsum=cumsum,
                            with_inverse=inverse, beyond=plan.forward_beyond,
                            bound=plan.forward_ref_bound, call_test=plan.call_test,
                            half_forms=plan.half_forms, qk_l2norm=plan.l2 == "on_load",
                            warpgroups=plan.prep_warpgroups)
      t, X, M = out if inverse else (out, None, None)
      # the delta kernels' last-chunk term of dg reads the state entering the last chunk in float32
      o, states, final = _walk(static, t, h0, with_states=saves, with_last_start=inverse)
      if not saves:
        saved = None
      elif inverse:
        states, transitions, last_start = states
        saved = channel_delta_grads.Saved(t, X, states, transitions, G=cumsum[0], refs=cumsum[1], M=M,
                                          last_start=last_start)
      else:
        saved = channel_grads.Saved(*states, qg=t.qg, decay=t.decay, G=cumsum[0], refs=cumsum[1])
    case other:
      raise ValueError(f"no forward stage {other!r}")
  return (o[:, :T], final), saved


def _backward(static: Static, q, k, v, g, beta, h0, segment_ids, saved, do, dfinal, gate_arrays=None):
  """`(dq, dk, dv, dg, dbeta, dh0 float32)` of the scaled o's cotangent `do` and the final state's; with a
  gate (`static.gate`; g its pre-activation) dg is `(df, dA_log, ddt_bias)`."""
  plan = static.plan
  gate = _gate(static, gate_arrays)
  kw = dict(chunk_size=static.chunk_size, dtype=static.compute_dtype, segment_ids=segment_ids,
            interpret=static.options.interpret if plan.backward != "xla_vjp" else None)

  def per_head():
    if gate is None:
      return prepared.backward_per_head(static, q, k, v, g, beta, h0, segment_ids, do, dfinal)
    grads = prepared.backward_per_head(static, q, k, v, gate.values(g), beta, h0, segment_ids, do, dfinal)
    return grads[:3] + (gate.vjp(g, grads[3]),) + grads[4:]

  match plan.backward:
    case "xla_vjp":
      return prepared.backward(static, q, k, v, g, beta, h0, segment_ids, do, dfinal)
    case "fused":
      return fused.backward(q, k, v, g, h0, do, dfinal, **kw, sequence_pieces=_sequence_pieces(static),
                            scale=static.scale, states=saved)
    case "delta_grads":
      return delta_grads.backward(q, k, v, g, beta, h0, do, dfinal, **kw, scale=static.scale,
                                  sequence_pieces=_sequence_pieces(static), saved=saved,
                                  qk_l2norm=plan.l2 == "on_load", warpgroups=plan.grads_warpgroups,
                                  programs=plan.grads_programs)
    case "channel_grads":
      kernels = lambda grams: lambda: channel_grads.backward(
          q, k, v, g, h0, do, dfinal, **kw, sequence_pieces=_sequence_pieces(static), scale=static.scale,
          saved=saved, grams=grams, dg_cumsum=plan.dg_cumsum, cumsums=plan.cumsums)
    case "channel_delta_grads":
      kernels = lambda grams: lambda: channel_delta_grads.backward(
          q, k, v, g, beta, h0, do, dfinal, **kw, sequence_pieces=_sequence_pieces(static),
          scale=static.scale, saved=saved, grams=grams, unit_bound=plan.unit_bound,
          qk_l2norm=plan.l2 == "on_load", dg_cumsum=plan.dg_cumsum, key_warpgroups=plan.key_warpgroups,
          l2_grads=plan.l2_grads, cumsums=plan.cumsums, gate=gate)
    case other:
      raise ValueError(f"no backward stage {other!r}")
  # the kernels sum their gradients over the mesh axes their primals do not vary over, as the per-head
  # branch's already are (the types of a lax.cond's branches must match under shard_map)
  return _by_bound((saved.G, saved.refs), static.chunk_size, static.compute_dtype, kernels("one"),
                   kernels(plan.backward_beyond), per_head,
                   test=plan.call_test or plan.backward_beyond != "chunk")


def _sequence_pieces(static: Static):
  return static.plan.sequence_pieces


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunked(static: Static, q, k, v, g, beta, h0, segment_ids, gate_arrays=None):
  """The op: `(o [B, T, H_v, V] in static.out_dtype, scaled by static.scale, final [B, H_v, K, V])`.

  Shapes as in `prep.prepare`; `h0` None or `[B, H_v, K, V]` float32; `segment_ids` None or `[B, T]`;
  `gate_arrays` None or `(A_log [H_v], dt_bias [H_v * K])` of the gate `static.gate`, whose
  pre-activation g then is.
  """
  return _forward(static, q, k, v, g, beta, h0, segment_ids, gate_arrays, keep=False)[0]


def _chunked_fwd(static, *primals):
  # symbolic zeros: the backward learns which cotangents are zero by their type, not their values
  q, k, v, g, beta, h0, segment_ids, gate_arrays = jax.tree.map(
      lambda p: p.value, primals + (None,) * (8 - len(primals)), is_leaf=lambda p: isinstance(p, Primal))
  out, saved = _forward(static, q, k, v, g, beta, h0, segment_ids, gate_arrays, keep=True)
  return out, (q, k, v, g, beta, h0, segment_ids, gate_arrays, saved)


def _chunked_bwd(static, residuals, cotangents):
  q, k, v, g, beta, h0, segment_ids, gate_arrays, saved = residuals
  do, dfinal = cotangents
  # an unused final state (a model's training step) passes no cotangent: the backward then skips
  # everything that reads it (the reverse walk's entry, kda's last-chunk terms in float32)
  dfinal = None if isinstance(dfinal, SymbolicZero) else dfinal
  do = jnp.zeros(do.aval.shape, do.aval.dtype) if isinstance(do, SymbolicZero) else do
  dq, dk, dv, dg, dbeta, dh0 = _backward(static, q, k, v, g, beta, h0, segment_ids, saved, do, dfinal,
                                         gate_arrays)
  dgate = None
  if gate_arrays is not None:
    dg, dgate = dg[0], common.summed_like(dg[1:], gate_arrays)
  dq, dk, dv, dg, dbeta = common.summed_like((dq, dk, dv, dg, dbeta), (q, k, v, g, beta))
  return dq, dk, dv, dg, dbeta, (None if h0 is None else dh0.astype(h0.dtype)), None, dgate


chunked.defvjp(_chunked_fwd, _chunked_bwd, symbolic_zeros=True)


def chunked_op(static: Static, q, k, v, g, beta, *, scale: float, initial_state, segment_ids, gate=None):
  """`chunked` with the read-out scale: `(o [B, T, H_v, V] out_dtype, final [B, H_v, K, V] float32)`;
  `gate` None or a `Gate` whose pre-activation g is."""
  h0 = None if initial_state is None else jnp.asarray(initial_state, jnp.float32)
  static = dataclasses.replace(static, scale=float(scale), gate=None if gate is None else gate.kind)
  arrays = None if gate is None else (gate.A_log, gate.dt_bias)
  return chunked(static, q, k, v, g, beta, h0, segment_ids, arrays)
