"""Language models built from the layers: config (layer pattern), the hybrid LM, caches, generation.

Pattern letters: L LinearAttention, R MultiScaleRetention, F GatedLinearAttention, D DeltaNet,
G GatedDeltaNet, K KimiDeltaAttention, A Attention.

`HybridLM` / `HybridConfig` name each layer's mixer and MLP (the released hybrids' shape); `models.hf`
converts Qwen3.5, Qwen3-Next and Kimi Linear checkpoints into them.
"""

from linear_attention_jax.models.config import MIXER_LETTERS, LMConfig
from linear_attention_jax.models.generate import generate, sample_token
from linear_attention_jax.models.hybrid import HybridConfig, HybridLM
from linear_attention_jax.models.lm import LM, Block, LMCache, SwiGLU, make_mixer
from linear_attention_jax.models.param_counts import (count_params, param_count_table,
                                                     param_counts_markdown, preset_125m)

__all__ = [
    "HybridConfig", "HybridLM", "LM", "MIXER_LETTERS", "Block", "LMCache", "LMConfig", "SwiGLU", "count_params", "generate",
    "make_mixer", "param_count_table", "param_counts_markdown", "preset_125m", "sample_token",
]
