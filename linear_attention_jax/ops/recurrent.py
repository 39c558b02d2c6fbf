"""The reference: one token at a time, float32, an explicit `lax.scan` over T.

Both families share one update (shared/DESIGN.md, "The math"):

    additive:  S_t = Diag(exp g_t) S_{t-1} + k_t v_t^T
    delta:     S'_t = Diag(exp g_t) S_{t-1};  S_t = S'_t + beta_t k_t (v_t - S'_t^T k_t)^T
    both:      o_t = scale * S_t^T q_t

`step_update` is that update for one token; the decoding step functions and the scan below both call it,
so the decode path and the reference cannot drift apart.

Shapes (heads already expanded to `H = H_v`): `q, k: [B, T, H, K]`, `v: [B, T, H, V]`, `g: None` (no
decay), `[B, T, H]` (scalar) or `[B, T, H, K]` (per channel), `beta: None` (additive) or `[B, T, H]`
(delta), state `[B, H, K, V]` float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_attention_jax.ops.packing import Packing

_HI = jax.lax.Precision.HIGHEST


def step_update(state, q, k, v, g, beta, scale):
  """One token of either family.

  Args:
    state: `[B, H, K, V]` float32, the state before this token.
    q, k: `[B, H, K]` float32.  v: `[B, H, V]` float32.
    g: None, `[B, H]` or `[B, H, K]` log-decay applied to the state before the write.
    beta: None for the additive family, `[B, H]` for the delta family.
    scale: python float multiplying the read-out.

  Returns:
    `(o [B, H, V] float32, new_state [B, H, K, V] float32)`.
  """
  if g is not None:
    decay = jnp.exp(g)
    state = state * (decay[..., None, None] if g.ndim == state.ndim - 2 else decay[..., None])
  if beta is None:
    write = v
  else:
    prediction = jnp.einsum("bhkv,bhk->bhv", state, k, precision=_HI)
    write = beta[..., None] * (v - prediction)
  state = state + k[..., :, None] * write[..., None, :]
  o = scale * jnp.einsum("bhkv,bhk->bhv", state, q, precision=_HI)
  return o, state


def recurrent_form(q, k, v, g, beta, *, scale, initial_state, packing: Packing):
  """Runs `step_update` over every token with `lax.scan`.

  `packing` says where the state restarts: for `segment_ids` it restarts from zero wherever the segment
  changes (the row's first segment starts from `initial_state`); for `cu_seqlens` (B == 1) sequence n
  starts from `initial_state[n]` and its final state is recorded after its last token.

  Returns `(o [B, T, H, V] float32, final_state)`, where `final_state` is `[B, H, K, V]`, or
  `[N, H, K, V]` for `cu_seqlens`.
  """
  B, T, H, K = k.shape
  V = v.shape[-1]
  if packing.kind == "cu_seqlens":
    N = packing.num_sequences
    table = jnp.zeros((N, H, K, V), jnp.float32) if initial_state is None else initial_state
    state0 = jnp.zeros((B, H, K, V), jnp.float32)
    carry0 = (state0, table)
  else:
    state0 = jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None else initial_state
    carry0 = (state0, None)

  def body(carry, xs):
    state, finals = carry
    q_t, k_t, v_t, g_t, b_t, restart_t, seq_t, last_t = xs
    if packing.kind == "cu_seqlens":
      start = finals_init_lookup(table, seq_t)  # [1, H, K, V]
      state = jnp.where(restart_t[:, None, None, None], start, state)
    elif packing.kind == "segments":
      state = jnp.where(restart_t[:, None, None, None], 0.0, state)
    o_t, state = step_update(state, q_t, k_t, v_t, g_t, b_t, scale)
    if packing.kind == "cu_seqlens":
      idx = jnp.clip(seq_t[0], 0, finals.shape[0] - 1)
      keep = jax.lax.dynamic_index_in_dim(finals, idx, keepdims=False)
      new = jnp.where(last_t[0], state[0], keep)
      finals = jax.lax.dynamic_update_index_in_dim(finals, new, idx, 0)
    return (state, finals), o_t

  time_major = lambda x: None if x is None else jnp.moveaxis(x, 1, 0)
  restart, seq, last = packing.per_token(B, T)
  xs = (time_major(q), time_major(k), time_major(v), time_major(g), time_major(beta),
        time_major(restart), time_major(seq), time_major(last))
  (state, finals), o = jax.lax.scan(body, carry0, xs)
  o = jnp.moveaxis(o, 0, 1)
  return o, (finals if packing.kind == "cu_seqlens" else state)


def finals_init_lookup(table, seq_t):
  """The starting state of the sequence `seq_t` (`[1]` int) from `table` (`[N, H, K, V]`)."""
  idx = jnp.clip(seq_t[0], 0, table.shape[0] - 1)
  return jax.lax.dynamic_index_in_dim(table, idx, keepdims=True)
