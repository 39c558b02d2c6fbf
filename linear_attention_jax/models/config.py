"""LMConfig: the shape of a language model whose layers follow a pattern of mixer letters.

One letter per mixer kind; the pattern repeats over depth ("GGGA" with depth 12 is G G G A three times):

  L  LinearAttention        (Katharopoulos et al. 2020; feature map + normaliser)
  R  MultiScaleRetention    (RetNet)
  F  GatedLinearAttention   (GLA; "F" for its forget gate)
  D  DeltaNet
  G  GatedDeltaNet
  K  KimiDeltaAttention     (KDA)
  A  Attention              (softmax, causal, GQA, RoPE)

Every field is checked when the config is built; a bad one raises a `ValueError` that names it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from linear_attention_jax import ops

MIXER_LETTERS = {
    "L": "LinearAttention",
    "R": "MultiScaleRetention",
    "F": "GatedLinearAttention",
    "D": "DeltaNet",
    "G": "GatedDeltaNet",
    "K": "KimiDeltaAttention",
    "A": "Attention",
}
LINEAR_LETTERS = "LRFDGK"
# Mixers whose papers put short convolutions on q, k, v (the others have none).
CONV_LETTERS = "DGK"


@dataclasses.dataclass(frozen=True)
class LMConfig:
  """A decoder-only LM: embedding, `depth` pre-norm blocks (RMSNorm, mixer, RMSNorm, SwiGLU), head.

  Attributes:
    vocab_size: tokens in the vocabulary.
    width: model width d.
    depth: number of blocks; a multiple of `len(pattern)`.
    num_heads: H, q/k heads of every mixer (query heads of Attention).
    pattern: mixer letters (see the module docstring), repeated over depth.
    num_kv_heads: Attention's key/value heads (default H; GQA when smaller).
    num_v_heads: H_v, value heads of the linear mixers, a multiple of H (default H).
    head_dim: K of the linear mixers and D of Attention (default width / H).
    head_v_dim: V of the linear mixers (default head_dim: every layer's own default, so a layer built
      alone with the same width and heads is the LM's layer).
    mlp_ratio: SwiGLU hidden width / d; the hidden width is rounded up to a multiple of 32.
    conv_size: width of the short convolutions (>= 1).
    use_short_conv: short convolutions on q, k, v in the mixers named by `conv_letters`.
    conv_letters: the mixers that get those convolutions (default "DGK", the mixers whose papers use
      them; "LRFDGKA" gives every mixer, attention too, one: the "short conv + mixer" models of
      associative-recall studies).
    tie_embeddings: the output head reuses the embedding matrix.
    rope_theta: rotary base (Attention and retention).
    norm_eps: epsilon of every RMSNorm.
    impl: the ops' implementation in training and prefill: "auto", "recurrent", "chunk", "pallas".
    chunk_size: chunk length of the chunked form (a power of two).
    dtype: compute dtype (activations, KV cache); recurrent states stay float32.
    param_dtype: parameter dtype.
    kda_gate_lower_bound: None (Kimi Linear's unbounded gate) or lb in [-5, 0): the K layers' bounded
      gate `lb * sigmoid(...)` (`KimiDeltaAttention(gate_lower_bound=lb)`).
  """
  vocab_size: int
  width: int
  depth: int
  num_heads: int
  pattern: str = "G"
  num_kv_heads: int | None = None
  num_v_heads: int | None = None
  head_dim: int | None = None
  head_v_dim: int | None = None
  mlp_ratio: float = 8 / 3
  conv_size: int = 4
  use_short_conv: bool = True
  conv_letters: str = CONV_LETTERS
  tie_embeddings: bool = True
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  impl: str = "auto"
  chunk_size: int = 64
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  kda_gate_lower_bound: float | None = None

  def __post_init__(self):
    def positive(name):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {name}={value!r}")
    for name in ("vocab_size", "width", "depth", "num_heads"):
      positive(name)
    for name in ("num_kv_heads", "num_v_heads", "head_dim", "head_v_dim"):
      if getattr(self, name) is not None:
        positive(name)
    if not isinstance(self.pattern, str) or not self.pattern:
      raise ValueError(f"pattern must be a non-empty string of mixer letters; got {self.pattern!r}")
    unknown = sorted(set(self.pattern) - set(MIXER_LETTERS))
    if unknown:
      raise ValueError(f"pattern={self.pattern!r} has unknown letters {unknown}; known: "
                       + ", ".join(f"{k}={v}" for k, v in MIXER_LETTERS.items()))
    if self.depth % len(self.pattern):
      raise ValueError(f"depth={self.depth} must be a multiple of len(pattern)={len(self.pattern)} "
                       f"(pattern={self.pattern!r})")
    if self.head_dim is None and self.width % self.num_heads:
      raise ValueError(f"width={self.width} must be divisible by num_heads={self.num_heads} "
                       f"(or set head_dim)")
    if self.num_v_heads is not None and self.num_v_heads % self.num_heads:
      raise ValueError(f"num_v_heads={self.num_v_heads} (H_v) must be a multiple of "
                       f"num_heads={self.num_heads} (H)")
    if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
    if "A" in self.pattern and self.resolved_head_dim % 2:
      raise ValueError(f"head_dim={self.resolved_head_dim} must be even for Attention's rotary "
                       f"embedding (pattern has 'A')")
    if not isinstance(self.conv_size, int) or isinstance(self.conv_size, bool) or self.conv_size < 1:
      raise ValueError(f"conv_size must be an integer >= 1; got conv_size={self.conv_size!r}")
    if not isinstance(self.conv_letters, str) or set(self.conv_letters) - set(MIXER_LETTERS):
      raise ValueError(f"conv_letters must be mixer letters ({''.join(MIXER_LETTERS)}); got "
                       f"conv_letters={self.conv_letters!r}")
    lb = self.kda_gate_lower_bound
    if lb is not None and (isinstance(lb, bool) or not isinstance(lb, (int, float)) or not -5.0 <= lb < 0.0):
      raise ValueError(f"kda_gate_lower_bound must be None or in [-5, 0); got kda_gate_lower_bound={lb!r}")
    if not self.mlp_ratio > 0:
      raise ValueError(f"mlp_ratio must be > 0; got mlp_ratio={self.mlp_ratio!r}")
    if self.impl not in ops.IMPLS:
      raise ValueError(f"impl must be one of {ops.IMPLS}; got impl={self.impl!r}")
    c = self.chunk_size
    if not isinstance(c, int) or c < 1 or c & (c - 1):
      raise ValueError(f"chunk_size must be a positive power of two; got chunk_size={c!r}")
    for name in ("dtype", "param_dtype"):
      if not jnp.issubdtype(jnp.dtype(getattr(self, name)), jnp.floating):
        raise ValueError(f"{name} must be a floating dtype; got {name}={getattr(self, name)!r}")

  @property
  def layer_kinds(self) -> str:
    """The mixer letter of every block, `depth` letters."""
    return self.pattern * (self.depth // len(self.pattern))

  @property
  def resolved_head_dim(self) -> int:
    return self.width // self.num_heads if self.head_dim is None else self.head_dim

  @property
  def mlp_dim(self) -> int:
    """SwiGLU hidden width: `mlp_ratio * width` rounded up to a multiple of 32."""
    return 32 * math.ceil(self.mlp_ratio * self.width / 32)

  def replace(self, **changes) -> LMConfig:
    """A copy with some fields changed (and checked again)."""
    return dataclasses.replace(self, **changes)
