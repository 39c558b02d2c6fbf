"""The Hopper GPU entry point: `chunked_attention` (both families, every decay kind), `supports`, and a
switch that runs the kernels in the Mosaic GPU interpreter (`interpret_kernels`), for tests without a GPU.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import common, prep, vjp
from pallas_kernels.gpu import channel_delta_grads, channel_grads, channel_prep, delta_grads, delta_prep
from pallas_kernels.gpu import fused as fused_kernel
from pallas_kernels.gpu import walk
from pallas_kernels.gpu.tiles import L2_EPS, SMEM_BYTES

_INTERPRET = common.InterpretSwitch("pallas_kernels_gpu_interpret", plgpu.InterpretGPUParams)
DTYPES = (jnp.bfloat16, jnp.float16)
HEAD_DIMS = (64, 128)
CHUNK_SIZES = (64,)


def interpret_kernels(params: plgpu.InterpretGPUParams | None = None):
  """Inside this context the GPU kernels run in the Mosaic GPU interpreter (on any backend) with
  `params` (default `plgpu.InterpretGPUParams()`: NaN for uninitialised memory, out-of-bounds reads
  raise), and `supports` treats the backend as a Hopper GPU, so `impl="pallas"` reaches these kernels
  on a CPU. jit caches do not see this switch: trace inside the context what you mean to interpret."""
  return _INTERPRET.use(params)


def interpreter_threads() -> int:
  """Threads in XLA's CPU pool, on which the interpreter runs each warpgroup of a multi-warpgroup kernel
  as a computation of its own (one that waits on a barrier holds its thread): the `NPROC` environment
  variable if set (read when JAX's CPU backend starts), else the CPUs this process may run on."""
  if os.environ.get("NPROC"):
    return int(os.environ["NPROC"])
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:   # not on Linux
    return os.cpu_count() or 1


def _check_interpreter_threads(call: dict[str, int]):
  """Raises, naming the option, where a multi-warpgroup kernel that `call` (option -> threads it needs:
  its warpgroups and the launcher) would run cannot start all its warpgroups in the interpreter: it
  would wait forever instead."""
  threads = interpreter_threads()
  short = [f"{name} needs {need}" for name, need in call.items() if threads < need]
  if short:
    raise ValueError(
        f"in the Mosaic GPU interpreter XLA's CPU pool has {threads} threads and {', '.join(short)} "
        f"(one a warpgroup and one for the launcher); set the environment variable NPROC to at least "
        f"{max(call.values())} before JAX starts, or pass the option's one-warpgroup value (1)")


def interpreting() -> plgpu.InterpretGPUParams | None:
  """The interpreter parameters in force (`interpret_kernels`), or None."""
  return _INTERPRET.current()


def hopper_reason(backend: str | None = None) -> str | None:
  """None if this process runs on a Hopper GPU (or inside `interpret_kernels`), else why not.
  `backend="hopper"` asserts a Hopper target (exporting for one from any machine)."""
  if backend == "hopper" or (backend is None and interpreting() is not None):
    return None
  backend = jax.default_backend() if backend is None else backend
  if backend != "gpu":
    return (f"the Mosaic GPU kernels need a Hopper GPU and the backend is {backend!r} (tests run them "
            f"on a CPU inside pallas_kernels.gpu.interpret_kernels())")
  device = jax.devices()[0]
  cc = getattr(device, "compute_capability", None)
  if cc != "9.0":
    return (f"the Mosaic GPU kernels are written for Hopper (compute capability 9.0, wgmma); "
            f"{device.device_kind} has {cc}")
  return None


def smem_bytes(*, C: int, K: int, V: int, itemsize: int, delta: bool, out_itemsize: int,
               backward: bool) -> int:
  """Shared memory of one program (double-buffered inputs, staging tiles, state)."""
  bv = min(walk.BLOCK_V, V)
  if not backward:
    ins = C * K * (2 + delta) + C * bv + C * C  # kd, qg, [w], u, p
    return (2 * ins * itemsize + 2 * K * 4 + 2 * C * bv * out_itemsize + 2 * bv * K * itemsize
            + bv * K * 4 + delta * bv * C * itemsize)
  ins = C * K * (1 + 2 * delta) + C * bv + delta * C * C  # qg, [kd, w], do, [p]
  return 2 * ins * itemsize + 2 * K * 4 + 2 * bv * K * itemsize + bv * K * 4 + delta * bv * C * itemsize


def supports(*, K: int, V: int, chunk_size: int, dtype=jnp.bfloat16, packing: str = "none",
             backend: str | None = None, sharded: bool = False) -> str | None:
  """None if the Mosaic GPU kernels serve a call of this kind, else the reason they do not.

  Args:
    K, V: head dims of the state. chunk_size: C. dtype: the matmul operand dtype (bfloat16 or float16;
      the state is float32). packing: "none", "segments" or "cu_seqlens".
    backend: None is the running backend (a Hopper GPU, or any inside `interpret_kernels`);
      "hopper" takes a Hopper target as given.
    sharded: the operands are split over non-manual mesh axes (`common.explicitly_sharded`).
  """
  reason = hopper_reason(backend)
  if reason is not None:
    return reason
  if sharded:
    return ("the inputs are sharded over mesh axes and XLA cannot partition a Pallas kernel: run it under "
            "jax.shard_map (pallas_kernels.gpu.sharded_chunked_attention)")
  if packing == "cu_seqlens":
    return "the GPU kernel does not take cu_seqlens (pass segment_ids instead)"
  if packing not in ("none", "segments"):
    return f"unknown packing {packing!r}"
  if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
    return (f"the GPU kernel takes bfloat16 or float16 operands (wgmma would run float32 as tf32), not "
            f"{jnp.dtype(dtype).name}; cast q, k, v or use the chunk form")
  if K not in HEAD_DIMS or V not in HEAD_DIMS:
    return f"the GPU kernel takes K and V in {HEAD_DIMS}; got K={K}, V={V}"
  if chunk_size not in CHUNK_SIZES:
    return f"the GPU kernel walks chunks of {CHUNK_SIZES} tokens; got chunk_size={chunk_size}"
  size = jnp.dtype(dtype).itemsize
  for backward in (False, True):
    need = smem_bytes(C=chunk_size, K=K, V=V, itemsize=size, delta=True, out_itemsize=size,
                      backward=backward)
    if need > SMEM_BYTES:
      return f"a program needs {need} bytes of shared memory, more than {SMEM_BYTES}"
  return None


@dataclasses.dataclass(frozen=True)
class _Options:
  interpret: Any  # None or plgpu.InterpretGPUParams
  fused: bool = False
  sequence_pieces: int | None = None
  delta_backward: bool = False
  qk_l2norm: bool = False   # only with the delta kernels (`_delta_kernels`): they normalise q, k on load
  channel_kernel: bool = True
  delta_warpgroups: int = 2   # 2: the delta gradients in chunk_grads_pair where it serves
  forward_warpgroups: int = 3   # 3: the fused additive forward in fused._streamed_walk
  walk_warpgroups: int = 1   # 3: the prepared forward walks in walk._streamed_walk
  gram_method: str = "auto"   # prep.prepare's per-channel grams, where the forward prepares in XLA


def _forward(t, h0, *, options, with_o, with_states, out_dtype, token_o=False, scale=1.0):
  o, states, final, transitions = walk.forward(
      t, h0, with_o=with_o, with_states=with_states, out_dtype=out_dtype, interpret=options.interpret,
      sequence_pieces=options.sequence_pieces, return_transitions=True, token_o=token_o, scale=scale,
      warpgroups=options.walk_warpgroups)
  # the backward reuses the sequence pieces' transition matrices (opaque to vjp.py)
  return o, (states, transitions) if with_states else None, final


def _backward(t, states, do, dfinal, *, options):
  states, transitions = states
  return walk.backward(t, states, do, dfinal, interpret=options.interpret,
                       sequence_pieces=options.sequence_pieces, transitions=transitions)


def _fused_serves(options, g, beta, segment_ids) -> bool:
  """The call asked for the fused path (`fused=True`) and `fused.py` covers it."""
  return options.fused and fused_kernel.serves(g, beta, segment_ids)


def _delta_kernels(options, g, beta, segment_ids) -> bool:
  """The delta family's preparation and gradients run as kernels (`delta_prep.py`, `delta_grads.py`)."""
  return options.fused and options.delta_backward and delta_prep.serves(g, beta, segment_ids)


def _fused_forward(q, k, v, g, beta, h0, segment_ids, *, options, chunk_size, compute_dtype, out_dtype,
                   scale, residuals=False):
  if _delta_kernels(options, g, beta, segment_ids):
    # the preparation kernel, then the walk writing o scaled in the token layout; the forward of a
    # differentiated call keeps what the gradient kernels read: the prepared tensors, (I + L)^-1 and
    # the state entering every chunk (the backward then runs no forward walk)
    out = delta_prep.prepare(q, k, v, g, beta, chunk_size=chunk_size, dtype=compute_dtype,
                             segment_ids=segment_ids, interpret=options.interpret,
                             with_inverse=residuals, chunk_multiple=_chunks_per_group(0, options),
                             qk_l2norm=options.qk_l2norm)
    t, X = out if residuals else (out, None)
    o, states, final = _forward(t, h0, options=options, with_o=True, with_states=residuals,
                                out_dtype=out_dtype, token_o=True, scale=scale)
    out = (o[:, :q.shape[1]], final)
    return (out, (t, X) + states) if residuals else out
  if residuals and _channel_grads(options, g, beta, segment_ids):
    # gla, differentiated: the prepared forward, keeping for channel_grads.backward the state entering
    # every chunk (and the pieces' transitions), q e^G and the decay that its reverse walk reads, and
    # the chunk-local cumsum of g
    T_pad = prep.padded_length(q.shape[1], chunk_size, _chunks_per_group(0, options))
    cumsum = channel_grads.chunk_cumsum(g, T_pad, chunk_size)
    t = _kernel_prepare(q, k, v, g, beta, segment_ids, options=options, chunk_size=chunk_size,
                        compute_dtype=compute_dtype, cumsum=cumsum)
    if t is None:
      t = common.cast_tensors(prep.prepare(q, k, v, g, beta, segment_ids, chunk_size=chunk_size,
                                 chunk_multiple=_chunks_per_group(0, options), dtype=compute_dtype,
                                 gram_method=options.gram_method), compute_dtype)
    o, (states, transitions), final = _forward(t, h0, options=options, with_o=True, with_states=True,
                                               out_dtype=out_dtype, token_o=True, scale=scale)
    saved = channel_grads.Saved(states=states, transitions=transitions, qg=t.qg, decay=t.decay,
                                G=cumsum[0], refs=cumsum[1])
    return (o[:, :q.shape[1]], final), saved
  if residuals and _channel_delta_grads(options, g, beta, segment_ids):
    # kda, differentiated: the preparation kernel also writes (I + L)^-1; the forward keeps it, the
    # prepared tensors, the state entering every chunk and the chunk-local cumsum of g for
    # channel_delta_grads.backward
    T_pad = prep.padded_length(q.shape[1], chunk_size, _chunks_per_group(0, options))
    cumsum = channel_grads.chunk_cumsum(g, T_pad, chunk_size)
    t, X = channel_prep.prepare(q, k, v, g, beta, chunk_size=chunk_size, dtype=compute_dtype,
                                segment_ids=segment_ids, interpret=options.interpret,
                                chunk_multiple=_chunks_per_group(0, options), cumsum=cumsum,
                                with_inverse=True)
    o, (states, transitions), final = _forward(t, h0, options=options, with_o=True, with_states=True,
                                               out_dtype=out_dtype, token_o=True, scale=scale)
    saved = channel_delta_grads.Saved(t=t, X=X, states=states, transitions=transitions, G=cumsum[0],
                                      refs=cumsum[1])
    return (o[:, :q.shape[1]], final), saved
  if not _fused_serves(options, g, beta, segment_ids):
    return None
  o, states, final = fused_kernel.forward(q, k, v, g, h0, chunk_size=chunk_size, dtype=compute_dtype,
                                          out_dtype=out_dtype, segment_ids=segment_ids,
                                          interpret=options.interpret, with_states=residuals,
                                          sequence_pieces=options.sequence_pieces, scale=scale,
                                          warpgroups=options.forward_warpgroups)
  out = (o[:, :q.shape[1]], final)
  return (out, states) if residuals else out


def _channel_grads(options, g, beta, segment_ids) -> bool:
  """gla's gradients run in `channel_grads.py` (`fused`; the forward keeps the chunk states)."""
  return options.fused and channel_grads.serves(g, beta, segment_ids)


def _channel_delta_grads(options, g, beta, segment_ids) -> bool:
  """kda's gradients run in `channel_delta_grads.py` (`fused`, `delta_backward`, `channel_kernel`: the
  forward's preparation kernel writes the inverse they read)."""
  return (options.fused and options.delta_backward and options.channel_kernel
          and channel_delta_grads.serves(g, beta, segment_ids))


def _fused_backward(q, k, v, g, beta, h0, segment_ids, do, dfinal, *, options, chunk_size,
                    compute_dtype, scale, residuals=None, fallback=None):
  if _channel_delta_grads(options, g, beta, segment_ids) and residuals is not None:
    return channel_delta_grads.backward(q, k, v, g, beta, h0, do, dfinal, chunk_size=chunk_size,
                                        dtype=compute_dtype, segment_ids=segment_ids,
                                        interpret=options.interpret, sequence_pieces=options.sequence_pieces,
                                        scale=scale, saved=residuals, fallback=fallback)
  if _channel_grads(options, g, beta, segment_ids) and residuals is not None:
    return channel_grads.backward(q, k, v, g, h0, do, dfinal, chunk_size=chunk_size, dtype=compute_dtype,
                                  segment_ids=segment_ids, interpret=options.interpret,
                                  sequence_pieces=options.sequence_pieces, scale=scale, saved=residuals,
                                  fallback=fallback)
  if _delta_kernels(options, g, beta, segment_ids):
    return delta_grads.backward(q, k, v, g, beta, h0, do, dfinal, chunk_size=chunk_size,
                                dtype=compute_dtype, segment_ids=segment_ids, interpret=options.interpret,
                                scale=scale, sequence_pieces=options.sequence_pieces, saved=residuals,
                                qk_l2norm=options.qk_l2norm, warpgroups=options.delta_warpgroups)
  if not _fused_serves(options, g, beta, segment_ids):
    return None
  return fused_kernel.backward(q, k, v, g, h0, do, dfinal, chunk_size=chunk_size, dtype=compute_dtype,
                               segment_ids=segment_ids, interpret=options.interpret,
                               sequence_pieces=options.sequence_pieces, scale=scale, states=residuals)


def _kernel_prepare(q, k, v, g, beta, segment_ids, *, options, chunk_size, compute_dtype, cumsum=None):
  assert not options.qk_l2norm, "qk_l2norm is only set where the delta kernels run the whole op"
  if options.fused and options.channel_kernel and channel_prep.serves(g, beta, segment_ids):   # gla, kda
    return channel_prep.prepare(q, k, v, g, beta, chunk_size=chunk_size, dtype=compute_dtype,
                                segment_ids=segment_ids, interpret=options.interpret,
                                chunk_multiple=_chunks_per_group(0, options), cumsum=cumsum)
  if not (options.fused and delta_prep.serves(g, beta, segment_ids)):
    return None
  return delta_prep.prepare(q, k, v, g, beta, chunk_size=chunk_size, dtype=compute_dtype,
                            segment_ids=segment_ids, interpret=options.interpret,
                            chunk_multiple=_chunks_per_group(0, options))


def _chunks_per_group(NC, options):
  """Explicit sequence pieces: T padded to whole pieces of chunks (the automatic choice divides NC)."""
  del NC
  return options.sequence_pieces or 1


GPU_WALK = vjp.Walk(forward=_forward, backward=_backward, chunks_per_group=_chunks_per_group,
                    fused_forward=_fused_forward, fused_backward=_fused_backward,
                    kernel_prepare=_kernel_prepare)


def _l2_normalize(x):
  """`x * rsqrt(sum(x^2) + eps)` over K in float32, back in x's dtype (XLA; differentiable)."""
  x32 = x.astype(jnp.float32)
  return (x32 * lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + L2_EPS)).astype(x.dtype)


