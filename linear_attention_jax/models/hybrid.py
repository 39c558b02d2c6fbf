"""HybridConfig and HybridLM: decoder LMs whose every layer names its mixer and its MLP, the shape of the
released hybrids (Qwen3.5, Qwen3-Next, Kimi Linear) that `models.hf` converts.

Mixer letters (one per layer, `mixers`):
  G  GatedDeltaNet             (grouped value heads; Qwen3.5, Qwen3-Next)
  K  KimiDeltaAttention        (Kimi Linear)
  Q  GatedAttention            (sigmoid output gate, q/k norms, partial RoPE; Qwen)
  M  MultiHeadLatentAttention  (no RoPE; Kimi Linear)
MLP letters (one per layer, `mlps`): D a dense SwiGLU, E a mixture of experts (`layers.MoE`).

    x = embed(tokens)
    for each layer:  x = x + mixer(norm(x));  x = x + mlp(norm(x))
    logits = head(norm(x))        (the embedding matrix when tie_embeddings)

`HybridLM` takes `(tokens, cache=None)` and returns `(logits, cache)` as `LM` does, and its cache is an
`LMCache`, so `generate` serves both.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention_jax import layers, ops
from linear_attention_jax.layers.embed import Embed
from linear_attention_jax.models.lm import LMCache
from linear_attention_jax.sharding.rules import axes

HYBRID_MIXERS = {"G": "GatedDeltaNet", "K": "KimiDeltaAttention", "Q": "GatedAttention",
                 "M": "MultiHeadLatentAttention"}
HYBRID_MLPS = {"D": "SwiGLU", "E": "MoE"}


@dataclasses.dataclass(frozen=True)
class HybridConfig:
  """Every field of a hybrid; the sections a model's letters do not use are ignored.

  Attributes:
    vocab_size, width: vocabulary and model width d.
    mixers: one mixer letter per layer (`HYBRID_MIXERS`); mlps: one MLP letter per layer (D or E).
    norm_eps: epsilon of every RMSNorm; zero_centered_norm: the block, final and q/k norms apply
      `1 + w` (Qwen) rather than `w` (Kimi).
    tie_embeddings: the head reuses the embedding matrix.
    num_heads, num_kv_heads, head_dim, rotary_dim, rope_theta, attn_output_gate: GatedAttention (Q);
      num_heads also MLA's heads.
    q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: MLA (M).
    linear_num_heads, linear_num_v_heads, linear_head_dim, linear_head_v_dim, conv_size: the delta
      mixers (G, K); kda_gate_bias: KDA's output gate has a bias.
    mlp_dim: the dense SwiGLU's hidden width.
    num_experts, experts_per_token, expert_dim, shared_expert_dim, shared_expert_gate, router,
      expert_score_bias, expert_groups, groups_per_token, normalize_expert_weights, routed_scaling:
      the MoE (E); see `layers.MoE`.
    impl, chunk_size: the delta rules' implementation in training and prefill, and its chunk length.
    dtype, param_dtype: compute and parameter dtypes; recurrent states stay float32.
  """
  vocab_size: int
  width: int
  mixers: str
  mlps: str
  norm_eps: float = 1e-6
  zero_centered_norm: bool = False
  tie_embeddings: bool = False
  num_heads: int = 1
  num_kv_heads: int | None = None
  head_dim: int | None = None
  rotary_dim: int | None = None
  rope_theta: float = 10000.0
  attn_output_gate: bool = True
  q_lora_rank: int | None = None
  kv_lora_rank: int = 0
  qk_nope_head_dim: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0
  linear_num_heads: int = 1
  linear_num_v_heads: int | None = None
  linear_head_dim: int = 0
  linear_head_v_dim: int = 0
  conv_size: int = 4
  kda_gate_bias: bool = False
  mlp_dim: int = 0
  num_experts: int = 0
  experts_per_token: int = 0
  expert_dim: int = 0
  shared_expert_dim: int = 0
  shared_expert_gate: bool = False
  router: str = "softmax"
  expert_score_bias: bool = False
  expert_groups: int = 1
  groups_per_token: int = 1
  normalize_expert_weights: bool = True
  routed_scaling: float = 1.0
  impl: str = "auto"
  chunk_size: int = 64
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    for name in ("vocab_size", "width"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1; got {name}={getattr(self, name)}")
    if not self.mixers or set(self.mixers) - set(HYBRID_MIXERS):
      raise ValueError(f"mixers={self.mixers!r} must be letters of {HYBRID_MIXERS}")
    if len(self.mlps) != len(self.mixers) or set(self.mlps) - set(HYBRID_MLPS):
      raise ValueError(f"mlps={self.mlps!r} needs one letter of {HYBRID_MLPS} per layer "
                       f"({len(self.mixers)} layers)")
    if "D" in self.mlps and self.mlp_dim < 1:
      raise ValueError(f"dense MLP layers need mlp_dim >= 1; got mlp_dim={self.mlp_dim}")
    if "E" in self.mlps and (self.num_experts < 1 or self.expert_dim < 1):
      raise ValueError(f"MoE layers need num_experts, expert_dim >= 1; got {self.num_experts=} "
                       f"{self.expert_dim=}")
    if set(self.mixers) & set("GK") and self.linear_head_dim < 1:
      raise ValueError(f"G and K layers need linear_head_dim >= 1; got {self.linear_head_dim}")
    if "M" in self.mixers and min(self.kv_lora_rank, self.qk_nope_head_dim, self.v_head_dim) < 1:
      raise ValueError("M layers need kv_lora_rank, qk_nope_head_dim, v_head_dim >= 1")
    if self.impl not in ops.IMPLS:
      raise ValueError(f"impl must be one of {ops.IMPLS}; got impl={self.impl!r}")

  @property
  def depth(self) -> int:
    return len(self.mixers)

  @property
  def pattern(self) -> str:
    """The mixer letters (what run summaries print)."""
    return self.mixers

  def replace(self, **changes) -> HybridConfig:
    return dataclasses.replace(self, **changes)


def make_hybrid_mixer(config: HybridConfig, letter: str, *, rngs: nnx.Rngs) -> nnx.Module:
  c = config
  kw = dict(dtype=c.dtype, param_dtype=c.param_dtype, rngs=rngs)
  if letter in "GK":
    linear = dict(num_v_heads=c.linear_num_v_heads, head_dim=c.linear_head_dim,
                  head_v_dim=c.linear_head_v_dim or c.linear_head_dim, norm_eps=c.norm_eps,
                  conv_size=c.conv_size, impl=c.impl, chunk_size=c.chunk_size, **kw)
    if letter == "G":
      return layers.GatedDeltaNet(c.width, c.linear_num_heads, **linear)
    return layers.KimiDeltaAttention(c.width, c.linear_num_heads, gate_bias=c.kda_gate_bias, **linear)
  if letter == "Q":
    return layers.GatedAttention(c.width, c.num_heads, num_kv_heads=c.num_kv_heads,
                                 head_dim=c.head_dim, rotary_dim=c.rotary_dim, rope_theta=c.rope_theta,
                                 output_gate=c.attn_output_gate, zero_centered_norm=c.zero_centered_norm,
                                 norm_eps=c.norm_eps, **kw)
  return layers.MultiHeadLatentAttention(
      c.width, c.num_heads, kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
      qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, q_lora_rank=c.q_lora_rank,
      norm_eps=c.norm_eps, **kw)


def make_hybrid_mlp(config: HybridConfig, letter: str, *, rngs: nnx.Rngs) -> nnx.Module:
  c = config
  kw = dict(dtype=c.dtype, param_dtype=c.param_dtype, rngs=rngs)
  if letter == "D":
    return layers.SwiGLU(c.width, c.mlp_dim, **kw)
  return layers.MoE(c.width, c.num_experts, c.experts_per_token, c.expert_dim,
                    shared_hidden=c.shared_expert_dim, router=c.router,
                    score_bias=c.expert_score_bias, num_groups=c.expert_groups,
                    groups_per_token=c.groups_per_token,
                    normalize_weights=c.normalize_expert_weights, routed_scaling=c.routed_scaling,
                    shared_gate=c.shared_expert_gate, **kw)


class HybridBlock(nnx.Module):
  """`x + mixer(norm(x))`, then `x + mlp(norm(x))`."""

  def __init__(self, config: HybridConfig, mixer: str, mlp: str, *, rngs: nnx.Rngs):
    norm = dict(eps=config.norm_eps, zero_centered=config.zero_centered_norm, dtype=config.dtype,
                param_dtype=config.param_dtype)
    self.letter = mixer
    self.mixer_norm = layers.RMSNorm(config.width, **norm)
    self.mixer = make_hybrid_mixer(config, mixer, rngs=rngs)
    self.mlp_norm = layers.RMSNorm(config.width, **norm)
    self.mlp = make_hybrid_mlp(config, mlp, rngs=rngs)

  def __call__(self, x, cache=None):
    h, cache = self.mixer(self.mixer_norm(x), cache)
    x = x + h
    return x + self.mlp(self.mlp_norm(x)), cache


class HybridLM(nnx.Module):
  """Decoder-only LM over `HybridConfig` (see the module docstring)."""

  def __init__(self, config: HybridConfig, *, rngs: nnx.Rngs):
    self.config = config
    kw = dict(dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)
    self.embed = Embed(config.vocab_size, config.width,
                           embedding_init=nnx.initializers.normal(0.02),
                           embedding_metadata=axes("vocab", "embed"), **kw)
    self.blocks = nnx.List([HybridBlock(config, m, f, rngs=rngs)
                            for m, f in zip(config.mixers, config.mlps)])
    self.final_norm = layers.RMSNorm(config.width, eps=config.norm_eps,
                                     zero_centered=config.zero_centered_norm, dtype=config.dtype,
                                     param_dtype=config.param_dtype)
    self.lm_head = (None if config.tie_embeddings else
                    nnx.Linear(config.width, config.vocab_size, use_bias=False,
                               kernel_metadata=axes("embed", "vocab"), **kw))

  def init_cache(self, batch: int, max_len: int) -> LMCache:
    """Empty caches for `batch` sequences of at most `max_len` tokens (see `LM.init_cache`)."""
    if batch < 1 or max_len < 1:
      raise ValueError(f"batch and max_len must be >= 1; got {batch=} {max_len=}")
    return LMCache(layers=tuple(b.mixer.init_cache(batch, max_len) for b in self.blocks),
                   max_len=max_len)

  def state_size(self, seq_len: int) -> int:
    """Cache elements per sequence at context `seq_len`, summed over the layers."""
    return sum(b.mixer.state_size(seq_len) for b in self.blocks)

  def __call__(self, tokens: jax.Array, cache: LMCache | None = None):
    """`tokens: [B, T]` int -> `(logits [B, T, vocab] float32, cache advanced by T or None)`."""
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"tokens must be an integer array [B, T]; got {tokens.dtype} {tokens.shape}")
    if cache is not None:
      if not isinstance(cache, LMCache) or len(cache.layers) != len(self.blocks):
        raise ValueError(f"cache must be an LMCache from init_cache with {len(self.blocks)} layers")
      pos = cache.pos
      if not isinstance(pos, jax.core.Tracer) and int(pos) + tokens.shape[1] > cache.max_len:
        raise ValueError(f"decoding past max_len: pos={int(pos)} + T={tokens.shape[1]} > "
                         f"max_len={cache.max_len}")
    x = self.embed(tokens)
    new = []
    for i, block in enumerate(self.blocks):
      x, c = block(x, None if cache is None else cache.layers[i])
      new.append(c)
    x = self.final_norm(x)
    logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
    new_cache = None if cache is None else LMCache(layers=tuple(new), max_len=cache.max_len)
    return logits.astype(jnp.float32), new_cache
