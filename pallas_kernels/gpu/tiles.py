"""The tile room the GPU kernels share: layouts, shared-memory buffers and their budget, the
tensor-core products, l2-normalised rows and their gradient, the unit lower inverse, and the
plumbing of a kernel's outputs (flat chunk layout, mesh variance).
"""

from __future__ import annotations

import contextlib
import math
import os

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from .. import common

F32 = jnp.float32
WGMMA = plgpu.Layout.WGMMA
COLS = plgpu.Layout.WGMMA.reduce(0)   # one value per column of a WGMMA-layout tile
ROWS = plgpu.Layout.WGMMA.reduce(1)   # one value per row of a WGMMA-layout tile
BLOCK_V = 64          # value columns per program: the WGMMA M dimension of the state
SMEM_BYTES = 227 * 1024   # an H100/H200 block's dynamic shared memory


_PHASES = {"on": None}   # (directory, ranges) while `phase_trace` is in force


@contextlib.contextmanager
def phase_trace(directory: str, ranges: int = 64):
  """Inside: the Mosaic GPU kernels traced from here on record, per warpgroup, the SM clock at the
  start and end of each `jax.named_scope` in their bodies (Mosaic GPU's on-device profiler), and every
  call writes one Chrome trace `{time}-trace.json` into `directory` (`experiments/kernel_phases.py`
  reads them). `ranges`: the scopes a warpgroup may record in one program (later ones are dropped);
  the record takes `16 ranges` bytes of shared memory a warpgroup. Off the device it has no effect;
  the kernels' traces are keyed by it (`once.lowered_once`), so a kernel traced before is traced again
  with the records (a program jitted around the call must itself be traced inside). For measurement
  only: the records cost a few cycles each."""
  previous = _PHASES["on"]
  os.makedirs(directory, exist_ok=True)
  _PHASES["on"] = (directory, ranges)
  try:
    yield
  finally:
    _PHASES["on"] = previous


def phases_key():
  """What `phase_trace` has in force (None when off): part of the key of a kernel's trace
  (`once.lowered_once`)."""
  return _PHASES["on"]


def phase(name: str):
  """A named phase of a kernel body (`with phase("grams"): ...`): what `phase_trace` times; nothing
  otherwise."""
  return jax.named_scope(name)


def compiler_params(**options) -> plgpu.CompilerParams:
  """`plgpu.CompilerParams(**options)`, with the phase records of `phase_trace` where it is in force.

  Every kernel lowers with lane semantics (the layouts its loads name, without Mosaic GPU's layout
  inference): on an H100 the same step times and bf16 errors, and the models' compiles 19-24% shorter."""
  if _PHASES["on"] is not None:
    directory, ranges = _PHASES["on"]
    options.update(profile_space=ranges, profile_dir=directory, profile_bounds_check=True)
  options.setdefault("lowering_semantics", plgpu.LoweringSemantics.Lane)
  return plgpu.CompilerParams(**options)


def phase_bytes(warpgroups: int = 1) -> int:
  """Shared memory that `phase_trace`'s records take in a kernel of `warpgroups` (0 when off)."""
  if _PHASES["on"] is None:
    return 0
  return 16 * _PHASES["on"][1] * warpgroups


def scratch_bytes(scratch) -> int:
  """Shared memory of a kernel's scratch dict as Mosaic GPU lays it out (jax 0.11's Pallas lowering):
  each buffer from a 1 KB boundary (`SMEM_ALIGNMENT`) and 8 bytes a barrier, which is Mosaic's count
  for a body that allocates nothing more (`test_smem_count.py`), plus the 2 KB of reduction scratch the
  lowering reserves when a body reduces. The buffers' plain sum passed layouts that Mosaic refuses.
  Scoped allocations inside a body are not counted (kda's key side showed 1 KB more, NOTES.md v61)."""
  total, barriers = 2048, 0
  for x in scratch.values():
    if isinstance(x, plgpu.Barrier):
      barriers += math.prod(x.num_barriers) if isinstance(x.num_barriers, tuple) else x.num_barriers
    else:
      total += -(-math.prod(x.shape) * jnp.dtype(x.dtype).itemsize // 1024) * 1024
  return total + 8 * barriers


def smem(shape, dtype):
  """A shared-memory buffer tiled and swizzled for TMA and WGMMA along its last dim."""
  dtype = jnp.dtype(dtype)
  swizzle = plgpu.find_swizzle(shape[-1] * dtype.itemsize * 8)
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle // dtype.itemsize)),
                                              plgpu.SwizzleTransform(swizzle)))


