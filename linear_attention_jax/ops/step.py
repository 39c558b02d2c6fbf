"""One-token steps for decoding: `(o_t, state) = <variant>_step(q_t, k_t, v_t, [gates], state)`.

Shapes: `q, k: [B, H, K]`, `v: [B, H_v, V]`, scalar gates and beta `[B, H_v]`, per-channel gates
`[B, H_v, K]`, `state: [B, H_v, K, V]` float32 (None: zeros). `o_t: [B, H_v, V]` in v's dtype. Each step
runs `recurrent.step_update`, the very update the reference scan uses, so T calls of a step equal one
recurrent call.

A step takes its op's options: `scale`, the variant's own (`use_qk_l2norm`, `feature_map`, `gamma`),
`initial_state=` as another name for `state` (the op's spelling; give one of the two), and `impl`:
"auto", "recurrent" and "chunk" all run the one update (a chunk of one token is the recurrence);
"pallas" raises, since no kernel serves a single token.
"""

from __future__ import annotations

import jax.numpy as jnp

from linear_attention_jax.ops import checks
from linear_attention_jax.ops.feature_maps import l2_normalize, resolve_feature_map
from linear_attention_jax.ops.recurrent import step_update
from linear_attention_jax.ops.variants import _expand_heads, retention_log_gamma
from linear_attention_jax.pallas_kernels import gate as kernel_gate


def _state_and_impl(state, initial_state, impl):
  """The state a step starts from (`state` or the op's spelling `initial_state`), after checking impl."""
  checks.check_options(impl=impl, chunk_size=1, scale=None)
  if impl == "pallas":
    raise ValueError("impl='pallas' cannot serve a one-token step: no kernel runs a single token; the "
                     "step is the recurrent update (impl='auto', 'recurrent' or 'chunk')")
  if state is not None and initial_state is not None:
    raise ValueError("give the step's state as state= or initial_state=, not both")
  return initial_state if state is None else state


def _step(q, k, v, g, beta, state, *, scale, gated=False, delta=False, per_channel=False, qk_map=None,
          v_extra=0):
  checks.check_step_ranks(q=q, k=k, v=v)
  B, _, H, K, Hv, V = checks.check_qkv(q[:, None], k[:, None], v[:, None])
  if gated:
    checks.check_gate("g", g, B, None, Hv, K, per_channel=per_channel)
  if delta:
    checks.check_gate("beta", beta, B, None, Hv, K, per_channel=False)
  checks.check_initial_state(state, B, Hv, K, V, v_extra=v_extra, rows_name="B", name="state")
  checks.check_options(impl="auto", chunk_size=1, scale=scale)
  scale = K ** -0.5 if scale is None else scale
  q32, k32 = q.astype(jnp.float32)[:, None], k.astype(jnp.float32)[:, None]
  if qk_map is not None:
    q32, k32 = qk_map(q32), qk_map(k32)
  q32, k32 = _expand_heads(q32, Hv)[:, 0], _expand_heads(k32, Hv)[:, 0]
  v32 = v.astype(jnp.float32)
  if v_extra:
    v32 = jnp.concatenate([v32, jnp.ones(v32.shape[:-1] + (v_extra,), jnp.float32)], axis=-1)
  state = (jnp.zeros((B, Hv, K, V + v_extra), jnp.float32) if state is None
           else jnp.asarray(state, jnp.float32))
  f32 = lambda x: None if x is None else x.astype(jnp.float32)
  return step_update(state, q32, k32, v32, f32(g), f32(beta), scale)


def linear_attention_step(q, k, v, state=None, *, feature_map="elu_plus_one", normalize=True,
                          eps=1e-6, scale=None, impl="auto", initial_state=None):
  """One token of `linear_attention`; with `normalize` the state is `[B, H_v, K, V + 1]`."""
  state = _state_and_impl(state, initial_state, impl)
  o, state = _step(q, k, v, None, None, state, scale=scale, qk_map=resolve_feature_map(feature_map),
                   v_extra=int(normalize))
  if normalize:
    o = o[..., :-1] / (o[..., -1:] + eps)
  return o.astype(v.dtype), state


def retention_step(q, k, v, state=None, *, gamma=None, scale=None, impl="auto", initial_state=None):
  """One token of `retention`; gamma (None, a float or `[H_v]`) as in the op."""
  state = _state_and_impl(state, initial_state, impl)
  checks.check_step_ranks(q=q, k=k, v=v)
  g = jnp.broadcast_to(retention_log_gamma(gamma, v.shape[1]), v.shape[:2])
  o, state = _step(q, k, v, g, None, state, scale=scale, gated=True)
  return o.astype(v.dtype), state


def simple_gla_step(q, k, v, g, state=None, *, scale=None, impl="auto", initial_state=None):
  """One token of `simple_gla`; `g: [B, H_v]`."""
  state = _state_and_impl(state, initial_state, impl)
  o, state = _step(q, k, v, g, None, state, scale=scale, gated=True)
  return o.astype(v.dtype), state


def gla_step(q, k, v, g, state=None, *, scale=None, impl="auto", initial_state=None):
  """One token of `gla`; `g: [B, H_v, K]`."""
  state = _state_and_impl(state, initial_state, impl)
  o, state = _step(q, k, v, g, None, state, scale=scale, gated=True, per_channel=True)
  return o.astype(v.dtype), state


def delta_rule_step(q, k, v, beta, state=None, *, scale=None, use_qk_l2norm=False,
                    impl="auto", initial_state=None):
  """One token of `delta_rule`; `beta: [B, H_v]`."""
  state = _state_and_impl(state, initial_state, impl)
  o, state = _step(q, k, v, None, beta, state, scale=scale, delta=True,
                   qk_map=l2_normalize if use_qk_l2norm else None)
  return o.astype(v.dtype), state


def gated_delta_rule_step(q, k, v, g, beta, state=None, *, scale=None, use_qk_l2norm=False,
                          impl="auto", initial_state=None):
  """One token of `gated_delta_rule`; `g, beta: [B, H_v]`."""
  state = _state_and_impl(state, initial_state, impl)
  o, state = _step(q, k, v, g, beta, state, scale=scale, gated=True, delta=True,
                   qk_map=l2_normalize if use_qk_l2norm else None)
  return o.astype(v.dtype), state


def kda_step(q, k, v, g, beta, state=None, *, scale=None, use_qk_l2norm=False,
             impl="auto", initial_state=None, A_log=None, dt_bias=None, gate_lower_bound=None):
  """One token of `kda`; `g: [B, H_v, K]`, `beta: [B, H_v]`. With `A_log`, `dt_bias` (and
  `gate_lower_bound`), g is the gate's pre-activation, as in `kda`."""
  state = _state_and_impl(state, initial_state, impl)
  gate = kernel_gate.from_args(A_log, dt_bias, gate_lower_bound)
  if gate is not None:
    _, _, _, K, Hv, _ = checks.check_qkv(q[:, None], k[:, None], v[:, None])
    kind = kernel_gate.check(g[:, None], gate.A_log, gate.dt_bias, gate.kind, Hv, K)
    g = kernel_gate.values(g[:, None], gate.A_log, gate.dt_bias, kind)[:, 0]
  o, state = _step(q, k, v, g, beta, state, scale=scale, gated=True, delta=True, per_channel=True,
                   qk_map=l2_normalize if use_qk_l2norm else None)
  return o.astype(v.dtype), state
