"""DeltaNet (Schlag et al. 2021; Yang, Wang, Zhang, Shen, Kim 2024, "Parallelizing Linear Transformers
with the Delta Rule over Sequence Length").

    q, k, v = SiLU(conv(x W_q)), SiLU(conv(x W_k)), SiLU(conv(x W_v))   (short convs, width 4)
    q, k    = q / |q|, k / |k|                                            (per head)
    beta_t  = sigmoid(x W_b)                                              (per value head)
    S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T,   o_t = K^-1/2 S_t^T q_t
    y   = RMSNorm(o) W_o

The state update writes the prediction error, so a key's old value is replaced instead of summed. Unit
keys and beta in (0, 1) keep `I - beta k k^T` a contraction.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention_jax import ops
from linear_attention_jax.layers.base import LinearMixer, linear
from linear_attention_jax.layers.cache import LinearCache
from linear_attention_jax.layers.norm import GatedRMSNorm


class DeltaNet(LinearMixer):
  """The delta rule with sigmoid beta, l2-normalised q/k, short convolutions and an output RMSNorm.

  Args:
    width: model width d.
    num_heads: H.  num_v_heads: H_v (a multiple of H; default H); beta follows v's heads.
    head_dim: K (default d / H).  head_v_dim: V (default K).
    use_output_gate: gate the output norm with `swish(x W_g)` (off in the paper's layer).
    norm_eps: epsilon of the output RMSNorm.
    use_short_conv, conv_size: causal depthwise convolutions (SiLU) on q, k, v; on by default. Without
      them q, k, v go through SiLU alone.
    impl, chunk_size: passed to `ops.delta_rule` in training and prefill.
    dtype, param_dtype: compute and parameter dtypes; the state is float32 regardless.
  """
  no_conv_activation = "silu"

  def __init__(self, width: int, num_heads: int, *, num_v_heads: int | None = None,
               head_dim: int | None = None, head_v_dim: int | None = None,
               use_output_gate: bool = False, norm_eps: float = 1e-5, use_short_conv: bool = True,
               conv_size: int = 4, impl: str = "auto", chunk_size: int = 64, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    super().__init__(width, num_heads, num_v_heads=num_v_heads, head_dim=head_dim,
                     head_v_dim=head_v_dim, use_short_conv=use_short_conv, conv_size=conv_size,
                     impl=impl, chunk_size=chunk_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    Hv, V = self.num_v_heads, self.head_v_dim
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.b_proj = linear(width, Hv, axes=("embed", "heads"), **kw)
    self.g_proj = linear(width, Hv * V, axes=("embed", "heads"), **kw) if use_output_gate else None
    self.o_norm = GatedRMSNorm(V, eps=norm_eps, activation="swish", **kw)
    self.o_proj = linear(Hv * V, width, axes=("heads", "embed"), **kw)

  def __call__(self, x: jax.Array, cache: LinearCache | None = None):
    """Mixes `x: [B, T, width]` along T.

    Returns `(y [B, T, width], new cache or None)`; with a cache, T == 1 takes the one-token step and
    T > 1 runs the full op from the cached state (the convolutions continue from the cached windows).
    """
    B, T = self._check_input(x, cache)
    Hv, V = self.num_v_heads, self.head_v_dim
    q, k, v, windows = self._project(x, cache)
    beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))  # [B, T, H_v]
    o, state = self._recur(ops.delta_rule, ops.delta_rule_step, q, k, v, (beta,), cache,
                           use_qk_l2norm=True)
    gate = None if self.g_proj is None else self.g_proj(x).reshape(B, T, Hv, V)
    y = self.o_proj(self.o_norm(o, gate).reshape(B, T, -1))
    return y, self._advance(cache, state, windows, T)
