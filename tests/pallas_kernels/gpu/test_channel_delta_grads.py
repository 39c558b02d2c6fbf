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
def test_kda_takes_the_last_chunks_state_term_in_float32(monkeypatch, dg_cumsum):
  # bfloat16 operands: the key side forms each chunk's e^(G_C) colsum(S dS) from the bfloat16 copies
  # of S (entering the chunk) and dS (leaving it); for the last chunk, where dS is the final state's
  # cotangent, `exact_last_term` adds the difference to the float32 S and cotangent. Row 0 has no run
  # start in its last chunk, row 1 has one (the carried state does not reach the chunk's end: no term)
  T = 150
  inp = make_inputs("kda", B=2, T=T, H=1, Hv=1, K=64, V=64, gates="normal", seed=46)
  seg = np.zeros((2, T), np.int32)
  seg[:, 70:], seg[1, 140:] = 1, 2
  names = [n for n in ("q", "k", "v", "g", "beta", "h0") if inp.get(n) is not None]
  rng = np.random.default_rng(47)
  do = rng.normal(size=inp["v"].shape).astype(np.float32)
  dhT = rng.normal(size=(2, 1, 64, 64)).astype(np.float32)
  config = dataclasses.replace(KERNELS, dg_cumsum=dg_cumsum)
  seen = {}
  exact_last_term = channel_delta_grads.exact_last_term

  def spy(dG, last_start, states, dstates, dfinal, refs, masks, C, summed):
    jax.debug.callback(lambda *xs: seen.update(zip(("S", "Sb", "dSb", "dF", "G_C", "carry"), xs)),
                       last_start, states[:, :, -1], dstates[:, :, -1], dfinal, refs[:, -1, 1],
                       masks[:, 2, -1])
    return exact_last_term(dG, last_start, states, dstates, dfinal, refs, masks, C, summed)

  def dg(term):
    monkeypatch.setattr(channel_delta_grads, "exact_last_term", term)

    @jax.jit
    def run(inp, do, dhT, seg):   # a new function: a fresh trace
      return run_with_grads.__wrapped__(inp, do, dhT, seg, params=PARAMS, dtype=jnp.bfloat16, config=config)

    return np.asarray(run(inp, do, dhT, jnp.asarray(seg))[2]["g"], np.float64)

  with_term, without = dg(spy), dg(lambda dG, *a, **kw: dG)
  assert set(seen) == {"S", "Sb", "dSb", "dF", "G_C", "carry"}, "the term was not taken"
  S, Sb, dSb = (np.asarray(seen[n], np.float32) for n in ("S", "Sb", "dSb"))
  dF = np.swapaxes(np.asarray(seen["dF"], np.float32), -1, -2)
  # the walk's bfloat16 copies are these float32 tensors rounded; the float32 S holds more than them
  np.testing.assert_array_equal(Sb, S.astype(jnp.bfloat16).astype(np.float32))
  np.testing.assert_array_equal(dSb, dF.astype(jnp.bfloat16).astype(np.float32))
  np.testing.assert_array_equal(dF, np.swapaxes(dhT, -1, -2))
  assert (S != Sb).mean() > 0.5
  np.testing.assert_array_equal(np.asarray(seen["carry"]), [1.0, 0.0])
  fix = np.exp(np.asarray(seen["G_C"], np.float64)) * (
      np.sum(S.astype(np.float64) * dF - Sb.astype(np.float64) * dSb, axis=-2))   # [B, H_v, K]
  # every token of row 0's last chunk (128 .. T) moves by the term's rounding; nothing else moves
  expected = np.zeros_like(with_term)
  expected[0, 128:] = fix[0][None]
  assert np.abs(fix[0]).max() > 1e-4 * np.abs(with_term[0, 128:]).max()
  np.testing.assert_allclose(with_term - without, expected, rtol=1e-3, atol=1e-6 * np.abs(with_term).max())
