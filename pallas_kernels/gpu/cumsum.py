"""Per-channel decay's chunk-local cumulative sums as two Mosaic GPU kernels, each one pass over its
input: the forward's `G` (g floored, summed down each chunk) with its references, and the backward's
reverse sum of dG up each chunk.

    G_t = sum_{s <= t} max(g_s, LOG_DECAY_FLOOR)     dg_t = sum_{s >= t} dG_s     (s, t in one chunk)

One program a (batch row, chunk, block of `BLOCK_D` channels of the flattened heads and channels)
copies the chunk's C rows into shared memory and walks them in order, each thread holding its own
channel's running sum in float32 (as `conv.py` walks its tokens), overwriting each row with its sum;
the forward also keeps the running maximum and minimum and writes `channel.chunk_cumsum`'s reference
rows (R = (max + min) / 2, G_C, each 8-token group's last row) beside G. XLA's form (`prep.local_cumsum`'s
product with the triangle of ones) reads and writes the same bytes but ran at about a third of the
memory's rate in the trained KDA LM (NOTES.md v64), and its references read G once more.

The sums run token after token, the order of `lax.cumsum`; float32 throughout.

`gated_forward` and `gated_reverse` take KDA's gate from its pre-activation (`pallas_kernels/gate.py`):
the forward computes g from f on load (`gate.elementwise`, zero past the sequence's T), the reverse
walk masks dg below the floor and returns the pre-activation's cotangent with each chunk's sums for
A_log's and dt_bias's, so that neither g nor dg is ever written (NOTES.md v65).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from .. import gate as gates
from .. import prep
from . import groups
from .once import lowered_once
from .tiles import F32, compiler_params, vary_like

BLOCK_D = 128   # channels a program: one a thread of the warpgroup
UNROLL = groups.GROUP   # rows a loop iteration: one 8-token group, whose last row is a reference row


def serves(D: int, C: int) -> bool:
  """Whether the kernels take `D` flattened channels (heads x key channels) and chunks of C tokens."""
  return D % BLOCK_D == 0 and C % UNROLL == 0 and C >= UNROLL


def _geometry(x, C: int):
  B, T_pad, D = x.shape
  if not serves(D, C) or T_pad % C:
    raise ValueError(f"the cumsum kernels take x [B, T_pad, D] with D a multiple of {BLOCK_D} and T_pad a "
                     f"multiple of C, C a multiple of {UNROLL}; got shape {tuple(x.shape)}, C={C}")
  return B, T_pad // C, D // BLOCK_D


def _params():
  return compiler_params(approx_math=False)


def _zeros(row):
  """Zeros in a loaded row's strided layout: a loop carry starts from them (a splat would change layout
  at the first addition, which the loop's carry does not allow)."""
  return plgpu.layout_cast(jnp.zeros_like(row), plgpu.Layout.WG_STRIDED(row.shape, vec_size=1))


def _floor(x):
  return jnp.where(x < prep.LOG_DECAY_FLOOR, jnp.full_like(x, prep.LOG_DECAY_FLOOR), x)


def _launch_forward(body, scratch, name: str, args, *, C: int, interpret):
  """A forward walk's kernel over `args` (the first `[B, T_pad, D]`): `(G, refs)` float32."""
  B, NC, ND = _geometry(args[0], C)
  rows = groups.FIRST_ROW + C // UNROLL
  out_type = (jax.ShapeDtypeStruct(args[0].shape, F32),
              jax.ShapeDtypeStruct((B, NC, rows, args[0].shape[2]), F32))
  return tuple(vary_like(plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=(B, NC, ND), grid_names=("b", "n", "c"),
      compiler_params=_params(), interpret=interpret, kernel_name=name)(*args), args))


def _sum_down(floored, out, r_s, C: int):
  """The forward walk of one program: the running sum of `floored(i)` (row i's floored gates, float32)
  down the chunk's C rows into `out`, and into `r_s` the reference rows: R from the running maximum and
  minimum (row 0), G_C (row 1) and each 8-token group's last row."""
  def group(u, carry):
    acc, top, bottom = carry
    for j in range(UNROLL):
      i = u * UNROLL + j
      acc = acc + floored(i)
      out[i] = acc
      top, bottom = jnp.maximum(top, acc), jnp.minimum(bottom, acc)
    r_s[groups.FIRST_ROW + u] = acc
    return acc, top, bottom

  first = floored(0)
  zero = _zeros(first)
  acc, top, bottom = lax.fori_loop(0, C // UNROLL, group, (zero, first, first))
  r_s[0] = (top + bottom) / 2
  r_s[1] = acc


def _store(out, r_s, G_dst, refs_dst):
  """G's tile and the reference rows from shared memory to their device-memory blocks."""
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out, G_dst)
  plgpu.copy_smem_to_gmem(r_s, refs_dst)
  plgpu.wait_smem_to_gmem(0)


