"""Per-channel decay at any gate strength (`pallas_kernels/gpu/groups.py`): the kernels' 8-token groups'
grams in the Mosaic GPU interpreter, bfloat16 operands.

- The preparation kernel's grams (`grams="groups"`) against float64 sums at g = -20 on every channel,
  uniform in [-20, 0], and -inf on some tokens (floored at prep.LOG_DECAY_FLOOR: finite).
- gla and kda end to end (the preparation kernel, the walks, the gradient kernels) against the float64
  loop: o, the final state and every gradient, at strong gates, at the KDA layer's own gates and with
  -inf tokens, grouped heads and packed rows; a spy checks that the groups' kernels ran, forward and
  backward.
- The bound: bfloat16 operands always fit the groups (no per-head XLA branch is built); float16 ones
  fit 2.2 nats a token.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention_jax.pallas_kernels import prep
from linear_attention_jax.pallas_kernels.gpu import channel, channel_delta_grads, channel_grads, channel_prep
from linear_attention_jax.pallas_kernels.gpu import groups
from tests.ops.conftest import make_inputs, rel_rms
from tests.pallas_kernels.gpu.util import KERNELS, PARAMS, check, packed_runs


def _float64_grams(q, k, g):
  """P (j <= i) and the strict M of k with k, per chunk of 64, float64, g floored as the kernels do."""
  g = np.maximum(np.asarray(g, np.float64), prep.LOG_DECAY_FLOOR)
  T = q.shape[0]
  P, M = [], []
  for c in range(0, T, 64):
    G = np.cumsum(g[c:c + 64], axis=0)
    D = np.exp(np.minimum(G[:, None] - G[None], 0.0))
    qc, kc = np.asarray(q[c:c + 64], np.float64), np.asarray(k[c:c + 64], np.float64)
    P.append(np.tril(np.einsum("ic,jc,ijc->ij", qc, kc, D)))
    M.append(np.tril(np.einsum("ic,jc,ijc->ij", kc, kc, D), -1))
  return P, M


@pytest.mark.parametrize("gates", ["minus20", "uniform", "minus_inf"])
def test_group_grams_equal_float64_sums_at_any_gate_strength(gates):
  B, T, H, K = 1, 128, 1, 64
  r = np.random.default_rng(5)
  q, k, v = (r.normal(size=(B, T, H, K)).astype(np.float32) for _ in range(3))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  g = {"minus20": np.full((B, T, H, K), -20.0), "uniform": r.uniform(-20, 0, (B, T, H, K))}.get(
      gates, r.uniform(-3, 0, (B, T, H, K))).astype(np.float32)
  if gates == "minus_inf":
    g[0, 5, 0, :16] = -np.inf
    g[0, 70] = -np.inf
  beta = r.uniform(0.1, 1.0, (B, T, H)).astype(np.float32)
  cumsum = channel.chunk_cumsum(jnp.asarray(g), T, 64)
  assert not bool(channel.fits(cumsum[0], 64, jnp.bfloat16))   # beyond one reference
  assert bool(groups.fits(cumsum[0], 64, jnp.bfloat16))
  cast = lambda x: jnp.asarray(x, jnp.bfloat16)
  t, _ = channel_prep.prepare(cast(q), cast(k), cast(v), jnp.asarray(g), jnp.asarray(beta), chunk_size=64,
                              dtype=jnp.bfloat16, interpret=PARAMS, with_inverse=True, grams="groups")
  qb, kb = (np.asarray(cast(x).astype(jnp.float32))[0, :, 0] for x in (q, k))
  P, _ = _float64_grams(qb, kb, g[0, :, 0])
  for c in range(2):
    got = np.asarray(t.p[0, 0, c], np.float64)
    assert np.all(np.isfinite(got))
    assert rel_rms(got, P[c]) < 1e-2, (c, rel_rms(got, P[c]))
  # w and u (through M and the inverse) against XLA's float32 preparation with the merge-form gram
  ref = prep.prepare(jnp.asarray(qb)[None, :, None], jnp.asarray(kb)[None, :, None],
                     cast(v).astype(jnp.float32), prep.floor_log_decay(jnp.asarray(g)), jnp.asarray(beta),
                     None, chunk_size=64, dtype=jnp.float32, inverse_dtype=jnp.float32, gram_method="merge")
  for name in ("w", "u", "qg", "kd"):
    a, b = np.asarray(getattr(t, name), np.float64), np.asarray(getattr(ref, name), np.float64)
    assert np.all(np.isfinite(a)) and rel_rms(a, b) < 1e-2, (name, rel_rms(a, b))


def _spy(monkeypatch):
  seen = []
  for module, name in ((channel_prep, "prepare"), (channel_grads, "chunk_grads"),
                       (channel_delta_grads, "key_side")):
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **k: seen.append(
        (_n, k.get("grams", "one"))) or _f(*a, **k))
  return seen


def _kda_layer_gates(r, shape):
  """KimiDeltaAttention's gates at initialisation: -A softplus(a + dt_bias), A ~ U(1, 16) per head (the
  first head at the range's top, where a 64-token chunk decays past one reference's bound)."""
  A = r.uniform(1.0, 16.0, (shape[2], 1))
  A[0] = 16.0
  dt = np.exp(r.uniform(np.log(1e-3), np.log(0.1), shape[2:]))
  return (-A * np.logaddexp(0.0, r.normal(size=shape) + dt + np.log(-np.expm1(-dt)))).astype(np.float32)


@pytest.mark.parametrize("variant,gates,packed", [("gla", "strong", True), ("kda", "strong", False),
                                                  ("kda", "layer", True), ("gla", "minus_inf", False),
                                                  ("kda", "minus_inf", False)])
def test_per_channel_kernels_at_any_gate_strength_match_the_float64_loop(monkeypatch, variant, gates,
                                                                          packed):
  seen = _spy(monkeypatch)
  T = 130 + len(variant) + len(gates) + packed   # a fresh trace per case (the spy sees traces)
  inp = make_inputs(variant, B=1, T=T, H=1, Hv=2, K=64, V=64, gates="strong" if gates == "strong" else "normal",
                    seed=61)
  r = np.random.default_rng(62)
  if gates == "layer":
    inp["g"] = _kda_layer_gates(r, inp["g"].shape)
  if gates == "minus_inf":   # forget everything at one token on some channels, and on all at another
    g = np.asarray(inp["g"]).copy() * 8.0
    g[0, 3, :, :20] = -np.inf
    g[0, 100] = -np.inf
    inp["g"] = g
  G, _ = channel.chunk_cumsum(jnp.asarray(inp["g"]), 192, 64)
  assert not bool(channel.fits(G, 64, jnp.bfloat16))
  check(variant, inp, seg=packed_runs(T) if packed else None, dtype=jnp.bfloat16, tol=1e-2, config=KERNELS)
  ran = {name for name, grams in seen if grams == "groups"}
  assert ran == {"prepare", "key_side" if variant == "kda" else "chunk_grads"}, seen


def test_bfloat16_always_fits_the_groups_and_float16_does_not():
  assert groups.always_fits(jnp.bfloat16) and not groups.always_fits(jnp.float16)
  G, _ = channel.chunk_cumsum(jnp.full((1, 64, 1, 64), -1e9), 64, 64)   # floored to -20 a token
  assert bool(groups.fits(G, 64, jnp.bfloat16)) and not bool(groups.fits(G, 64, jnp.float16))
  G, _ = channel.chunk_cumsum(jnp.full((1, 64, 1, 64), -2.0), 64, 64)   # 16 nats a group: f16's edge
  assert bool(groups.fits(G, 64, jnp.float16))
  with pytest.raises(ValueError, match="power of two"):
    groups.groups(24)
