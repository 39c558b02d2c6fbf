"""MultiHeadLatentAttention (MLA; DeepSeek-AI 2024, "DeepSeek-V2"), in the no-RoPE form of Kimi Linear's
full attention layers.

    q          = x W_q                      or, with a q LoRA,  q = RMSNorm(x W_qa) W_qb
                                            (H heads of D_n + D_r channels)
    c, k_r     = split(x W_kva)             (c: the kv latent, R channels; k_r: D_r channels every head
                                            shares)
    k_n, v     = split(RMSNorm(c) W_kvb)    (per head: D_n key channels, D_v value channels)
    k          = [k_n, k_r]                 (k_r the same for every head)
    o_t        = softmax(q_t k_{<=t}^T / sqrt(D_n + D_r)) v_{<=t};   y = o W_o

DeepSeek rotates q's and k_r's last D_r channels (RoPE); Kimi Linear leaves positions to its KDA layers
and rotates nothing, which is the form here. The cache holds `RMSNorm(c)` and `k_r`, `R + D_r` numbers
per token whatever H is; each call expands them into per-head keys and values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention_jax.layers.base import linear
from linear_attention_jax.layers.cache import LatentCache
from linear_attention_jax.layers.gated_attention import causal_softmax_attention, write_cache
from linear_attention_jax.layers.norm import RMSNorm


class MultiHeadLatentAttention(nnx.Module):
  """Causal MLA without rotary positions (see the module docstring).

  Args:
    width: model width d.
    num_heads: H.
    kv_lora_rank: R, channels of the kv latent.
    qk_nope_head_dim: D_n, per-head key channels from the latent.
    qk_rope_head_dim: D_r, key channels shared by all heads (0: none).
    v_head_dim: D_v.
    q_lora_rank: the rank of a low-rank q projection (None: a full one).
    norm_eps: epsilon of the latents' RMSNorms.
    dtype, param_dtype: compute (also the cache's) and parameter dtypes.
  """

  def __init__(self, width: int, num_heads: int, *, kv_lora_rank: int, qk_nope_head_dim: int,
               qk_rope_head_dim: int, v_head_dim: int, q_lora_rank: int | None = None,
               norm_eps: float = 1e-6, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    for name, value in dict(width=width, num_heads=num_heads, kv_lora_rank=kv_lora_rank,
                            qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim).items():
      if value < 1:
        raise ValueError(f"{name} must be >= 1; got {name}={value}")
    if qk_rope_head_dim < 0 or (q_lora_rank is not None and q_lora_rank < 1):
      raise ValueError(f"need qk_rope_head_dim >= 0 and q_lora_rank None or >= 1; got "
                       f"{qk_rope_head_dim=} {q_lora_rank=}")
    H, Dn, Dr, Dv, R = num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank
    self.width, self.num_heads, self.kv_lora_rank = width, H, R
    self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = Dn, Dr, Dv
    self.dtype = dtype
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    if q_lora_rank is None:
      self.q_proj = linear(width, H * (Dn + Dr), axes=("embed", "heads"), **kw)
      self.q_a_proj = self.q_a_norm = self.q_b_proj = None
    else:
      self.q_proj = None
      self.q_a_proj = linear(width, q_lora_rank, axes=("embed", None), **kw)
      self.q_a_norm = RMSNorm(q_lora_rank, eps=norm_eps, axis=None, **kw)
      self.q_b_proj = linear(q_lora_rank, H * (Dn + Dr), axes=(None, "heads"), **kw)
    self.kv_a_proj = linear(width, R + Dr, axes=("embed", None), **kw)
    self.kv_a_norm = RMSNorm(R, eps=norm_eps, axis=None, **kw)
    self.kv_b_proj = linear(R, H * (Dn + Dv), axes=(None, "heads"), **kw)
    self.o_proj = linear(H * Dv, width, axes=("heads", "embed"), **kw)

  def init_cache(self, batch: int, max_len: int | None = None) -> LatentCache:
    """Empty latent buffers `[B, max_len, R]` and `[B, max_len, D_r]` in the compute dtype."""
    if max_len is None or max_len < 1:
      raise ValueError(f"MultiHeadLatentAttention.init_cache needs max_len >= 1; got {max_len}")
    return LatentCache(latent=jnp.zeros((batch, max_len, self.kv_lora_rank), self.dtype),
                       k_shared=jnp.zeros((batch, max_len, self.qk_rope_head_dim), self.dtype),
                       pos=jnp.zeros((), jnp.int32))

  def state_size(self, seq_len: int | None = None) -> int:
    """Cache elements per sequence at context `seq_len`: `L (R + D_r)`."""
    if seq_len is None:
      raise ValueError("MultiHeadLatentAttention.state_size needs seq_len: its cache grows with L")
    return seq_len * (self.kv_lora_rank + self.qk_rope_head_dim)

  def __call__(self, x: jax.Array, cache: LatentCache | None = None):
    """Attends causally over `x: [B, T, width]` and the cached tokens before it.

    Returns `(y [B, T, width], new cache or None)`.
    """
    if x.ndim != 3 or x.shape[-1] != self.width:
      raise ValueError(f"x must have shape [B, T, width] with width={self.width}; got {x.shape}")
    if cache is not None and not isinstance(cache, LatentCache):
      raise ValueError(f"cache must be a LatentCache (from init_cache) or None; got {type(cache)}")
    B, T, _ = x.shape
    H, Dn, Dr, Dv, R = (self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim,
                        self.v_head_dim, self.kv_lora_rank)
    q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
    q = q.reshape(B, T, H, Dn + Dr)
    ckr = self.kv_a_proj(x)
    latent, k_shared = self.kv_a_norm(ckr[..., :R]), ckr[..., R:]
    start = jnp.zeros((), jnp.int32) if cache is None else cache.pos
    new_cache = None
    if cache is not None:
      latent = write_cache(cache.latent, latent, cache.pos)
      k_shared = write_cache(cache.k_shared, k_shared, cache.pos)
      new_cache = LatentCache(latent=latent, k_shared=k_shared, pos=cache.pos + T)
    S = latent.shape[1]
    kv = self.kv_b_proj(latent).reshape(B, S, H, Dn + Dv)
    k = jnp.concatenate([kv[..., :Dn], jnp.broadcast_to(k_shared[:, :, None, :], (B, S, H, Dr))], -1)
    positions = start + jnp.arange(T, dtype=jnp.int32)
    o = causal_softmax_attention(q, k, kv[..., Dn:], positions, scale=(Dn + Dr) ** -0.5)
    return self.o_proj(o.reshape(B, T, H * Dv)), new_cache
