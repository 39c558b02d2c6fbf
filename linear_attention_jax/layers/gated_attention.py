"""GatedAttention: softmax attention with a sigmoid output gate, q/k RMSNorm and partial RoPE (the full
attention layers of Qwen3-Next and Qwen3.5).

    q, g = x W_q, x W_g                        (H heads of D; g gates the output, Qiu et al. 2025,
                                                "Gated Attention for Large Language Models")
    k, v = x W_k, x W_v                        (H_kv heads, H % H_kv == 0)
    q, k = RMSNorm(q), RMSNorm(k)              (per head over D; zero-centred weights in Qwen)
    q, k = rotate the first `rotary_dim` channels of each head (RoPE, "rotate half"); the rest pass
    o_t  = softmax(q_t k_{<=t}^T / sqrt(D)) v_{<=t}
    y    = (o * sigmoid(g)) W_o

The cache is a `KVCache` of the normalised, rotated keys and the values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention_jax.layers.attention import attention_heads
from linear_attention_jax.layers.base import linear
from linear_attention_jax.layers.cache import KVCache
from linear_attention_jax.layers.norm import RMSNorm
from linear_attention_jax.layers.rope import apply_rope

_HI = jax.lax.Precision.HIGHEST


def causal_softmax_attention(q, k, v, q_positions, *, scale: float, num_keys=None):
  """Softmax attention in float32 where query i sees keys `j <= q_positions[i]` (and `j < num_keys`).

  Args:
    q: `[B, T, H, D]`.  k: `[B, S, H_kv, D]`.  v: `[B, S, H_kv, D_v]` (H % H_kv == 0; query head h
      reads key head h // (H / H_kv)).
    q_positions: `[T]` int, the absolute position of each query; key j sits at position j.
    scale: the logit scale.

  Returns `o: [B, T, H, D_v]` in q's dtype.
  """
  B, T, H, D = q.shape
  H_kv = k.shape[2]
  qg = q.astype(jnp.float32).reshape(B, T, H_kv, H // H_kv, D)
  logits = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32), precision=_HI) * scale
  mask = jnp.arange(k.shape[1])[None, :] <= q_positions[:, None]  # [T, S]
  logits = jnp.where(mask, logits, -jnp.inf)
  weights = jax.nn.softmax(logits, axis=-1)
  o = jnp.einsum("bkgts,bskd->btkgd", weights, v.astype(jnp.float32), precision=_HI)
  return o.reshape(B, T, H, v.shape[-1]).astype(q.dtype)


def write_cache(buffer, new, pos):
  """`buffer [B, L, ...]` with `new [B, T, ...]` written at row `pos`."""
  return jax.lax.dynamic_update_slice(buffer, new.astype(buffer.dtype), (0, pos) + (0,) * (new.ndim - 2))


class GatedAttention(nnx.Module):
  """Causal GQA softmax attention with q/k norms, partial RoPE and a sigmoid output gate.

  Args:
    width: model width d.
    num_heads: H, query heads.  num_kv_heads: H_kv (default H).
    head_dim: D (default d / H).
    rotary_dim: channels of each head that RoPE rotates (even, <= D; default D). Qwen3.5 and
      Qwen3-Next rotate a quarter of them.
    rope_theta: base of the rotary embedding.
    output_gate: multiply the attention output by `sigmoid(x W_g)` (default True).
    qk_norm: RMSNorm q and k per head (default True); `zero_centered_norm`: its weights are applied
      as `1 + w` (Qwen). `norm_eps`: its epsilon.
    dtype, param_dtype: compute (also the KV cache's) and parameter dtypes.
  """

  def __init__(self, width: int, num_heads: int, *, num_kv_heads: int | None = None,
               head_dim: int | None = None, rotary_dim: int | None = None,
               rope_theta: float = 10000.0, output_gate: bool = True, qk_norm: bool = True,
               zero_centered_norm: bool = True, norm_eps: float = 1e-6, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    H, H_kv, head_dim = attention_heads(width, num_heads, num_kv_heads, head_dim)
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if rotary_dim < 0 or rotary_dim > head_dim or rotary_dim % 2:
      raise ValueError(f"rotary_dim must be even and in [0, head_dim={head_dim}]; got {rotary_dim=}")
    self.width, self.num_heads, self.num_kv_heads, self.head_dim = width, H, H_kv, head_dim
    self.rotary_dim, self.rope_theta, self.dtype = rotary_dim, rope_theta, dtype
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.q_proj = linear(width, H * head_dim, axes=("embed", "heads"), **kw)
    self.g_proj = linear(width, H * head_dim, axes=("embed", "heads"), **kw) if output_gate else None
    self.k_proj = linear(width, H_kv * head_dim, axes=("embed", "kv_heads"), **kw)
    self.v_proj = linear(width, H_kv * head_dim, axes=("embed", "kv_heads"), **kw)
    self.o_proj = linear(H * head_dim, width, axes=("heads", "embed"), **kw)
    if qk_norm:
      norm_kw = dict(eps=norm_eps, zero_centered=zero_centered_norm, axis=None, **kw)
      self.q_norm, self.k_norm = RMSNorm(head_dim, **norm_kw), RMSNorm(head_dim, **norm_kw)
    else:
      self.q_norm = self.k_norm = None

  def init_cache(self, batch: int, max_len: int | None = None) -> KVCache:
    """Empty key/value buffers `[B, max_len, H_kv, D]` in the compute dtype."""
    if max_len is None or max_len < 1:
      raise ValueError(f"GatedAttention.init_cache needs max_len >= 1; got {max_len}")
    shape = (batch, max_len, self.num_kv_heads, self.head_dim)
    return KVCache(k=jnp.zeros(shape, self.dtype), v=jnp.zeros(shape, self.dtype),
                   pos=jnp.zeros((), jnp.int32))

  def state_size(self, seq_len: int | None = None) -> int:
    """Cache elements per sequence at context `seq_len`: `2 L H_kv D`."""
    if seq_len is None:
      raise ValueError("GatedAttention.state_size needs seq_len: its cache grows with the context")
    return 2 * seq_len * self.num_kv_heads * self.head_dim

  def _rope(self, x, positions):
    r = self.rotary_dim
    if r == 0:
      return x
    rotated = apply_rope(x[..., :r], positions, theta=self.rope_theta)
    return jnp.concatenate([rotated, x[..., r:]], axis=-1) if r < self.head_dim else rotated

  def __call__(self, x: jax.Array, cache: KVCache | None = None):
    """Attends causally over `x: [B, T, width]` and the cached tokens before it.

    Returns `(y [B, T, width], new cache or None)`; with a cache the T new keys and values are written
    at `cache.pos` (the caller keeps `pos + T <= max_len`).
    """
    if x.ndim != 3 or x.shape[-1] != self.width:
      raise ValueError(f"x must have shape [B, T, width] with width={self.width}; got {x.shape}")
    if cache is not None and not isinstance(cache, KVCache):
      raise ValueError(f"cache must be a KVCache (from init_cache) or None; got {type(cache)}")
    B, T, _ = x.shape
    H, H_kv, D = self.num_heads, self.num_kv_heads, self.head_dim
    start = jnp.zeros((), jnp.int32) if cache is None else cache.pos
    positions = start + jnp.arange(T, dtype=jnp.int32)
    q = self.q_proj(x).reshape(B, T, H, D)
    k = self.k_proj(x).reshape(B, T, H_kv, D)
    v = self.v_proj(x).reshape(B, T, H_kv, D)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = self._rope(q, positions), self._rope(k, positions)
    new_cache = None
    if cache is not None:
      k = write_cache(cache.k, k, cache.pos)
      v = write_cache(cache.v, v, cache.pos)
      new_cache = KVCache(k=k, v=v, pos=cache.pos + T)
    o = causal_softmax_attention(q, k, v, positions, scale=D ** -0.5).reshape(B, T, H * D)
    if self.g_proj is not None:
      o = (o.astype(jnp.float32) * jax.nn.sigmoid(self.g_proj(x).astype(jnp.float32))).astype(o.dtype)
    return self.o_proj(o), new_cache
