"""Flax NNX layers over `linear_attention_jax.ops`: six linear mixers, softmax Attention, and their parts.

Every mixer maps `x: [B, T, width]` to `(y [B, T, width], cache)`:

  mixer(x)            training: the full-sequence op (`impl`, default "auto"); returns `(y, None)`
  mixer(x, cache)     T > 1: prefill from `cache`; T == 1: one decode step; returns the advanced cache

and has `init_cache(batch, max_len=None)` and `state_size(seq_len=None)` (state elements per sequence).

Mixers:  LinearAttention, MultiScaleRetention, GatedLinearAttention, DeltaNet, GatedDeltaNet,
         KimiDeltaAttention (caches: LinearCache), Attention, GatedAttention (cache: KVCache),
         MultiHeadLatentAttention (cache: LatentCache).
MLPs:    SwiGLU, MoE (top-k routed experts and shared experts).
Parts:   ShortConvolution, RMSNorm (optionally zero-centred), GatedRMSNorm, HeadGroupNorm, apply_rope,
         Embed (nnx.Embed whose gradient is no contended scatter).
Linen:   init_cache(cls, *args, batch=B) gives the cache of a layer wrapped by `nnx.bridge.to_linen`.
"""

from linear_attention_jax.layers.attention import Attention
from linear_attention_jax.layers.bridge import init_cache
from linear_attention_jax.layers.cache import KVCache, LatentCache, LinearCache, nbytes
from linear_attention_jax.layers.conv import ShortConvolution
from linear_attention_jax.layers.delta_net import DeltaNet
from linear_attention_jax.layers.embed import Embed
from linear_attention_jax.layers.gated_attention import GatedAttention
from linear_attention_jax.layers.gated_delta_net import GatedDeltaNet
from linear_attention_jax.layers.gla import GatedLinearAttention
from linear_attention_jax.layers.kda import KimiDeltaAttention
from linear_attention_jax.layers.linear_attention import LinearAttention
from linear_attention_jax.layers.mla import MultiHeadLatentAttention
from linear_attention_jax.layers.mlp import SwiGLU
from linear_attention_jax.layers.moe import MoE
from linear_attention_jax.layers.norm import GatedRMSNorm, HeadGroupNorm, RMSNorm
from linear_attention_jax.layers.retention import MultiScaleRetention
from linear_attention_jax.layers.rope import apply_rope

__all__ = [
    "Attention", "DeltaNet", "Embed", "GatedAttention", "GatedDeltaNet", "GatedLinearAttention",
    "GatedRMSNorm",
    "HeadGroupNorm", "KVCache", "KimiDeltaAttention", "LatentCache", "LinearAttention", "LinearCache",
    "MoE", "MultiHeadLatentAttention", "MultiScaleRetention", "RMSNorm", "ShortConvolution", "SwiGLU",
    "apply_rope", "init_cache", "nbytes",
]
