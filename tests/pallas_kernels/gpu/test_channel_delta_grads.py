"""kda's gradient kernels (`channel_delta_grads.py`) in the Mosaic GPU interpreter: the whole op (the
preparation kernel writing the inverse, the forward walk keeping the chunk states, the reverse walk, the
value-side and key-side kernels) against the float64 loop, with grouped heads, packed rows, sequence
pieces and an initial state; strong decay within the bound; decay beyond it takes the XLA merge form's
vjp; q, k l2-normalised on load (bfloat16, every form; the two-warpgroup key side's norm gradients at
K = 128) against the float64 loop on the normalised q, k.
A spy checks that the kernels ran."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention_jax.pallas_kernels import gpu
from linear_attention_jax.pallas_kernels.gpu import (call_plan, channel, channel_delta_grads,
                                                     channel_delta_keys, channel_prep, plan)
from tests.ops.conftest import make_inputs, rel_rms
from tests.ops.test_equivalence import _reference
from tests.pallas_kernels.gpu.util import (KERNELS, PARAMS, check, normalised_kda_reference, packed_runs,
                                         run_with_grads)


def _spy(monkeypatch):
  calls = []
  for name in ("value_side", "key_side"):
    original = getattr(channel_delta_grads, name)
    monkeypatch.setattr(channel_delta_grads, name,
                        lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
  return calls


@pytest.mark.parametrize("K,V,Hv,packed,pieces,h0", [(64, 64, 2, False, None, False),
                                                     (128, 64, 1, True, None, True),
                                                     (64, 128, 1, False, 2, True)],
                         ids=["grouped", "K128-packed-h0", "V128-pieces-h0"])
def test_kda_gradient_kernels_match_the_float64_loop(monkeypatch, K, V, Hv, packed, pieces, h0):
  calls = _spy(monkeypatch)
  T = 151 + 7 * (K // 64) + V // 64 + Hv   # a fresh trace per case (the kernels' calls are counted)
  inp = make_inputs("kda", B=1, T=T, H=1, Hv=Hv, K=K, V=V, gates="normal", seed=41)
  if not h0:
    inp["h0"] = None
  # milder gates, so that every chunk fits float16's one-reference bound and the kernels' branch runs
  # (the spy below only sees the trace, and lax.cond traces both branches)
  inp["g"] = np.asarray(inp["g"]) * 0.4
  G, _ = channel.chunk_cumsum(jnp.asarray(inp["g"]), 256, 64)
  assert bool(channel.fits(G, 64, jnp.float16))
  check("kda", inp, seg=packed_runs(T) if packed else None, pieces=pieces, config=KERNELS)
  assert sorted(set(calls)) == ["key_side", "value_side"], "the gradient kernels did not run"


@pytest.mark.parametrize("dg_cumsum", ["xla", "kernel"])
def test_kda_gradient_kernels_at_strong_decay_within_the_bound(monkeypatch, dg_cumsum):
  # bfloat16 operands, g = -1.8 a token on half the channels: each chunk spans 115 nats there, so the
  # kernels' factors reach e^(+-58) (the one-reference bound is 60); dG's reverse cumsum in XLA or in
  # the key-side kernel (GpuConfig.dg_cumsum)
  calls = _spy(monkeypatch)
  summed = []
  key_side = channel_delta_grads.key_side
  monkeypatch.setattr(channel_delta_grads, "key_side",
                      lambda *a, **kw: summed.append(kw.get("reverse_cumsum")) or key_side(*a, **kw))
  inp = make_inputs("kda", B=1, T=129, H=1, Hv=1, K=64, V=64, gates="normal", seed=42)
  g = np.asarray(inp["g"]).copy()
  g[..., ::2] = -1.8
  inp["g"] = g
  G, _ = channel.chunk_cumsum(jnp.asarray(g), 192, 64)
  assert bool(channel.fits(G, 64, jnp.bfloat16))
  check("kda", inp, dtype=jnp.bfloat16, tol=1e-2, config=dataclasses.replace(KERNELS, dg_cumsum=dg_cumsum))
  assert calls and set(summed) == {dg_cumsum == "kernel"}, summed


def test_kda_beyond_the_bound_takes_the_merge_form():
  # g down to -20 a token: beyond float16's bound, so the call's tensors and gradients come from XLA's
  # merge form, one batch row and value head at a time (two rows, grouped heads, packed rows)
  inp = make_inputs("kda", B=2, T=70, H=1, Hv=2, K=64, V=64, gates="strong", seed=43)
  G, _ = channel.chunk_cumsum(jnp.asarray(inp["g"]), 128, 64)
  assert not bool(channel.fits(G, 64, jnp.float16))
  seg = np.zeros((2, 70), np.int32)
  seg[0, 30:], seg[1, 66:] = 1, 1
  check("kda", inp, seg=seg, config=KERNELS)


@pytest.mark.parametrize("K, key_warpgroups", [(64, 1), (128, 2)])
def test_kda_normalises_q_and_k_on_load_and_matches_the_float64_loop(monkeypatch, K, key_warpgroups):
  # qk_l2norm=True, bfloat16: the preparation and key-side kernels normalise the raw q, k (norms 5-64)
  # as they load them; XLA takes the norm's backward from the one-warpgroup key side's dq, dk, the
  # two-warpgroup key side (K = 128) takes it in its epilogue. Against the float64 loop
  # on the normalised q, k, dq and dk through the norm's float64 backward; grouped value heads, packed
  # rows, an initial state, and gates from mild to -20 a token (every chunk form), -inf on some channels
  # of one token (the floor: the kernels' cumsum floors g, their backward zeroes dg below it). Then
  # against the same kernels with q, k normalised by XLA before them (the plan's l2 "xla").
  seen = []
  for module, name in ((channel_prep, "prepare"), (channel_delta_grads, "key_side"),
                       (channel_delta_keys, "key_side")):
    original = getattr(module, name)
    tag = f"{module.__name__.rsplit('.', 1)[-1]}.{name}"
    monkeypatch.setattr(module, name, lambda *a, _f=original, _n=tag, **kw: seen.append(
        (_n, kw.get("qk_l2norm"))) or _f(*a, **kw))
  config = dataclasses.replace(KERNELS, key_warpgroups=key_warpgroups)
  T, Hv, V = 150, 2, 64
  inp = make_inputs("kda", B=1, T=T, H=1, Hv=Hv, K=K, V=V, gates="normal", seed=44)
  r = np.random.default_rng(45)
  q, k = (np.asarray(jnp.asarray(x * r.uniform(1.0, 8.0, x.shape[:-1] + (1,)), jnp.bfloat16), np.float64)
          for x in (inp["q"], inp["k"] * 5.0))
  v = np.asarray(jnp.asarray(inp["v"], jnp.bfloat16), np.float64)
  g = np.asarray(inp["g"], np.float32).copy()
  g[:, 64:128, :, :8] = -r.uniform(3.0, 20.0, (1, 64, Hv, 8))   # chunk 1: beyond one reference
  g[:, 130, :, 20:24] = -np.inf
  beta, h0, seg = inp["beta"], inp["h0"], packed_runs(T)
  do = r.normal(size=v.shape).astype(np.float32)
  dhT = r.normal(size=h0.shape).astype(np.float32)
  args = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, h0)]

  @jax.jit
  def run(*a):
    def f(q, k, v, g, beta, h0):
      return gpu.chunked_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
                                   g, beta, initial_state=h0, segment_ids=jnp.asarray(seg), qk_l2norm=True,
                                   config=config, interpret=PARAMS)
    (o, hT), pull = jax.vjp(f, *a)
    return o, hT, pull((jnp.asarray(do, o.dtype), jnp.asarray(dhT)))

  o, hT, grads = run(*args)
  p = call_plan(*(x.astype(jnp.bfloat16) for x in args[:3]), args[3], args[4], qk_l2norm=True,
                config=config)
  assert (p.l2, p.gate_floor, p.key_warpgroups) == ("on_load", "stages", key_warpgroups)
  keys = "channel_delta_keys" if key_warpgroups == 2 else "channel_delta_grads"
  assert {n for n, on in seen if on} == {"channel_prep.prepare", f"{keys}.key_side"}, seen
  ro, rhT, rgrads = normalised_kda_reference(q, k, v, np.maximum(g, -20.0), beta, h0, do, dhT, seg)
  rgrads["g"] = np.where(g >= -20.0, rgrads["g"], 0.0)
  errors = {"o": rel_rms(o, ro), "state": rel_rms(hT, rhT)}
  errors.update({f"d{n}": rel_rms(a, rgrads[n]) for n, a in zip("q k v g beta".split(), grads)})
  print(errors)
  assert np.isfinite(list(errors.values())).all() and all(bool(jnp.isfinite(x).all()) for x in grads)
  for name, e in errors.items():
    assert e <= 1e-2, (name, errors)
  # the same call with the norm in XLA before the kernels
  select = plan.select
  monkeypatch.setattr(plan, "select", lambda **kw: dataclasses.replace(select(**kw), l2="xla"))
  seen.clear()
  o2, hT2, grads2 = run.__wrapped__(*args)
  assert not any(on for _, on in seen), seen
  for n, a in zip("q k".split(), grads2):
    assert rel_rms(a, rgrads[n]) <= 1e-2, n
  # only the norm's rounding differs (the sums' order); dq, dk also through its backward's cancellation
  for name, a, b in [("o", o, o2), ("state", hT, hT2)] + list(zip("q k v g beta h0".split(), grads, grads2)):
    assert rel_rms(a, b) < (6e-3 if name in "qk" else 1e-3), (name, rel_rms(a, b))


@pytest.mark.parametrize("dg_cumsum", ["xla", "kernel"])
def test_kda_takes_the_final_states_cotangent_on_the_last_chunk_in_float32(monkeypatch, dg_cumsum):
  # bfloat16 operands, no cotangent on o: every gradient comes from the final state's cotangent. The
  # kernels would form the last chunk's terms with it as a bfloat16 operand; `channel.final_state_grads`
  # forms them in float32 from the float32 state entering the chunk, and the kernels take none of them.
  # Row 0's last chunk (tokens 128 .. T) is one run; row 1's has a run start (140) inside it.
  T = 150
  inp = make_inputs("kda", B=2, T=T, H=1, Hv=1, K=64, V=64, gates="normal", seed=46)
  inp = {n: None if x is None else (np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
                                    if n in ("q", "k", "v") else np.asarray(x, np.float32))
         for n, x in inp.items()}
  inp["h0"] = None
  seg = np.zeros((2, T), np.int32)
  seg[:, 70:], seg[1, 140:] = 1, 2
  do = np.zeros(inp["v"].shape, np.float32)
  dhT = np.random.default_rng(47).normal(size=(2, 1, 64, 64)).astype(np.float32)
  config = dataclasses.replace(KERNELS, dg_cumsum=dg_cumsum)
  seen = {}
  final_state_grads = channel.final_state_grads

  def spy(dfinal, last_start, *a, **kw):
    jax.debug.callback(lambda S: seen.update(S=S), last_start)
    return final_state_grads(dfinal, last_start, *a, **kw)

  monkeypatch.setattr(channel, "final_state_grads", spy)

  @jax.jit
  def run(inp, do, dhT, seg):   # a new function: a fresh trace
    return run_with_grads.__wrapped__(inp, do, dhT, seg, params=PARAMS, dtype=jnp.bfloat16, config=config)

  _, _, grads = run(inp, do, dhT, jnp.asarray(seg))
  assert "S" in seen, "the last chunk's terms were not taken in float32"
  # the float64 loop over the last chunk alone, from the float32 state the forward walk left there
  last = {n: None if x is None else x[:, 128:] for n, x in inp.items()}
  last["h0"] = np.swapaxes(np.asarray(seen["S"], np.float64), -1, -2)
  _, _, ref_last = _reference("kda", last, do[:, 128:], dhT, segment_ids=seg[:, 128:])
  for n in ("g", "beta"):   # float32 gradients: float32's rounding, not bfloat16's
    assert rel_rms(grads[n][:, 128:], ref_last[n]) < 1e-5, (n, rel_rms(grads[n][:, 128:], ref_last[n]))
  for n in ("k", "v"):      # bfloat16 gradients: their own rounding
    assert rel_rms(grads[n][:, 128:], ref_last[n]) < 4e-3, n
  # row 1's tokens before its run start do not reach the final state
  assert np.abs(np.asarray(grads["g"][1, 128:140])).max() < 1e-6 * np.abs(np.asarray(grads["g"])).max()
  # the chunks before: the kernels' bfloat16 operands, against the float64 loop over the whole rows
  _, _, ref = _reference("kda", dict(inp, h0=np.zeros((2, 1, 64, 64), np.float32)), do, dhT, segment_ids=seg)
  for n in ("q", "k", "v", "g", "beta"):
    assert rel_rms(grads[n], ref[n]) < 1e-2, n
  assert 1e-4 < rel_rms(grads["g"][:, :128], ref["g"][:, :128])


def test_an_unused_final_state_sends_the_backward_no_cotangent(monkeypatch):
  # a model's training step drops the final state: its cotangent is a symbolic zero, and the backward
  # then reads none (no reverse-walk entry, no last-chunk float32 terms); used, it is read
  inp = make_inputs("kda", B=1, T=70, H=1, Hv=1, K=64, V=64, gates="normal", seed=48)
  q, k, v, g, beta = (jnp.asarray(inp[n], jnp.bfloat16 if n in "qkv" else jnp.float32)
                      for n in ("q", "k", "v", "g", "beta"))
  seen = []
  backward_states = channel_delta_grads.walk.backward_states
  spy = lambda t, do, dfinal, **kw: seen.append(dfinal is None) or backward_states(t, do, dfinal, **kw)
  monkeypatch.setattr(channel_delta_grads.walk, "backward_states", spy)
  op = lambda q, k, g, final: gpu.chunked_attention(q, k, v, g, beta, config=KERNELS, interpret=PARAMS)[
      1 if final else 0].astype(jnp.float32)
  for final in (False, True):
    seen.clear()
    grads = jax.jit(jax.grad(lambda *xs: jnp.sum(op(*xs, final) ** 2), argnums=(0, 1, 2)))(q, k, g)
    assert set(seen) == {not final}, (final, seen)   # each traced branch of the backward, alike
    assert all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in grads)
    assert all(bool(jnp.any(x != 0)) for x in grads[final:])   # q does not reach the final state
