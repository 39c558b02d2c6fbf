"""Every layer inside a Flax Linen model, through `flax.nnx.bridge.to_linen`."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.nnx import bridge

from linear_attention_jax import layers
from tests.layers.util import fast_jit, rel_rms

WIDTH = 32
LAYERS = {  # name -> (NNX class, constructor args); each maps [B, T, 32] to (y, cache)
    "LinearAttention": (layers.LinearAttention, (WIDTH, 2), {}),
    "MultiScaleRetention": (layers.MultiScaleRetention, (WIDTH, 2), {}),
    "GatedLinearAttention": (layers.GatedLinearAttention, (WIDTH, 2), {}),
    "DeltaNet": (layers.DeltaNet, (WIDTH, 2), {}),
    "GatedDeltaNet": (layers.GatedDeltaNet, (WIDTH, 2), {"num_v_heads": 4}),
    "KimiDeltaAttention": (layers.KimiDeltaAttention, (WIDTH, 2), {}),
    "Attention": (layers.Attention, (WIDTH, 4), {"num_kv_heads": 2}),
    "ShortConvolution": (layers.ShortConvolution, (WIDTH, 4), {}),
}


class LinenModel(nn.Module):
  """A Linen model with an NNX layer in the middle: Dense, the bridged layer (residual), Dense."""
  name_of_layer: str

  @nn.compact
  def __call__(self, x):
    cls, args, kwargs = LAYERS[self.name_of_layer]
    h = nn.Dense(WIDTH)(x)
    y, _ = bridge.to_linen(cls, *args, **kwargs, name="mixer")(h)
    return nn.Dense(8)(h + y)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_trains_inside_a_linen_model(name):
  # Given a Linen model wrapping the NNX layer
  model = LinenModel(name)
  x = jax.random.normal(jax.random.key(0), (2, 6, WIDTH))
  # When initialised and differentiated the Linen way
  variables = fast_jit(model.init)(jax.random.key(1), x)
  loss = lambda v: jnp.mean(model.apply(v, x) ** 2)
  value, grads = fast_jit(jax.value_and_grad(loss))(variables)
  # Then the layer's parameters live in the Linen tree and receive finite gradients
  assert "mixer" in variables["params"]
  assert np.isfinite(float(value))
  for leaf in jax.tree.leaves(grads["params"]["mixer"]):
    assert bool(jnp.all(jnp.isfinite(leaf)))


class LinenDecoder(nn.Module):
  """A bridged GatedDeltaNet called with its cache, as a Linen decoder would."""

  @nn.compact
  def __call__(self, x, cache=None):
    return bridge.to_linen(layers.GatedDeltaNet, WIDTH, 2, name="mixer")(x, cache)


def test_bridged_layer_decodes_with_its_cache():
  # Given a bridged Gated DeltaNet and an empty cache of the NNX layer's type
  model = LinenDecoder()
  x = jax.random.normal(jax.random.key(0), (1, 7, WIDTH))
  variables = fast_jit(model.init)(jax.random.key(1), x)
  cache = layers.GatedDeltaNet(WIDTH, 2, rngs=nnx.Rngs(0)).init_cache(1)
  apply = fast_jit(model.apply)
  # When it prefills 4 tokens and decodes 3
  full, _ = apply(variables, x)
  head, cache = apply(variables, x[:, :4], cache)
  outs = [head]
  for t in range(4, 7):
    y, cache = apply(variables, x[:, t:t + 1], cache)
    outs.append(y)
  # Then decoding equals the full forward
  assert rel_rms(jnp.concatenate(outs, axis=1), full) <= 1e-5
  assert int(cache.pos) == 7


@pytest.mark.parametrize("name", ["GatedDeltaNet", "Attention"])
def test_init_cache_from_the_bridge_arguments_matches_the_nnx_layer(name):
  # Given a layer's bridge arguments (no NNX instance)
  cls, args, kwargs = LAYERS[name]
  # When its cache is made from them
  cache = layers.init_cache(cls, *args, batch=2, max_len=9, **kwargs)
  # Then it is the NNX layer's own cache, array for array
  want = cls(*args, rngs=nnx.Rngs(0), **kwargs).init_cache(2, 9)
  assert type(cache) is type(want)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), cache) == jax.tree.map(lambda a: (a.shape, a.dtype), want)
  with pytest.raises(ValueError, match="rngs"):
    layers.init_cache(cls, *args, batch=2, rngs=nnx.Rngs(0), **kwargs)
