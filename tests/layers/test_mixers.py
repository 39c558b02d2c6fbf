"""Every mixer: training output equals decoding (step by step, and prefill then steps), chunk mode equals
recurrent mode, gradients reach every parameter, and the state stays float32 in a bf16 layer."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from linear_attention_jax import layers
from tests.layers.util import (B, LINEAR_MIXERS, MIXERS, T, call, decode_tokens, fast_jit, inputs,
                               make_mixer, rel_rms)

F32_TOL, BF16_TOL = 1e-5, 2e-2


@pytest.mark.parametrize("name", MIXERS)
def test_step_by_step_decoding_equals_full_sequence(name):
  # Given a mixer and a sequence
  mixer, x = make_mixer(name), inputs()
  # When it runs on the whole sequence, and one token at a time from an empty cache
  full, _ = call(mixer, x, None)
  stepped, cache = decode_tokens(mixer, x, mixer.init_cache(B, max_len=T), start=0)
  # Then the outputs agree and the cache has counted every token
  err = rel_rms(stepped, full)
  print(f"{name}: step-by-step vs full, float32 rel RMS error {err:.2e}")
  assert err <= F32_TOL
  assert int(cache.pos) == T


@pytest.mark.parametrize("name", MIXERS)
def test_prefill_then_decode_equals_full_sequence(name):
  # Given a mixer and a sequence
  mixer, x = make_mixer(name), inputs()
  full, _ = call(mixer, x, None)
  # When 6 tokens are prefilled, 3 more prefilled from the cached state, and the rest decoded
  first, cache = call(mixer, x[:, :6], mixer.init_cache(B, max_len=T))
  second, cache = call(mixer, x[:, 6:9], cache)
  rest, cache = decode_tokens(mixer, x, cache, start=9)
  # Then the concatenated outputs equal the full forward
  err = rel_rms(jnp.concatenate([first, second, rest], axis=1), full)
  print(f"{name}: prefill 6 + prefill 3 + decode 4 vs full, float32 rel RMS error {err:.2e}")
  assert err <= F32_TOL


@pytest.mark.parametrize("name", LINEAR_MIXERS)
def test_chunk_mode_equals_recurrent_mode(name):
  # Given two copies of a mixer (same seed), one chunked (chunks of 8) and one recurrent
  chunked, recurrent = make_mixer(name, impl="chunk"), make_mixer(name, impl="recurrent")
  x = inputs()
  # When both run on the same sequence
  y_chunk, _ = call(chunked, x, None)
  y_rec, _ = call(recurrent, x, None)
  # Then their outputs agree
  err = rel_rms(y_chunk, y_rec)
  print(f"{name}: chunk vs recurrent, float32 rel RMS error {err:.2e}")
  assert err <= F32_TOL


@pytest.mark.parametrize("name", MIXERS)
def test_gradients_reach_every_parameter(name):
  # Given a mixer and a loss with a random cotangent
  mixer, x = make_mixer(name), inputs()
  cotangent = jax.random.normal(jax.random.key(7), x.shape)

  graphdef, params = nnx.split(mixer)

  @fast_jit
  def grads(params, x):
    return jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p)(x)[0] * cotangent))(params)

  # When differentiated through the training path
  g = grads(params, x)
  # Then every parameter has a finite gradient that is not identically zero
  leaves = jax.tree_util.tree_leaves_with_path(g)
  assert leaves
  for path, leaf in leaves:
    assert bool(jnp.all(jnp.isfinite(leaf))), jax.tree_util.keystr(path)
    assert bool(jnp.any(leaf != 0)), f"zero gradient for {jax.tree_util.keystr(path)}"


@pytest.mark.parametrize("name", MIXERS)
def test_bf16_mixer_keeps_float32_state_and_decodes_close(name):
  # Given a bf16 mixer (float32 parameters)
  mixer, x = make_mixer(name, dtype=jnp.bfloat16), inputs(jnp.bfloat16)
  # When it runs in full and token by token
  full, _ = call(mixer, x, None)
  stepped, cache = decode_tokens(mixer, x, mixer.init_cache(B, max_len=T), start=0)
  # Then outputs are bf16, the recurrent state and conv windows float32, and the paths agree loosely
  assert full.dtype == stepped.dtype == jnp.bfloat16
  if isinstance(cache, layers.LinearCache):
    assert cache.state.dtype == jnp.float32
    assert all(w.dtype == jnp.float32 for w in cache.conv)
  else:
    assert cache.k.dtype == jnp.bfloat16
  err = rel_rms(stepped, full)
  print(f"{name}: step-by-step vs full, bfloat16 rel RMS error {err:.2e}")
  assert err <= BF16_TOL


@pytest.mark.parametrize("name", MIXERS)
def test_state_size_counts_the_cache(name):
  # Given a mixer and its cache for one sequence at context 40
  mixer = make_mixer(name)
  cache = mixer.init_cache(1, max_len=40)
  # Then state_size is the number of cached elements (the position counter aside)
  cached = sum(math.prod(x.shape) for x in jax.tree.leaves(cache)) - 1
  assert mixer.state_size(40) == cached
  if name == "attention":
    assert mixer.state_size(80) == 2 * mixer.state_size(40)
    with pytest.raises(ValueError, match="seq_len"):
      mixer.state_size()
  else:
    assert mixer.state_size() == mixer.state_size(10**6)


def test_linear_state_size_formula():
  # K V H_v for the recurrent state plus (W - 1) times the convolved channels
  mixer = layers.GatedDeltaNet(32, 2, num_v_heads=4, head_dim=8, head_v_dim=16, conv_size=4,
                               rngs=nnx.Rngs(0))
  assert mixer.state_size() == 4 * 8 * 16 + 3 * (2 * 2 * 8 + 4 * 16)
  no_conv = layers.GatedDeltaNet(32, 2, head_dim=8, head_v_dim=16, use_short_conv=False,
                                 rngs=nnx.Rngs(0))
  assert no_conv.state_size() == 2 * 8 * 16
