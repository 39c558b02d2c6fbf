"""The hybrid LM: token embedding, pre-norm blocks whose mixers follow `LMConfig.pattern`, output head.

    x = embed(tokens)
    for each block:  x = x + mixer(RMSNorm(x));  x = x + SwiGLU(RMSNorm(x))
    logits = head(RMSNorm(x))                      (the embedding matrix when tie_embeddings)

`LM.__call__(tokens, cache=None)` serves all three uses:

  training   cache None: every mixer runs its full-sequence op (`config.impl`); returns (logits, None)
  prefill    a cache and T > 1 tokens: the ops start from the cached states and return the new ones
  decode     a cache and T == 1: the linear mixers take their one-token step, Attention reads its KV cache
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_attention_jax import debug, layers
from linear_attention_jax.layers.cache import KVCache, LinearCache
from linear_attention_jax.layers.embed import Embed
from linear_attention_jax.layers.mlp import SwiGLU
from linear_attention_jax.models.config import CONV_LETTERS, LMConfig
from linear_attention_jax.sharding.rules import axes, constrain


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LMCache:
  """Per-block caches (`LinearCache` for linear mixers, `KVCache` for Attention) and the context limit.

  Attributes:
    layers: one cache per block, in order (a linear mixer's state `[B, H_v, K, V]` float32 and conv
      windows, attention's `[B, max_len, H_kv, D]` buffers).
    max_len: the most tokens a sequence may hold (the KV buffers' length); static.
  """
  layers: tuple[LinearCache | KVCache, ...]
  max_len: int = dataclasses.field(metadata=dict(static=True))

  @property
  def pos(self) -> jax.Array:
    """`[]` int32: tokens seen so far."""
    return self.layers[0].pos


def make_mixer(config: LMConfig, letter: str, *, rngs: nnx.Rngs) -> nnx.Module:
  """The mixer for one pattern letter, with the config's head sizes, dtypes and impl; it maps
  `x: [B, T, width]` to `(y [B, T, width], cache)`."""
  kw = dict(dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs,
            use_short_conv=config.use_short_conv and letter in config.conv_letters,
            conv_size=config.conv_size)
  if letter == "A":
    return layers.Attention(config.width, config.num_heads, num_kv_heads=config.num_kv_heads,
                            head_dim=config.head_dim, rope_theta=config.rope_theta, **kw)
  K = config.resolved_head_dim
  # head_v_dim None: the layer's own default (V = K), so the LM's layer is the layer built alone
  kw.update(num_v_heads=config.num_v_heads, head_dim=K, head_v_dim=config.head_v_dim,
            impl=config.impl, chunk_size=config.chunk_size)
  if letter in CONV_LETTERS:
    kw.update(norm_eps=config.norm_eps)
  cls = {"L": layers.LinearAttention, "R": layers.MultiScaleRetention,
         "F": layers.GatedLinearAttention, "D": layers.DeltaNet, "G": layers.GatedDeltaNet,
         "K": layers.KimiDeltaAttention}[letter]
  if letter == "R":
    kw.update(rope_theta=config.rope_theta, norm_eps=config.norm_eps)
  if letter == "F":
    kw.update(norm_eps=config.norm_eps)
  if letter == "K":
    kw.update(gate_lower_bound=config.kda_gate_lower_bound)
  return cls(config.width, config.num_heads, **kw)


class Block(nnx.Module):
  """Pre-norm residual block: `x + mixer(norm(x))`, then `x + mlp(norm(x))`."""

  def __init__(self, config: LMConfig, letter: str, *, rngs: nnx.Rngs):
    kw = dict(dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)
    self.letter = letter
    self.mixer_norm = nnx.RMSNorm(config.width, epsilon=config.norm_eps, scale_metadata=axes("embed"),
                                  **kw)
    self.mixer = make_mixer(config, letter, rngs=rngs)
    self.mlp_norm = nnx.RMSNorm(config.width, epsilon=config.norm_eps, scale_metadata=axes("embed"),
                                **kw)
    self.mlp = SwiGLU(config.width, config.mlp_dim, **kw)

  def __call__(self, x: jax.Array, cache=None):
    """`x: [B, T, d]` -> `(x', cache')`; the cache is this block's mixer cache or None."""
    h, cache = self.mixer(self.mixer_norm(x), cache)
    x = x + h
    return x + self.mlp(self.mlp_norm(x)), cache


class LM(nnx.Module):
  """Decoder-only language model over `LMConfig` (see the module docstring)."""

  def __init__(self, config: LMConfig, *, rngs: nnx.Rngs):
    self.config = config
    kw = dict(dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)
    self.embed = Embed(config.vocab_size, config.width,
                           embedding_init=nnx.initializers.normal(0.02),
                           embedding_metadata=axes("vocab", "embed"), **kw)
    self.blocks = nnx.List([Block(config, letter, rngs=rngs) for letter in config.layer_kinds])
    self.final_norm = nnx.RMSNorm(config.width, epsilon=config.norm_eps, scale_metadata=axes("embed"),
                                  **kw)
    self.lm_head = (None if config.tie_embeddings else
                    nnx.Linear(config.width, config.vocab_size, use_bias=False,
                               kernel_metadata=axes("embed", "vocab"), **kw))

  def init_cache(self, batch: int, max_len: int) -> LMCache:
    """Empty caches for `batch` sequences of at most `max_len` tokens.

    Linear mixers get a `LinearCache` (float32 state and conv windows, independent of max_len);
    Attention gets a `KVCache` with `[B, max_len, H_kv, D]` buffers.
    """
    if not isinstance(batch, int) or batch < 1:
      raise ValueError(f"batch must be a positive integer; got batch={batch!r}")
    if not isinstance(max_len, int) or max_len < 1:
      raise ValueError(f"max_len must be a positive integer; got max_len={max_len!r}")
    return LMCache(layers=tuple(b.mixer.init_cache(batch, max_len) for b in self.blocks),
                   max_len=max_len)

  def state_size(self, seq_len: int) -> int:
    """Cache elements per sequence at context `seq_len`, summed over the blocks' mixers."""
    return sum(b.mixer.state_size(seq_len) for b in self.blocks)

  def __call__(self, tokens: jax.Array, cache: LMCache | None = None):
    """Runs the model on `tokens: [B, T]` int.

    Returns `(logits [B, T, vocab] float32, cache)`: the cache advanced by T tokens, or None when
    `cache` is None (training). Raises when the tokens would run past `cache.max_len` (checked when
    the position is concrete, i.e. outside jit; `generate` checks its lengths up front).
    """
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"tokens must be an integer array [B, T]; got {tokens.dtype} {tokens.shape}")
    B, T = tokens.shape
    if cache is not None:
      if not isinstance(cache, LMCache) or len(cache.layers) != len(self.blocks):
        raise ValueError(f"cache must be an LMCache from init_cache with {len(self.blocks)} layers")
      if T > cache.max_len:
        raise ValueError(f"decoding past max_len: T={T} tokens > max_len={cache.max_len}")
      pos = cache.pos
      def room(p, max_len=cache.max_len):
        if int(p) + T > max_len:
          raise ValueError(f"decoding past max_len: pos={int(p)} + T={T} > max_len={max_len}")
      if debug.is_traced(pos):
        debug.check_at_run_time(room, pos)  # with debug_checks on
      else:
        room(pos)
    _check_token_ids(tokens, self.config.vocab_size)
    residual = ("batch", "seq", "embed")  # the layout of the residual stream under sharding rules
    x = constrain(self.embed(tokens), residual)
    new = []
    for i, block in enumerate(self.blocks):
      x, c = block(x, None if cache is None else cache.layers[i])
      x = constrain(x, residual)
      new.append(c)
    x = self.final_norm(x)
    logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
    new_cache = None if cache is None else LMCache(layers=tuple(new), max_len=cache.max_len)
    return logits.astype(jnp.float32), new_cache


def _check_token_ids(tokens, vocab_size: int):
  """Token ids outside [0, vocab_size) give NaN logits (or, for -1, the last row): raises for concrete
  tokens; traced ones only with `linear_attention_jax.debug_checks()` on, when the program runs."""
  def check(t):
    bad = (t < 0) | (t >= vocab_size)
    if bad.any():
      raise ValueError(f"token ids must lie in [0, vocab_size={vocab_size}); got {int(bad.sum())} outside "
                       f"(min {int(t.min())}, max {int(t.max())})")
  if debug.is_traced(tokens):
    debug.check_at_run_time(check, tokens)
  else:
    check(np.asarray(tokens))
