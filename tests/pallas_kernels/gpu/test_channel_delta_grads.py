"""kda's gradient kernels (`channel_delta_grads.py`) in the Mosaic GPU interpreter: the whole op (the
preparation kernel writing the inverse, the forward walk keeping the chunk states, the reverse walk, the
value-side and key-side kernels) against the float64 loop, with grouped heads, packed rows, sequence
pieces and an initial state; strong decay within the bound; decay beyond it takes the XLA merge form's
vjp. A spy checks that the kernels ran."""

import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention_jax.pallas_kernels.gpu import channel, channel_delta_grads
from tests.ops.conftest import make_inputs
from tests.pallas_kernels.gpu.util import KERNELS, check, packed_runs


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


def test_kda_gradient_kernels_at_strong_decay_within_the_bound(monkeypatch):
  # bfloat16 operands, g = -1.8 a token on half the channels: each chunk spans 115 nats there, so the
  # kernels' factors reach e^(+-58) (the one-reference bound is 60)
  calls = _spy(monkeypatch)
  inp = make_inputs("kda", B=1, T=129, H=1, Hv=1, K=64, V=64, gates="normal", seed=42)
  g = np.asarray(inp["g"]).copy()
  g[..., ::2] = -1.8
  inp["g"] = g
  G, _ = channel.chunk_cumsum(jnp.asarray(g), 192, 64)
  assert bool(channel.fits(G, 64, jnp.bfloat16))
  check("kda", inp, dtype=jnp.bfloat16, tol=1e-2, config=KERNELS)
  assert calls


def test_kda_beyond_the_bound_takes_the_merge_form():
  # g down to -20 a token: beyond float16's bound, so the call's tensors and gradients come from XLA's
  # merge form, one batch row and value head at a time (two rows, grouped heads, packed rows)
  inp = make_inputs("kda", B=2, T=70, H=1, Hv=2, K=64, V=64, gates="strong", seed=43)
  G, _ = channel.chunk_cumsum(jnp.asarray(inp["g"]), 128, 64)
  assert not bool(channel.fits(G, 64, jnp.float16))
  seg = np.zeros((2, 70), np.int32)
  seg[0, 30:], seg[1, 66:] = 1, 1
  check("kda", inp, seg=seg, config=KERNELS)
