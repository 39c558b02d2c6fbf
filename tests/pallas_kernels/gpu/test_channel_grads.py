"""gla's gradient kernel (`channel_grads.py`) in the Mosaic GPU interpreter: the whole op (prepared
forward keeping the chunk states, reverse walk, the per-chunk gradient kernel) against the float64 loop,
with grouped heads, packed rows, sequence pieces and an initial state; decay strong enough to leave the
one-reference bound takes the XLA merge form's vjp, and the kernel's call is checked to happen; the
kernel's own reverse cumsum of dG against float64."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention_jax.pallas_kernels.gpu import channel, channel_grads
from tests.ops.conftest import make_inputs
from tests.pallas_kernels.gpu.util import KERNEL_BACKWARD, KERNELS, PARAMS, check, packed_runs


@pytest.mark.parametrize("K,V,Hv,packed,pieces,h0", [(64, 64, 2, False, None, False),
                                                     (128, 64, 1, True, None, True),
                                                     (64, 128, 1, False, 2, True)],
                         ids=["grouped", "K128-packed-h0", "V128-pieces-h0"])
def test_gla_gradient_kernel_matches_the_float64_loop(monkeypatch, K, V, Hv, packed, pieces, h0):
  calls = []
  original = channel_grads.chunk_grads
  monkeypatch.setattr(channel_grads, "chunk_grads", lambda *a, **k: calls.append(1) or original(*a, **k))
  T = 150 + 7 * (K // 64) + V // 64 + Hv   # a fresh trace per case (the kernel's call is counted)
  inp = make_inputs("gla", B=1, T=T, H=1, Hv=Hv, K=K, V=V, gates="normal", seed=31)
  if not h0:
    inp["h0"] = None
  # milder gates, so that every chunk fits float16's one-reference bound and the kernels' branch runs
  # (the spy below only sees the trace, and lax.cond traces both branches)
  inp["g"] = np.asarray(inp["g"]) * 0.4
  G, _ = channel.chunk_cumsum(jnp.asarray(inp["g"]), 256, 64)
  assert bool(channel.fits(G, 64, jnp.float16))
  check("gla", inp, seg=packed_runs(T) if packed else None, config=KERNEL_BACKWARD, pieces=pieces)
  assert calls, "the gradient kernel did not run"


@pytest.mark.parametrize("dg_cumsum", ["xla", "kernel"])
def test_gla_gradient_kernel_at_strong_decay_within_the_bound(monkeypatch, dg_cumsum):
  # bfloat16 operands, g = -1.8 a token on half the channels: each chunk spans 115 nats there, so the
  # kernel's factors reach e^(+-58) (the one-reference bound is 60): still the float64 loop's gradients,
  # dG's reverse cumsum in XLA or in the kernel (GpuConfig.dg_cumsum)
  summed = []
  original = channel_grads.chunk_grads
  monkeypatch.setattr(channel_grads, "chunk_grads",
                      lambda *a, **kw: summed.append(kw.get("reverse_cumsum")) or original(*a, **kw))
  inp = make_inputs("gla", B=1, T=128, H=1, Hv=1, K=64, V=64, gates="normal", seed=32)
  g = np.asarray(inp["g"]).copy()
  g[..., ::2] = -1.8
  inp["g"] = g
  G, _ = channel.chunk_cumsum(jnp.asarray(g), 128, 64)
  assert bool(channel.fits(G, 64, jnp.bfloat16))
  assert not bool(channel.fits(G, 64, jnp.float16))   # float16 would overflow: merge form
  check("gla", inp, config=dataclasses.replace(KERNEL_BACKWARD, dg_cumsum=dg_cumsum), dtype=jnp.bfloat16,
        tol=1e-2)
  assert set(summed) == {dg_cumsum == "kernel"}, summed


def test_gla_dg_under_strong_gates_cancels_each_pairs_terms():
  # bfloat16 operands, the benchmark's strong gates (about -10 nats a token: every chunk takes the
  # groups' products): dG's gram terms from the products' rounded operands, so that each pair's
  # shares of q dq and k dk cancel in dg's reverse cumsum. From q e^(G - R) in float32 instead, dg
  # was 1.06e-2 from the float64 loop here (NOTES.md v64), the other gradients as now
  inp = make_inputs("gla", B=1, T=200, H=1, Hv=2, K=64, V=64, gates="strong", seed=5)
  inp["h0"] = None
  errors = check("gla", inp, config=KERNELS, dtype=jnp.bfloat16, tol=1e-2)
  assert errors["dg"] <= 5e-3, errors


def test_gla_beyond_the_bound_takes_the_merge_form():
  # g down to -20 a token: some chunk's channel spans more than 2 x 8 nats (float16's bound), so the
  # call's tensors and gradients come from XLA's merge form (one lax.cond each), one batch row and
  # value head at a time: two rows, grouped heads and packed rows exercise the slicing; they match the
  # float64 loop
  inp = make_inputs("gla", B=2, T=96, H=1, Hv=2, K=64, V=64, gates="strong", seed=33)
  G, _ = channel.chunk_cumsum(jnp.asarray(inp["g"]), 128, 64)
  assert not bool(channel.fits(G, 64, jnp.float16))
  seg = np.zeros((2, 96), np.int32)
  seg[0, 30:], seg[1, 70:] = 1, 1
  check("gla", inp, seg=seg, config=KERNEL_BACKWARD)


@pytest.mark.parametrize("K,grams", [(128, "one"), (64, "groups")])
def test_the_gradient_kernel_takes_the_reverse_cumsum_of_dG_to_float32_precision(K, grams):
  # reverse_cumsum=True (bfloat16, C = 64): dg = U dG at the end of each program, dG's three bfloat16
  # parts in tiles free by then (K = 128: kd's two halves and Qr's; K = 64 with the groups: kd's, the
  # one q factor tile and P's); against dG's reverse cumsum in float64, the other outputs bit for bit
  B, T, Hv, V, C = 1, 192, 1, 64, 64
  r = np.random.default_rng(12)
  g = r.uniform(-0.4 if grams == "one" else -20.0, 0.0, (B, T, Hv, K)).astype(np.float32)
  G, refs = channel.chunk_cumsum(jnp.asarray(g), T, C)
  bf = lambda *shape: jnp.asarray(r.normal(size=shape) * 0.3, jnp.bfloat16)
  args = (bf(B, T, Hv, K), bf(B, T, Hv, K), bf(B, T, Hv, V), G, refs, bf(B, Hv, T // C, V, K),
          bf(B, Hv, T // C, V, K), bf(B, T, Hv, V))
  run = lambda summed: [np.asarray(x, np.float64) for x in channel_grads.chunk_grads(
      *args, dtype=jnp.bfloat16, interpret=PARAMS, grams=grams, reverse_cumsum=summed)]
  plain, summed = run(False), run(True)
  dG = plain[3].reshape(B, T // C, C, Hv, K)
  want = np.flip(np.cumsum(np.flip(dG, 2), 2), 2).reshape(plain[3].shape)
  err = np.abs(summed[3] - want)
  assert err.max() <= 1e-6 * np.abs(want).max(), err.max() / np.abs(want).max()
  assert np.abs(want - plain[3]).max() > 0.1 * np.abs(want).max()   # the sum is not dG
  for a, b in zip(plain[:3], summed[:3]):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="bfloat16"):
    channel_grads.chunk_grads(*args, dtype=jnp.float16, interpret=PARAMS, reverse_cumsum=True)