def chunked_attention(q, k, v, g=None, beta=None, *, scale=None, initial_state=None, segment_ids=None,
                      chunk_size: int = 64, compute_dtype=None, out_dtype=None, inverse_dtype=jnp.float32,
                      fused: bool = True, sequence_pieces: int | None = None, delta_backward: bool = True,
                      qk_l2norm: bool = False, channel_kernel: bool = True, gram_method: str = "auto",
                      delta_warpgroups: int = 2, forward_warpgroups: int = 3, walk_warpgroups: int = 1,
                      interpret=None):
  """Either family in chunked form, with the chunk walk as Mosaic GPU kernels; differentiable in
  q, k, v, g, beta and initial_state.

  Args:
    q, k: `[B, T, H, K]`. v: `[B, T, H_v, V]`, `H_v % H == 0` (grouped value heads).
    g: None (no decay), `[B, T, H_v]` (scalar) or `[B, T, H_v, K]` (per channel) log-decay.
    beta: None (additive family) or `[B, T, H_v]` (delta family).
    scale: read-out scale, default `K ** -0.5`.
    initial_state: None or `[B, H_v, K, V]`, used as float32.
    segment_ids: None or `[B, T]` int: the state restarts from zero wherever the id changes.
    chunk_size: C (64). compute_dtype: matmul operand dtype (bfloat16 or float16); default: q, k, v's
      common dtype. out_dtype: o's dtype, bfloat16 or float16 (o leaves the kernels through a 16-bit
      tile), default v's dtype when that is one of them, else compute_dtype. inverse_dtype: operand dtype
      of the matmuls of `(I + L)^-1` in the preparation (`prep.prepare`, delta family); float32 is exact and,
      on the H200, faster than bfloat16 there (NOTES.md). fused: the additive family with no or scalar
      decay (packed or not) runs with no XLA preparation (`fused.py`): its forward is one kernel that
      forms the chunk tensors in shared memory (and, when differentiated, keeps the states), its
      backward a reverse walk that does the same and one kernel that forms every chunk's gradients in
      parallel. On the H200 that is 1.9x faster forward and 1.4x faster forward + backward than the
      prepared path (NOTES.md, v4-v6; before v12-v14 made both faster). For the delta family with
      no or scalar decay it runs the preparation as one kernel (`delta_prep.py`). `False` runs the
      prepared path with XLA's preparation (per-channel gates always do).
    sequence_pieces: split each sequence's walks into this many pieces that run in parallel, joined by
      the pieces' end states (None: as many as keep one wave of programs on the GPU, `walk.pieces`;
      an explicit number pads T to whole pieces of chunks).
    delta_backward: with `fused`, the delta family with no or scalar decay (packed or not) computes its
      gradients in kernels (`delta_grads.py`: every chunk's gradients in parallel, no XLA vjp of the
      preparation; on the H200 gated_delta_rule's value and gradients at (4, 8192, 16, 128) take 3.4 ms
      against 7.5 ms with XLA's vjp, NOTES.md v10-v22); so does kda with `channel_kernel`
      (`channel_delta_grads.py`: the forward keeps the prepared tensors and `(I + L)^-1`; fwd+bwd at
      (4, 8192, 16, 128) 5.3 ms against 15.5 with XLA's vjp, NOTES.md v36). `False`: XLA's vjp of the
      preparation.
    qk_l2norm: l2-normalise q and k over K first (`x * rsqrt(sum(x^2) + 1e-6)` in float32, rounded to
      the inputs' dtype), gradients of the raw q, k. Where the delta kernels run (`fused`,
      `delta_backward`, no or scalar decay) the preparation and gradient kernels do it on load, so no
      XLA pass over q and k remains; elsewhere XLA does it before the kernels.
    delta_warpgroups: with the delta gradient kernels and V = 128 (two value blocks), 16-bit v and
      operands: 2 (default) computes both blocks in one program of two warpgroups that share q, k and X
      and add their partial dq, dk, dg and dbeta in shared memory (`delta_grads.chunk_grads_pair`; on
      the H200 gated_delta_rule's value and gradients at (4, 8192, 16, 128) take 2.9 ms against 3.5 ms
      with 1, NOTES.md v27); 1 (and every call the pair does not serve) one warpgroup per block, the
      partial sums added by XLA. In the interpreter the pair needs three threads in XLA's CPU pool
      (`NPROC >= 3` on a 2-core machine; `chunk_grads_pair`).
    forward_warpgroups: the fused additive forward (`fused`, no or scalar decay) in 3 (default)
      warpgroups per program: one fetches into 3-4 input stages, one carries the state, one forms P
      and o (`fused._streamed_walk`); 1: one warpgroup. On the H200, simple_gla's forward at
      (4, 8192, 16, 128) / (1, 32768, 16, 128) took 0.42 / 0.51 ms with 3 and 0.41 / 0.67 with 1
      (NOTES.md v28-v29). In the interpreter 3 warpgroups need `NPROC >= 4` on a 2-core machine
      (tests/conftest.py).
    walk_warpgroups: the forward walk over prepared chunk tensors (the delta family, per-channel
      decay, `fused=False`) and its sequence pieces' map walk: 3 specialises warpgroups as
      `forward_warpgroups=3` does (fetch into 2-4 input stages / state / output; the map walk, which
      has no output, in two), with the same products and roundings as 1 (`walk._streamed_walk`).
      1 until it is measured on a Hopper GPU (NOTES.md v30).
    channel_kernel: per-channel decay (gla, kda): the forward's chunk tensors from one kernel
      (`channel_prep.py`: the decayed grams as one whole-tile product about a per-channel reference,
      where every chunk's decay fits `prep.ref_bound`; else XLA's preparation with the merge form, one
      `lax.cond`). The backward needs no preparation: gla's in `channel_grads.py`, kda's (with
      `delta_backward`) in `channel_delta_grads.py`, from what the forward kept; a call beyond the bound
      takes XLA's vjp of the merge form, one batch row and value head at a time. False: XLA's
      preparation (and, for kda, XLA's vjp).
    gram_method: per-channel decay on the prepared path: XLA's decayed grams (`prep.decayed_gram`),
      forward and backward, as "auto" (default: one C x C product per gram about a per-channel
      reference, wherever every chunk's decay fits its bound, else the merge form for the whole call),
      "merge" (batched s x s blocks per level, any decay) or "levels" (one masked C x C product per
      level; slower on the H200, NOTES.md v25).
    interpret: None (the `interpret_kernels` context's parameters, else compiled) or a
      `plgpu.InterpretGPUParams`.

  Returns:
    `(o [B, T, H_v, V] in out_dtype, final_state [B, H_v, K, V] float32)`.

  The call targets a Hopper GPU (or the interpreter); `supports(...)` says whether this machine is one.
  """
  B, T, H, K, Hv, V = common.check_shapes(q, k, v, g, beta, initial_state, segment_ids)
  dtype = jnp.result_type(q.dtype, k.dtype, v.dtype) if compute_dtype is None else compute_dtype
  interpret = interpreting() if interpret is None else interpret
  reason = supports(K=K, V=V, chunk_size=chunk_size, dtype=dtype,
                    packing="none" if segment_ids is None else "segments",
                    backend="hopper",
                    sharded=common.explicitly_sharded(q, k, v, g, beta, initial_state, segment_ids))
  if reason is not None:
    raise ValueError(reason)
  sixteen_bit = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  if out_dtype is None:
    out_dtype = v.dtype if jnp.dtype(v.dtype) in sixteen_bit else dtype
  if jnp.dtype(out_dtype) not in sixteen_bit:
    raise ValueError(f"out_dtype must be bfloat16 or float16 (o leaves the kernels through a 16-bit "
                     f"tile; cast it afterwards); got {jnp.dtype(out_dtype).name}")
  if delta_warpgroups not in (1, 2):
    raise ValueError(f"delta_warpgroups must be 1 or 2; got {delta_warpgroups!r}")
  if forward_warpgroups not in (1, 3):
    raise ValueError(f"forward_warpgroups must be 1 or 3; got {forward_warpgroups!r}")
  if walk_warpgroups not in (1, 3):
    raise ValueError(f"walk_warpgroups must be 1 or 3; got {walk_warpgroups!r}")
  if gram_method not in prep.GRAM_METHODS:
    raise ValueError(f"gram_method must be one of {prep.GRAM_METHODS}; got {gram_method!r}")
  additive_fused = fused and fused_kernel.serves(g, beta, segment_ids)
  if interpret:
    delta_pair = (fused and delta_backward and delta_prep.serves(g, beta, segment_ids)
                  and delta_grads.pair_serves(V, chunk_size, v.dtype, dtype))
    _check_interpreter_threads({name: need for name, need, used in (
        ("forward_warpgroups=3", 4, forward_warpgroups == 3 and additive_fused),
        ("walk_warpgroups=3", 4, walk_warpgroups == 3 and not additive_fused),
        ("delta_warpgroups=2", 3, delta_warpgroups == 2 and delta_pair)) if used})
  in_kernels = qk_l2norm and fused and delta_backward and delta_prep.serves(g, beta, segment_ids)
  if qk_l2norm and not in_kernels:
    q, k = _l2_normalize(q), _l2_normalize(k)
  static = vjp.Static(walk=GPU_WALK, options=_Options(interpret=interpret or None, fused=fused,
                                                      sequence_pieces=sequence_pieces,
                                                      delta_backward=delta_backward,
                                                      qk_l2norm=bool(in_kernels),
                                                      channel_kernel=channel_kernel,
                                                      delta_warpgroups=delta_warpgroups,
                                                      forward_warpgroups=forward_warpgroups,
                                                      walk_warpgroups=walk_warpgroups,
                                                      gram_method=gram_method),
                      chunk_size=chunk_size, compute_dtype=jnp.dtype(dtype), out_dtype=jnp.dtype(out_dtype),
                      inverse_dtype=None if inverse_dtype is None else jnp.dtype(inverse_dtype),
                      gram_method=gram_method)
  return vjp.chunked_op(static, q, k, v, g, beta, scale=K ** -0.5 if scale is None else scale,
                        initial_state=initial_state, segment_ids=segment_ids)
