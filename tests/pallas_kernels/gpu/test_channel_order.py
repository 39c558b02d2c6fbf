"""`GpuConfig.order_channels`: kda's channels taken strongest first (`channel.channel_order`), so that a
chunk whose strong channels scatter over the head's K lands them in one half of the key side's channels.

- `channel.permute_channels` gathers by the order and its cotangent by the inverse, per batch row and
  head, repeated over grouped value heads.
- kda end to end in the Mosaic GPU interpreter with the option, against the float64 loop: o, the final
  state and every gradient (h0 among them), grouped heads, 40 strong channels of 128 scattered
  differently in each row; the order puts every chunk's strong channels in its first half.
- With "ordered" (how the KDA layers call it under "layer", the default, having ordered their
  projections: tests/layers/test_channel_order.py) the op gathers nothing and its preparation still
  gives each half its own form: right for channels in any order, here both halves of every chunk beyond
  one reference. "layer" itself leaves a direct call of the op as "none".
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from linear_attention_jax.pallas_kernels.gpu import channel, channel_prep, plan
from tests.ops.conftest import make_inputs
from tests.pallas_kernels.gpu.util import KERNELS, check


def test_permute_channels_gathers_by_the_order_and_its_cotangent_by_the_inverse():
  r = np.random.default_rng(3)
  B, T, H, Hv, K = 2, 5, 2, 4, 8
  g = jnp.asarray(-r.uniform(0.0, 1.0, (B, T, Hv, K)), jnp.float32)
  order, inverse = channel.channel_order(g, H)
  decay = -np.asarray(g).sum(axis=1).reshape(B, H, 2, K).sum(axis=2)
  np.testing.assert_array_equal(np.asarray(order), np.argsort(-decay, axis=-1, kind="stable"))
  x = jnp.asarray(r.normal(size=(B, T, Hv, K)), jnp.float32)
  got = channel.permute_channels(x, order, inverse, 2, 3)
  for b in range(B):
    for h in range(Hv):   # value head h reads key head h // 2's order
      want = np.asarray(x[b, :, h])[:, np.asarray(order)[b, h // 2]]
      np.testing.assert_array_equal(np.asarray(got[b, :, h]), want)
  ct = jnp.asarray(r.normal(size=x.shape), jnp.float32)
  (dx,) = jax.vjp(lambda x: channel.permute_channels(x, order, inverse, 2, 3), x)[1](ct)
  back = channel.permute_channels(dx, order, inverse, 2, 3)
  np.testing.assert_array_equal(np.asarray(back), np.asarray(ct))
  state = jnp.asarray(r.normal(size=(B, Hv, K, 3)), jnp.float32)   # channels on axis 2
  back = channel.permute_channels(channel.permute_channels(state, order, inverse, 1, 2), inverse, order, 1, 2)
  np.testing.assert_array_equal(np.asarray(back), np.asarray(state))


def test_kda_with_its_channels_ordered_matches_the_float64_loop():
  B, T, H, Hv, K, V = 2, 192, 1, 2, 128, 64
  inp = make_inputs("kda", B=B, T=T, H=H, Hv=Hv, K=K, V=V, seed=21)
  r = np.random.default_rng(22)
  g = -r.uniform(0.0, 0.3, (B, T, Hv, K)).astype(np.float32)
  for b in range(B):   # 40 strong channels, a different set in each row, the same for its value heads
    strong = r.choice(K, 40, replace=False)
    g[b, :, :, strong] = r.uniform(-20.0, -2.0, (len(strong), T, Hv))
  inp["g"] = g
  refs = channel.chunk_cumsum(jnp.asarray(g), T, 64)[1]
  forms = np.asarray(channel.chunk_forms(refs, 64, jnp.bfloat16, width=64))
  assert (forms != channel.ONE).all()   # in the callers' order both halves of every chunk are beyond
  order, inverse = channel.channel_order(jnp.asarray(g), H)
  ordered = channel.permute_channels(jnp.asarray(g), order, inverse, 2, 3)
  forms = np.asarray(channel.chunk_forms(channel.chunk_cumsum(ordered, T, 64)[1], 64, jnp.bfloat16, width=64))
  assert (forms[..., 0] == channel.GROUPS).all() and (forms[..., 1] == channel.ONE).all(), forms
  config = dataclasses.replace(KERNELS, order_channels="op")
  p = plan.select(delta=True, decay="channel", config=config)
  assert p.order_channels and p.half_forms
  assert not plan.select(delta=False, decay="channel", config=config).half_forms
  check("kda", inp, dtype=jnp.bfloat16, tol=1e-2, config=config)


def test_kda_with_channels_ordered_by_its_caller_takes_half_forms_without_gathers(monkeypatch):
  B, T, H, Hv, K, V = 1, 130, 1, 1, 128, 64
  inp = make_inputs("kda", B=B, T=T, H=H, Hv=Hv, K=K, V=V, seed=23)
  r = np.random.default_rng(24)
  g = -r.uniform(0.0, 0.3, (B, T, Hv, K)).astype(np.float32)
  strong = r.choice(K, 30, replace=False)   # in both halves: the unordered worst case
  g[..., strong] = r.uniform(-20.0, -2.0, (B, T, Hv, len(strong)))
  inp["g"] = g
  forms = np.asarray(channel.chunk_forms(channel.chunk_cumsum(jnp.asarray(g), 192, 64)[1], 64, jnp.bfloat16,
                                         width=64))
  assert (forms != channel.ONE).all(axis=-1).any()   # a chunk with both halves beyond one reference
  # "layer" (the default) leaves a direct call of the op as "none"; the layer calls it "ordered"
  for order in ("layer", "none"):
    p = plan.select(delta=True, decay="channel", config=dataclasses.replace(KERNELS, order_channels=order))
    assert not p.half_forms and not p.order_channels
  config = dataclasses.replace(KERNELS, order_channels="ordered")
  p = plan.select(delta=True, decay="channel", config=config)
  assert p.half_forms and not p.order_channels
  seen = []
  for name in ("permute_channels", "channel_order"):
    monkeypatch.setattr(channel, name, lambda *a, _n=name, **kw: seen.append(_n))
  prepare = channel_prep.prepare
  monkeypatch.setattr(channel_prep, "prepare",
                      lambda *a, **kw: seen.append(("prepare", kw.get("half_forms"))) or prepare(*a, **kw))
  check("kda", inp, dtype=jnp.bfloat16, tol=1e-2, config=config)
  assert ("prepare", True) in seen and "permute_channels" not in seen and "channel_order" not in seen, seen
