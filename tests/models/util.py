"""Tiny models for the model tests, and jitted calls that compile fast."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention_jax.models import LM, LMConfig
from tests.layers.util import fast_jit

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


@functools.partial(fast_jit, static_argnums=0)
def _call(graphdef, state, tokens, cache):
  return nnx.merge(graphdef, state)(tokens, cache)


def call(model, tokens, cache):
  """`model(tokens, cache)` under jit."""
  graphdef, state = nnx.split(model)
  return _call(graphdef, state, tokens, cache)


def decode(model, toks, cache, start: int):
  """Feeds `toks[:, start:]` one token at a time; returns the logits `[B, T - start, vocab]`, cache."""
  outs = []
  for t in range(start, toks.shape[1]):
    logits, cache = call(model, toks[:, t:t + 1], cache)
    outs.append(logits)
  return jnp.concatenate(outs, axis=1), cache
