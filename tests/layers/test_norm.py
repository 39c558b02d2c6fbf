"""GatedRMSNorm and HeadGroupNorm: per-head normalisation in float32, output in the layer dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_attention_jax.layers import GatedRMSNorm, HeadGroupNorm, apply_rope


def test_gated_rms_norm_is_rms_norm_times_activated_gate():
  # Given x and a gate over [B, T, H, V]
  x = jax.random.normal(jax.random.key(0), (2, 3, 4, 8))
  gate = jax.random.normal(jax.random.key(1), (2, 3, 4, 8))
  for activation, act in (("swish", jax.nn.silu), ("sigmoid", jax.nn.sigmoid)):
    norm = GatedRMSNorm(8, eps=1e-5, activation=activation, rngs=nnx.Rngs(0))
    # When normalised with and without the gate
    y, plain = norm(x, gate), norm(x)
    # Then each head's V vector has unit RMS before gating, and the gate multiplies it
    ref = x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(plain, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y, ref * act(gate), rtol=1e-5, atol=1e-6)


def test_gated_rms_norm_keeps_the_layer_dtype():
  norm = GatedRMSNorm(8, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  x = jnp.ones((1, 2, 8), jnp.bfloat16)
  assert norm(x, x).dtype == jnp.bfloat16


def test_head_group_norm_normalises_each_head_separately():
  # Given heads with very different scales
  x = jax.random.normal(jax.random.key(0), (2, 3, 4, 8)) * jnp.array([1.0, 10.0, 100.0, 0.1])[:, None]
  y = HeadGroupNorm(4, 8, eps=1e-9, rngs=nnx.Rngs(0))(x + 3.0)
  # Then every head has zero mean and unit variance over V
  np.testing.assert_allclose(jnp.mean(y, axis=-1), 0.0, atol=1e-5)
  np.testing.assert_allclose(jnp.var(y, axis=-1), 1.0, rtol=1e-3)


def test_rope_scores_depend_only_on_distance():
  # Given one query and one key vector placed at positions (p, p - 3) for several p
  q = jax.random.normal(jax.random.key(0), (1, 1, 1, 8))
  k = jax.random.normal(jax.random.key(1), (1, 1, 1, 8))
  scores = [float(jnp.sum(apply_rope(q, jnp.array([p])) * apply_rope(k, jnp.array([p - 3]))))
            for p in (3, 10, 50)]
  # Then the rotated dot products agree
  np.testing.assert_allclose(scores, scores[0], rtol=1e-4)
