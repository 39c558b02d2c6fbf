"""The Hopper GPU entry point: `chunked_attention`, both families and every decay kind as Mosaic GPU kernels.

What runs for a call is `plan.plan`'s (its module docstring has the table); the tuning values are one
`plan.GpuConfig`; `vjp.py` runs the plan's stages forward and backward.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any

import jax.numpy as jnp

from .. import common, prep, prepared, vjp
from ..gate import Gate
from . import plan as plans
from . import channel, cumsum, walk
from .interpret import check_interpreter_threads, interpreting
from .plan import GpuConfig

SIXTEEN_BIT = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class Options:
  """What the GPU's stages read of a call besides the plan: the interpreter, and the plan's sequence
  pieces (for the prepared path's walk)."""

  sequence_pieces: int | None = None
  interpret: Any = None   # None (compiled) or a plgpu.InterpretGPUParams


_DEFAULT_CONFIG = contextvars.ContextVar("pallas_kernels_gpu_default_config", default=None)


@contextlib.contextmanager
def default_config(config: GpuConfig):
  """Inside: the calls that pass no `config` (the ops, and the layers and models through them, with
  impl "pallas" or "auto") run with `config` instead of `GpuConfig()`, so an option can be measured in
  whole layers and models (`experiments/layer_benchmark.py --mixers=G,G:p132`). jit caches do not see
  it: trace inside."""
  if not isinstance(config, GpuConfig):
    raise ValueError(f"config must be a pallas_kernels.gpu.GpuConfig; got {type(config).__name__}")
  token = _DEFAULT_CONFIG.set(config)
  try:
    yield
  finally:
    _DEFAULT_CONFIG.reset(token)


def _config(config: GpuConfig | None) -> GpuConfig:
  if config is not None:
    return config
  default = _DEFAULT_CONFIG.get()
  return GpuConfig() if default is None else default


def layers_order_channels() -> bool:
  """Whether the current default configuration (`default_config`) asks the layers to order kda's key
  channels in their projections (`GpuConfig.order_channels == "layer"`, the default)."""
  return _config(None).order_channels == "layer"


@contextlib.contextmanager
def ordered_channels():
  """Inside: the calls that pass no `config` run with the current default configuration's
  `order_channels` set to "ordered" (their key channels come strongest first, each half of a chunk's
  takes its own form). For a caller that has ordered them, as the KDA layers do under "layer"."""
  with default_config(dataclasses.replace(_config(None), order_channels="ordered")):
    yield


def _walk_forward(t, h0, *, options, with_o, with_states, out_dtype):
  o, states, final, transitions = walk.forward(
      t, h0, with_o=with_o, with_states=with_states, out_dtype=out_dtype, interpret=options.interpret,
      sequence_pieces=options.sequence_pieces, return_transitions=True)
  # the backward reuses the sequence pieces' transition matrices
  return o, (states, transitions) if with_states else None, final


def _walk_backward(t, states, do, dfinal, *, options):
  states, transitions = states
  return walk.backward(t, states, do, dfinal, interpret=options.interpret,
                       sequence_pieces=options.sequence_pieces, transitions=transitions)


# the prepared path's walk (explicit sequence pieces pad T to whole pieces of chunks; the automatic
# choice divides the chunk count)
GPU_WALK = prepared.Walk(forward=_walk_forward, backward=_walk_backward,
                         chunks_per_group=lambda NC, options: options.sequence_pieces or 1)


def decay_kind(g) -> str:
  """"none", "scalar" (`[B, T, H_v]`) or "channel" (`[B, T, H_v, K]`)."""
  return "none" if g is None else ("scalar" if g.ndim == 3 else "channel")


def call_plan(q, k, v, g=None, beta=None, *, segment_ids=None, chunk_size: int = 64, compute_dtype=None,
              qk_l2norm: bool = False, config: GpuConfig | None = None) -> plans.Plan:
  """The plan `chunked_attention` runs for these arguments (its stages: `plan.py`'s table)."""
  dtype = jnp.dtype(jnp.result_type(q.dtype, k.dtype, v.dtype) if compute_dtype is None else compute_dtype)
  return plans.select(delta=beta is not None, decay=decay_kind(g), config=_config(config),
                    packing="none" if segment_ids is None else "segments", qk_l2norm=qk_l2norm,
                    V=v.shape[-1], chunk_size=chunk_size, v_dtype=dtype, dtype=dtype, K=q.shape[-1])


def chunked_attention(q, k, v, g=None, beta=None, *, scale=None, initial_state=None, segment_ids=None,
                      chunk_size: int = 64, compute_dtype=None, out_dtype=None, qk_l2norm: bool = False,
                      config: GpuConfig | None = None, interpret=None, gate: Gate | None = None):
  """Either family in chunked form as Mosaic GPU kernels; differentiable in q, k, v, g, beta and
  initial_state (and the gate's A_log and dt_bias).

  Args:
    q, k: `[B, T, H, K]`. v: `[B, T, H_v, V]`, `H_v % H == 0` (grouped value heads).
    g: None (no decay), `[B, T, H_v]` (scalar) or `[B, T, H_v, K]` (per channel) log-decay, floored
      at `prep.LOG_DECAY_FLOOR` here (or inside the stages: `Plan.gate_floor`), gradient 0 below it.
    beta: None (additive family) or `[B, T, H_v]` (delta family).
    scale: read-out scale, default `K ** -0.5`.
    initial_state: None or `[B, H_v, K, V]`, used as float32.
    segment_ids: None or `[B, T]` int: the state restarts from zero wherever the id changes.
    chunk_size: C (64).
    compute_dtype: the matmul operand dtype, bfloat16 or float16 (q, k, v are cast to it; the state and
      every sum stay float32); default q, k, v's common dtype.
    out_dtype: o's dtype, bfloat16 or float16 (o leaves the kernels through a 16-bit tile); default v's
      dtype when that is one of them, else compute_dtype.
    qk_l2norm: l2-normalise q and k over K first (`x * rsqrt(sum(x^2) + 1e-6)` in float32, rounded to
      the operand dtype), gradients of the raw q, k: in the kernels on load where the plan says so
      (`Plan.l2`), else in XLA before them.
    config: a `GpuConfig` (default `GpuConfig()`: what the library runs).
    interpret: None (the `interpret_kernels` context's parameters, else compiled) or a
      `plgpu.InterpretGPUParams`.

  Returns:
    `(o [B, T, H_v, V] in out_dtype, final_state [B, H_v, K, V] float32)`.

  The call targets a Hopper GPU (or the interpreter); `plan.supports(...)` says whether this machine is
  one, and `call_plan(...)` what would run.
  """
  B, T, H, K, Hv, V = common.check_shapes(q, k, v, g, beta, initial_state, segment_ids)
  config = _config(config)
  if not isinstance(config, GpuConfig):
    raise ValueError(f"config must be a pallas_kernels.gpu.GpuConfig; got {type(config).__name__}")
  dtype = jnp.dtype(jnp.result_type(q.dtype, k.dtype, v.dtype) if compute_dtype is None else compute_dtype)
  interpret = interpreting() if interpret is None else interpret
  reason = plans.supports(K=K, V=V, chunk_size=chunk_size, dtype=dtype,
                          packing="none" if segment_ids is None else "segments", backend="hopper",
                          sharded=common.explicitly_sharded(q, k, v, g, beta, initial_state, segment_ids),
                          delta=beta is not None)
  if reason is not None:
    raise ValueError(reason)
  if out_dtype is None:
    out_dtype = v.dtype if jnp.dtype(v.dtype) in SIXTEEN_BIT else dtype
  if jnp.dtype(out_dtype) not in SIXTEEN_BIT:
    raise ValueError(f"out_dtype must be bfloat16 or float16 (o leaves the kernels through a 16-bit "
                     f"tile; cast it afterwards); got {jnp.dtype(out_dtype).name}")
  if gate is not None and (g is None or g.ndim != 4 or beta is None):
    raise ValueError("gate takes a per-channel delta call: g [B, T, H_v, K] (its pre-activation) and beta")
  if plans.head_blocks(K, V, delta=beta is not None, decay=decay_kind(g)) != (K, V):
    g = g if gate is None else gate.values(g)
    return _by_head_blocks(q, k, v, g, beta, scale=K ** -0.5 if scale is None else scale,
                           initial_state=initial_state, segment_ids=segment_ids, chunk_size=chunk_size,
                           compute_dtype=dtype, out_dtype=out_dtype, qk_l2norm=qk_l2norm, config=config,
                           interpret=interpret)
  q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
  p = call_plan(q, k, v, g, beta, segment_ids=segment_ids, chunk_size=chunk_size, qk_l2norm=qk_l2norm,
                config=config)
  if gate is not None and not fused_gate(p, Hv * K, chunk_size):
    g, gate = gate.values(g), None
  if p.gate_floor == "xla":   # -inf (forget everything) is e^-20 a token: finite differences of G
    g = prep.floor_log_decay(g)
  if interpret:
    check_interpreter_threads(p.interpreter_threads())
  if p.l2 == "xla":
    q, k = common.l2_normalize(q), common.l2_normalize(k)
  static = prepared.Static(plan=p, walk=GPU_WALK,
                           options=Options(sequence_pieces=p.sequence_pieces, interpret=interpret or None),
                           chunk_size=chunk_size, compute_dtype=dtype, out_dtype=jnp.dtype(out_dtype),
                           inverse_dtype=jnp.dtype(jnp.float32), gram_method=p.gram_method)
  scale = K ** -0.5 if scale is None else scale
  if not p.order_channels:
    return vjp.chunked_op(static, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                          segment_ids=segment_ids, gate=gate)
  # the strongest channels first (`GpuConfig.order_channels`); the final state back in the callers' order
  order, inverse = channel.channel_order(g, H)
  q, k, g = (channel.permute_channels(x, order, inverse, 2, 3) for x in (q, k, g))
  if initial_state is not None:
    initial_state = channel.permute_channels(initial_state, order, inverse, 1, 2)
  o, final = vjp.chunked_op(static, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                            segment_ids=segment_ids)
  return o, channel.permute_channels(final, inverse, order, 1, 2)


def fused_gate(p, D: int, chunk_size: int) -> bool:
  """Whether the plan `p` takes a gate's pre-activation into its kernels (`chunked_attention`'s `gate`;
  `GpuConfig.gate`): the per-channel delta plan with the cumsum walks (where they serve `D = H_v K`
  flattened channels), the gate's floor inside the stages and no channel order of the op's own (the layer's order moves dt_bias with
  its channels; the op's differs per batch row)."""
  return ((p.forward, p.backward, p.cumsums, p.gate) == ("channel_prep", "channel_delta_grads", "kernel",
                                                       "kernel")
          and p.gate_floor != "xla" and not p.order_channels and cumsum.serves(D, chunk_size))


def _by_head_blocks(q, k, v, g, beta, *, scale, initial_state, segment_ids, out_dtype, qk_l2norm, **call):
  """`chunked_attention` of a head dim of 256 as calls on `plan.head_blocks` (128): value blocks as
  value heads of one call (`_as_value_heads`: each value column walks alone), key blocks of the additive
  family summed (its state and read-out are sums over key channels; the state's key blocks stack). Each
  block is differentiable, so the gradients add up through the slices. q and k are l2-normalised over
  the whole K before any key split."""
  K, V = q.shape[-1], v.shape[-1]
  kb, vb = plans.head_blocks(K, V, delta=beta is not None, decay=decay_kind(g))
  if qk_l2norm and kb != K:
    q, k = common.l2_normalize(q.astype(jnp.float32)), common.l2_normalize(k.astype(jnp.float32))
    qk_l2norm = False
  per_channel = g is not None and g.ndim == 4
  rows, finals = [], []
  for i in range(0, K, kb):
    keys = slice(i, i + kb)
    o, final = _as_value_heads(
        q[..., keys], k[..., keys], v, g[..., keys] if per_channel else g, beta, vb, scale=scale,
        initial_state=None if initial_state is None else initial_state[:, :, keys],
        segment_ids=segment_ids, out_dtype=out_dtype, qk_l2norm=qk_l2norm, **call)
    rows.append(o)
    finals.append(final)
  if len(rows) == 1:
    o = rows[0]
  else:   # the key blocks' read-outs add, in float32
    o = sum(r.astype(jnp.float32) for r in rows).astype(rows[0].dtype)
  return o, jnp.concatenate(finals, axis=-2) if len(finals) > 1 else finals[0]


def _as_value_heads(q, k, v, g, beta, vb: int, *, initial_state, **call):
  """One `chunked_attention` call whose `V / vb` value blocks are value heads of their own: v
  `[B, T, H_v, V]` is read as `[B, T, H_v V / vb, vb]` (no copy), each block a value head grouped on its
  q/k head (head `h` block `j` is value head `h V / vb + j`), the gates and betas repeated per block; o
  and the final state are read back the same way. One call, not one per block: the blocks share the
  launches, and no slice or concatenation of v, o, dv or dq/dk sums sits between them."""
  B, T, Hv, V = v.shape
  K = q.shape[-1]
  nb = V // vb
  if nb == 1:
    return chunked_attention(q, k, v, g, beta, initial_state=initial_state, **call)
  per_block = lambda x: None if x is None else jnp.repeat(x, nb, axis=2)
  h0 = None if initial_state is None else jnp.asarray(initial_state).reshape(
      B, Hv, K, nb, vb).transpose(0, 1, 3, 2, 4).reshape(B, Hv * nb, K, vb)
  o, final = chunked_attention(q, k, v.reshape(B, T, Hv * nb, vb), per_block(g), per_block(beta),
                               initial_state=h0, **call)
  final = final.reshape(B, Hv, nb, K, vb).transpose(0, 1, 3, 2, 4).reshape(B, Hv, K, V)
  return o.reshape(B, T, Hv, V), final