def matmul(a, b, shape, init=None):
  """`init + a @ b` on the tensor cores, float32 result (`a`, `b`: 16-bit shared-memory refs, possibly
  transposed views).

  The result passes an optimisation barrier: reading the accumulator lowers to a `wgmma.wait_group` that
  has no data dependency on the registers, so without it arithmetic on the result could be scheduled
  before the wait."""
  def scoped(acc):
    plgpu.wgmma(acc, a, b)
    return acc[...]
  out = lax.optimization_barrier(pl.run_scoped(scoped, plgpu.ACC(shape, F32)))
  return out if init is None else init + out


def matmuls(*specs):
  """Several products issued before one wait, so the tensor cores pipeline them: each spec is
  `(shape, [(a, b), ...])` and yields `sum(a @ b)` (float32, one accumulator per spec; the terms of a
  spec chain in it). Returns the results as a tuple, past one optimisation barrier (see `matmul`)."""
  def scoped(*accs):
    for acc, (_, pairs) in zip(accs, specs):
      for a, b in pairs:
        plgpu.wgmma(acc, a, b)
    return tuple(acc[...] for acc in accs)
  return lax.optimization_barrier(pl.run_scoped(scoped, *(plgpu.ACC(shape, F32) for shape, _ in specs)))


def chunk_program(C: int, group: int):
  """Inside a kernel whose grid is `("b", "h", "n")` (batch row, value head, chunk): `(b, h, n, the key
  head of value head h with `group` value heads a key head, the chunk's C token rows)`."""
  b, h, n = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
  return b, h, n, lax.div(h, group), pl.ds(n * C, C)


def flat(x):
  """`[B, H, NC, C, D]` -> `[B, H, NC * C, D]` (free: a reshape of contiguous dims)."""
  return None if x is None else x.reshape(x.shape[:2] + (-1,) + x.shape[4:])


def vary_like(outs, args):
  """Under `jax.shard_map(check_vma=True)`: the kernel's outputs vary over the mesh axes its inputs vary
  over (`plgpu.kernel` itself does not track them)."""
  axes = common.varying_axes(args)
  return [common.vary_over(x, axes) for x in outs]


L2_EPS = 1e-6   # `x * rsqrt(sum(x^2) + eps)`, as linear_attention_jax.ops.l2_normalize


def l2_normalize_rows(ref, C):
  """Normalises the rows of the 16-bit `[C, K]` shared-memory tile `ref` in place (float32 sums, then
  rounded to the tile's dtype, as an XLA l2 norm before the kernel would round); returns the `[C]`
  reciprocal norms (rows layout) for the gradient, `dx = r (dy - y rowsum(y dy))`."""
  x = plgpu.load(ref, layout=WGMMA).astype(jnp.float32)
  r = lax.rsqrt(jnp.sum(x * x, axis=1) + L2_EPS)
  ref[...] = (x * lax.broadcast_in_dim(r, x.shape, [0])).astype(ref.dtype)
  plgpu.commit_smem()
  return r


