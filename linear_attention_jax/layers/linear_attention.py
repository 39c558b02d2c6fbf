"""LinearAttention: kernel linear attention (Katharopoulos et al. 2020, "Transformers are RNNs").

    q, k, v = x W_q, x W_k, x W_v                  (per head; optional short convolutions)
    S_t = S_{t-1} + phi(k_t) v_t^T                 (no decay)
    o_t = phi(q_t)^T S_t / (phi(q_t)^T z_t + eps)  z_t = sum_{j <= t} phi(k_j)   (normalize=True)
    y   = o W_o

phi is the feature map (elu + 1 in the paper). The normaliser z rides in the state as one extra value
column, so the state is `[B, H_v, K, V + 1]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention_jax import ops
from linear_attention_jax.layers.base import LinearMixer, linear
from linear_attention_jax.layers.cache import LinearCache


class LinearAttention(LinearMixer):
  """Kernel linear attention with a feature map and an optional normaliser.

  Args:
    width: model width d.
    num_heads: H, the q/k heads.
    num_v_heads: H_v (a multiple of H; default H).
    head_dim: K (default width / H).  head_v_dim: V (default K).
    feature_map: a name in `ops.FEATURE_MAPS` or a callable `[..., K] -> [..., K]`.
    normalize: divide by `phi(q)^T z` (the paper's form); the state gains one column.
    eps: added to the normaliser.
    use_short_conv, conv_size: causal depthwise convolutions on q, k, v (off by default).
    impl, chunk_size: passed to `ops.linear_attention` in training and prefill.
    dtype, param_dtype: compute and parameter dtypes; the state is float32 regardless.
  """

  def __init__(self, width: int, num_heads: int, *, num_v_heads: int | None = None,
               head_dim: int | None = None, head_v_dim: int | None = None,
               feature_map="elu_plus_one", normalize: bool = True, eps: float = 1e-6,
               use_short_conv: bool = False, conv_size: int = 4, impl: str = "auto",
               chunk_size: int = 64, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    ops.feature_maps.resolve_feature_map(feature_map)  # raises on an unknown name
    super().__init__(width, num_heads, num_v_heads=num_v_heads, head_dim=head_dim,
                     head_v_dim=head_v_dim, use_short_conv=use_short_conv, conv_size=conv_size,
                     impl=impl, chunk_size=chunk_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                     state_extra=int(normalize))
    self.feature_map, self.normalize, self.eps = feature_map, normalize, eps
    self.o_proj = linear(self.num_v_heads * self.head_v_dim, width, axes=("heads", "embed"), dtype=dtype,
                         param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array, cache: LinearCache | None = None):
    """Mixes `x: [B, T, width]` along T.

    Returns `(y [B, T, width], new cache or None)`; with a cache, T == 1 takes the one-token step and
    T > 1 runs the full op from the cached state.
    """
    B, T = self._check_input(x, cache)
    q, k, v, windows = self._project(x, cache)
    o, state = self._recur(ops.linear_attention, ops.linear_attention_step, q, k, v, (), cache,
                           feature_map=self.feature_map, normalize=self.normalize, eps=self.eps)
    y = self.o_proj(o.reshape(B, T, -1))
    return y, self._advance(cache, state, windows, T)
