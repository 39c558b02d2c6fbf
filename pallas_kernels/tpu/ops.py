"""The TPU entry point: `chunked_attention` (both families, every decay kind), `supports`, and an explicit
switch that runs the kernels in the TPU interpreter (`interpret_kernels`), for tests without a TPU."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from .. import common, prep, prepared, vjp
from ..common import explicitly_sharded  # noqa: F401  (re-exported)
from . import walk
from .walk import BlockSizes

_INTERPRET = common.InterpretSwitch("pallas_kernels_tpu_interpret", pltpu.InterpretParams)
MIN_CHUNK = 16  # a bfloat16 (16, 128) tile: blocks of C rows are whole tiles
DTYPES = (jnp.float32, jnp.bfloat16)


def interpret_kernels(params: pltpu.InterpretParams | None = None):
  """Inside this context the TPU kernels run in the TPU interpreter (on any backend) with `params`
  (default `pltpu.InterpretParams()`: NaN for uninitialised memory, out-of-bounds reads raise), and
  `supports` treats the backend as a TPU, so `impl="pallas"` reaches these kernels on a CPU.

  jit caches do not see this switch: trace inside the context the functions you mean to interpret.
  """
  return _INTERPRET.use(params)


def interpreting() -> pltpu.InterpretParams | None:
  """The interpreter parameters in force (`interpret_kernels`), or None."""
  return _INTERPRET.current()


def supports(*, K: int, V: int, chunk_size: int, dtype=jnp.float32, packing: str = "none",
             block_sizes: BlockSizes | None = None, backend: str | None = None,
             sharded: bool = False, delta: bool = False) -> str | None:
  """None if the TPU kernels serve a call of this kind, else the reason they do not.

  Args:
    K, V: head dims of the state. chunk_size: C. dtype: the matmul dtype (float32 or bfloat16).
    packing: "none", "segments" (segment_ids) or "cu_seqlens".
    backend: the platform to run on; None is `jax.default_backend()`, or "tpu" inside
      `interpret_kernels`.
    sharded: the operands are split over non-manual mesh axes (`explicitly_sharded`).
    delta: the call is of the delta family (the TPU kernels take every K and V of either family
      that fits VMEM, so it changes nothing here).
  """
  if backend is None:
    backend = "tpu" if interpreting() is not None else jax.default_backend()
  if backend != "tpu":
    return (f"the Pallas TPU kernels need a TPU and the backend is {backend!r} (tests run them on a CPU "
            f"inside linear_attention_jax.pallas_kernels.tpu.interpret_kernels())")
  if sharded:
    return ("the inputs are sharded over mesh axes and XLA cannot partition a pallas_call: run it under "
            "jax.shard_map (as linear_attention_jax.sharding.shard_op does)")
  if packing == "cu_seqlens":
    return ("the TPU kernel does not take cu_seqlens (pass segment_ids instead: the kernel restarts the "
            "state at every change of id)")
  if packing not in ("none", "segments"):
    return f"unknown packing {packing!r}"
  if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
    return f"the TPU kernel computes in float32 or bfloat16, not {jnp.dtype(dtype).name}"
  if chunk_size < MIN_CHUNK:
    return f"the TPU kernel needs chunk_size >= {MIN_CHUNK} (whole (16, 128) tiles); got {chunk_size}"
  bs = BlockSizes() if block_sizes is None else block_sizes
  bv, size = bs.v_block(V), jnp.dtype(dtype).itemsize
  for backward, nb in ((False, bs.chunks_per_step), (True, bs.chunks_per_step_bwd)):
    for delta in (False, True):
      need = walk.vmem_bytes(C=chunk_size, K=K, V=V, nb=nb, bv=bv, itemsize=size, delta=delta,
                             backward=backward)
      if need > bs.vmem_budget:
        return (f"a {'backward' if backward else 'forward'} grid step needs {need / 2**20:.1f} MiB of "
                f"VMEM at K={K}, V={V}, chunk_size={chunk_size}, {nb} chunks per step, block_v={bv}: "
                f"more than the {bs.vmem_budget / 2**20:.0f} MiB available (BlockSizes)")
  return None


@dataclasses.dataclass(frozen=True)
class _Options:
  block_sizes: BlockSizes
  interpret: Any  # False or pltpu.InterpretParams


def _forward(t, h0, *, options, with_o, with_states, out_dtype):
  return walk.forward(t, h0, block_sizes=options.block_sizes, with_o=with_o, with_states=with_states,
                      out_dtype=out_dtype, interpret=options.interpret)


def _backward(t, states, do, dfinal, *, options):
  return walk.backward(t, states, do, dfinal, block_sizes=options.block_sizes,
                       interpret=options.interpret)


TPU_WALK = prepared.Walk(forward=_forward, backward=_backward,
                    chunks_per_group=lambda NC, options: options.block_sizes.forward_steps(NC))


def walked_columns(V: int, appended: int) -> int:
  """How many leading value columns of a call with `appended` columns of ones (the linear-attention
  normaliser) the kernels walk: all of them (any V that fits VMEM is a block of the walk)."""
  del appended
  return V


def chunked_attention(q, k, v, g=None, beta=None, *, scale=None, initial_state=None, segment_ids=None,
                      chunk_size: int = 64, block_sizes: BlockSizes | None = None, compute_dtype=None,
                      qk_l2norm: bool = False, interpret=None):
  """Either family in chunked form, with the chunk walk as a Pallas TPU kernel; differentiable in
  q, k, v, g, beta and initial_state.

  Args:
    q, k: `[B, T, H, K]`. v: `[B, T, H_v, V]`, `H_v % H == 0` (grouped value heads).
    g: None (no decay), `[B, T, H_v]` (scalar) or `[B, T, H_v, K]` (per channel) log-decay, floored
      at `prep.LOG_DECAY_FLOOR` here (gradient 0 below it).
    beta: None (additive family) or `[B, T, H_v]` (delta family).
    scale: read-out scale, default `K ** -0.5`.
    initial_state: None or `[B, H_v, K, V]`, used as float32.
    segment_ids: None or `[B, T]` int: the state restarts from zero wherever the id changes
      (initial_state applies to each row's first segment).
    chunk_size: C, a power of two >= 16. block_sizes: `BlockSizes`, default `BlockSizes()`.
    compute_dtype: matmul dtype of the kernels (float32 or bfloat16); default: q, k, v's common dtype.
    qk_l2norm: l2-normalise q and k over K first (`x * rsqrt(sum(x^2) + 1e-6)` in float32, in XLA
      before the kernels), gradients of the raw q, k.
    interpret: None (the `interpret_kernels` context's parameters, else compiled), False, or a
      `pltpu.InterpretParams`.

  Returns:
    `(o [B, T, H_v, V] in v's dtype, final_state [B, H_v, K, V] float32)`.
  """
  B, T, H, K, Hv, V = common.check_shapes(q, k, v, g, beta, initial_state, segment_ids)
  dtype = jnp.result_type(q.dtype, k.dtype, v.dtype) if compute_dtype is None else compute_dtype
  interpret = interpreting() if interpret is None else interpret
  bs = BlockSizes() if block_sizes is None else block_sizes
  reason = supports(K=K, V=V, chunk_size=chunk_size, dtype=dtype, block_sizes=bs,
                    packing="none" if segment_ids is None else "segments", backend="tpu",
                    sharded=common.explicitly_sharded(q, k, v, g, beta, initial_state, segment_ids))
  if reason is not None:
    raise ValueError(reason)
  if qk_l2norm:
    q, k = common.l2_normalize(q), common.l2_normalize(k)
  g = prep.floor_log_decay(g)   # -inf (forget everything) is e^-20 a token: finite differences of G
  static = prepared.Static(plan=vjp.PREPARED, walk=TPU_WALK,
                           options=_Options(block_sizes=bs, interpret=interpret or False),
                           chunk_size=chunk_size, compute_dtype=jnp.dtype(dtype), out_dtype=v.dtype)
  return vjp.chunked_op(static, q, k, v, g, beta, scale=K ** -0.5 if scale is None else scale,
                        initial_state=initial_state, segment_ids=segment_ids)
