"""kda's preparation on two warpgroups (`channel_prep_split.py`, `GpuConfig.prep_warpgroups=2`) in the
Mosaic GPU interpreter: its outputs against the one-warpgroup kernel's on the same call for every grams
form (one reference, the halves', the groups', each chunk its own, each half its own), with packed rows,
grouped value heads and q, k normalised on load; the whole op against the float64 loop with both the
preparation and the key side on two warpgroups; the KDA layer under that configuration; the plan and the
argument checks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention_jax.pallas_kernels import gpu
from linear_attention_jax.pallas_kernels.gpu import GpuConfig, call_plan, channel, channel_prep
from tests.ops.conftest import make_inputs, rel_rms
from tests.pallas_kernels.gpu.util import F16_TOL, KERNELS, PARAMS, check, packed_runs

SPLIT = dataclasses.replace(KERNELS, prep_warpgroups=2)
NAMES = ("qg", "kd", "w", "u", "p", "X", "M")


def _strong_half(g, seed):
  g = np.asarray(g, np.float32).copy()
  g[..., :32] = -np.random.default_rng(seed).uniform(3.0, 20.0, g[..., :32].shape)
  return g


@pytest.mark.parametrize("grams,half_forms,l2,packed,V", [
    ("one", False, False, True, 64), ("groups", False, True, False, 64), ("halves", False, False, False, 64),
    ("chunk", True, True, True, 64), ("chunk", False, False, False, 64), ("chunk", True, False, True, 256)])
def test_two_warpgroup_preparation_equals_the_one_warpgroup_kernel(grams, half_forms, l2, packed, V):
  # bfloat16 operands; T = 150 (three chunks, the last partial), two value heads on one key head; the
  # strong channels in the first half for the per-chunk forms (the second half takes one reference).
  # V = 64: warpgroup 1 writes both halves of qg and kd after its hand-over; V = 256 leaves no room for
  # its staging tiles, and each warpgroup writes its own half before
  T = 150
  inp = make_inputs("kda", B=1, T=T, H=1, Hv=2, K=128, V=V, gates="normal", seed=81)
  g = _strong_half(inp["g"], 82) if grams in ("groups", "chunk") else np.asarray(inp["g"]) * 0.5
  q, k, v = (jnp.asarray(inp[n] * (4.0 if n == "q" else 1.0), jnp.bfloat16) for n in ("q", "k", "v"))
  args = (q, k, v, jnp.asarray(g), jnp.asarray(inp["beta"]))
  seg = jnp.asarray(packed_runs(T)) if packed else None
  if grams == "one":
    G, _ = channel.chunk_cumsum(args[3], 192, 64)
    assert bool(channel.fits(G, 64, jnp.bfloat16))
  outs = {}
  for warpgroups in (1, 2):
    run = jax.jit(lambda *a, w=warpgroups: channel_prep.prepare(
        *a, chunk_size=64, dtype=jnp.bfloat16, segment_ids=seg, interpret=PARAMS, with_inverse=True,
        grams=grams, half_forms=half_forms, qk_l2norm=l2, warpgroups=w))
    t, X, M = run(*args)
    outs[warpgroups] = dict(qg=t.qg, kd=t.kd, w=t.w, u=t.u, p=t.p, X=X, M=M)
  errors = {n: rel_rms(np.asarray(outs[2][n], np.float32), np.asarray(outs[1][n], np.float32)) for n in NAMES}
  print(errors)
  for n in ("qg", "kd"):   # each half's columns: the same arithmetic
    np.testing.assert_array_equal(np.asarray(outs[2][n], np.float32), np.asarray(outs[1][n], np.float32))
  for n, e in errors.items():   # P and M summed in another order (bfloat16 outputs)
    assert np.isfinite(np.asarray(outs[2][n], np.float32)).all() and e < 1e-3, (n, errors)


@pytest.mark.parametrize("gates,dtype", [("normal", jnp.bfloat16), ("strong", jnp.bfloat16),
                                         ("normal", jnp.float16)], ids=["bf16", "bf16-strong", "f16"])
def test_both_two_warpgroup_kernels_match_the_float64_loop(gates, dtype):
  # the op at K = 128 with the preparation and the key side on two warpgroups, packed rows and an initial
  # state; "strong": gates down to -20 a token on every channel; float16 (the 16-bit products the value
  # side writes in its narrower range) with gates within its one-reference bound
  inp = make_inputs("kda", B=1, T=140, H=1, Hv=1, K=128, V=64, gates=gates, seed=83)
  f16 = dtype == jnp.float16
  if f16:
    inp["g"] = np.asarray(inp["g"]) * 0.4
    G, _ = channel.chunk_cumsum(jnp.asarray(inp["g"]), 192, 64)
    assert bool(channel.fits(G, 64, jnp.float16))
  config = dataclasses.replace(SPLIT, key_warpgroups=2)
  check("kda", inp, seg=packed_runs(140), dtype=dtype, tol=F16_TOL if f16 else 1e-2, config=config)


def test_the_plan_and_the_checks():
  q = jnp.zeros((1, 64, 1, 128), jnp.bfloat16)
  v = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
  g = jnp.zeros((1, 64, 1, 128), jnp.float32)
  beta = jnp.zeros((1, 64, 1), jnp.float32)
  plan = call_plan(q, q, v, g, beta, config=SPLIT)
  assert plan.prep_warpgroups == 2 and plan.interpreter_threads() == {"prep_warpgroups=2": 3}
  assert call_plan(q[..., :64], q[..., :64], v, g[..., :64], beta, config=SPLIT).prep_warpgroups == 1
  assert call_plan(q, q, v, g, None, config=SPLIT).prep_warpgroups == 1   # gla
  assert call_plan(q, q, v, g, beta, config=KERNELS).prep_warpgroups == 1
  with pytest.raises(ValueError, match="prep_warpgroups must be one of"):
    GpuConfig(prep_warpgroups=3)
  with pytest.raises(ValueError, match="kda at K = 128"):
    channel_prep.prepare(q, q, v, g, None, chunk_size=64, dtype=jnp.bfloat16, warpgroups=2)


def test_the_kda_layer_takes_both_two_warpgroup_kernels_by_default(monkeypatch):
  # where users are: KimiDeltaAttention (K = 128, bfloat16, its own gates and the layer order) fwd+bwd in
  # the interpreter under the default config: both two-warpgroup kernels run, and the loss and every
  # parameter's gradient agree with the one-warpgroup kernels' (`key_warpgroups=1, prep_warpgroups=1`)
  from flax import nnx
  from linear_attention_jax import layers
  from linear_attention_jax.pallas_kernels.gpu import channel_delta_keys, channel_prep_split
  from linear_attention_jax.pallas_kernels.gpu.interpret import interpret_kernels
  calls = []
  for module, name in ((channel_delta_keys, "key_side"), (channel_prep_split, "kernel")):
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
  layer = layers.KimiDeltaAttention(256, 2, head_dim=128, impl="pallas", dtype=jnp.bfloat16, rngs=nnx.Rngs(3))
  x = jnp.asarray(np.random.default_rng(4).normal(size=(1, 70, 256)), jnp.float32)

  def loss(layer):
    y, _ = layer(x)
    return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(y.shape[-1], dtype=jnp.float32)))

  runs = []
  for config in (GpuConfig(key_warpgroups=1, prep_warpgroups=1), GpuConfig()):
    with interpret_kernels(), gpu.default_config(config):
      runs.append(jax.jit(nnx.value_and_grad(loss))(layer))
  assert sorted(set(calls)) == ["kernel", "key_side"], calls
  (l1, g1), (l2, g2) = runs
  # the two preparations round their bfloat16 tiles apart (6.5e-5 of the loss under jax 0.12.1's
  # interpreter, within 1e-5 under 0.11.2's)
  assert abs(float(l2) - float(l1)) <= 2e-4 * abs(float(l1))
  for a, b in zip(jax.tree.leaves(nnx.state(g1)), jax.tree.leaves(nnx.state(g2))):
    assert np.isfinite(np.asarray(b)).all() and rel_rms(np.asarray(b), np.asarray(a)) < 2e-2
