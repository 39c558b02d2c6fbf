"""`GpuConfig(order_channels="layer")` (the default): on the GPU's kernels the KDA layer takes its key
channels strongest first by ordering its projections' columns (`KimiDeltaAttention.channel_columns`),
which changes the layer's output and its parameters' gradients only by float32 rounding; the short
convolution's `channels` and `base.dense_columns` it is built from."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention_jax import layers, ops
from linear_attention_jax.layers import kda as kda_module
from linear_attention_jax.layers.base import dense_columns
from linear_attention_jax.layers.conv import ShortConvolution
from linear_attention_jax.pallas_kernels import gpu


def test_dense_columns_and_conv_channels_are_the_layers_own_outputs_reordered():
  r = np.random.default_rng(0)
  x = jnp.asarray(r.normal(size=(2, 9, 12)), jnp.float32)
  perm = jnp.asarray(r.permutation(16), jnp.int32)
  dense = nnx.Linear(12, 16, use_bias=True, rngs=nnx.Rngs(1))
  dense.bias[...] = jnp.asarray(r.normal(size=16), jnp.float32)
  np.testing.assert_allclose(dense_columns(dense, x, perm), dense(x)[..., perm], rtol=1e-6, atol=1e-6)
  conv = ShortConvolution(16, use_bias=True, impl="xla", rngs=nnx.Rngs(2))
  conv.bias[...] = jnp.asarray(r.normal(size=16), jnp.float32)
  z = jnp.asarray(r.normal(size=(2, 9, 16)), jnp.float32)
  y, _ = conv(z)
  y_perm, _ = conv(z[..., perm], channels=perm)
  np.testing.assert_allclose(y_perm, y[..., perm], rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="channels"):
    conv(z[:, :1], jnp.zeros((2, 3, 16), jnp.float32), channels=perm)
  with pytest.raises(ValueError, match="channels"):
    conv(z, channels=perm[:8])


def _loss_and_grads(layer, x):
  def loss(layer):
    y, _ = layer(x)
    return jnp.sum(y * jnp.cos(jnp.arange(y.shape[-1], dtype=y.dtype)))
  return nnx.value_and_grad(loss)(layer)


@pytest.mark.parametrize("conv,bound,groups", [(True, None, 2), (False, -5.0, 1)],
                         ids=["conv-grouped", "noconv-bounded"])
def test_kda_layer_ordering_its_channels_changes_only_the_rounding(conv, bound, groups, monkeypatch):
  H, K = 2, 16
  layer = layers.KimiDeltaAttention(64, H, num_v_heads=H * groups, head_dim=K, use_short_conv=conv,
                                    gate_lower_bound=bound, impl="auto", rngs=nnx.Rngs(3))
  x = jnp.asarray(np.random.default_rng(4).normal(size=(2, 40, 64)), jnp.float32)
  key, gate = layer.channel_columns(x)
  key, gate = np.asarray(key), np.asarray(gate)
  # a permutation within each head, the strongest decaying channels first, the value heads their key head's
  assert sorted(key) == list(range(H * K)) and (key.reshape(H, K) // K == np.arange(H)[:, None]).all()
  np.testing.assert_array_equal(gate.reshape(H, groups, K) % K,
                                np.repeat(key.reshape(H, 1, K) % K, groups, 1))
  g = np.asarray(layer.gates(x)[0])
  decay = -g.sum(axis=(0, 1)).reshape(H, groups, K).sum(axis=1)
  np.testing.assert_array_equal(key.reshape(H, K) % K, np.argsort(-decay, axis=-1, kind="stable"))
  assert (key != np.arange(H * K)).any()   # the layer's initialisation decays its channels unequally
  # a long batch: the gates of every order_stride(T)-th token, at least ORDER_TOKENS a row
  T = 3 * kda_module.ORDER_TOKENS + 5
  assert kda_module.order_stride(T) == 3 and kda_module.order_stride(2 * kda_module.ORDER_TOKENS - 1) == 1
  long = np.random.default_rng(5).normal(size=(2, T, 64))
  long[:, 1::3] *= 30   # the tokens left out, loud enough to change the whole batch's order
  long = jnp.asarray(long, jnp.float32)
  rank = lambda g: np.argsort(g.sum(axis=(0, 1)).reshape(H, groups, K).sum(axis=1), axis=-1, kind="stable")
  every_third, whole = (rank(np.asarray(layer.gates(x)[0])) for x in (long[:, ::3], long))
  assert (every_third != whole).any()
  np.testing.assert_array_equal(np.asarray(layer.channel_columns(long)[0]).reshape(H, K) % K, every_third)
  # "layer" is the default, and the order is taken only where the GPU's kernels can run (not on this CPU)
  assert gpu.layers_order_channels() and not layer._orders_channels(None)
  orders = []
  op = ops.kda
  monkeypatch.setattr(ops, "kda", lambda *a, **kw: orders.append(gpu.ops._config(None).order_channels)
                      or op(*a, **kw))
  loss, grads = _loss_and_grads(layer, x)
  assert orders == ["layer"]
  monkeypatch.setattr(kda_module, "_gpu_kernels", lambda: True)   # as on a Hopper GPU
  assert layer._orders_channels(None) and not layer._orders_channels(layer.init_cache(2, 8))
  with gpu.default_config(gpu.GpuConfig(order_channels="none")):
    assert not layer._orders_channels(None)
  seen = []
  columns = layer.channel_columns
  layer.channel_columns = lambda x: seen.append(1) or columns(x)
  loss2, grads2 = _loss_and_grads(layer, x)
  del layer.channel_columns
  assert seen, "the layer did not order its channels"
  assert orders == ["layer", "ordered"]   # its op told the channels come ordered
  np.testing.assert_allclose(loss2, loss, rtol=1e-5)
  for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(grads),
                               jax.tree_util.tree_leaves_with_path(grads2)):
    a, b = np.asarray(a), np.asarray(b)
    err = np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30)
    assert err < 1e-5, (jax.tree_util.keystr(path), err)
