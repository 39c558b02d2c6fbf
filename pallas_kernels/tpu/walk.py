"""The sequential walk over chunks as Mosaic TPU kernels: forward and backward.

Per chunk (shapes per program; `S` is kept transposed, `[V, K]`, so that the per-channel decay runs along
the 128 lanes and every vector op is lane-dense):

    forward                                   backward (chunks in reverse; dS = d loss / d S_next)
    u      = U - W S                          u   = U - W S                     (recomputed)
    o      = Qg S + P u                       du  = P^T dO + Kd dS
    S_next = Diag(decay) S + Kd^T u           dQg = dO S^T      dP = dO u^T     dKd = u dS^T
                                              dW  = -du S^T     dU = du         ddecay = rowsum(S * dS)
                                              dS <- Diag(decay) dS + Qg^T dO - W^T du

Grid `(B, H, V / block_v, NC / chunks_per_step)`: the first three axes are "parallel", the chunk axis is
"arbitrary" and last, and each grid step walks `chunks_per_step` chunks with an inner loop. The state
(and, backward, dS) lives in a float32 VMEM scratch that persists across the chunk axis and is
initialised at its first step. The backward reads the state entering each chunk from `forward(...,
with_states=True)` (the custom_vjp recomputes them; nothing per token is stored).

Matmul operands are the per-chunk tensors' dtype (bfloat16 or float32); the state is cast to it for the
MXU and accumulation is float32 (`preferred_element_type`). float32 operands use
`Precision.HIGHEST` (otherwise the MXU would round them to bfloat16).

The V axis of the walk is independent per value column, so `block_v < V` splits the state with no
communication; the backward then emits per-V-block partial sums of the K-side gradients (dQg, dKd, dW,
dP, ddecay), which the caller adds.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .. import common
from ..prep import ChunkTensors

MiB = 1 << 20
DEFAULT_SCOPED_VMEM = 16 * MiB


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Block sizes of the chunk walk (the chunk length itself is the op's `chunk_size`).

  Defaults are for TPU v5e and v6e (one TensorCore per chip, 128 MiB of VMEM); NOTES.md has the
  arithmetic. Numbers below are for K = V = 128, chunk 64, bfloat16 operands, the delta family.

  Attributes:
    chunks_per_step: chunks walked per grid step in the forward. A grid step has a fixed cost (pipeline
      bookkeeping, DMA issue and waits; assumed ~0.35 us, not measured here) while one chunk moves
      ~93 KB (~0.11 us of v5e HBM time, ~0.06 us on v6e), so one chunk per step would be overhead-bound;
      16 chunks (1024 tokens) make a step ~1.8 us of v5e DMA, with <= 5.4 MiB of double-buffered VMEM.
    chunks_per_step_bwd: the same for the backward, which moves ~3.5x the bytes per chunk (float32
      state and gradients): 8 chunks keep its double-buffered footprint <= 5.4 MiB as well.
    block_v: value columns per program; None takes all of V. v5e/v6e have one TensorCore, so splitting
      V buys no parallelism that B * H does not already give, re-reads the K-side tensors once per block
      and makes the backward emit partial sums; set a multiple of 128 (the lane width) for megacore
      chips or very large V.
    vmem_limit_bytes: scoped VMEM requested from Mosaic; None keeps the compiler's default, taken to be
      16 MiB (the smaller of the v5e / v6e defaults) when `supports` checks a call's footprint. Larger
      values may also need XLA's `--xla_tpu_scoped_vmem_limit_kib`.
  """

  chunks_per_step: int = 16
  chunks_per_step_bwd: int = 8
  block_v: int | None = None
  vmem_limit_bytes: int | None = None

  @property
  def vmem_budget(self) -> int:
    """The VMEM a grid step may use: `vmem_limit_bytes`, else the assumed default scoped limit."""
    return DEFAULT_SCOPED_VMEM if self.vmem_limit_bytes is None else self.vmem_limit_bytes

  def __post_init__(self):
    for name in ("chunks_per_step", "chunks_per_step_bwd"):
      if getattr(self, name) < 1:
        raise ValueError(f"BlockSizes.{name} must be >= 1; got {getattr(self, name)}")
    if self.block_v is not None and (self.block_v < 1 or self.block_v % 128):
      raise ValueError(f"BlockSizes.block_v must be None or a positive multiple of 128; got {self.block_v}")

  def v_block(self, V: int) -> int:
    """The value columns per program for a given V (all of V unless `block_v` divides it)."""
    return V if self.block_v is None or V % self.block_v or self.block_v >= V else self.block_v

  def forward_steps(self, NC: int) -> int:
    """Chunks per forward grid step for a walk of (at least) NC chunks: as even as possible, so that
    padding NC up to a multiple of it adds fewer chunks than there are grid steps."""
    steps = -(-NC // self.chunks_per_step)
    return -(-NC // steps)

  def backward_steps(self, NC: int) -> int:
    """Chunks per backward grid step: the largest divisor of NC that is <= chunks_per_step_bwd."""
    return max(d for d in range(1, min(NC, self.chunks_per_step_bwd) + 1) if NC % d == 0)


def vmem_bytes(*, C: int, K: int, V: int, nb: int, bv: int, itemsize: int, delta: bool,
               backward: bool) -> int:
  """An upper bound on the VMEM of one grid step: every block any pass of that direction uses, double
  buffered and padded to (8, 128) tiles, plus the scratch."""
  tile = lambda r, c, size=4: -(-r // 8) * 8 * -(-c // 128) * 128 * size
  ck, cv, cc, row = tile(C, K, itemsize), tile(C, bv, itemsize), tile(C, C, itemsize), tile(1, K)
  state = tile(bv, K)
  if not backward:  # qg, kd, [w], u, p, decay, h0 in; o, states, final out
    blocks = nb * ((3 if delta else 2) * ck + cv + cc + row + cv + state) + 2 * state
    return 2 * blocks + state
  f32 = lambda r, c: tile(r, c)
  ins = nb * ((3 if delta else 2) * ck + cv + cc + row + state + cv) + state
  outs = nb * ((3 if delta else 2) * f32(C, K) + f32(C, bv) + f32(C, C) + tile(1, K)) + state
  return 2 * (ins + outs) + state


def cost(*, B: int, H: int, NC: int, C: int, K: int, V: int, itemsize: int, delta: bool, walk: str,
         out_itemsize: int = 4, NV: int = 1) -> tuple[int, int]:
  """`(FLOPs, HBM bytes)` of one walk: "forward" (outputs), "states" (the backward's recomputation of
  the state entering each chunk) or "backward". Matmul FLOPs only (elementwise work is O(K V) per
  chunk against O(C K V)); bytes count every block read or written once per v-block where it is
  re-read, plus the initial/final state."""
  ckv, ccv = 2 * C * K * V, 2 * C * C * V
  k_side = (3 if delta else 2) * C * K  # qg, kd, [w]
  per_chunk_in = NV * (k_side * itemsize + C * C * itemsize + K * 4) + C * V * itemsize
  if walk == "forward":
    flops = (6 if delta else 4) * ckv // 2 + ccv
    bytes_ = per_chunk_in + C * V * out_itemsize
  elif walk == "states":
    flops = (2 if delta else 1) * ckv
    bytes_ = NV * ((k_side - C * K) * itemsize + K * 4) + C * V * itemsize + K * V * 4
  elif walk == "backward":
    flops = (7 if delta else 4) * ckv + 2 * ccv
    bytes_ = (per_chunk_in + K * V * 4 + C * V * 4  # inputs, states, dO
              + NV * (k_side * 4 + C * C * 4 + K * 4) + C * V * 4)  # K-side grads per v-block, dU
  else:
    raise ValueError(f"walk must be 'forward', 'states' or 'backward'; got {walk!r}")
  return B * H * NC * flops, B * H * (NC * bytes_ + 2 * K * V * 4)


def _dot(a, b, contract, dtype):
  """`a @ b` with contracting dims `contract` (e.g. ((1,), (0,))), operands in `dtype`, f32 result."""
  precision = lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT
  return lax.dot_general(a.astype(dtype), b.astype(dtype), (contract, ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)


NN, NT, TN = ((1,), (0,)), ((1,), (1,)), ((0,), (0,))


def _forward_kernel(*refs, nb: int, delta: bool, has_h0: bool, with_o: bool, with_states: bool):
  """One grid step: walks `nb` chunks. Refs (present per the flags), blocks of one (b, h, v-block):
  qg (nb, C, K) [with_o], kd (nb, C, K), w (nb, C, K) [delta], u (nb, C, bv), p (nb, C, C) [with_o],
  decay (nb, 1, K), h0 (bv, K) [has_h0]; out: o (nb, C, bv) [with_o], states (nb, bv, K)
  [with_states], final (bv, K); scratch: state (bv, K) f32."""
  refs = list(refs)
  take = lambda flag=True: refs.pop(0) if flag else None
  qg_ref, kd_ref, w_ref, u_ref, p_ref = take(with_o), take(), take(delta), take(), take(with_o)
  decay_ref, h0_ref = take(), take(has_h0)
  o_ref, states_ref, final_ref = take(with_o), take(with_states), take()
  (state_ref,) = refs
  step = pl.program_id(3)
  dtype = kd_ref.dtype

  @pl.when(step == 0)
  def _():
    state_ref[...] = h0_ref[...].astype(jnp.float32) if has_h0 else jnp.zeros_like(state_ref)

  def chunk(i, carry):
    s = state_ref[...]
    if with_states:
      states_ref[i] = s
    u = u_ref[i].astype(jnp.float32)
    if delta:
      u = u - _dot(w_ref[i], s, NT, dtype)
    if with_o:
      o = _dot(qg_ref[i], s, NT, dtype) + _dot(p_ref[i], u, NN, dtype)
      o_ref[i] = o.astype(o_ref.dtype)
    state_ref[...] = decay_ref[i] * s + _dot(u, kd_ref[i], TN, dtype)
    return carry

  lax.fori_loop(0, nb, chunk, 0)

  @pl.when(step == pl.num_programs(3) - 1)
  def _():
    final_ref[...] = state_ref[...]


def _backward_kernel(*refs, nb: int, delta: bool, has_dfinal: bool):
  """One grid step of the reverse walk over `nb` chunks (last chunk first). Refs: qg, kd, [w], u, p,
  decay, states (nb, bv, K), do (nb, C, bv), [dfinal (bv, K)]; out: dqg, dkd, [dw] (nb, C, K), du
  (nb, C, bv), dp (nb, C, C), ddecay (nb, 1, K), dh0 (bv, K); scratch: dS (bv, K) f32."""
  refs = list(refs)
  take = lambda flag=True: refs.pop(0) if flag else None
  qg_ref, kd_ref, w_ref, u_ref, p_ref, decay_ref = take(), take(), take(delta), take(), take(), take()
  states_ref, do_ref, dfinal_ref = take(), take(), take(has_dfinal)
  dqg_ref, dkd_ref, dw_ref, du_ref, dp_ref, ddecay_ref, dh0_ref = (
      take(), take(), take(delta), take(), take(), take(), take())
  (ds_ref,) = refs
  step = pl.program_id(3)
  dtype = kd_ref.dtype

  @pl.when(step == 0)
  def _():
    ds_ref[...] = dfinal_ref[...].astype(jnp.float32) if has_dfinal else jnp.zeros_like(ds_ref)

  def chunk(t, carry):
    i = nb - 1 - t
    s, ds, do = states_ref[i], ds_ref[...], do_ref[i].astype(jnp.float32)
    u = u_ref[i].astype(jnp.float32)
    if delta:
      u = u - _dot(w_ref[i], s, NT, dtype)
    du = _dot(p_ref[i], do, TN, dtype) + _dot(kd_ref[i], ds, NT, dtype)
    dqg_ref[i] = _dot(do, s, NN, dtype)
    dp_ref[i] = _dot(do, u, NT, dtype)
    dkd_ref[i] = _dot(u, ds, NN, dtype)
    du_ref[i] = du
    ddecay_ref[i] = jnp.sum(s * ds, axis=0, keepdims=True)
    ds_prev = decay_ref[i] * ds + _dot(do, qg_ref[i], TN, dtype)
    if delta:
      dw_ref[i] = -_dot(du, s, NN, dtype)
      ds_prev = ds_prev - _dot(du, w_ref[i], TN, dtype)
    ds_ref[...] = ds_prev
    return carry

  lax.fori_loop(0, nb, chunk, 0)

  @pl.when(step == pl.num_programs(3) - 1)
  def _():
    dh0_ref[...] = ds_ref[...]


def _vary_alike(args):
  """Under `jax.shard_map(check_vma=True)` a pallas_call's outputs must say over which mesh axes they
  vary: make every input vary over the union of the inputs' axes and return that for the outputs."""
  axes = common.varying_axes(args)
  if not axes:
    return args, None
  args = [common.vary_over(x, axes) for x in args]
  return args, jax.typeof(args[0]).manual_axis_type


def _params(bs: BlockSizes):
  return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
                              vmem_limit_bytes=bs.vmem_limit_bytes)


def forward(t: ChunkTensors, h0, *, block_sizes: BlockSizes, with_o: bool = True,
            with_states: bool = False, out_dtype=jnp.float32, interpret=False):
  """Runs the forward walk.

  Args:
    t: per-chunk tensors `[B, H, NC, C, ...]` in the matmul dtype (decay float32).
    h0: None or `[B, H, K, V]` float32 initial state.
    with_o: compute the outputs (the backward's recomputation needs only the states).
    with_states: also return the state entering every chunk (opaque; for `backward`).

  Returns:
    `(o [B, H, NC, C, V] out_dtype or None, states or None, final [B, H, K, V] float32)`.
  """
  B, H, NC, C, K = t.kd.shape
  V = t.u.shape[-1]
  delta = t.w is not None
  bv, nb = block_sizes.v_block(V), block_sizes.forward_steps(NC)
  if NC % nb:
    raise ValueError(f"NC={NC} chunks do not fill whole grid steps of {nb}; pad T with "
                     f"prep.padded_length(T, C, BlockSizes.forward_steps(ceil(T / C)))")
  NV, NS = V // bv, NC // nb
  grid = (B, H, NV, NS)
  ck = pl.BlockSpec((None, None, nb, C, K), lambda b, h, j, n: (b, h, n, 0, 0))
  cv = pl.BlockSpec((None, None, nb, C, bv), lambda b, h, j, n: (b, h, n, 0, j))
  cc = pl.BlockSpec((None, None, nb, C, C), lambda b, h, j, n: (b, h, n, 0, 0))
  row = pl.BlockSpec((None, None, nb, 1, K), lambda b, h, j, n: (b, h, n, 0, 0))
  st = pl.BlockSpec((None, None, bv, K), lambda b, h, j, n: (b, h, j, 0))
  sts = pl.BlockSpec((None, None, nb, bv, K), lambda b, h, j, n: (b, h, n, j, 0))

  args, in_specs = [], []
  for x, spec, use in ((t.qg, ck, with_o), (t.kd, ck, True), (t.w, ck, delta), (t.u, cv, True),
                       (t.p, cc, with_o), (t.decay[:, :, :, None, :], row, True),
                       (None if h0 is None else jnp.swapaxes(h0, -1, -2), st, h0 is not None)):
    if use:
      args.append(x), in_specs.append(spec)
  args, axes = _vary_alike(args)
  out = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=axes)
  out_shape, out_specs = [], []
  if with_o:
    out_shape.append(out((B, H, NC, C, V), out_dtype)), out_specs.append(cv)
  if with_states:
    out_shape.append(out((B, H, NC, V, K), jnp.float32)), out_specs.append(sts)
  out_shape.append(out((B, H, V, K), jnp.float32)), out_specs.append(st)

  kernel = functools.partial(_forward_kernel, nb=nb, delta=delta, has_h0=h0 is not None,
                             with_o=with_o, with_states=with_states)
  flops, bytes_ = cost(B=B, H=H, NC=NC, C=C, K=K, V=V, itemsize=t.kd.dtype.itemsize, delta=delta,
                       walk="forward" if with_o else "states", out_itemsize=jnp.dtype(out_dtype).itemsize,
                       NV=NV)
  outs = pl.pallas_call(
      kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
      scratch_shapes=[pltpu.VMEM((bv, K), jnp.float32)], compiler_params=_params(block_sizes),
      cost_estimate=pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=bytes_),
      interpret=interpret, name="chunk_walk_fwd" if with_o else "chunk_walk_states")(*args)
  outs = list(outs)
  o = outs.pop(0) if with_o else None
  states = outs.pop(0) if with_states else None
  return o, states, jnp.swapaxes(outs[0], -1, -2)


def backward(t: ChunkTensors, states, do, dfinal, *, block_sizes: BlockSizes, interpret=False):
  """Runs the reverse walk.

  Args:
    t: the per-chunk tensors given to `forward`.
    states: `forward(..., with_states=True)`'s states.
    do: `[B, H, NC, C, V]` cotangent of the unscaled outputs.
    dfinal: None or `[B, H, K, V]` cotangent of the final state.

  Returns:
    `(ChunkTensors of float32 cotangents (w None for the additive family), dh0 [B, H, K, V])`.
  """
  B, H, NC, C, K = t.kd.shape
  V = t.u.shape[-1]
  delta = t.w is not None
  bv = block_sizes.v_block(V)
  if states.shape[3] != V:
    raise ValueError(f"states do not match V={V}: {states.shape}")
  nb = block_sizes.backward_steps(NC)
  NV, NS = V // bv, NC // nb
  rev = lambda n: NS - 1 - n
  ck = pl.BlockSpec((None, None, nb, C, K), lambda b, h, j, n: (b, h, rev(n), 0, 0))
  cv = pl.BlockSpec((None, None, nb, C, bv), lambda b, h, j, n: (b, h, rev(n), 0, j))
  cc = pl.BlockSpec((None, None, nb, C, C), lambda b, h, j, n: (b, h, rev(n), 0, 0))
  row = pl.BlockSpec((None, None, nb, 1, K), lambda b, h, j, n: (b, h, rev(n), 0, 0))
  st = pl.BlockSpec((None, None, bv, K), lambda b, h, j, n: (b, h, j, 0))
  sts = pl.BlockSpec((None, None, nb, bv, K), lambda b, h, j, n: (b, h, rev(n), j, 0))
  # K-side gradients are partial sums per v-block: one slab per block, added below.
  pck = pl.BlockSpec((None, None, None, nb, C, K), lambda b, h, j, n: (b, h, j, rev(n), 0, 0))
  pcc = pl.BlockSpec((None, None, None, nb, C, C), lambda b, h, j, n: (b, h, j, rev(n), 0, 0))
  prow = pl.BlockSpec((None, None, None, nb, 1, K), lambda b, h, j, n: (b, h, j, rev(n), 0, 0))

  args, in_specs = [], []
  for x, spec, use in ((t.qg, ck, True), (t.kd, ck, True), (t.w, ck, delta), (t.u, cv, True),
                       (t.p, cc, True), (t.decay[:, :, :, None, :], row, True), (states, sts, True),
                       (do, cv, True),
                       (None if dfinal is None else jnp.swapaxes(dfinal, -1, -2), st,
                        dfinal is not None)):
    if use:
      args.append(x), in_specs.append(spec)
  args, axes = _vary_alike(args)
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32, manual_axis_type=axes)
  out_shape = [f32(B, H, NV, NC, C, K), f32(B, H, NV, NC, C, K)]
  out_specs = [pck, pck]
  if delta:
    out_shape.append(f32(B, H, NV, NC, C, K)), out_specs.append(pck)
  out_shape += [f32(B, H, NC, C, V), f32(B, H, NV, NC, C, C), f32(B, H, NV, NC, 1, K), f32(B, H, V, K)]
  out_specs += [cv, pcc, prow, st]

  kernel = functools.partial(_backward_kernel, nb=nb, delta=delta, has_dfinal=dfinal is not None)
  flops, bytes_ = cost(B=B, H=H, NC=NC, C=C, K=K, V=V, itemsize=t.kd.dtype.itemsize, delta=delta,
                       walk="backward", NV=NV)
  outs = list(pl.pallas_call(
      kernel, out_shape=out_shape, grid=(B, H, NV, NS), in_specs=in_specs, out_specs=out_specs,
      scratch_shapes=[pltpu.VMEM((bv, K), jnp.float32)], compiler_params=_params(block_sizes),
      cost_estimate=pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=bytes_),
      interpret=interpret, name="chunk_walk_bwd")(*args))
  total = lambda x: jnp.sum(x, axis=2)
  dqg, dkd = total(outs.pop(0)), total(outs.pop(0))
  dw = total(outs.pop(0)) if delta else None
  du, dp, ddecay, dh0 = outs
  grads = ChunkTensors(qg=dqg, kd=dkd, w=dw, u=du, p=total(dp), decay=total(ddecay)[:, :, :, 0])
  return grads, jnp.swapaxes(dh0, -1, -2)
