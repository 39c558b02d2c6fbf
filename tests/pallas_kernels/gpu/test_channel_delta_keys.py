"""kda's key side on two warpgroups (`channel_delta_keys.py`, `GpuConfig.key_warpgroups=2`) in the Mosaic
GPU interpreter: the whole op against the float64 loop (o, the final state, every gradient) at K = 128
with each form of the grams (one reference, the groups' products, each half its own form with the
strong channels in one half), packed rows, grouped value heads, an initial state and q, k normalised on
load; against the one-warpgroup key side on the same call; and the plan and the argument checks. The
race detector's run over both key sides is in test_races.py."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention_jax.pallas_kernels import gpu
from linear_attention_jax.pallas_kernels.gpu import (GpuConfig, call_plan, channel_delta_grads,
                                                     channel_delta_keys)
from tests.ops.conftest import make_inputs, rel_rms
from tests.pallas_kernels.gpu.util import KERNELS, PARAMS, check, packed_runs

SPLIT = dataclasses.replace(KERNELS, key_warpgroups=2)


def _spy(monkeypatch):
  calls = []
  for module, name in ((channel_delta_grads, "key_side"), (channel_delta_keys, "key_side")):
    original = getattr(module, name)
    tag = f"{module.__name__.rsplit('.', 1)[-1]}.{name}"
    monkeypatch.setattr(module, name, lambda *a, _f=original, _t=tag, **k: calls.append(_t) or _f(*a, **k))
  return calls


def _strong_half(g, seed, lo=3.0, hi=20.0):
  """g with its first 32 channels decaying lo..hi nats a token (beyond one reference in every chunk):
  the strong channels all in the first half, as the layers' order puts them."""
  g = np.asarray(g, np.float32).copy()
  g[..., :32] = -np.random.default_rng(seed).uniform(lo, hi, g[..., :32].shape)
  return g


@pytest.mark.parametrize("case", ["one-packed-h0", "grouped-strong-half", "groups-everywhere"])
def test_two_warpgroup_key_side_matches_the_float64_loop(monkeypatch, case):
  # bfloat16 operands; mild gates (one reference), the first 32 channels decaying 3-20 nats a token with
  # each half its own form ("ordered"), or gates down to -20 a token on every channel (the groups' form)
  calls = _spy(monkeypatch)
  Hv = 2 if case == "grouped-strong-half" else 1
  T = {"one-packed-h0": 150, "grouped-strong-half": 133, "groups-everywhere": 97}[case]
  gates = "strong" if case == "groups-everywhere" else "normal"
  inp = make_inputs("kda", B=1, T=T, H=1, Hv=Hv, K=128, V=64, gates=gates, seed=61)
  seg, config = None, SPLIT
  if case == "one-packed-h0":
    inp["g"] = np.asarray(inp["g"]) * 0.4
    seg = packed_runs(T)
  else:
    inp["h0"] = None
  if case == "grouped-strong-half":
    inp["g"] = _strong_half(inp["g"], 62)
    config = dataclasses.replace(SPLIT, order_channels="ordered")
  check("kda", inp, seg=seg, dtype=jnp.bfloat16, tol=1e-2, config=config)
  assert calls and set(calls) == {"channel_delta_keys.key_side"}, calls



@functools.partial(jax.jit, static_argnames=("config",))
def _normalised_on_load(q, k, v, g, beta, h0, seg, do, dhT, *, config):
  def f(q, k, v, g, beta, h0):
    return gpu.chunked_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), g,
                                 beta, initial_state=h0, segment_ids=seg, qk_l2norm=True, config=config,
                                 interpret=PARAMS)
  (o, hT), pull = jax.vjp(f, q, k, v, g, beta, h0)
  return o, hT, pull((do.astype(o.dtype), dhT))


def test_two_warpgroup_key_side_equals_the_one_warpgroup_kernel_with_q_and_k_normalised_on_load(monkeypatch):
  # The same call both ways (the one-warpgroup kernel's own test checks it against the float64 loop):
  # q, k normalised on load (raw norms 4-40; each warpgroup reads both halves for the norms), the strong
  # channels in the first half, each half its own form, packed rows, an initial state. The halves'
  # arithmetic is the same; the products without a decayed gram are rounded to bfloat16 between the two
  # kernels (the value side writes them).
  calls = _spy(monkeypatch)
  T = 140
  inp = make_inputs("kda", B=1, T=T, H=1, Hv=1, K=128, V=128, gates="normal", seed=64)
  rng = np.random.default_rng(66)
  args = [jnp.asarray(x, jnp.float32) for x in (inp["q"] * rng.uniform(1.0, 8.0, (1, T, 1, 1)),
                                                  inp["k"] * 5.0, inp["v"], _strong_half(inp["g"], 65),
                                                  inp["beta"], inp["h0"])]
  do = jnp.asarray(rng.normal(size=inp["v"].shape), jnp.float32)
  dhT = jnp.asarray(rng.normal(size=inp["h0"].shape), jnp.float32)
  seg = jnp.asarray(packed_runs(T))
  ordered = lambda c: dataclasses.replace(c, order_channels="ordered")
  o1, h1, g1 = _normalised_on_load(*args, seg, do, dhT, config=ordered(KERNELS))
  o2, h2, g2 = _normalised_on_load(*args, seg, do, dhT, config=ordered(SPLIT))
  # each call's two branches (the call-wide test's), the one-warpgroup call first
  assert calls == ["channel_delta_grads.key_side"] * 2 + ["channel_delta_keys.key_side"] * 2, calls
  np.testing.assert_array_equal(np.asarray(o1, np.float32), np.asarray(o2, np.float32))
  errors = {n: rel_rms(b, a) for n, a, b in zip("q k v g beta h0".split(), g1, g2)}
  print(errors)
  for n, e in errors.items():
    assert np.isfinite(np.asarray(g2["q k v g beta h0".split().index(n)])).all() and e < 5e-3, (n, errors)
  assert errors["v"] == 0.0 and errors["h0"] == 0.0   # the value side and the walks are the same kernels


def test_the_plan_and_the_checks():
  q = jnp.zeros((1, 64, 1, 128), jnp.bfloat16)
  v = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
  g = jnp.zeros((1, 64, 1, 128), jnp.float32)
  beta = jnp.zeros((1, 64, 1), jnp.float32)
  assert call_plan(q, q, v, g, beta, config=SPLIT).key_warpgroups == 2
  assert call_plan(q, q, v, g, beta, config=SPLIT).interpreter_threads() == {"key_warpgroups=2": 3}
  assert call_plan(q[..., :64], q[..., :64], v, g[..., :64], beta, config=SPLIT).key_warpgroups == 1
  assert call_plan(q, q, v, g, beta, config=KERNELS).key_warpgroups == 1
  assert call_plan(q, q, v, g[..., 0], beta, config=SPLIT).key_warpgroups == 1   # not kda
  with pytest.raises(ValueError, match="dg_cumsum must be 'xla'"):
    GpuConfig(key_warpgroups=2, dg_cumsum="kernel")
  with pytest.raises(ValueError, match="key_warpgroups must be one of"):
    GpuConfig(key_warpgroups=3)
  with pytest.raises(ValueError, match="K = 128"):
    channel_delta_keys.key_side(q[..., :64], q[..., :64], None, jnp.zeros((1, 1, 10, 1, 64)), None, None,
                                None, jnp.zeros((1, 1, 64, 64)), None, None, jnp.zeros((1, 1, 1, 2, 64)),
                                dtype=jnp.bfloat16)

