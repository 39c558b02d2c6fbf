"""GatedLinearAttention (Yang, Wang, Shen, Panda, Kim 2024, "Gated Linear Attention Transformers with
Hardware-Efficient Training").

    q, k, v = x W_q, x W_k, x W_v                       (the paper: K = d / 2H, V = d / H, keys half as
                                                          wide; the default here: K = V = d / H)
    log a_t = log_sigmoid(x W_a1 W_a2 + b_a) / 16       (a low-rank (rank 16) gate per key channel;
                                                          the 1/16 "temperature" keeps a_t near 1)
    S_t = Diag(a_t) S_{t-1} + k_t v_t^T,   o_t = K^-1/2 S_t^T q_t
    y   = (RMSNorm(o) * swish(x W_r)) W_o
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention_jax import ops
from linear_attention_jax.layers.base import LinearMixer, linear
from linear_attention_jax.layers.cache import LinearCache
from linear_attention_jax.layers.norm import GatedRMSNorm


class GatedLinearAttention(LinearMixer):
  """GLA: a data-dependent decay per key channel from a low-rank projection.

  Args:
    width: model width d.
    num_heads: H.  num_v_heads: H_v (a multiple of H; default H); gates follow v's heads.
    head_dim: K (default d / H).  head_v_dim: V (default K). These are the sizes `LMConfig` gives the
      layer, so the layer built alone is the LM's; the paper's keys of half width are
      `head_dim=d // (2 * H), head_v_dim=d // H`.
    gate_low_rank_dim: rank of the gate projection (16 in the paper).
    gate_logit_normalizer: the decay is `log_sigmoid(.) / gate_logit_normalizer` (16 in the paper).
    norm_eps: epsilon of the gated output RMSNorm.
    use_short_conv, conv_size: causal depthwise convolutions on q, k, v (off, as in the paper).
    impl, chunk_size: passed to `ops.gla` in training and prefill.
    dtype, param_dtype: compute and parameter dtypes; the state is float32 regardless.
  """

  def __init__(self, width: int, num_heads: int, *, num_v_heads: int | None = None,
               head_dim: int | None = None, head_v_dim: int | None = None,
               gate_low_rank_dim: int = 16, gate_logit_normalizer: float = 16.0,
               norm_eps: float = 1e-5, use_short_conv: bool = False, conv_size: int = 4,
               impl: str = "auto", chunk_size: int = 64, dtype=jnp.float32, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    super().__init__(width, num_heads, num_v_heads=num_v_heads, head_dim=head_dim,
                     head_v_dim=head_v_dim, use_short_conv=use_short_conv, conv_size=conv_size,
                     impl=impl, chunk_size=chunk_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    if gate_low_rank_dim < 1 or not gate_logit_normalizer > 0:
      raise ValueError(f"need gate_low_rank_dim >= 1 and gate_logit_normalizer > 0; got "
                       f"{gate_low_rank_dim=} {gate_logit_normalizer=}")
    Hv, K, V = self.num_v_heads, self.head_dim, self.head_v_dim
    self.gate_logit_normalizer = float(gate_logit_normalizer)
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.gk_down = linear(width, gate_low_rank_dim, axes=("embed", None), **kw)
    self.gk_up = linear(gate_low_rank_dim, Hv * K, use_bias=True, axes=(None, "heads"), **kw)
    self.g_proj = linear(width, Hv * V, axes=("embed", "heads"), **kw)
    self.o_norm = GatedRMSNorm(V, eps=norm_eps, activation="swish", **kw)
    self.o_proj = linear(Hv * V, width, axes=("heads", "embed"), **kw)

  def __call__(self, x: jax.Array, cache: LinearCache | None = None):
    """Mixes `x: [B, T, width]` along T.

    Returns `(y [B, T, width], new cache or None)`; with a cache, T == 1 takes the one-token step and
    T > 1 runs the full op from the cached state.
    """
    B, T = self._check_input(x, cache)
    Hv, K, V = self.num_v_heads, self.head_dim, self.head_v_dim
    q, k, v, windows = self._project(x, cache)
    logits = self.gk_up(self.gk_down(x)).astype(jnp.float32).reshape(B, T, Hv, K)
    g = jax.nn.log_sigmoid(logits) / self.gate_logit_normalizer  # [B, T, H_v, K], <= 0
    o, state = self._recur(ops.gla, ops.gla_step, q, k, v, (g,), cache)
    o = self.o_norm(o, self.g_proj(x).reshape(B, T, Hv, V))
    y = self.o_proj(o.reshape(B, T, -1))
    return y, self._advance(cache, state, windows, T)
