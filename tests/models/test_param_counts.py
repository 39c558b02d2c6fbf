"""The ~125M parameter-count table is computed from abstract models and kept in docs/param_counts.md."""

from __future__ import annotations

import pathlib

from linear_attention_jax.models import count_params, param_counts_markdown, preset_125m
from linear_attention_jax.models.param_counts import abstract_model

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "param_counts.md"


def test_transformer_count_matches_the_formula():
  config = preset_125m("A")
  d, L, V, m = config.width, config.depth, config.vocab_size, config.mlp_dim
  # tied embedding; per block: q, k, v, o (4 d^2), SwiGLU (3 d m), two RMSNorm weights; final norm
  assert count_params(abstract_model(config)) == V * d + L * (4 * d * d + 3 * d * m + 2 * d) + d


def test_docs_table_is_current():
  text = param_counts_markdown()
  print(text)
  assert DOC.read_text() == text, "regenerate docs/param_counts.md with param_counts_markdown()"
