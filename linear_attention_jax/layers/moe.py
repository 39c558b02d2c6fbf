"""MoE: a mixture-of-experts SwiGLU MLP with a top-k router and shared experts, dispatched densely.

    s      = sigmoid(x W_r)  or  softmax(x W_r)          (router scores, float32, [E])
    choice = s + b                                        (b: an expert-score bias used only to choose,
                                                           DeepSeek-V3's load-balancing correction)
    groups: the E experts form G groups; a group's score is the sum of its two best choices; only the
            `groups_per_token` best groups stay eligible (G = 1: all experts are)
    I      = the top_k eligible experts by `choice`;  w_i = s_i (i in I), divided by sum_I s_i when
             `normalize_weights`, times `routed_scaling`
    y      = sum_{i in I} w_i SwiGLU_i(x)  +  gate * SwiGLU_shared(x)
             (gate = sigmoid(x W_sg) with `shared_gate` (Qwen3-Next), else 1 (DeepSeek, Kimi))

Dispatch is dense: every expert runs on every token and the unchosen ones get weight 0. It is exact
and simple, costs E times the compute of one expert, and suits small models and parity tests; a sparse
dispatch (sort tokens by expert, grouped matmul) is the fast form for large E.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention_jax.layers.mlp import SwiGLU
from linear_attention_jax.sharding.rules import axes

ROUTERS = ("sigmoid", "softmax")


def route(logits, *, top_k: int, router: str = "softmax", score_bias=None, num_groups: int = 1,
          groups_per_token: int = 1, normalize_weights: bool = True, routed_scaling: float = 1.0):
  """Router logits `[N, E]` -> combine weights `[N, E]` float32, zero outside each token's top_k."""
  logits = logits.astype(jnp.float32)
  N, E = logits.shape
  scores = jax.nn.sigmoid(logits) if router == "sigmoid" else jax.nn.softmax(logits, axis=-1)
  choice = scores if score_bias is None else scores + score_bias.astype(jnp.float32)
  if num_groups > 1:
    grouped = choice.reshape(N, num_groups, E // num_groups)
    group_scores = jnp.sum(jax.lax.top_k(grouped, min(2, E // num_groups))[0], axis=-1)  # [N, G]
    kept = jax.lax.top_k(group_scores, groups_per_token)[1]
    group_mask = jnp.sum(jax.nn.one_hot(kept, num_groups, dtype=jnp.float32), axis=1) > 0
    choice = jnp.where(jnp.repeat(group_mask, E // num_groups, axis=1), choice, -jnp.inf)
  chosen = jax.lax.top_k(choice, top_k)[1]  # [N, k]
  weights = jnp.take_along_axis(scores, chosen, axis=-1)
  if normalize_weights:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  weights = weights * routed_scaling
  return jnp.sum(jax.nn.one_hot(chosen, E, dtype=jnp.float32) * weights[..., None], axis=1)


class MoE(nnx.Module):
  """Top-k routed SwiGLU experts plus optional shared experts: `[B, T, d] -> [B, T, d]`.

  Args:
    width: d.  num_experts: E.  top_k: experts per token.  hidden: each expert's hidden width.
    shared_hidden: hidden width of the shared SwiGLU (0: no shared experts).
    router: "sigmoid" (DeepSeek-V3, Kimi) or "softmax" (Qwen).
    score_bias: keep an expert-score bias `[E]` that shifts the choice, not the weights.
    num_groups, groups_per_token: group-limited routing (1, 1: plain top-k).
    normalize_weights: divide the chosen scores by their sum.  routed_scaling: then multiply.
    shared_gate: gate the shared experts' output by `sigmoid(x W_sg)`.

  Parameters: `router: [d, E]` (float32), `score_bias: [E]` (float32; its gradient is zero: it only
  selects), `gate, up: [E, d, hidden]`, `down: [E, hidden, d]`, and the shared `SwiGLU`.
  """

  def __init__(self, width: int, num_experts: int, top_k: int, hidden: int, *,
               shared_hidden: int = 0, router: str = "softmax", score_bias: bool = False,
               num_groups: int = 1, groups_per_token: int = 1, normalize_weights: bool = True,
               routed_scaling: float = 1.0, shared_gate: bool = False, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    if router not in ROUTERS:
      raise ValueError(f"router must be one of {ROUTERS}; got {router!r}")
    if not 1 <= top_k <= num_experts or hidden < 1:
      raise ValueError(f"need 1 <= top_k <= num_experts and hidden >= 1; got {top_k=} "
                       f"{num_experts=} {hidden=}")
    if num_experts % num_groups or not 1 <= groups_per_token <= num_groups:
      raise ValueError(f"num_groups={num_groups} must divide num_experts={num_experts} and "
                       f"1 <= groups_per_token={groups_per_token} <= num_groups")
    self.width, self.num_experts, self.top_k, self.hidden = width, num_experts, top_k, hidden
    self.router_kind, self.num_groups, self.groups_per_token = router, num_groups, groups_per_token
    self.normalize_weights, self.routed_scaling, self.dtype = normalize_weights, routed_scaling, dtype
    E = num_experts
    init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    router_init = nnx.initializers.lecun_normal()
    self.router = nnx.Param(router_init(rngs.params(), (width, E), jnp.float32), **axes("embed", None))
    self.score_bias = nnx.Param(jnp.zeros((E,), jnp.float32), **axes(None)) if score_bias else None
    expert = lambda shape, in_axis: nnx.Param(init(rngs.params(), shape, param_dtype),
                                              **axes(None, *in_axis))
    self.gate = expert((E, width, hidden), ("embed", "mlp"))
    self.up = expert((E, width, hidden), ("embed", "mlp"))
    self.down = expert((E, hidden, width), ("mlp", "embed"))
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.shared = SwiGLU(width, shared_hidden, **kw) if shared_hidden else None
    self.shared_gate = (nnx.Linear(width, 1, use_bias=False, kernel_metadata=axes("embed", None), **kw)
                        if shared_gate and shared_hidden else None)

  def combine_weights(self, x: jax.Array) -> jax.Array:
    """`[B, T, E]` float32: each token's weight on each expert (zero for the unchosen)."""
    B, T, d = x.shape
    logits = x.reshape(B * T, d).astype(jnp.float32) @ self.router[...]
    w = route(logits, top_k=self.top_k, router=self.router_kind,
              score_bias=None if self.score_bias is None else self.score_bias[...],
              num_groups=self.num_groups, groups_per_token=self.groups_per_token,
              normalize_weights=self.normalize_weights, routed_scaling=self.routed_scaling)
    return w.reshape(B, T, self.num_experts)

  def __call__(self, x: jax.Array) -> jax.Array:
    if x.ndim != 3 or x.shape[-1] != self.width:
      raise ValueError(f"x must have shape [B, T, width] with width={self.width}; got {x.shape}")
    w = self.combine_weights(x)
    xc = x.astype(self.dtype)
    cast = lambda p: p[...].astype(self.dtype)
    h = jax.nn.silu(jnp.einsum("btd,edh->bteh", xc, cast(self.gate)))
    h = h * jnp.einsum("btd,edh->bteh", xc, cast(self.up))
    y = jnp.einsum("bteh,ehd,bte->btd", h, cast(self.down), w.astype(self.dtype))
    if self.shared is not None:
      s = self.shared(x)
      if self.shared_gate is not None:
        s = s * jax.nn.sigmoid(self.shared_gate(x))
      y = y + s
    return y.astype(self.dtype)
