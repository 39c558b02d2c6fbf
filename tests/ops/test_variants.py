"""The variant wrappers (feature maps, normaliser, retention's gamma, q/k l2 norm), chained calls and the
one-token step functions, each against the plain NumPy loop or the recurrent form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention_jax import ops
from tests.ops.conftest import FAMILY, call, make_inputs, rel_rms
from tests.ops.numpy_reference import forward_backward

ALL = tuple(FAMILY)


def _numpy_forward(q, k, v, g, beta, h0, scale):
  """`[B, T, H, K]` inputs (heads expanded) through the NumPy loop, row by row."""
  outs, finals = [], []
  for b in range(q.shape[0]):
    pick = lambda x: None if x is None else np.asarray(x[b], np.float64)
    T, H = q.shape[1], q.shape[2]
    o, hT, _ = forward_backward(pick(q), pick(k), pick(v), pick(g), pick(beta), h0[b], scale,
                                np.zeros(v.shape[1:]), np.zeros(h0.shape[1:]))
    outs.append(o), finals.append(hT)
  return np.stack(outs), np.stack(finals)


@pytest.mark.parametrize("impl", ["recurrent", "chunk"])
# The normaliser is only well posed for positive feature maps (q.z can vanish otherwise).
@pytest.mark.parametrize("feature_map,normalize", [
    ("elu_plus_one", True), ("relu", True), ("callable", True), ("elu_plus_one", False),
    ("relu", False), ("identity", False), ("silu", False), ("callable", False)])
def test_linear_attention_matches_numpy(feature_map, normalize, impl):
  inp = make_inputs("linear_attention", B=2, T=70, H=2, Hv=2, K=8, V=6, seed=11)
  phi_np = {"elu_plus_one": lambda x: np.where(x > 0, x + 1, np.exp(x)), "relu": lambda x: np.maximum(x, 0),
            "identity": lambda x: x, "silu": lambda x: x / (1 + np.exp(-x)),
            "callable": lambda x: x ** 2}[feature_map]
  fm = (lambda x: x ** 2) if feature_map == "callable" else feature_map
  q, k, v = (np.asarray(inp[n], np.float64) for n in ("q", "k", "v"))
  h0 = np.asarray(inp["h0"], np.float64)
  if normalize:
    h0 = np.concatenate([h0, np.abs(h0[..., :1])], axis=-1)  # z column: keep the denominator positive
    v = np.concatenate([v, np.ones(v.shape[:-1] + (1,))], axis=-1)
  ro, rhT = _numpy_forward(phi_np(q), phi_np(k), v, None, None, h0, 8 ** -0.5)
  if normalize:
    ro = ro[..., :-1] / (ro[..., -1:] + 1e-6)
  o, hT = ops.linear_attention(inp["q"], inp["k"], inp["v"], feature_map=fm, normalize=normalize,
                               initial_state=h0.astype(np.float32), output_final_state=True, impl=impl)
  assert hT.shape == h0.shape
  assert rel_rms(o, ro) < 1e-5 and rel_rms(hT, rhT) < 1e-5


def test_retention_default_gamma_matches_numpy():
  inp = make_inputs("retention", B=1, T=90, H=2, Hv=4, K=8, V=6, seed=12)
  Hv = 4
  gamma = 1 - 2.0 ** (-5.0 - np.arange(Hv))
  g = np.broadcast_to(np.log(gamma), (1, 90, Hv))
  q, k = (np.repeat(np.asarray(inp[n], np.float64), 2, axis=2) for n in ("q", "k"))
  ro, rhT = _numpy_forward(q, k, inp["v"], g, None, np.asarray(inp["h0"], np.float64), 8 ** -0.5)
  for impl in ("recurrent", "chunk"):
    o, hT = call("retention", inp, impl=impl, output_final_state=True)
    assert rel_rms(o, ro) < 1e-5 and rel_rms(hT, rhT) < 1e-5, impl
  o2, _ = call("retention", inp, gamma=jnp.asarray(gamma), impl="chunk")
  o3, _ = call("retention", inp, gamma=0.5, impl="chunk")
  assert rel_rms(o2, ro) < 1e-5 and rel_rms(o3, ro) > 1e-2


@pytest.mark.parametrize("variant", ["delta_rule", "gated_delta_rule", "kda"])
def test_qk_l2norm_matches_numpy(variant):
  inp = make_inputs(variant, B=1, T=80, H=2, Hv=2, K=8, V=6, seed=13)
  inp["k"] = inp["k"] * 3.0  # not unit norm: the option must normalise
  norm = lambda x: x / np.sqrt(np.sum(np.asarray(x, np.float64) ** 2, -1, keepdims=True) + 1e-6)
  ro, rhT = _numpy_forward(norm(inp["q"]), norm(inp["k"]), inp["v"], inp["g"], inp["beta"],
                           np.asarray(inp["h0"], np.float64), 8 ** -0.5)
  for impl in ("recurrent", "chunk"):
    o, hT = call(variant, inp, use_qk_l2norm=True, impl=impl, output_final_state=True)
    assert rel_rms(o, ro) < 1e-5 and rel_rms(hT, rhT) < 1e-5, impl


@pytest.mark.parametrize("variant", ["linear_attention", "retention"])
def test_wrapper_gradients_chunk_equal_recurrent(variant):
  inp = make_inputs(variant, B=2, T=75, H=2, Hv=4, K=8, V=6, seed=14)
  if variant == "linear_attention":
    inp["h0"] = np.abs(np.concatenate([inp["h0"], inp["h0"][..., :1]], -1))
  do = np.random.default_rng(0).normal(size=inp["v"].shape).astype(np.float32)

  def grads(impl):
    def loss(q, k, v, h0):
      o, hT = call(variant, dict(inp, q=q, k=k, v=v, h0=h0), impl=impl, output_final_state=True)
      return jnp.sum(o * do) + jnp.sum(hT * 0.1)
    return jax.grad(loss, argnums=(0, 1, 2, 3))(inp["q"], inp["k"], inp["v"], inp["h0"])

  for a, b in zip(grads("chunk"), grads("recurrent")):
    assert rel_rms(a, b) < 1e-5


@pytest.mark.parametrize("impl", ["recurrent", "chunk"])
@pytest.mark.parametrize("variant", ALL)
def test_chained_calls_equal_one_call(variant, impl):
  inp = make_inputs(variant, B=2, T=100, seed=15)
  if variant == "linear_attention":
    inp["h0"] = np.abs(np.concatenate([inp["h0"], inp["h0"][..., :1]], -1))
  full_o, full_h = call(variant, inp, impl=impl, output_final_state=True, chunk_size=16)
  t = 37
  cut = lambda lo, hi: {n: None if x is None or n == "h0" else x[:, lo:hi] for n, x in inp.items()}
  o1, h1 = call(variant, dict(cut(0, t), h0=inp["h0"]), impl=impl, output_final_state=True,
                chunk_size=16)
  o2, h2 = call(variant, dict(cut(t, 100), h0=h1), impl=impl, output_final_state=True, chunk_size=16)
  assert rel_rms(jnp.concatenate([o1, o2], axis=1), full_o) < 1e-5
  assert rel_rms(h2, full_h) < 1e-5


STEPS = {
    "linear_attention": lambda x, s: ops.linear_attention_step(x["q"], x["k"], x["v"], s),
    "retention": lambda x, s: ops.retention_step(x["q"], x["k"], x["v"], s),
    "simple_gla": lambda x, s: ops.simple_gla_step(x["q"], x["k"], x["v"], x["g"], s),
    "gla": lambda x, s: ops.gla_step(x["q"], x["k"], x["v"], x["g"], s),
    "delta_rule": lambda x, s: ops.delta_rule_step(x["q"], x["k"], x["v"], x["beta"], s,
                                                   use_qk_l2norm=True),
    "gated_delta_rule": lambda x, s: ops.gated_delta_rule_step(x["q"], x["k"], x["v"], x["g"],
                                                               x["beta"], s, use_qk_l2norm=True),
    "kda": lambda x, s: ops.kda_step(x["q"], x["k"], x["v"], x["g"], x["beta"], s,
                                     use_qk_l2norm=True),
}


@pytest.mark.parametrize("variant", ALL)
def test_steps_equal_recurrence(variant):
  T = 20
  inp = make_inputs(variant, B=2, T=T, seed=16)
  if variant == "linear_attention":
    inp["h0"] = np.abs(np.concatenate([inp["h0"], inp["h0"][..., :1]], -1))
  kw = {"use_qk_l2norm": True} if FAMILY[variant][1] else {}
  ref_o, ref_h = call(variant, inp, impl="recurrent", output_final_state=True, **kw)
  step = jax.jit(STEPS[variant])
  state, outs = inp["h0"], []
  for t in range(T):
    x = {n: None if a is None or n == "h0" else a[:, t] for n, a in inp.items()}
    o_t, state = step(x, state)
    assert state.dtype == jnp.float32 and o_t.shape == inp["v"][:, t].shape
    outs.append(o_t)
  assert rel_rms(jnp.stack(outs, axis=1), ref_o) < 1e-6
  assert rel_rms(state, ref_h) < 1e-6


@pytest.mark.parametrize("variant", ALL)
def test_output_dtype_and_state_dtype(variant):
  inp = make_inputs(variant, B=1, T=9, seed=17)
  inp = {n: None if x is None else jnp.asarray(x, jnp.bfloat16) for n, x in inp.items()}
  if variant == "linear_attention":
    inp["h0"] = None
  o, hT = call(variant, inp, output_final_state=True)
  assert o.dtype == jnp.bfloat16 and hT.dtype == jnp.float32
  _, none = call(variant, inp)
  assert none is None
