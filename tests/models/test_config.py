"""Bad configurations and bad uses raise ValueError naming the offending field, one test each."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from linear_attention_jax.models import MIXER_LETTERS, LMConfig
from tests.models.util import B, call, tiny_config, tiny_model, tokens


def test_a_good_config_builds_and_expands_its_pattern():
  config = tiny_config(depth=6, pattern="GA")
  assert config.layer_kinds == "GAGAGA"
  assert set(MIXER_LETTERS) == set("LRFDGKA")


def test_unknown_pattern_letter():
  with pytest.raises(ValueError, match=r"pattern='GGX'.*unknown letters \['X'\]"):
    tiny_config(pattern="GGX", depth=3)


def test_width_not_divisible_by_heads():
  with pytest.raises(ValueError, match="width=30 must be divisible by num_heads=4"):
    tiny_config(width=30, num_heads=4, num_v_heads=None)


def test_value_heads_not_a_multiple_of_heads():
  with pytest.raises(ValueError, match="num_v_heads=3"):
    tiny_config(num_v_heads=3)


def test_conv_width_below_one():
  with pytest.raises(ValueError, match="conv_size"):
    tiny_config(conv_size=0)


def test_depth_not_a_multiple_of_the_pattern():
  with pytest.raises(ValueError, match="depth=4"):
    tiny_config(depth=4, pattern="GKA")


def test_kv_heads_not_dividing_heads():
  with pytest.raises(ValueError, match="num_kv_heads=3"):
    tiny_config(num_heads=4, num_v_heads=None, num_kv_heads=3)


def test_unknown_impl():
  with pytest.raises(ValueError, match="impl"):
    tiny_config(impl="triton")


def test_chunk_size_not_a_power_of_two():
  with pytest.raises(ValueError, match="chunk_size"):
    tiny_config(chunk_size=24)


def test_non_float_dtype():
  with pytest.raises(ValueError, match="dtype"):
    tiny_config(dtype=jnp.int32)


def test_decoding_past_max_len():
  # Given a pure-linear model whose cache allows 6 tokens
  model = tiny_model(pattern="G", depth=1)
  cache = model.init_cache(B, max_len=6)
  # Then a prompt longer than max_len raises, and so does a decode step past it
  with pytest.raises(ValueError, match="max_len"):
    model(tokens(7), cache)
  _, cache = call(model, tokens(6), cache)
  with pytest.raises(ValueError, match="max_len"):
    model(tokens(1), cache)
