"""GatedDeltaNet (Yang, Kautz, Hatamizadeh 2025, "Gated Delta Networks: Improving Mamba2 with Delta
Rule").

    q, k, v = SiLU(conv(x W_q)), SiLU(conv(x W_k)), SiLU(conv(x W_v))   (short convs, width 4)
    q, k    = q / |q|, k / |k|                                            (use_qk_l2norm=True)
    g_t     = -exp(A_log) * softplus(x W_a + dt_bias)                     (log decay per value head,
                                                                           Mamba-2's parameterisation)
    beta_t  = sigmoid(x W_b)
    S_t = e^{g_t} S_{t-1} + beta_t k_t (v_t - e^{g_t} S_{t-1}^T k_t)^T,   o_t = K^-1/2 S_t^T q_t
    y   = (RMSNorm(o) * swish(x W_g)) W_o

The decay erases the state wholesale (Mamba-2's gate); the delta rule edits it key by key. The paper's
value heads are twice as wide as the key heads (V = 2K: `head_v_dim=2 * head_dim`); the default here
is V = K (see `GatedDeltaNet`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention_jax import ops
from linear_attention_jax.layers.base import LinearMixer, a_log_init, dense_shared_input, dt_bias_init, linear
from linear_attention_jax.layers.cache import LinearCache
from linear_attention_jax.layers.norm import GatedRMSNorm
from linear_attention_jax.sharding.rules import axes


class GatedDeltaNet(LinearMixer):
  """Gated delta rule with a Mamba-2 decay, sigmoid beta, short convolutions and a gated RMSNorm.

  Args:
    width: model width d.
    num_heads: H.  num_v_heads: H_v (a multiple of H; default H); g, beta, A_log, dt_bias follow v.
    head_dim: K (default d / H).  head_v_dim: V (default K, as `LMConfig` builds it; the paper's V = 2K
      is `head_v_dim=2 * head_dim`). K is the default because the layer built alone should be the
      layer an LM builds, because the released hybrids (Qwen3-Next, Qwen3.5) use V = K with more value
      heads (`num_v_heads`) rather than wider ones. Both run on the GPU kernels (V = 256 in one
      call, the key side once per chunk, `pallas_kernels.gpu.plan.head_blocks`).
    norm_eps: epsilon of the gated output RMSNorm.
    use_short_conv, conv_size: causal depthwise convolutions (SiLU) on q, k, v; on by default.
    impl, chunk_size: passed to `ops.gated_delta_rule` in training and prefill.
    dtype, param_dtype: compute and parameter dtypes; the state, g and beta are float32 regardless.

  Parameters beyond the projections: `A_log: [H_v]` (log A, A ~ U(1, 16)) and `dt_bias: [H_v]`
  (inverse softplus of dt ~ logU(1e-3, 0.1)); both usually excluded from weight decay.
  """
  no_conv_activation = "silu"

  def __init__(self, width: int, num_heads: int, *, num_v_heads: int | None = None,
               head_dim: int | None = None, head_v_dim: int | None = None, norm_eps: float = 1e-5,
               use_short_conv: bool = True, conv_size: int = 4, impl: str = "auto",
               chunk_size: int = 64, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    super().__init__(width, num_heads, num_v_heads=num_v_heads, head_dim=head_dim,
                     head_v_dim=head_v_dim, use_short_conv=use_short_conv, conv_size=conv_size,
                     impl=impl, chunk_size=chunk_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    Hv, V = self.num_v_heads, self.head_v_dim
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.a_proj = linear(width, Hv, axes=("embed", "heads"), **kw)
    self.b_proj = linear(width, Hv, axes=("embed", "heads"), **kw)
    self.A_log = nnx.Param(a_log_init(rngs.params(), (Hv,), param_dtype), **axes("heads"))
    self.dt_bias = nnx.Param(dt_bias_init(rngs.params(), (Hv,), param_dtype), **axes("heads"))
    self.g_proj = linear(width, Hv * V, axes=("embed", "heads"), **kw)
    self.o_norm = GatedRMSNorm(V, eps=norm_eps, activation="swish", **kw)
    self.o_proj = linear(Hv * V, width, axes=("heads", "embed"), **kw)

  def gates(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(g, beta)`, each `[B, T, H_v]` float32, for `x: [B, T, width]`."""
    a, b = (y.astype(jnp.float32) for y in dense_shared_input((self.a_proj, self.b_proj), x))
    A = jnp.exp(self.A_log[...].astype(jnp.float32))
    g = -A * jax.nn.softplus(a + self.dt_bias[...].astype(jnp.float32))
    beta = jax.nn.sigmoid(b)
    return g, beta

  def __call__(self, x: jax.Array, cache: LinearCache | None = None):
    """Mixes `x: [B, T, width]` along T.

    Returns `(y [B, T, width], new cache or None)`; with a cache, T == 1 takes the one-token step and
    T > 1 runs the full op from the cached state (the convolutions continue from the cached windows).
    """
    B, T = self._check_input(x, cache)
    Hv, V = self.num_v_heads, self.head_v_dim
    q, k, v, windows = self._project(x, cache)
    g, beta = self.gates(x)
    o, state = self._recur(ops.gated_delta_rule, ops.gated_delta_rule_step, q, k, v, (g, beta), cache,
                           use_qk_l2norm=True)
    o = self.o_norm(o, self.g_proj(x).reshape(B, T, Hv, V))
    y = self.o_proj(o.reshape(B, T, -1))
    return y, self._advance(cache, state, windows, T)
