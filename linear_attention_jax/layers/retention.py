"""MultiScaleRetention: RetNet's token mixer (Sun et al. 2023, "Retentive Network").

    q, k = rotate(x W_q), rotate(x W_k)              (rotary positions; the paper's xPos-style Theta)
    v    = x W_v
    S_t  = gamma_h S_{t-1} + k_t v_t^T               (a fixed decay per head, gamma_h = 1 - 2^(-5-h))
    o_t  = K^-1/2 S_t^T q_t
    y    = (swish(x W_G) * GroupNorm_heads(o)) W_O

The multi-scale part is the per-head gamma: heads see exponentially different horizons. GroupNorm with
one group per head normalises each head's output separately (their variances differ with gamma). The
paper's value heads are twice as wide as the key heads (V = 2K: `head_v_dim=2 * head_dim`); the default
here is V = K, what `LMConfig` builds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention_jax import ops
from linear_attention_jax.layers.base import LinearMixer, linear
from linear_attention_jax.layers.cache import LinearCache
from linear_attention_jax.layers.norm import HeadGroupNorm
from linear_attention_jax.layers.rope import apply_rope


class MultiScaleRetention(LinearMixer):
  """RetNet retention with per-head gamma, group norm over heads and a swish output gate.

  Args:
    width: model width d.
    num_heads: H.  num_v_heads: H_v (a multiple of H; default H); gamma is per value head.
    head_dim: K (default width / H).  head_v_dim: V (default K, as `LMConfig` builds the layer; the
      paper's V = 2K is `head_v_dim=2 * head_dim`).
    gamma: None (RetNet's `1 - 2^(-5-h)`), a float, or a sequence of H_v floats in (0, 1]; fixed.
    rope_theta: base of the rotary embedding on q and k.
    norm_eps: epsilon of the group norm.
    use_short_conv, conv_size: causal depthwise convolutions on q, k, v (off: RetNet has none).
    impl, chunk_size: passed to `ops.retention` in training and prefill.
    dtype, param_dtype: compute and parameter dtypes; the state is float32 regardless.
  """

  def __init__(self, width: int, num_heads: int, *, num_v_heads: int | None = None,
               head_dim: int | None = None, head_v_dim: int | None = None, gamma=None,
               rope_theta: float = 10000.0, norm_eps: float = 1e-5, use_short_conv: bool = False,
               conv_size: int = 4, impl: str = "auto", chunk_size: int = 64, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    super().__init__(width, num_heads, num_v_heads=num_v_heads, head_dim=head_dim,
                     head_v_dim=head_v_dim, use_short_conv=use_short_conv, conv_size=conv_size,
                     impl=impl, chunk_size=chunk_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    Hv, V = self.num_v_heads, self.head_v_dim
    ops.variants.retention_log_gamma(gamma, Hv)  # raises on a bad gamma
    self.gamma = None if gamma is None else tuple(float(x) for x in jnp.broadcast_to(
        jnp.asarray(gamma, jnp.float32), (Hv,)))
    self.rope_theta = rope_theta
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.g_proj = linear(width, Hv * V, axes=("embed", "heads"), **kw)
    self.group_norm = HeadGroupNorm(Hv, V, eps=norm_eps, **kw)
    self.o_proj = linear(Hv * V, width, axes=("heads", "embed"), **kw)

  def __call__(self, x: jax.Array, cache: LinearCache | None = None):
    """Mixes `x: [B, T, width]` along T.

    Returns `(y [B, T, width], new cache or None)`; with a cache, T == 1 takes the one-token step and
    T > 1 runs the full op from the cached state. Rotary positions continue from `cache.pos`.
    """
    B, T = self._check_input(x, cache)
    q, k, v, windows = self._project(x, cache)
    positions = self._positions(cache, T)
    q = apply_rope(q, positions, theta=self.rope_theta)
    k = apply_rope(k, positions, theta=self.rope_theta)
    gamma = None if self.gamma is None else jnp.asarray(self.gamma, jnp.float32)
    o, state = self._recur(ops.retention, ops.retention_step, q, k, v, (), cache, gamma=gamma)
    gate = jax.nn.silu(self.g_proj(x).astype(jnp.float32))
    o = self.group_norm(o).astype(jnp.float32) * gate.reshape(o.shape)
    y = self.o_proj(o.astype(self.dtype).reshape(B, T, -1))
    return y, self._advance(cache, state, windows, T)
