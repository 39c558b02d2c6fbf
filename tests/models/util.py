"""Tiny models for the model tests; jitted calls and token-by-token decoding come from the layer tests."""

from __future__ import annotations

import jax
from flax import nnx

from linear_attention_jax.models import LM, LMConfig
from tests.layers.util import call, decode_tokens as decode  # noqa: F401 (re-exported)

VOCAB, B, T = 32, 2, 12


def tiny_config(**changes) -> LMConfig:
  """Width 32, 2 heads (H_v = 4 value heads), chunks of 8; a Gated DeltaNet, KDA, Attention hybrid."""
  fields = dict(vocab_size=VOCAB, width=32, depth=3, num_heads=2, num_v_heads=4, num_kv_heads=1,
                pattern="GKA", chunk_size=8)
  fields.update(changes)
  return LMConfig(**fields)


def tiny_model(**changes) -> LM:
  return LM(tiny_config(**changes), rngs=nnx.Rngs(0))


def tokens(T: int = T, seed: int = 0):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, VOCAB)
