"""Bad input to the public ops raises `ValueError` naming the offending argument (ops/checks.py)."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention_jax import ops

B, T, H, HV, K, V = 1, 8, 1, 2, 4, 4


def _x(*shape, dtype=np.float32):
  return np.ones(shape, dtype)


def _qkv(b=B, t=T, h=H, hv=HV, kk=K, vv=V):
  return _x(b, t, h, kk), _x(b, t, h, kk), _x(b, t, hv, vv)


def _g(b=B, t=T, hv=HV):
  return -0.1 * _x(b, t, hv)


def _beta(b=B, t=T, hv=HV):
  return 0.5 * _x(b, t, hv)


def _kda(**kw):
  """`ops.kda` on valid tiny inputs, any of which `kw` replaces."""
  q, k, v = _qkv()
  args = dict(q=q, k=k, v=v, g=-0.1 * _x(B, T, HV, K), beta=_beta())
  args.update(kw)
  return ops.kda(**args)


# Variant -> valid positional arguments after q, k, v.
GATES = {
    "linear_attention": lambda: (),
    "retention": lambda: (),
    "simple_gla": lambda: (_g(),),
    "gla": lambda: (-0.1 * _x(B, T, HV, K),),
    "delta_rule": lambda: (_beta(),),
    "gated_delta_rule": lambda: (_g(), _beta()),
    "kda": lambda: (-0.1 * _x(B, T, HV, K), _beta()),
}


def _call(variant, q=None, k=None, v=None, **kw):
  dq, dk, dv = _qkv()
  q, k, v = (dq if q is None else q), (dk if k is None else k), (dv if v is None else v)
  return getattr(ops, variant)(q, k, v, *GATES[variant](), **kw)


# q, k, v.

def test_q_wrong_rank():
  with pytest.raises(ValueError, match=r"^q must have shape \[B, T, H, K\] \(rank 4\); "
                     r"got shape \(1, 8, 4\)"):
    _kda(q=_x(B, T, K))


def test_k_wrong_rank():
  with pytest.raises(ValueError, match=r"^k must have shape \[B, T, H, K\] \(rank 4\)"):
    _kda(k=_x(B, T, H, K, 1))


def test_v_wrong_rank():
  with pytest.raises(ValueError, match=r"^v must have shape \[B, T, H_v, V\] \(rank 4\)"):
    _kda(v=_x(B, T, HV * V))


@pytest.mark.parametrize("variant", ops.VARIANTS)
def test_every_variant_checks_q_rank(variant):
  with pytest.raises(ValueError, match=r"^q must have shape \[B, T, H, K\]"):
    _call(variant, q=_x(T, H, K))


def test_v_batch_differs_from_q():
  q, k, _ = _qkv(b=2)
  with pytest.raises(ValueError, match=r"^v must have shape \[B, T, H_v, V\] with B=2, T=8 as in q; "
                     r"got \(1, 8, 2, 4\)"):
    ops.simple_gla(q, k, _x(1, T, HV, V), _g(b=2))


def test_v_time_differs_from_q():
  with pytest.raises(ValueError, match=r"^v must have shape \[B, T, H_v, V\] with B=1, T=8"):
    _kda(v=_x(B, T - 1, HV, V))


def test_k_time_differs_from_q():
  with pytest.raises(ValueError, match=r"^k must have the shape of q \[B, T, H, K\]"):
    _kda(k=_x(B, T - 1, H, K))


def test_k_head_dim_differs_from_q():
  with pytest.raises(ValueError, match=r"^k must have the shape of q \[B, T, H, K\] = \(1, 8, 1, 4\); "
                     r"got \(1, 8, 1, 3\)"):
    _kda(k=_x(B, T, H, K - 1))


def test_v_heads_not_a_multiple_of_q_heads():
  q, k, v = _qkv(h=2, hv=3)
  with pytest.raises(ValueError, match=r"^v's heads H_v=3 must be a multiple of q's heads H=2"):
    ops.delta_rule(q, k, v, _beta(hv=3))


def test_q_with_zero_heads():
  q, k, v = _qkv(h=0)
  with pytest.raises(ValueError, match=r"^q, k, v need H, K, V >= 1"):
    ops.simple_gla(q, k, v, _g())


def test_integer_q():
  with pytest.raises(ValueError, match=r"^q must be a floating-point array; got dtype int32"):
    _kda(q=np.ones((B, T, H, K), np.int32))


def test_integer_v():
  with pytest.raises(ValueError, match=r"^v must be a floating-point array"):
    _kda(v=np.ones((B, T, HV, V), np.int32))


# Gates and beta.

def test_simple_gla_given_per_channel_g():
  with pytest.raises(ValueError, match=r"^g must have shape \[B, T, H_v\] = \(1, 8, 2\); "
                     r"got \(1, 8, 2, 4\)"):
    ops.simple_gla(*_qkv(), -0.1 * _x(B, T, HV, K))


def test_gated_delta_rule_given_per_channel_g():
  with pytest.raises(ValueError, match=r"^g must have shape \[B, T, H_v\]"):
    ops.gated_delta_rule(*_qkv(), -0.1 * _x(B, T, HV, K), _beta())


def test_gla_given_scalar_g():
  with pytest.raises(ValueError, match=r"^g must have shape \[B, T, H_v, K\] = \(1, 8, 2, 4\); "
                     r"got \(1, 8, 2\)"):
    ops.gla(*_qkv(), _g())


def test_kda_given_scalar_g():
  with pytest.raises(ValueError, match=r"^g must have shape \[B, T, H_v, K\]"):
    _kda(g=_g())


def test_g_with_q_heads_instead_of_v_heads():
  with pytest.raises(ValueError, match=r"^g must have shape \[B, T, H_v\] = \(1, 8, 2\); "
                     r"got \(1, 8, 1\)"):
    ops.simple_gla(*_qkv(), _g(hv=H))


def test_g_missing():
  with pytest.raises(ValueError, match=r"^g is required, with shape \[B, T, H_v\]"):
    ops.simple_gla(*_qkv(), None)


def test_beta_missing():
  with pytest.raises(ValueError, match=r"^beta is required, with shape \[B, T, H_v\]"):
    ops.delta_rule(*_qkv(), None)


def test_integer_g():
  with pytest.raises(ValueError, match=r"^g must be a floating-point array; got dtype int32"):
    ops.simple_gla(*_qkv(), np.zeros((B, T, HV), np.int32))


def test_kda_beta_per_channel():
  with pytest.raises(ValueError, match=r"^beta must have shape \[B, T, H_v\] = \(1, 8, 2\); "
                     r"got \(1, 8, 2, 4\)"):
    _kda(beta=_x(B, T, HV, K))


def test_delta_rule_beta_wrong_time():
  with pytest.raises(ValueError, match=r"^beta must have shape \[B, T, H_v\]"):
    ops.delta_rule(*_qkv(), _beta(t=T + 1))


def test_integer_beta():
  with pytest.raises(ValueError, match=r"^beta must be a floating-point array"):
    _kda(beta=np.ones((B, T, HV), np.int32))


# Packed sequences.

def test_cu_seqlens_with_batch_two():
  q, k, v = _qkv(b=2)
  with pytest.raises(ValueError, match=r"^cu_seqlens needs B == 1 .*; got B=2"):
    ops.delta_rule(q, k, v, _beta(b=2), cu_seqlens=np.array([0, 3, 8], np.int32))


def test_cu_seqlens_decreasing():
  with pytest.raises(ValueError, match=r"^cu_seqlens must be non-decreasing; got \[0, 5, 3, 8\]"):
    _kda(cu_seqlens=np.array([0, 5, 3, 8], np.int32))


def test_cu_seqlens_not_ending_at_t():
  with pytest.raises(ValueError, match=r"^cu_seqlens must start at 0 and end at T=8; got \[0, 3, 7\]"):
    _kda(cu_seqlens=np.array([0, 3, 7], np.int32))


def test_cu_seqlens_not_starting_at_zero():
  with pytest.raises(ValueError, match=r"^cu_seqlens must start at 0 .*; got \[1, 3, 8\]"):
    _kda(cu_seqlens=np.array([1, 3, 8], np.int32))


def test_cu_seqlens_not_1d():
  with pytest.raises(ValueError, match=r"^cu_seqlens must have shape \[N \+ 1\] with N >= 1; "
                     r"got \(1, 3\)"):
    _kda(cu_seqlens=np.array([[0, 3, 8]], np.int32))


def test_cu_seqlens_without_a_sequence():
  with pytest.raises(ValueError, match=r"^cu_seqlens must have shape \[N \+ 1\] with N >= 1; "
                     r"got \(1,\)"):
    _kda(cu_seqlens=np.array([0], np.int32))


def test_float_cu_seqlens():
  with pytest.raises(ValueError, match=r"^cu_seqlens must be integer; got dtype float32"):
    _kda(cu_seqlens=np.array([0.0, 3.0, 8.0], np.float32))


def test_segment_ids_wrong_shape():
  with pytest.raises(ValueError, match=r"^segment_ids must have shape \[B, T\] = \(1, 8\); "
                     r"got \(8,\)"):
    _kda(segment_ids=np.zeros((T,), np.int32))


def test_float_segment_ids():
  with pytest.raises(ValueError, match=r"^segment_ids must be integer; got dtype float32"):
    _kda(segment_ids=np.zeros((B, T), np.float32))


def test_segment_ids_and_cu_seqlens_together():
  with pytest.raises(ValueError, match=r"at most one of segment_ids and cu_seqlens"):
    _kda(segment_ids=np.zeros((B, T), np.int32), cu_seqlens=np.array([0, 8], np.int32))


# Initial state.

def test_initial_state_wrong_shape():
  with pytest.raises(ValueError, match=r"^initial_state must have shape \[B, H_v, K, V\] = \(1, 2, 4, 4\); "
                     r"got \(1, 1, 4, 4\)"):
    _kda(initial_state=_x(B, H, K, V))


def test_initial_state_with_cu_seqlens_needs_n_rows():
  with pytest.raises(ValueError, match=r"^initial_state must have shape \[N, H_v, K, V\] = \(2, 2, 4, 4\); "
                     r"got \(1, 2, 4, 4\)"):
    _kda(cu_seqlens=np.array([0, 3, 8], np.int32), initial_state=_x(B, HV, K, V))


def test_linear_attention_normalized_state_has_v_plus_one_columns():
  with pytest.raises(ValueError, match=r"^initial_state must have shape \[B, H_v, K, V \+ 1\] = "
                     r"\(1, 2, 4, 5\); got \(1, 2, 4, 4\)"):
    ops.linear_attention(*_qkv(), normalize=True, initial_state=_x(B, HV, K, V))


def test_linear_attention_unnormalized_state_has_v_columns():
  with pytest.raises(ValueError, match=r"^initial_state must have shape \[B, H_v, K, V\] = "
                     r"\(1, 2, 4, 4\)"):
    ops.linear_attention(*_qkv(), normalize=False, initial_state=_x(B, HV, K, V + 1))


def test_integer_initial_state():
  with pytest.raises(ValueError, match=r"^initial_state must be floating-point"):
    _kda(initial_state=np.zeros((B, HV, K, V), np.int32))


# Options.

@pytest.mark.parametrize("chunk_size", [0, 48, -4, 2.0, True], ids=["0", "48", "-4", "2.0", "True"])
def test_bad_chunk_size(chunk_size):
  with pytest.raises(ValueError, match=r"^chunk_size must be a positive power of two; got "
                     + re.escape(repr(chunk_size))):
    _kda(chunk_size=chunk_size)


def test_unknown_impl():
  with pytest.raises(ValueError, match=r"^impl must be one of \('auto', 'recurrent', 'chunk', "
                     r"'pallas'\); got 'triton'"):
    _kda(impl="triton")


@pytest.mark.parametrize("variant", ops.VARIANTS)
def test_pallas_impl_says_why(variant):
  with pytest.raises(ValueError, match=rf"^impl='pallas' cannot serve {variant}: no Pallas kernel .*"
                     r"use impl='chunk' or impl='auto'"):
    _call(variant, impl="pallas")


def test_unknown_feature_map():
  with pytest.raises(ValueError, match=r"^feature_map must be a callable or one of .*; got 'softmax'"):
    ops.linear_attention(*_qkv(), feature_map="softmax")


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), "big"],
                         ids=["zero", "negative", "nan", "str"])
def test_bad_scale(scale):
  with pytest.raises(ValueError, match=r"^scale must be a positive number or None"):
    _kda(scale=scale)


def test_negative_scale_as_jax_array():
  with pytest.raises(ValueError, match=r"^scale must be a positive number or None"):
    _kda(scale=jnp.float32(-0.5))


def test_scale_with_a_shape():
  with pytest.raises(ValueError, match=r"^scale must be a positive number or None"):
    _kda(scale=np.full((HV,), 0.5, np.float32))


# Retention's gamma.

def test_retention_gamma_wrong_shape():
  with pytest.raises(ValueError, match=r"^gamma must be a float or have shape \[H_v\] = \(2,\); "
                     r"got \(3,\)"):
    ops.retention(*_qkv(), gamma=np.full((3,), 0.9, np.float32))


@pytest.mark.parametrize("gamma", [0.0, 1.5, -0.5, [0.9, 0.0]],
                         ids=["zero", "above_one", "negative", "one_head_zero"])
def test_retention_gamma_out_of_range(gamma):
  with pytest.raises(ValueError, match=r"^gamma must lie in \(0, 1\]"):
    ops.retention(*_qkv(), gamma=gamma)


# One-token steps: q, k `[B, H, K]`, v `[B, H_v, V]`, gates `[B, H_v]` or `[B, H_v, K]`,
# state `[B, H_v, K, V]`.

STEP_GATES = {
    "linear_attention_step": lambda: (),
    "retention_step": lambda: (),
    "simple_gla_step": lambda: (-0.1 * _x(B, HV),),
    "gla_step": lambda: (-0.1 * _x(B, HV, K),),
    "delta_rule_step": lambda: (0.5 * _x(B, HV),),
    "gated_delta_rule_step": lambda: (-0.1 * _x(B, HV), 0.5 * _x(B, HV)),
    "kda_step": lambda: (-0.1 * _x(B, HV, K), 0.5 * _x(B, HV)),
}


def _step(name, q=None, k=None, v=None, gates=None, **kw):
  q = _x(B, H, K) if q is None else q
  k = _x(B, H, K) if k is None else k
  v = _x(B, HV, V) if v is None else v
  return getattr(ops, name)(q, k, v, *(STEP_GATES[name]() if gates is None else gates), **kw)


@pytest.mark.parametrize("name", list(STEP_GATES))
def test_step_with_rank4_q(name):
  with pytest.raises(ValueError, match=r"^q must have shape \[B, H, K\] \(rank 3\) for a step; "
                     r"got \(1, 1, 1, 4\)"):
    _step(name, q=_x(B, 1, H, K))


@pytest.mark.parametrize("name", list(STEP_GATES))
def test_step_with_wrong_state_shape(name):
  v_label = r"V \+ 1" if name == "linear_attention_step" else "V"
  with pytest.raises(ValueError, match=rf"^state must have shape \[B, H_v, K, {v_label}\]"):
    _step(name, state=_x(B, H, K, V + 2))


def test_linear_attention_step_normalized_state_needs_v_plus_one():
  with pytest.raises(ValueError, match=r"^state must have shape \[B, H_v, K, V \+ 1\] = \(1, 2, 4, 5\)"):
    _step("linear_attention_step", state=_x(B, HV, K, V))


def test_step_with_rank4_v():
  with pytest.raises(ValueError, match=r"^v must have shape \[B, H_v, V\] \(rank 3\) for a step"):
    _step("kda_step", v=_x(B, 1, HV, V))


def test_simple_gla_step_given_per_channel_g():
  with pytest.raises(ValueError, match=r"^g must have shape \[B, H_v\] = \(1, 2\); got \(1, 2, 4\)"):
    _step("simple_gla_step", gates=(-0.1 * _x(B, HV, K),))


def test_kda_step_given_scalar_g():
  with pytest.raises(ValueError, match=r"^g must have shape \[B, H_v, K\] = \(1, 2, 4\); got \(1, 2\)"):
    _step("kda_step", gates=(-0.1 * _x(B, HV), 0.5 * _x(B, HV)))


def test_step_given_a_0d_gate():
  with pytest.raises(ValueError, match=r"^g must have shape \[B, H_v\] = \(1, 2\); got \(\)"):
    _step("simple_gla_step", gates=(np.float32(-0.1),))


def test_gla_step_g_missing():
  with pytest.raises(ValueError, match=r"^g is required, with shape \[B, H_v, K\] = \(1, 2, 4\)"):
    _step("gla_step", gates=(None,))


def test_gated_delta_rule_step_beta_wrong_shape():
  with pytest.raises(ValueError, match=r"^beta must have shape \[B, H_v\] = \(1, 2\); got \(1, 1\)"):
    _step("gated_delta_rule_step", gates=(-0.1 * _x(B, HV), 0.5 * _x(B, H)))


def test_retention_step_gamma_out_of_range():
  with pytest.raises(ValueError, match=r"^gamma must lie in \(0, 1\]"):
    _step("retention_step", gamma=2.0)


# Valid calls.

@pytest.mark.parametrize("impl", ["auto", "recurrent", "chunk"])
def test_valid_call_does_not_raise(impl):
  o, final = _kda(impl=impl, chunk_size=4, initial_state=_x(B, HV, K, V), output_final_state=True,
                  scale=np.array(0.5, np.float32))
  assert o.shape == (B, T, HV, V) and final.shape == (B, HV, K, V)


def test_valid_steps_do_not_raise():
  for name in STEP_GATES:
    o, state = _step(name, scale=jnp.float32(0.5))
    v_cols = V + 1 if name == "linear_attention_step" else V
    assert o.shape == (B, HV, V) and state.shape == (B, HV, K, v_cols), name


@pytest.mark.parametrize("name", list(STEP_GATES))
def test_step_takes_its_op_s_options(name):
  # Given a step and its full-sequence op
  import inspect
  keywords = lambda f: {p.name for p in inspect.signature(f).parameters.values() if p.kind is p.KEYWORD_ONLY}
  op, step = getattr(ops, name.removesuffix("_step")), getattr(ops, name)
  # Then the step takes every option of the op but those of a sequence (packing, chunks, the final state)
  sequence_only = {"output_final_state", "segment_ids", "cu_seqlens", "chunk_size"}
  assert keywords(op) - sequence_only <= keywords(step)
  # And initial_state= is state=, impl="recurrent"/"chunk" is the step, impl="pallas" raises
  state = 0.1 * _x(B, HV, K, V + (name == "linear_attention_step"))
  o, s = _step(name, state=state)
  for kw in (dict(initial_state=state), dict(initial_state=state, impl="recurrent"), dict(state=state, impl="chunk")):
    o2, s2 = _step(name, **kw)
    np.testing.assert_array_equal(o2, o)
    np.testing.assert_array_equal(s2, s)
  with pytest.raises(ValueError, match=r"^impl='pallas' cannot serve a one-token step"):
    _step(name, state=state, impl="pallas")
  with pytest.raises(ValueError, match=r"not both"):
    _step(name, state=state, initial_state=state)
