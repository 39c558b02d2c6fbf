"""Attention: causal softmax attention with grouped KV heads, rotary positions and a KV cache.

The hybrid models' exact-recall layer. It calls `jax.nn.dot_product_attention`. Left to itself (its
`implementation=None`) that function runs XLA's unfused form even on GPUs, so this layer picks: with
`implementation="auto"` it asks for cuDNN's fused kernel on NVIDIA GPUs when the call fits it (bf16 or
fp16, D <= 128 and a multiple of 8, a causal or padding mask) and XLA otherwise.

    q, k, v = rotate(x W_q), rotate(x W_k), x W_v       (H query heads, H_kv key/value heads, H % H_kv == 0)
                                                         (optionally conv(x W_*) first: short convolutions)
    o_t     = softmax(q_t k_{<=t}^T / sqrt(D)) v_{<=t}
    y       = o W_o

Its cache is the keys and values of every token, `2 L H_kv D` elements per sequence at context L: the
cost the linear mixers avoid. With `use_short_conv` the cache also holds the convolutions' windows.

`use_short_conv=True` puts a causal depthwise convolution (SiLU) on each of q, k and v before the
rotary embedding, as the delta-rule mixers have: a key can then carry the token before it, so one layer
can look a value up by its key (the "short conv + mixer" models of associative-recall studies). Off by
default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention_jax.layers.base import linear
from linear_attention_jax.layers.cache import KVCache
from linear_attention_jax.layers.conv import ShortConvolution
from linear_attention_jax.layers.rope import apply_rope

IMPLEMENTATIONS = ("auto", "xla", "cudnn")


class Attention(nnx.Module):
  """Causal multi-head / grouped-query softmax attention with RoPE.

  Args:
    width: model width d.
    num_heads: H, query heads.
    num_kv_heads: H_kv, key/value heads (default H; H % H_kv == 0 gives GQA).
    head_dim: D (default d / H).
    rope_theta: base of the rotary embedding.
    implementation: "auto" (cuDNN on NVIDIA GPUs where it fits, else XLA), "xla" or "cudnn" (passed
      to `jax.nn.dot_product_attention`, which raises if cuDNN cannot serve the call).
    use_short_conv, conv_size: causal depthwise convolutions (SiLU) on q, k, v; off by default.
    dtype, param_dtype: compute (also the KV cache's) and parameter dtypes.
  """

  def __init__(self, width: int, num_heads: int, *, num_kv_heads: int | None = None,
               head_dim: int | None = None, rope_theta: float = 10000.0,
               implementation: str = "auto", use_short_conv: bool = False, conv_size: int = 4,
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    H, H_kv, head_dim = attention_heads(width, num_heads, num_kv_heads, head_dim)
    if head_dim < 2 or head_dim % 2:
      raise ValueError(f"head_dim must be even (rotary pairs); got {head_dim=}")
    if implementation not in IMPLEMENTATIONS:
      raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}; got {implementation!r}")
    self.width, self.num_heads, self.num_kv_heads, self.head_dim = width, H, H_kv, head_dim
    self.rope_theta, self.implementation, self.dtype = rope_theta, implementation, dtype
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.q_proj = linear(width, H * head_dim, axes=("embed", "heads"), **kw)
    self.k_proj = linear(width, H_kv * head_dim, axes=("embed", "kv_heads"), **kw)
    self.v_proj = linear(width, H_kv * head_dim, axes=("embed", "kv_heads"), **kw)
    self.o_proj = linear(H * head_dim, width, axes=("heads", "embed"), **kw)
    if use_short_conv:
      self.q_conv = ShortConvolution(H * head_dim, conv_size, axis="heads", **kw)
      self.k_conv = ShortConvolution(H_kv * head_dim, conv_size, axis="kv_heads", **kw)
      self.v_conv = ShortConvolution(H_kv * head_dim, conv_size, axis="kv_heads", **kw)
    else:
      self.q_conv = self.k_conv = self.v_conv = None

  @property
  def convs(self) -> tuple[ShortConvolution, ...]:
    return () if self.q_conv is None else (self.q_conv, self.k_conv, self.v_conv)

  def init_cache(self, batch: int, max_len: int | None = None) -> KVCache:
    """Empty key/value buffers `[B, max_len, H_kv, D]` in the compute dtype (and zero conv windows)."""
    if max_len is None or max_len < 1:
      raise ValueError(f"Attention.init_cache needs max_len >= 1 (the KV buffer length); got {max_len}")
    shape = (batch, max_len, self.num_kv_heads, self.head_dim)
    return KVCache(k=jnp.zeros(shape, self.dtype), v=jnp.zeros(shape, self.dtype),
                   pos=jnp.zeros((), jnp.int32), conv=tuple(c.init_cache(batch) for c in self.convs))

  def state_size(self, seq_len: int | None = None) -> int:
    """Cache elements per sequence at context `seq_len`: keys and values, `2 L H_kv D` (2 L d for MHA),
    plus the conv windows when there are short convolutions."""
    if seq_len is None:
      raise ValueError("Attention.state_size needs seq_len: its cache grows with the context")
    return 2 * seq_len * self.num_kv_heads * self.head_dim + sum(c.state_size() for c in self.convs)

  def __call__(self, x: jax.Array, cache: KVCache | None = None):
    """Attends causally over `x: [B, T, width]` (and the cached tokens before it).

    Returns `(y [B, T, width], new cache or None)`. With a cache, the T new keys/values are written at
    `cache.pos`; the caller must keep `cache.pos + T <= max_len` (checked when `pos` is concrete).
    """
    if x.ndim != 3 or x.shape[-1] != self.width:
      raise ValueError(f"x must have shape [B, T, width] with width={self.width}; got {x.shape}")
    B, T, _ = x.shape
    H, H_kv, D = self.num_heads, self.num_kv_heads, self.head_dim
    if cache is not None and not isinstance(cache, KVCache):
      raise ValueError(f"cache must be a KVCache (from init_cache) or None; got {type(cache)}")
    start = jnp.zeros((), jnp.int32) if cache is None else cache.pos
    positions = start + jnp.arange(T, dtype=jnp.int32)
    q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    windows = ()
    if self.convs:
      old = (None,) * 3 if cache is None else cache.conv
      (q, wq), (k, wk), (v, wv) = (conv(z, w) for conv, z, w in zip(self.convs, (q, k, v), old))
      windows = (wq, wk, wv)
    q = apply_rope(q.reshape(B, T, H, D), positions, theta=self.rope_theta)
    k = apply_rope(k.reshape(B, T, H_kv, D), positions, theta=self.rope_theta)
    v = v.reshape(B, T, H_kv, D)
    def attend(q, k, v, mask=None, **kw):
      implementation = self._implementation(q.dtype, masked=mask is not None)
      return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation, **kw)

    if cache is None:
      o = attend(q, k, v, is_causal=True)
      return self.o_proj(o.reshape(B, T, H * D)), None

    L = cache.max_len
    if T > L:
      raise ValueError(f"T={T} tokens do not fit the KV cache of max_len={L}")
    _check_room(cache.pos, T, L)
    k_all = jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), (0, cache.pos, 0, 0))
    v_all = jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), (0, cache.pos, 0, 0))
    if T == 1:  # one query sees keys 0..pos: a padding mask, which cuDNN serves
      lengths = jnp.broadcast_to(cache.pos + 1, (B,)).astype(jnp.int32)
      o = attend(q, k_all.astype(q.dtype), v_all.astype(q.dtype), key_value_seq_lengths=lengths)
    else:
      mask = jnp.arange(L)[None, :] <= positions[:, None]  # [T, L]
      o = attend(q, k_all.astype(q.dtype), v_all.astype(q.dtype), mask=mask[None, None])
    new_cache = KVCache(k=k_all, v=v_all, pos=cache.pos + T, conv=windows)
    return self.o_proj(o.reshape(B, T, H * D)), new_cache

  def _implementation(self, dtype, *, masked: bool) -> str:
    """The `dot_product_attention` implementation for this call ("auto" resolved at trace time)."""
    if self.implementation != "auto":
      return self.implementation
    fits = (_on_nvidia_gpu() and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
            and self.head_dim <= 128 and self.head_dim % 8 == 0 and not masked)
    return "cudnn" if fits else "xla"


def attention_heads(width: int, num_heads: int, num_kv_heads: int | None, head_dim: int | None):
  """`(H, H_kv, head_dim)` of a softmax attention layer (H_kv default H, head_dim default width / H), or
  a ValueError naming the argument."""
  H = num_heads
  H_kv = H if num_kv_heads is None else num_kv_heads
  if H < 1 or H_kv < 1 or H % H_kv:
    raise ValueError(f"num_heads={H} must be a positive multiple of num_kv_heads={H_kv}")
  if head_dim is None:
    if width % H:
      raise ValueError(f"width={width} must be divisible by num_heads={H}, or pass head_dim")
    head_dim = width // H
  return H, H_kv, head_dim


def _on_nvidia_gpu() -> bool:
  device = jax.devices()[0]
  return device.platform == "gpu" and "cuda" in device.client.platform_version.lower()


def _check_room(pos, T, max_len):
  """Raises when the cache would overflow; silent when `pos` is traced (under jit)."""
  if isinstance(pos, jax.core.Tracer):
    return
  if int(pos) + T > max_len:
    raise ValueError(f"decoding past max_len: pos={int(pos)} + T={T} > max_len={max_len}")
