"""`conv_letters`: short convolutions on q, k, v in any mixer, attention included, with exact decoding."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from linear_attention_jax import layers
from linear_attention_jax.layers import KVCache, LinearCache
from tests.layers.util import rel_rms
from tests.models.util import B, T, call, decode, tiny_config, tiny_model, tokens


def test_every_mixer_can_get_short_convolutions():
  # Given a linear-attention + attention model with convolutions in every mixer
  model = tiny_model(pattern="LA", depth=2, conv_letters="LRFDGKA")
  # Then both mixers have them, and their caches hold the windows
  assert all(len(b.mixer.convs) == 3 for b in model.blocks)
  lin, attn = model.init_cache(B, max_len=T).layers
  assert isinstance(lin, LinearCache) and isinstance(attn, KVCache)
  assert [w.shape[1] for w in attn.conv] == [3, 3, 3]
  # And the default puts them only in the delta-rule mixers
  assert [len(b.mixer.convs) for b in tiny_model(pattern="LA", depth=2).blocks] == [0, 0]


def test_decoding_with_convolutions_everywhere_equals_the_full_forward():
  model, toks = tiny_model(pattern="LA", depth=2, conv_letters="LA"), tokens()
  full, _ = call(model, toks, None)
  head, cache = call(model, toks[:, :5], model.init_cache(B, max_len=T))
  tail, cache = decode(model, toks, cache, start=5)
  err = rel_rms(jnp.concatenate([head, tail], axis=1), full)
  print(f"LA with convs: prefill 5 + decode 7 vs full logits, float32 rel RMS error {err:.2e}")
  assert err <= 1e-5


def test_attention_state_size_counts_its_windows():
  layer = layers.Attention(32, 4, num_kv_heads=2, use_short_conv=True, conv_size=3, rngs=nnx.Rngs(0))
  cache = layer.init_cache(1, max_len=10)
  cached = sum(math.prod(x.shape) for x in jax.tree.leaves(cache)) - 1
  assert layer.state_size(10) == cached == 2 * 10 * 2 * 8 + 2 * (32 + 16 + 16)


def test_unknown_conv_letter():
  with pytest.raises(ValueError, match="conv_letters"):
    tiny_config(conv_letters="GX")