@lowered_once()
def forward(g, *, C: int, interpret=None):
  """`(G [B, T_pad, D], refs [B, NC, 2 + C / 8, D])` float32 of `g [B, T_pad, D]` (any float dtype;
  zero rows past the sequence): G the chunk-local cumulative sums of g floored at
  `prep.LOG_DECAY_FLOOR`, refs `channel.chunk_cumsum`'s rows (R, G_C, the groups' last rows)."""
  _geometry(g, C)
  in_place = g.dtype == F32
  rows = groups.FIRST_ROW + C // UNROLL
  scratch = dict(x_s=plgpu.SMEM((C, BLOCK_D), g.dtype), r_s=plgpu.SMEM((rows, BLOCK_D), F32),
                 bar=plgpu.Barrier(num_arrivals=1))
  if not in_place:
    scratch["y_s"] = plgpu.SMEM((C, BLOCK_D), F32)

  def body(g_r, G_r, refs_r, x_s, r_s, bar, y_s=None):
    b, n, c = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("c")
    cols, chunk = pl.ds(c * BLOCK_D, BLOCK_D), pl.ds(n * C, C)
    out = x_s if in_place else y_s
    plgpu.copy_gmem_to_smem(g_r.at[b, chunk, cols], x_s, bar)
    plgpu.barrier_wait(bar)

    _sum_down(lambda i: _floor(x_s[i].astype(F32)), out, r_s, C)
    _store(out, r_s, G_r.at[b, chunk, cols], refs_r.at[b, n, :, cols])

  return _launch_forward(body, scratch, "chunk_cumsum_fwd", (g,), C=C, interpret=interpret)


