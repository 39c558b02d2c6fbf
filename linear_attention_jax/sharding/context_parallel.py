"""Context parallelism: the sequence split across devices, exact for both families, forward and backward.

Cut T into P contiguous shards, one per device of the mesh axis `axis_name`. Given its inputs, each
shard's walk is affine in the state it starts from (both families are linear in S):

    S_out = M S_in + N                       M: [K, K] per (row, head);  N: [K, V]
    o_t   = o0_t + scale * (M_t^T q_t)^T S_in     M_t: the map from S_in to the state after token t

For the additive family M_t is the diagonal decay product Diag(exp(b_t)); for the delta family it is
the product of the transitions (I - beta_i k_i k_i^T) Diag(exp g_i), a full K x K matrix.

How a shard gets (M, N, o0, M_t^T q_t), exactly and with any implementation: every value column of the
state evolves on its own (column j of S only meets column j of v, in both families), so the shard runs
its op once on `[v, 0_K]` from the state `[0, I_K]`: K extra value columns that start as the identity
and receive no writes. Their state after token t is M_t I = M_t, so the op itself returns

    o[..., :V]  = o0 (the output from S_in = 0)       o[..., V:]  = scale * M_t^T q_t
    S[..., :V]  = N                                   S[..., V:]  = M

The cost is a walk with V + K value columns instead of V (1.5x the state work for Gated DeltaNet's
V = 2K, 2x for V = K; the intra-chunk work, which does not depend on V, is unchanged), and it needs
nothing from the op but its public signature: the chunked XLA form, the recurrence and the Pallas
kernels all serve unchanged. For the additive family the identity columns stay diagonal (exactly: their
writes are zero), so the same code covers both families. (The alternative, carrying the transition
through the chunk walk from its WY factors, M_chunk = Diag(e^G_C) - (K * e^(G_C - G))^T W in chunk.py's
notation, does about the same K x K work per chunk but needs the form's internals and a second path in
every kernel.)

The exchange: an all-gather of every shard's (M, N) over the axis, then each device walks the P
summaries from the initial state (P small matmuls, `S_in(p) = M_{p-1} S_in(p-1) + N_{p-1}`), picks its
own incoming state and fixes its outputs up: `o = o0 + (M_t^T q_t) S_in` (one [K] x [K, V] product per
token, the size of the chunked form's inter-chunk term). Every device ends with the final state.

Packed rows (`segment_ids`): the shard's op restarts the state where the id changes inside the shard
(its M is then zero for the part before the restart, and the tokens after it get no S_in); across a
shard boundary the incoming state is zeroed when the previous shard's last id differs from this shard's
first. `cu_seqlens` is not supported (turn it into segment_ids).

Gradients are JAX's autodiff through `shard_map` (the all-gather transposes to a reduce-scatter): exact,
and tested against the single-device op.

Precision: the op returns its outputs in v's dtype, so with bfloat16 values o0 and M_t^T q_t come back
rounded to bfloat16 (as any op output is); the exchange and the fix-up run in float32. The summary walk
is P sequential steps on every device, cheap for the 2-8 shards of one host or slice; many more shards
would want a parallel (associative) scan of the (M, N) pairs instead. Under a head_v split too, each
device walks its own K identity columns: M is computed once per value shard.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_attention_jax import ops

_HI = jax.lax.Precision.HIGHEST


def shard_summaries(op, q, k, v, gates, *, extra_ones: int, segment_ids=None, **kwargs):
  """Runs `op` on one shard from S_in = 0 and from the identity basis at once (the true incoming
  state enters later, through the exchange).

  `extra_ones`: value columns of ones appended to v before the identity columns (1 for normalised
  linear attention, whose normaliser z rides as such a column; `op` then runs with normalize=False).
  Returns `(o0 [B, T, H_v, V'] float32, qm [B, T, H_v, K] float32 = scale * M_t^T q_t,
  N [B, H_v, K, V'], M [B, H_v, K, K])` with `V' = V + extra_ones`.
  """
  B, T, Hv, V = v.shape
  K = q.shape[-1]
  cols = [v]
  if extra_ones:
    cols.append(jnp.ones((B, T, Hv, extra_ones), v.dtype))
  cols.append(jnp.zeros((B, T, Hv, K), v.dtype))
  Vx = V + extra_ones
  eye = jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (B, Hv, K, K))
  h0 = jnp.concatenate([jnp.zeros((B, Hv, K, Vx), jnp.float32), eye], axis=-1)
  o, state = op(q, k, jnp.concatenate(cols, axis=-1), *gates, initial_state=h0,
                output_final_state=True, segment_ids=segment_ids, **kwargs)
  o = o.astype(jnp.float32)
  return o[..., :Vx], o[..., Vx:], state[..., :Vx], state[..., Vx:]


def incoming_states(M, N, initial_state, axis_name, *, segment_ids=None):
  """The state entering this device's shard, and the final state after the last shard.

  `M: [B, H_v, K, K]`, `N: [B, H_v, K, V]` this shard's summary; `initial_state: [B, H_v, K, V]`
  float32 or None (zeros). Gathers every shard's summary over `axis_name` and walks them in order.
  """
  P = jax.lax.axis_size(axis_name)
  index = jax.lax.axis_index(axis_name)
  Ms = jax.lax.all_gather(M, axis_name)  # [P, B, H_v, K, K]
  Ns = jax.lax.all_gather(N, axis_name)
  cont = None
  if segment_ids is not None:  # the state crosses a boundary only inside one segment
    firsts = jax.lax.all_gather(segment_ids[:, 0], axis_name)  # [P, B]
    lasts = jax.lax.all_gather(segment_ids[:, -1], axis_name)
    cont = firsts[1:] == lasts[:-1]  # [P - 1, B]: shard p + 1 continues shard p's last segment
  S = jnp.zeros_like(N) if initial_state is None else initial_state.astype(jnp.float32)
  entering = []
  for p in range(P):
    if p > 0 and cont is not None:
      S = jnp.where(cont[p - 1][:, None, None, None], S, 0.0)
    entering.append(S)
    S = jnp.einsum("bhij,bhjv->bhiv", Ms[p], S, precision=_HI) + Ns[p]
  return jnp.stack(entering)[index], S


def shard_forward(op, q, k, v, *gates, axis_name, initial_state=None, output_final_state=False,
                  segment_ids=None, **kwargs):
  """One device's part of a context-parallel call, inside `shard_map` over `axis_name`.

  `op` is one of the seven variant functions; the arguments are its own, for this device's tokens
  (`T / P` of them). Returns `(o [B, T / P, H_v, V] in v's dtype, final_state or None)`, the final
  state (after the last shard) the same on every device.
  """
  if kwargs.get("cu_seqlens") is not None:
    raise ValueError("context parallelism does not take cu_seqlens; pass segment_ids instead")
  normalize, eps = False, None
  if op is ops.linear_attention:  # divide after the fix-up: the normaliser is affine in S_in too
    normalize, eps = kwargs.pop("normalize", True), kwargs.pop("eps", 1e-6)
    kwargs["normalize"] = False
  o0, qm, N, M = shard_summaries(op, q, k, v, gates, extra_ones=int(normalize),
                                 segment_ids=segment_ids, **kwargs)
  S_in, final = incoming_states(M, N, initial_state, axis_name, segment_ids=segment_ids)
  o = o0 + jnp.einsum("bthk,bhkv->bthv", qm, S_in)
  if normalize:
    o = o[..., :-1] / (o[..., -1:] + eps)
  return o.astype(v.dtype), (final if output_final_state else None)
