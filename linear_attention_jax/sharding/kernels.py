"""The ops under `jax.shard_map`: each device runs the unchanged single-device op on its block.

A `pallas_call` cannot be partitioned by XLA, and the chunked form's sequential walk partitions badly,
so a sharded call gives each device its block (rows, heads, value columns, tokens) and runs the
single-device op on it:

    q, k        [B, T, H, K]      P(batch, seq, heads, None)
    v, o        [B, T, H_v, V]    P(batch, seq, heads, head_v)
    gates, beta [B, T, H_v(, K)]  P(batch, seq, heads(, None))
    state       [B, H_v, K, V]    P(batch, heads, None, head_v)
    segment_ids [B, T]            P(batch, seq)

with the mesh axes the rules give those logical axes. Heads split into contiguous blocks, so with
grouped value heads q/k head block i serves value head block i (H and H_v both divisible by the axis
size). K is never split. V splits with no communication (each value column evolves on its own). With a
"seq" rule the call is context parallel (`context_parallel.shard_forward`). The op chooses its
implementation per shard (`impl="auto"` sees the shard's shapes).

    sharded = shard_op(ops.gated_delta_rule, mesh, "tp+cp")
    o, final = sharded(q, k, v, g, beta, output_final_state=True)     # the op's own signature

Layers do this themselves while `rules.use_rules(mesh, rules)` is active (`for_current_rules`; the
training path, without a cache). In a sharded LM step only the recurrence is manual: projections, short
convolutions, softmax attention and norms are partitioned by XLA from the step's in/out shardings
(correct by construction; under "cp" XLA moves the convolution windows and attention's keys across
shards as it sees fit, untuned).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from linear_attention_jax import ops
from linear_attention_jax.ops.variants import retention_log_gamma
from linear_attention_jax.sharding import context_parallel
from linear_attention_jax.sharding.rules import axis_size, current_rules, rule_set, to_spec


def op_axes(mesh, rules) -> tuple:
  """`(batch, seq, heads, head_v)` mesh axes (PartitionSpec entries) of a sharded op call."""
  return tuple(to_spec(("batch", "seq", "heads", "head_v"), rules, mesh))


def shard_op(op, mesh, rules="dp", *, check_vma: bool = False):
  """`op` (one of the seven variant functions) run under `shard_map` on `mesh` as `rules` say.

  Returns a function with the op's signature and results (`q, k: [B, T, H, K]`, `v: [B, T, H_v, V]`,
  state `[B, H_v, K, V]`: B over the batch axes, T over the sequence axes, H / H_v over the head axes,
  V over `state_v`). Raises `ValueError` naming the size that the
  mesh axes do not divide (B, T, H, H_v or V), and for `cu_seqlens` with a sharded batch or sequence.
  `retention` runs as `simple_gla` with its (per-head, hence sharded) log-gamma as the gate. Any other
  function with the variants' signature and results runs the same way (the tests shard a backend's
  kernel entry itself, kernel options and all, through an adapter: tests/sharding/util.py).

  `check_vma`: `jax.shard_map`'s check that every value says which mesh axes it varies over (the
  kernels declare theirs; their tests turn it on). Not with a "seq" rule: a context-parallel final
  state is computed alike on every sequence shard, which the check cannot see.
  """
  table = rule_set(rules)

  @functools.wraps(op)
  def sharded(q, k, v, *gates, initial_state=None, output_final_state=False, segment_ids=None,
              cu_seqlens=None, **kwargs):
    b, s, h, vx = op_axes(mesh, table)
    B, T, H, K = q.shape
    _, _, Hv, V = v.shape
    if cu_seqlens is not None and (axis_size(mesh, s) > 1 or axis_size(mesh, b) > 1):
      raise ValueError("cu_seqlens packs sequences along T of one row: it cannot be split over the "
                       f"batch or sequence axes ({b!r}, {s!r}); pass segment_ids instead")
    for name, size, entry, logical in (("B", B, b, "batch"), ("T", T, s, "seq"), ("H", H, h, "heads"),
                                       ("H_v", Hv, h, "heads"), ("V", V, vx, "head_v")):
      n = axis_size(mesh, entry)
      if size % n:
        raise ValueError(f"{name}={size} is not divisible by {n}, the size of mesh axes {entry!r} "
                         f"that the rules give {logical!r}")
    normalize = op is ops.linear_attention and kwargs.get("normalize", True)
    if normalize and axis_size(mesh, vx) > 1 and (initial_state is not None or output_final_state):
      raise ValueError("normalised linear attention keeps its normaliser as state column V + 1, which "
                       "a head_v split cannot hold: no initial_state or output_final_state with it")
    local_op = op
    if op is ops.retention:
      gates = (jnp.broadcast_to(retention_log_gamma(kwargs.pop("gamma", None), Hv), (B, T, Hv)),)
      local_op = ops.simple_gla
    rows = None if cu_seqlens is not None else b
    gate_spec = lambda x: P(b, s, h) if x.ndim == 3 else P(b, s, h, None)
    state_spec = P(rows, h, None, vx)
    # kda's gate arrays (`ops.kda(..., A_log=[H_v], dt_bias=[H_v K])`): one row a value head, split as the
    # heads are (dt_bias's channels head after head)
    per_head = {n: kwargs.pop(n) for n in ("A_log", "dt_bias") if kwargs.get(n) is not None}
    args = (q, k, v, *gates, initial_state, segment_ids, cu_seqlens, *per_head.values())
    in_specs = (P(b, s, h, None), P(b, s, h, None), P(b, s, h, vx), *map(gate_spec, gates),
                None if initial_state is None else state_spec,
                None if segment_ids is None else P(b, s), None if cu_seqlens is None else P(),
                *(P(h) for _ in per_head))
    seq_axis = s if axis_size(mesh, s) > 1 else None
    if check_vma and seq_axis is not None:
      raise ValueError(f"check_vma=True cannot serve a context-parallel call (sequence over {s!r}): "
                       "its final state is replicated over that axis by construction, unseen by the check")

    def body(q, k, v, *rest):
      rest, local = rest[:len(rest) - len(per_head)], rest[len(rest) - len(per_head):]
      *gates, h0, seg, cu = rest
      options = dict(kwargs, **dict(zip(per_head, local)))
      if seq_axis is not None:
        return context_parallel.shard_forward(
            local_op, q, k, v, *gates, axis_name=seq_axis, initial_state=h0,
            output_final_state=output_final_state, segment_ids=seg, **options)
      return local_op(q, k, v, *gates, initial_state=h0, output_final_state=output_final_state,
                      segment_ids=seg, cu_seqlens=cu, **options)

    out_specs = (P(b, s, h, vx), state_spec if output_final_state else None)
    # check_vma=False by default: the final state of a context-parallel call is computed identically
    # on every sequence shard from all-gathered summaries; gradients are JAX's transposes either way
    # (tested).
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=check_vma)(*args)

  return sharded


def for_current_rules(op):
  """`op` itself, or under `rules.use_rules(mesh, rules)` the op sharded by them (`shard_op`)."""
  current = current_rules()
  if current is None:
    return op
  mesh, table = current
  return shard_op(op, mesh, table)
