"""The per-channel forward's wider one-reference bound for l2-normalised q and k
(`GpuConfig.unit_ref_bound`, `prep.UNIT_REF_BOUND`), in the Mosaic GPU interpreter, bfloat16 operands.

Gates of 2.125 nats a token on some channels: a 64-token chunk spans 134 nats there, beyond one
reference at the narrower bound (2 x 60: the halves' form) and within the unit bound (2 x 76).
- The preparation kernel's one-reference grams about the unit bound equal float64 sums; about the
  narrower bound the same product is wrong (its factors clamp): the bound is what makes it exact.
- kda end to end with `qk_l2norm=True` under the option (one reference forward and backward): o, the
  final state and the gradients of v, g, beta against the float64 loop on the normalised q, k, and
  every output and gradient against the narrower bound's (`unit_ref_bound=False`: the halves' form).
- kda's key side under the option: each chunk's bound from its cotangents (`channel.cotangent_bound`);
  with cotangents of 1e12 it falls below the gates' half span and the gradients stay finite and equal
  the narrower bound's.
- The plan takes the unit bound only for l2-normalised q, k with bfloat16 operands (the forward's also
  only for the preparation kernel), by default, and not under `unit_ref_bound=False`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention_jax.pallas_kernels import gpu, prep
from linear_attention_jax.pallas_kernels.gpu import GpuConfig, channel, channel_prep, plan
from tests.ops.conftest import rel_rms
from tests.ops.test_equivalence import _reference
from tests.pallas_kernels.gpu.test_groups import _float64_grams
from tests.pallas_kernels.gpu.util import KERNELS, PARAMS

UNIT = dataclasses.replace(KERNELS, unit_ref_bound=True)   # the default, named
NARROW = dataclasses.replace(KERNELS, unit_ref_bound=False)


def _inputs(T=128, Hv=1, K=64, seed=3):
  r = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  # unit rows, then rounded to the operands' dtype (what the kernels read)
  q, k = (np.asarray(jnp.asarray(unit(r.normal(size=(1, T, 1, K))), jnp.bfloat16).astype(jnp.float32))
          for _ in range(2))
  v = np.asarray(jnp.asarray(r.normal(size=(1, T, Hv, K)), jnp.bfloat16).astype(jnp.float32))
  g = r.uniform(-0.3, 0.0, (1, T, Hv, K)).astype(np.float32)
  g[..., :8] = -2.125
  beta = r.uniform(0.1, 1.0, (1, T, Hv)).astype(np.float32)
  return q, k, v, g, beta


def test_the_gates_lie_between_the_two_bounds():
  *_, g, _ = _inputs()
  refs = channel.chunk_cumsum(jnp.asarray(g), 128, 64)[1]
  unit = prep.ref_bound(jnp.bfloat16, unit=True)
  assert (np.asarray(channel.chunk_forms(refs, 64, jnp.bfloat16)) == channel.HALVES).all()
  assert (np.asarray(channel.chunk_forms(refs, 64, jnp.bfloat16, unit)) == channel.ONE).all()
  G = channel.chunk_cumsum(jnp.asarray(g), 128, 64)[0]
  assert not bool(channel.fits(G, 64, jnp.bfloat16)) and bool(channel.fits(G, 64, jnp.bfloat16, unit))


def test_one_reference_grams_about_the_unit_bound_equal_float64_sums():
  q, k, v, g, beta = _inputs()
  cast = lambda x: jnp.asarray(x, jnp.bfloat16)
  P, M = _float64_grams(q[0, :, 0], k[0, :, 0], g[0, :, 0])

  def errors(bound):
    t, _, M_got = channel_prep.prepare(cast(q), cast(k), cast(v), jnp.asarray(g), jnp.asarray(beta),
                                       chunk_size=64, dtype=jnp.bfloat16, interpret=PARAMS,
                                       with_inverse=True, grams="one", bound=bound)
    out = []
    for c in range(2):
      for got, want in ((t.p[0, 0, c], P[c]), (M_got[0, 0, c], M[c])):
        got = np.asarray(got, np.float64)
        assert np.isfinite(got).all()
        out.append(np.abs(got - want).max() / np.abs(want).max())
    return max(out)

  assert errors(prep.ref_bound(jnp.bfloat16, unit=True)) < 1e-2
  assert errors(prep.REF_BOUND) > 1e-1   # the narrower bound clamps these chunks' factors


def _run(q, k, v, g, beta, do, dhT, config):
  def f(q, k, v, g, beta):
    return gpu.chunked_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
                                 g, beta, qk_l2norm=True, config=config, interpret=PARAMS)
  (o, hT), vjp = jax.vjp(f, *map(jnp.asarray, (q, k, v, g, beta)))
  return o, hT, vjp((jnp.asarray(do, o.dtype), jnp.asarray(dhT)))


def test_kda_forward_about_the_unit_bound_matches_the_loop_and_the_narrow_bound(monkeypatch):
  # the kernels' jit caches (`once.lowered_once`) would serve an earlier test's trace of the same call
  # (test_call_test.py's, in one process) without calling the functions patched below
  jax.clear_caches()
  bounds = []   # what the call passes to the test of which chunks fit and to the preparation kernel
  for module, name, arg in ((channel_prep, "prepare", None), (channel, "fits_refs", 2),
                            (channel, "cotangent_bound", 2)):
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, _i=arg, **kw: bounds.append(
        (_n, kw.get("bound") if _i is None else (a[_i] if len(a) > _i else kw.get("bound")))) or _f(*a, **kw))
  q, k, v, g, beta = _inputs()
  r = np.random.default_rng(4)
  do = r.normal(size=v.shape).astype(np.float32)
  dhT = r.normal(size=(1, 1, 64, 64)).astype(np.float32)
  o, hT, grads = _run(q, k, v, g, beta, do, dhT, UNIT)
  unit = prep.ref_bound(jnp.bfloat16, unit=True)
  forward = [b for b in bounds if b[0] == "prepare"]
  assert forward and all(b == ("prepare", unit) for b in forward), bounds
  # the forward's call-wide test about the unit bound, the backward's about the default
  assert ("fits_refs", unit) in bounds and ("fits_refs", None) in bounds, bounds
  assert ("cotangent_bound", 64) in bounds, bounds   # the key side's forms: the chunks' own bounds
  bounds.clear()
  o0, hT0, grads0 = _run(q, k, v, g, beta, do, dhT, NARROW)
  assert ("prepare", prep.REF_BOUND) in bounds and all(b[1] != unit for b in bounds), bounds
  assert not any(b[0] == "cotangent_bound" for b in bounds), bounds
  # the float64 loop on the unit q, k (the op normalises them again: a change of their rounding only);
  # dq and dk are the op's through that normalisation, so they meet the narrower bound's
  ref = dict(q=q, k=k, v=v, g=g, beta=beta, h0=np.zeros((1, 1, 64, 64), np.float32))
  ro, rhT, rgrads = _reference("kda", ref, do, dhT, segment_ids=None)
  errors = {"o": rel_rms(o, ro), "state": rel_rms(hT, rhT)}
  errors.update({f"d{n}": rel_rms(grads[i], rgrads[n]) for i, n in ((2, "v"), (3, "g"), (4, "beta"))})
  errors.update({f"{n} vs narrow": rel_rms(a, b) for n, a, b in
                 [("o", o, o0), ("state", hT, hT0)] + [(f"d{n}", grads[i], grads0[i])
                                                      for i, n in enumerate("q k v g beta".split())]})
  print(errors)
  assert np.isfinite(list(errors.values())).all(), errors
  for name, e in errors.items():
    assert e <= 1e-2, (name, errors)


def test_kda_with_huge_cotangents_stays_finite_and_matches_the_narrow_bound():
  # cotangents of 1e12: a chunk's bound from them (`channel.cotangent_bound`) falls below these chunks'
  # half span (67 nats), so the key side takes the halves where a fixed bound of 76 would overflow
  q, k, v, g, beta = _inputs()
  r = np.random.default_rng(5)
  do = 1e12 * r.normal(size=v.shape).astype(np.float32)
  dhT = 1e12 * r.normal(size=(1, 1, 64, 64)).astype(np.float32)
  *_, grads = _run(q, k, v, g, beta, do, dhT, UNIT)
  *_, grads0 = _run(q, k, v, g, beta, do, dhT, NARROW)
  for name, a, b in zip("q k v g beta".split(), grads, grads0):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all(), name
    assert rel_rms(a, b) <= 1e-2, (name, rel_rms(a, b))


def test_cotangent_bound():
  dP = jnp.zeros((1, 2, 128, 64), jnp.bfloat16)
  dM = dP.at[0, 1, 70, 3].set(-1e12)
  got = np.asarray(channel.cotangent_bound(dP, dM, 64))
  assert got.shape == (1, 2, 2)   # [B, NC, H_v]
  want = 87.72 - np.log(2 * 64 * float(jnp.asarray(1e12, jnp.bfloat16)))
  np.testing.assert_allclose(got, [[[prep.UNIT_REF_BOUND, prep.UNIT_REF_BOUND],
                                    [prep.UNIT_REF_BOUND, want]]], rtol=1e-6)
  assert want < 60


@pytest.mark.parametrize("qk_l2norm,dtype,forward,want", [
    (True, jnp.bfloat16, "kernel", prep.UNIT_REF_BOUND), (False, jnp.bfloat16, "kernel", prep.REF_BOUND),
    (True, jnp.float16, "kernel", prep.REF_BOUND_F16), (True, jnp.bfloat16, "xla_prep", prep.REF_BOUND)])
def test_the_plan_takes_the_unit_bound_only_where_it_holds(qk_l2norm, dtype, forward, want):
  config = GpuConfig(unit_ref_bound=True, forward=forward, backward="xla_vjp")
  p = plan.select(delta=True, decay="channel", config=config, qk_l2norm=qk_l2norm, V=64, dtype=dtype,
                  v_dtype=dtype)
  assert p.forward_ref_bound == want
  assert p.unit_bound == (qk_l2norm and dtype == jnp.bfloat16)
  select = lambda config: plan.select(delta=True, decay="channel", config=config, qk_l2norm=True,
                                      dtype=jnp.bfloat16)
  assert select(GpuConfig()).forward_ref_bound == prep.UNIT_REF_BOUND and select(GpuConfig()).unit_bound
  narrow = select(GpuConfig(unit_ref_bound=False))
  assert narrow.forward_ref_bound == prep.REF_BOUND and not narrow.unit_bound
  with pytest.raises(ValueError, match="unit_ref_bound"):
    GpuConfig(unit_ref_bound=1)
  with pytest.raises(ValueError, match="bound"):
    channel_prep.prepare(*(jnp.zeros((1, 64, 1, 64), jnp.bfloat16),) * 3, jnp.zeros((1, 64, 1, 64)),
                         jnp.ones((1, 64, 1)), chunk_size=64, dtype=jnp.bfloat16, bound=90.0)
