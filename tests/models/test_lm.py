"""The hybrid LM: full-sequence logits equal decoding with the cache (float32 tight, bf16 loose), the
cache is typed per block, gradients are finite, and generation runs under jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention_jax import layers
from linear_attention_jax.layers import KVCache, LinearCache
from linear_attention_jax.models import LM, MIXER_LETTERS, LMConfig, generate, make_mixer
from tests.layers.util import fast_jit, rel_rms
from tests.models.util import B, T, VOCAB, call, decode, tiny_model, tokens


def test_step_by_step_decoding_equals_full_forward():
  # Given the hybrid model and a token sequence
  model, toks = tiny_model(), tokens()
  # When it runs over the whole sequence, and one token at a time from an empty cache
  full, none = call(model, toks, None)
  stepped, cache = decode(model, toks, model.init_cache(B, max_len=T), start=0)
  # Then the logits agree
  err = rel_rms(stepped, full)
  print(f"hybrid GKA: step-by-step vs full logits, float32 rel RMS error {err:.2e}")
  assert err <= 1e-5
  assert none is None and full.shape == (B, T, VOCAB) and full.dtype == jnp.float32
  assert int(cache.pos) == T


def test_prefill_then_decode_equals_full_forward():
  model, toks = tiny_model(), tokens()
  full, _ = call(model, toks, None)
  # When the first 5 tokens are prefilled and the rest decoded
  head, cache = call(model, toks[:, :5], model.init_cache(B, max_len=T))
  tail, cache = decode(model, toks, cache, start=5)
  # Then the logits equal the full forward's
  err = rel_rms(jnp.concatenate([head, tail], axis=1), full)
  print(f"hybrid GKA: prefill 5 + decode 7 vs full logits, float32 rel RMS error {err:.2e}")
  assert err <= 1e-5


def test_cache_is_typed_per_block():
  model = tiny_model()
  cache = model.init_cache(B, max_len=T)
  kinds = [type(c) for c in cache.layers]
  assert kinds == [LinearCache, LinearCache, KVCache]
  gdn, kda, attn = cache.layers
  assert gdn.state.shape == (B, 4, 16, 16) and gdn.state.dtype == jnp.float32
  assert [w.shape for w in gdn.conv] == [(B, 3, 32), (B, 3, 32), (B, 3, 64)]
  assert attn.k.shape == (B, T, 1, 16) and cache.max_len == T


def test_bf16_model_keeps_float32_state_and_decodes_close():
  # Given the hybrid model in bf16 (float32 parameters)
  model, toks = tiny_model(dtype=jnp.bfloat16), tokens()
  # When it runs in full and as prefill + decode
  full, _ = call(model, toks, None)
  head, cache = call(model, toks[:, :5], model.init_cache(B, max_len=T))
  tail, cache = decode(model, toks, cache, start=5)
  # Then the recurrent states and conv windows stay float32, the KV cache is bf16, logits agree loosely
  for c in cache.layers:
    if isinstance(c, LinearCache):
      assert c.state.dtype == jnp.float32 and all(w.dtype == jnp.float32 for w in c.conv)
    else:
      assert c.k.dtype == c.v.dtype == jnp.bfloat16
  err = rel_rms(jnp.concatenate([head, tail], axis=1), full)
  print(f"hybrid GKA: prefill + decode vs full logits, bfloat16 rel RMS error {err:.2e}")
  assert err <= 2e-2


def test_gradients_are_finite_for_every_parameter():
  model, toks = tiny_model(), tokens()
  graphdef, params = nnx.split(model)

  def loss(params):
    logits, _ = nnx.merge(graphdef, params)(toks[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), toks[:, 1:, None], axis=-1))

  value, grads = fast_jit(jax.value_and_grad(loss))(params)
  assert np.isfinite(float(value))
  for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
    assert bool(jnp.all(jnp.isfinite(leaf))), jax.tree_util.keystr(path)


def test_greedy_generation_follows_the_full_forward_argmax():
  # Given a prompt, when 6 tokens are generated greedily under jit
  model, prompt = tiny_model(), tokens(4)
  out = generate(model, prompt, 6)
  # Then each new token is the argmax of the full forward's logits at the position before it
  assert out.shape == (B, 10) and out.dtype == jnp.int32
  np.testing.assert_array_equal(out[:, :4], prompt)
  logits, _ = call(model, out, None)
  np.testing.assert_array_equal(out[:, 4:], jnp.argmax(logits[:, 3:-1], axis=-1))


def test_sampling_is_reproducible_with_a_fixed_key():
  model, prompt = tiny_model(), tokens(4)
  key = jax.random.key(42)
  a = generate(model, prompt, 6, key=key, temperature=0.8, top_k=5)
  b = generate(model, prompt, 6, key=key, temperature=0.8, top_k=5)
  np.testing.assert_array_equal(a, b)
  assert bool(jnp.all((a >= 0) & (a < VOCAB)))
  # top_k = 1 leaves only the argmax: sampling becomes greedy
  greedy = generate(model, prompt, 6)
  np.testing.assert_array_equal(generate(model, prompt, 6, key=key, temperature=0.8, top_k=1), greedy)


def test_generation_past_max_len_raises():
  with pytest.raises(ValueError, match="max_len"):
    generate(tiny_model(), tokens(4), 6, max_len=8)


def test_untied_embeddings_add_an_output_head():
  from linear_attention_jax.models import count_params, preset_125m
  from linear_attention_jax.models.param_counts import abstract_model
  tied = abstract_model(preset_125m("GGGA"))
  untied = abstract_model(preset_125m("GGGA", tie_embeddings=False))
  assert tied.lm_head is None and untied.lm_head is not None
  assert count_params(untied) - count_params(tied) == 50304 * 768


@pytest.mark.parametrize("letter", "LRFDGKA")
def test_a_layer_built_alone_is_the_layer_the_lm_builds(letter):
  # Given an LM config of one mixer kind, and that mixer built alone from the same width and heads
  config = LMConfig(vocab_size=16, width=64, depth=1, num_heads=4, pattern=letter)
  cls = getattr(layers, MIXER_LETTERS[letter])
  shapes = lambda build: jax.tree.map(lambda p: p.shape, nnx.state(nnx.eval_shape(build), nnx.Param))
  # When both are built (abstractly: shapes only)
  from_lm = shapes(lambda: make_mixer(config, letter, rngs=nnx.Rngs(0)))
  alone = shapes(lambda: cls(config.width, config.num_heads, rngs=nnx.Rngs(0)))
  # Then they have the same parameters, path for path and shape for shape (one default per layer)
  assert from_lm == alone


def test_kda_gate_lower_bound_reaches_the_k_layers():
  # Given an LM of K and A layers with the bounded gate, and one without
  bounded = LMConfig(vocab_size=16, width=64, depth=2, num_heads=4, pattern="KA", kda_gate_lower_bound=-5.0)
  model = nnx.eval_shape(lambda: LM(bounded, rngs=nnx.Rngs(0)))
  plain = nnx.eval_shape(lambda: LM(LMConfig(vocab_size=16, width=64, depth=2, num_heads=4, pattern="KA"),
                                    rngs=nnx.Rngs(0)))
  # Then the K layer takes the bound, the default keeps Kimi Linear's unbounded gate
  assert model.blocks[0].mixer.gate_lower_bound == -5.0 and plain.blocks[0].mixer.gate_lower_bound is None
  for bad in (-6.0, 0.0, True, "x"):
    with pytest.raises(ValueError, match="kda_gate_lower_bound"):
      LMConfig(vocab_size=16, width=64, depth=2, num_heads=4, pattern="KA", kda_gate_lower_bound=bad)