@lowered_once()
def reverse(dG, *, C: int, interpret=None):
  """`dg [B, T_pad, D]` float32: the sums of the float32 `dG [B, T_pad, D]` from each row to its chunk's
  last."""
  B, NC, ND = _geometry(dG, C)
  if dG.dtype != F32:
    raise ValueError(f"dG must be float32; got {dG.dtype}")
  scratch = dict(x_s=plgpu.SMEM((C, BLOCK_D), F32), bar=plgpu.Barrier(num_arrivals=1))

  def body(dG_r, dg_r, x_s, bar):
    b, n, c = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("c")
    cols, chunk = pl.ds(c * BLOCK_D, BLOCK_D), pl.ds(n * C, C)
    plgpu.copy_gmem_to_smem(dG_r.at[b, chunk, cols], x_s, bar)
    plgpu.barrier_wait(bar)

    def group(u, acc):
      for j in range(UNROLL):
        i = C - 1 - (u * UNROLL + j)
        acc = acc + x_s[i]
        x_s[i] = acc
      return acc

    lax.fori_loop(0, C // UNROLL, group, _zeros(x_s[C - 1]))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(x_s, dg_r.at[b, chunk, cols])
    plgpu.wait_smem_to_gmem(0)

  (dg,) = vary_like(plgpu.kernel(
      body, out_type=(jax.ShapeDtypeStruct(dG.shape, F32),), scratch_types=scratch, grid=(B, NC, ND),
      grid_names=("b", "n", "c"), compiler_params=_params(), interpret=interpret,
      kernel_name="chunk_cumsum_bwd")(dG), (dG,))
  return dg


def _gate_vectors(A, bias, D: int):
  for name, x in (("A", A), ("bias", bias)):
    if x.shape != (D,) or x.dtype != F32:
      raise ValueError(f"{name} must be float32 [D] = ({D},); got {x.dtype} {tuple(x.shape)}")


def _copy_in(bars, *pairs):
  """Each `(device-memory block, shared-memory tile)` copied in on its own barrier of `bars`; waits for
  all."""
  for i, (src, dst) in enumerate(pairs):
    plgpu.copy_gmem_to_smem(src, dst, bars.at[i])
  for i in range(len(pairs)):
    plgpu.barrier_wait(bars.at[i])


def _inside(t, T: int):
  """1.0 for a token `t` before T, else 0.0 (a scalar: Mosaic GPU selects no vector by a scalar)."""
  return jnp.where(t < T, 1.0, 0.0).astype(F32)


@lowered_once()
def gated_forward(f, A, bias, *, C: int, kind, T: int, interpret=None):
  """`forward` of `g = gate(f + bias)` (`gate.elementwise` of `kind` with `A = exp(A_log)` per channel):
  `f [B, T_pad, D]` (any float dtype; rows from `T` on are padding, g = 0 there), `A`, `bias` float32
  `[D]`. Returns `forward`'s `(G, refs)`."""
  _geometry(f, C)
  _gate_vectors(A, bias, f.shape[2])
  rows = groups.FIRST_ROW + C // UNROLL
  scratch = dict(x_s=plgpu.SMEM((C, BLOCK_D), f.dtype), y_s=plgpu.SMEM((C, BLOCK_D), F32),
                 r_s=plgpu.SMEM((rows, BLOCK_D), F32), a_s=plgpu.SMEM((BLOCK_D,), F32),
                 b_s=plgpu.SMEM((BLOCK_D,), F32), bars=plgpu.Barrier(num_arrivals=1, num_barriers=3))

  def body(f_r, A_r, bias_r, G_r, refs_r, x_s, y_s, r_s, a_s, b_s, bars):
    b, n, c = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("c")
    cols, chunk = pl.ds(c * BLOCK_D, BLOCK_D), pl.ds(n * C, C)
    _copy_in(bars, (f_r.at[b, chunk, cols], x_s), (A_r.at[cols], a_s), (bias_r.at[cols], b_s))
    a, bias_v = a_s[...], b_s[...]

    def floored(i):
      g = gates.elementwise(x_s[i].astype(F32) + bias_v, a, kind, exact_log1p=False)[0]
      return _floor(g * _inside(n * C + i, T))

    _sum_down(floored, y_s, r_s, C)
    _store(y_s, r_s, G_r.at[b, chunk, cols], refs_r.at[b, n, :, cols])

  return _launch_forward(body, scratch, "chunk_cumsum_gate_fwd", (f, A, bias), C=C, interpret=interpret)


@lowered_once()
def gated_reverse(dG, f, A, bias, *, C: int, kind, T: int, interpret=None):
  """`reverse` through the gate of `gated_forward`: `(df [B, T_pad, D] in f's dtype, parts [B, NC, 2, D]
  float32)`, df the cotangent of f (zero where g is below the floor, rows from `T` on undefined), parts
  each chunk's sums over its tokens before T of `dg dg/dA_log` (row 0; summed over a head's channels and
  every chunk: A_log's cotangent) and of df (row 1; over every chunk: dt_bias's)."""
  B, NC, ND = _geometry(dG, C)
  D = dG.shape[2]
  if dG.dtype != F32:
    raise ValueError(f"dG must be float32; got {dG.dtype}")
  if f.shape != dG.shape:
    raise ValueError(f"f must be dG's shape {tuple(dG.shape)}; got {tuple(f.shape)}")
  _gate_vectors(A, bias, D)
  scratch = dict(x_s=plgpu.SMEM((C, BLOCK_D), F32), f_s=plgpu.SMEM((C, BLOCK_D), f.dtype),
                 p_s=plgpu.SMEM((2, BLOCK_D), F32), a_s=plgpu.SMEM((BLOCK_D,), F32),
                 b_s=plgpu.SMEM((BLOCK_D,), F32), bars=plgpu.Barrier(num_arrivals=1, num_barriers=4))

  def body(dG_r, f_r, A_r, bias_r, df_r, parts_r, x_s, f_s, p_s, a_s, b_s, bars):
    b, n, c = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("c")
    cols, chunk = pl.ds(c * BLOCK_D, BLOCK_D), pl.ds(n * C, C)
    _copy_in(bars, (dG_r.at[b, chunk, cols], x_s), (f_r.at[b, chunk, cols], f_s), (A_r.at[cols], a_s),
             (bias_r.at[cols], b_s))
    a, bias_v = a_s[...], b_s[...]

    def group(u, carry):
      acc, pa, pb = carry
      for j in range(UNROLL):
        i = C - 1 - (u * UNROLL + j)
        acc = acc + x_s[i]
        g, du, dlog_a = gates.elementwise(f_s[i].astype(F32) + bias_v, a, kind, exact_log1p=False)
        # the floor's gradient; padding adds none
        dg = jnp.where(g >= prep.LOG_DECAY_FLOOR, acc, jnp.zeros_like(acc)) * _inside(n * C + i, T)
        df = dg * du
        f_s[i] = df.astype(f_s.dtype)
        pa, pb = pa + dg * dlog_a, pb + df
      return acc, pa, pb

    zero = _zeros(x_s[C - 1])
    _, pa, pb = lax.fori_loop(0, C // UNROLL, group, (zero, zero, zero))
    p_s[0] = pa
    p_s[1] = pb
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(f_s, df_r.at[b, chunk, cols])
    plgpu.copy_smem_to_gmem(p_s, parts_r.at[b, n, :, cols])
    plgpu.wait_smem_to_gmem(0)

  out_type = (jax.ShapeDtypeStruct(f.shape, f.dtype), jax.ShapeDtypeStruct((B, NC, 2, D), F32))
  return tuple(vary_like(plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=(B, NC, ND), grid_names=("b", "n", "c"),
      compiler_params=_params(), interpret=interpret, kernel_name="chunk_cumsum_gate_bwd")(dG, f, A, bias),
      (dG, f, A, bias)))
