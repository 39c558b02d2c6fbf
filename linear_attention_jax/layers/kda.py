"""KimiDeltaAttention (Kimi Team 2025, "Kimi Linear", arXiv 2510.26692).

Gated DeltaNet with a decay per key channel instead of per head:

    q, k, v = SiLU(conv(x W_q)), SiLU(conv(x W_k)), SiLU(conv(x W_v))   (short convs, width 4)
    q, k    = q / |q|, k / |k|
    g_t     = -exp(A_log_h) * softplus(x W_f1 W_f2 + dt_bias)            (per channel, [H_v, K];
                                                                           a low-rank f projection, rank V)
                or, with `gate_lower_bound=lb` (lb in [-5, 0)), the bounded gate
            g_t = lb * sigmoid(exp(A_log_h) * (x W_f1 W_f2 + dt_bias))     (g in (lb, 0))
    beta_t  = sigmoid(x W_b)
    S'_t = Diag(e^{g_t}) S_{t-1};  S_t = S'_t + beta_t k_t (v_t - S'_t^T k_t)^T;  o_t = K^-1/2 S_t^T q_t
    y   = (RMSNorm(o) * sigmoid(x W_g1 W_g2 + b_g)) W_o                 (a low-rank output gate; Kimi
                                                                           Linear's has no b_g)
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention_jax import ops
from linear_attention_jax.layers.base import LinearMixer, a_log_init, dense_columns, dt_bias_init, linear
from linear_attention_jax.layers.cache import LinearCache
from linear_attention_jax.layers.norm import GatedRMSNorm
from linear_attention_jax.pallas_kernels import gate as kernel_gate
from linear_attention_jax.pallas_kernels import gpu
from linear_attention_jax.pallas_kernels.gpu import channel, plan
from linear_attention_jax.sharding.rules import axes


class KimiDeltaAttention(LinearMixer):
  """KDA: the gated delta rule with a fine-grained (per key channel) decay.

  Args:
    width: model width d.
    num_heads: H.  num_v_heads: H_v (a multiple of H; default H); g, beta follow v's heads.
    head_dim: K (default d / H).  head_v_dim: V (default K).
    norm_eps: epsilon of the gated output RMSNorm.
    gate_bias: the output gate's up projection has a bias b_g (Kimi Linear's checkpoints have none).
    gate_lower_bound: None (Kimi Linear's unbounded gate) or lb in [-5, 0): the bounded gate above, of
      Kimi Linear's successors, whose decay never exceeds |lb| nats a token.
    use_short_conv, conv_size: causal depthwise convolutions (SiLU) on q, k, v; on by default.
    impl, chunk_size: passed to `ops.kda` in training and prefill.
    dtype, param_dtype: compute and parameter dtypes; the state, g and beta are float32 regardless.

  Parameters beyond the projections: `A_log: [H_v]` (log A, A ~ U(1, 16)) and `dt_bias: [H_v * K]`
  (inverse softplus of dt ~ logU(1e-3, 0.1)), one per channel.

  On the GPU's kernels (impl "pallas" or "auto"), a call without a cache takes each key head's channels
  strongest first (`channel_columns`; `GpuConfig.order_channels`, "layer" by default): the same output
  to float32 rounding, for the kernels' per-half forms.
  """
  no_conv_activation = "silu"

  def __init__(self, width: int, num_heads: int, *, num_v_heads: int | None = None,
               head_dim: int | None = None, head_v_dim: int | None = None, norm_eps: float = 1e-5,
               gate_bias: bool = True, gate_lower_bound: float | None = None, use_short_conv: bool = True,
               conv_size: int = 4, impl: str = "auto", chunk_size: int = 64, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    if gate_lower_bound is not None and not -5.0 <= gate_lower_bound < 0.0:
      raise ValueError(f"gate_lower_bound must be None or in [-5, 0); got {gate_lower_bound!r}")
    self.gate_lower_bound = None if gate_lower_bound is None else float(gate_lower_bound)
    super().__init__(width, num_heads, num_v_heads=num_v_heads, head_dim=head_dim,
                     head_v_dim=head_v_dim, use_short_conv=use_short_conv, conv_size=conv_size,
                     impl=impl, chunk_size=chunk_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    Hv, K, V = self.num_v_heads, self.head_dim, self.head_v_dim
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.f_down = linear(width, V, axes=("embed", None), **kw)
    self.f_up = linear(V, Hv * K, axes=(None, "heads"), **kw)
    self.b_proj = linear(width, Hv, axes=("embed", "heads"), **kw)
    self.A_log = nnx.Param(a_log_init(rngs.params(), (Hv,), param_dtype), **axes("heads"))
    self.dt_bias = nnx.Param(dt_bias_init(rngs.params(), (Hv * K,), param_dtype), **axes("heads"))
    self.g_down = linear(width, V, axes=("embed", None), **kw)
    self.g_up = linear(V, Hv * V, use_bias=gate_bias, axes=(None, "heads"), **kw)
    self.o_norm = GatedRMSNorm(V, eps=norm_eps, activation="sigmoid", **kw)
    self.o_proj = linear(Hv * V, width, axes=("heads", "embed"), **kw)

  def gates(self, x: jax.Array, columns: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """`(g [B, T, H_v, K], beta [B, T, H_v])` float32 for `x: [B, T, width]`; `columns` (None or
    `[H_v * K]` int32, a permutation of g's channels within each value head) takes g's channels in
    that order."""
    f, dt_bias, beta = self.gate_inputs(x, columns)
    return kernel_gate.values(f, self.A_log[...], dt_bias, self._gate_kind()), beta

  def gate_inputs(self, x: jax.Array, columns: jax.Array | None = None):
    """`(f [B, T, H_v, K] in the layer's dtype, dt_bias [H_v * K], beta [B, T, H_v] float32)`: the gate's
    pre-activation (its low-rank projection) and bias, each in `columns`' order (as `gates`), and beta."""
    B, T, _ = x.shape
    Hv, K = self.num_v_heads, self.head_dim
    down = self.f_down(x)
    if columns is None:
      f, dt_bias = self.f_up(down), self.dt_bias[...]
    else:
      f, dt_bias = dense_columns(self.f_up, down, columns), jnp.take(self.dt_bias[...], columns)
    beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
    return f.reshape(B, T, Hv, K), dt_bias, beta

  def _gate_kind(self):
    return kernel_gate.SOFTPLUS if self.gate_lower_bound is None else self.gate_lower_bound

  def __call__(self, x: jax.Array, cache: LinearCache | None = None):
    """Mixes `x: [B, T, width]` along T.

    Returns `(y [B, T, width], new cache or None)`; with a cache, T == 1 takes the one-token step and
    T > 1 runs the full op from the cached state (the convolutions continue from the cached windows).
    """
    B, T = self._check_input(x, cache)
    Hv, V = self.num_v_heads, self.head_v_dim
    ordered = self._orders_channels(cache)
    key_columns, gate_columns = self.channel_columns(x) if ordered else (None, None)
    q, k, v, windows = self._project(x, cache, key_columns)
    # the op and its step take the gate's pre-activation (the GPU's kernels compute the gate)
    # f_down, b_proj and g_down stay three products of x with three x-cotangents: taking those as one
    # (`base.dense_shared_input`, as GatedDeltaNet's gates do) saved 0.11 ms of a K step on an H100, within
    # the noise between machines (NOTES.md v75, v76)
    f, dt_bias, beta = self.gate_inputs(x, gate_columns)
    gate = dict(A_log=self.A_log[...], dt_bias=dt_bias, gate_lower_bound=self.gate_lower_bound)
    with gpu.ordered_channels() if ordered else contextlib.nullcontext():
      o, state = self._recur(ops.kda, ops.kda_step, q, k, v, (f, beta), cache, use_qk_l2norm=True, **gate)
    o = self.o_norm(o, self.g_up(self.g_down(x)).reshape(B, T, Hv, V))
    y = self.o_proj(o.reshape(B, T, -1))
    return y, self._advance(cache, state, windows, T)

  def _orders_channels(self, cache) -> bool:
    """Whether this call orders its key channels (`channel_columns`) and calls its op with
    `gpu.ordered_channels()`: without a cache, with the GPU's kernels possible (impl "pallas" or
    "auto", on a Hopper GPU or inside the Mosaic GPU interpreter) and
    `GpuConfig.order_channels == "layer"` (the default)."""
    return (cache is None and self.impl in ("pallas", "auto") and _gpu_kernels()
            and gpu.layers_order_channels())

  def channel_columns(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(key_columns [H * K], gate_columns [H_v * K])` int32: each key head's channels by how much
    they decay over the batch `x` (`-sum g` over rows and every `order_stride(T)`-th token, summed
    over the head's value heads), strongest first, as columns of q, k's projections and of g's (a value
    head takes its key head's order). Not differentiated. A key channel permutation within a head
    leaves the layer's output unchanged (every per-channel part of it, the convolutions and the gate
    included, moves with its channel; q . k and the l2 norms sum over them); the GPU's kda kernels give
    each half of a chunk's key channels its own form, and with the strongest first a trained chunk's
    strong channels share one half (NOTES.md v57, v59)."""
    H, Hv, K = self.num_heads, self.num_v_heads, self.head_dim
    g = self.gates(x[:, ::order_stride(x.shape[1])])[0]   # an order only picks the kernels' forms
    # the op's per-row order of the batch's summed gates: one row's [1, H, K]
    order = channel.channel_order(jnp.sum(g, axis=0, keepdims=True), H)[0][0]
    key = (jnp.arange(H, dtype=jnp.int32)[:, None] * K + order).reshape(-1)
    gate = (jnp.arange(Hv, dtype=jnp.int32)[:, None] * K + jnp.repeat(order, Hv // H, axis=0)).reshape(-1)
    return key, gate


ORDER_TOKENS = 256


def order_stride(T: int) -> int:
  """The stride of the tokens whose gates `KimiDeltaAttention.channel_columns` sums: 1 up to
  2 ORDER_TOKENS - 1 tokens, then whatever keeps at least ORDER_TOKENS of each row. A channel's decay
  is its A and dt_bias scaled by a softplus of its low-rank projection, so a few hundred tokens a row
  rank the channels as all of them do; the whole batch's gate cost a second projection as large as
  the op's own f (0.24 ms of an H100's 40.9 ms K LM step at T = 4096, batch 8; NOTES.md v66)."""
  return max(1, T // ORDER_TOKENS)


def _gpu_kernels() -> bool:
  """Whether the GPU's kernels can run here (a Hopper GPU, or the Mosaic GPU interpreter:
  `gpu.plan.hopper_reason`)."""
  return plan.hopper_reason() is None
