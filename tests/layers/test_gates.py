"""The papers' gate parameterisations: GLA's log-sigmoid / 16, Gated DeltaNet's and KDA's
-exp(A_log) * softplus(a + dt_bias), KDA's bounded gate, sigmoid beta, and the A_log / dt_bias
initialisations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention_jax import layers
from linear_attention_jax.layers.base import a_log_init, dt_bias_init

x = jax.random.normal(jax.random.key(0), (2, 5, 32))


def test_gated_delta_net_gate_is_mamba2_decay_per_value_head():
  # Given a Gated DeltaNet layer with grouped value heads
  layer = layers.GatedDeltaNet(32, 2, num_v_heads=4, rngs=nnx.Rngs(0))
  # When its gates are computed
  g, beta = layer.gates(x)
  # Then g = -exp(A_log) softplus(x W_a + dt_bias) per value head, and beta = sigmoid(x W_b)
  a = x @ layer.a_proj.kernel[...]
  want = -jnp.exp(layer.A_log[...]) * jax.nn.softplus(a + layer.dt_bias[...])
  np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(beta, jax.nn.sigmoid(x @ layer.b_proj.kernel[...]), rtol=1e-5)
  assert g.shape == beta.shape == (2, 5, 4) and g.dtype == jnp.float32
  assert bool(jnp.all(g < 0)) and layer.A_log.shape == layer.dt_bias.shape == (4,)


def test_kda_gate_is_per_channel_from_a_low_rank_projection():
  layer = layers.KimiDeltaAttention(32, 2, num_v_heads=4, rngs=nnx.Rngs(0))
  g, beta = layer.gates(x)
  f = (x @ layer.f_down.kernel[...]) @ layer.f_up.kernel[...] + layer.dt_bias[...]
  want = -jnp.exp(layer.A_log[...])[:, None] * jax.nn.softplus(f.reshape(2, 5, 4, 16))
  np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)
  assert g.shape == (2, 5, 4, 16) and beta.shape == (2, 5, 4)
  assert layer.f_down.kernel.shape == (32, 16)  # rank V
  assert layer.A_log.shape == (4,) and layer.dt_bias.shape == (4 * 16,)


def test_kda_bounded_gate_stays_within_its_lower_bound():
  # Kimi Linear's successors: g = lb * sigmoid(exp(A_log) * (f + dt_bias)), in (lb, 0)
  layer = layers.KimiDeltaAttention(32, 2, gate_lower_bound=-5.0, rngs=nnx.Rngs(0))
  x = 4.0 * jax.random.normal(jax.random.key(1), (2, 9, 32))
  g, _ = layer.gates(x)
  f = layer.f_up(layer.f_down(x)).reshape(2, 9, 2, 16) + layer.dt_bias[...].reshape(2, 16)
  A = jnp.exp(layer.A_log[...])[:, None]
  np.testing.assert_allclose(g, -5.0 * jax.nn.sigmoid(A * f), rtol=1e-6)
  assert bool(jnp.all((g <= 0) & (g >= -5.0)))   # (lb, 0) up to float32 saturation
  for bad in (-6.0, 0.0, 1.0):
    with pytest.raises(ValueError, match="gate_lower_bound"):
      layers.KimiDeltaAttention(32, 2, gate_lower_bound=bad, rngs=nnx.Rngs(0))


def test_gla_decay_is_log_sigmoid_over_sixteen():
  layer = layers.GatedLinearAttention(32, 2, rngs=nnx.Rngs(0))
  assert layer.gk_down.kernel.shape == (32, 16)  # low rank 16
  logits = layer.gk_up(layer.gk_down(x))
  g = jax.nn.log_sigmoid(logits) / 16
  # log a in (log(1/2) / 16, 0) at zero logits: the decay stays close to 1
  assert bool(jnp.all(g <= 0))
  assert layer.head_dim == 16 and layer.head_v_dim == 16  # K = V = d / H, as LMConfig builds it


def test_a_log_and_dt_bias_initialisations():
  A = jnp.exp(a_log_init(jax.random.key(0), (1000,)))
  assert float(A.min()) >= 1.0 and float(A.max()) <= 16.0
  dt = jax.nn.softplus(dt_bias_init(jax.random.key(1), (1000,)))
  assert float(dt.min()) >= 1e-3 * 0.999 and float(dt.max()) <= 0.1 * 1.001


def test_default_head_shapes_are_the_lm_s_and_the_papers_are_keywords():
  rngs = nnx.Rngs(0)
  assert layers.MultiScaleRetention(32, 2, rngs=rngs).head_v_dim == 16  # V = K, as LMConfig builds it
  assert layers.GatedDeltaNet(32, 2, rngs=rngs).head_v_dim == 16       # V = K, as LMConfig builds it
  assert layers.GatedDeltaNet(32, 2, head_v_dim=32, rngs=rngs).head_v_dim == 32  # the paper's V = 2K
  gla = layers.GatedLinearAttention(32, 2, head_dim=8, head_v_dim=16, rngs=rngs)  # the paper's K = d / 2H
  assert (gla.head_dim, gla.head_v_dim) == (8, 16)
  assert layers.KimiDeltaAttention(32, 2, rngs=rngs).head_v_dim == 16  # V = K
  assert layers.DeltaNet(32, 2, rngs=rngs).q_conv is not None           # short convs on
  assert layers.LinearAttention(32, 2, rngs=rngs).q_conv is None


def test_layer_arguments_are_checked():
  import pytest
  rngs = nnx.Rngs(0)
  with pytest.raises(ValueError, match="num_v_heads"):
    layers.GatedDeltaNet(32, 2, num_v_heads=3, rngs=rngs)
  with pytest.raises(ValueError, match="width"):
    layers.DeltaNet(30, 4, rngs=rngs)
  with pytest.raises(ValueError, match="conv_size"):
    layers.KimiDeltaAttention(32, 2, conv_size=0, rngs=rngs)
  with pytest.raises(ValueError, match="impl"):
    layers.GatedLinearAttention(32, 2, impl="fast", rngs=rngs)
  with pytest.raises(ValueError, match="num_kv_heads"):
    layers.Attention(32, 4, num_kv_heads=3, rngs=rngs)
  with pytest.raises(ValueError, match="feature_map"):
    layers.LinearAttention(32, 2, feature_map="cosine", rngs=rngs)