def l2_normalize_halves(ref):
  """`l2_normalize_rows` of a `[C, K]` tile held as its column blocks, the 16-bit `[n, C, K / n]`
  shared-memory `ref` (block i the columns `[i K / n, (i + 1) K / n)`): the norm over all K, each block
  scaled in place. Returns the `[C]` reciprocal norms."""
  load = lambda i: plgpu.load(ref.at[i], layout=WGMMA).astype(jnp.float32)
  sums = None
  for i in range(ref.shape[0]):   # one block live at a time
    x = load(i)
    sums = jnp.sum(x * x, axis=1) if sums is None else sums + jnp.sum(x * x, axis=1)
  r = lax.rsqrt(sums + L2_EPS)
  for i in range(ref.shape[0]):
    x = load(i)
    ref.at[i][...] = (x * lax.broadcast_in_dim(r, x.shape, [0])).astype(ref.dtype)
  plgpu.commit_smem()
  return r


def l2_normalize_grad(dy, y_ref, r):
  """`dx` of `y = l2_normalize(x)` for the float32 `[C, K]` tile `dy`, `y` the normalised tile in shared
  memory and `r` the rows' reciprocal norms."""
  y = plgpu.load(y_ref, layout=WGMMA).astype(jnp.float32)
  dot = jnp.sum(dy * y, axis=1)
  rows = lambda x: lax.broadcast_in_dim(x, dy.shape, [0])
  return rows(r) * (dy - y * rows(dot))


def upper_ones(ref):
  """Writes the `[C, C]` upper triangle of ones, `U[t, s] = 1` for `s >= t`, into the 16-bit `ref`."""
  C = ref.shape[0]
  i = plgpu.broadcasted_iota(jnp.int32, (C, C), 0, layout=WGMMA)
  j = plgpu.broadcasted_iota(jnp.int32, (C, C), 1, layout=WGMMA)
  ref[...] = jnp.where(j >= i, 1.0, 0.0).astype(ref.dtype)


def reverse_cumsum_rows(x_ref, upper, parts):
  """Replaces the float32 `[C, W]` shared-memory tile `x_ref` by its rows' reverse cumulative sums,
  `U x` (`upper`: `upper_ones`), on the tensor cores: x split into the three bfloat16 `[C, W]` tiles
  `parts`, each the rounding of what the ones before it left, so that their sum is x to float32's
  precision; the products with ones are exact and summed in float32."""
  rest = plgpu.load(x_ref, layout=WGMMA)
  for part in parts:
    head = rest.astype(part.dtype)
    part[...] = head
    rest = rest - head.astype(jnp.float32)
  plgpu.commit_smem()
  (x_ref[...],) = matmuls((x_ref.shape, [(upper, part) for part in parts]))
  plgpu.commit_smem()


def unit_lower_inverse(l_s, x_s, e_s, y_s):
  """`X = (I + L)^-1` of the strictly lower `[C, C]` tile `l_s` into `x_s` (the operand dtype) by block
  doubling on whole tiles (delta_prep.py's docstring); `e_s`, `y_s` are scratch tiles of the same shape.
  X stays float32 in registers between the levels."""
  C = l_s.shape[0]
  sq = (C, C)
  apart = (plgpu.broadcasted_iota(jnp.int32, sq, 0, layout=WGMMA)
           ^ plgpu.broadcasted_iota(jnp.int32, sq, 1, layout=WGMMA))   # i XOR j
  # the first level without products: the inverse of each 2 x 2 block is I - L there (X = I, so
  # X - (X E) X = I - E exactly, as the products would give it)
  L = plgpu.load(l_s, layout=WGMMA).astype(F32)
  X = jnp.where(apart == 0, 1.0, 0.0).astype(F32) - jnp.where(apart == 1, L, 0.0)
  s = 2
  while s < C:
    inside = (apart < 2 * s) & (apart >= s)   # same 2s block, different s blocks
    e_s[...] = jnp.where(inside, plgpu.load(l_s, layout=WGMMA), 0.0).astype(e_s.dtype)
    x_s[...] = X.astype(x_s.dtype)
    plgpu.commit_smem()
    y_s[...] = matmul(x_s, e_s, sq).astype(y_s.dtype)
    plgpu.commit_smem()
    X = X - matmul(y_s, x_s, sq)
    s *= 2
  x_s[...] = X.astype(x_s.dtype)
  plgpu.commit_smem()   # before any copy or product reads it (the async proxy)
