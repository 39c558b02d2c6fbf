"""The residual stream's RMSNorm, with the residual addition in front of it, as two Mosaic GPU kernels
(forward and backward) that move each row through once.

A pre-norm block adds its mixer's (or MLP's) output h to the stream x and normalises the sum for what
comes next. With s the new stream (rounded to x's dtype, as the addition alone gives it):

    s = x + h                                   (no h: s = x)
    y = s * (r w),  r = (mean(s^2) + eps)^(-1/2)          (float32; y rounded to `out_dtype`)

and in the backward, with dy the cotangent of y and ds_out that of s from the rest of the model:

    g  = dy w,  c = mean(g s r)
    ds = r (g - s r c) + ds_out                 (the cotangent of x and of h; rounded to s's dtype)
    dw = sum over rows of dy s r

XLA gives each of these reductions a pass of its own over the rows (the sum of squares, y; c, ds and the
column sums dw), and its addition another: at x `[32768, 1024]` bfloat16 a block norm moved ~13 row
arrays forward and back where these kernels move 8 (NOTES.md v79). A program takes 64 rows (a
warpgroup's WGMMA-layout tile) and streams them twice in column blocks through double-buffered shared
memory: the first pass forms the row sums (and writes s, and dw's column sums), the second the rows
(y; ds) from the same blocks, read again from the L2 cache. Rows are padded to whole programs (zero rows
give zeros); the columns must be whole blocks.

The forward's multiplication order, `s * (r * w)` in float32, is flax's `nnx.RMSNorm`'s, so that the
kernels' y equals the module's to its last rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax.custom_derivatives import SymbolicZero

from .interpret import interpreting
from .once import lowered_once
from .pipeline import walk_chunks
from .plan import hopper_reason
from .tiles import COLS, F32, ROWS, WGMMA, compiler_params, smem, vary_like

ROWS_A_PROGRAM = 64      # a warpgroup's WGMMA-layout tile
BLOCK_FWD = 128          # columns a block, forward: two [64, 128] float32 tiles live at most
BLOCK_BWD = 64           # backward: s, dy and ds_out in registers at once
MAX_D = 8192             # w in shared memory: 32 KB
DTYPES = (jnp.bfloat16, jnp.float16)


def reason(shape, dtype, backend: str | None = None) -> str | None:
  """None if the kernels serve rows `shape = [..., D]` of `dtype`, else why not."""
  why = hopper_reason(backend)
  if why is not None:
    return why
  D = shape[-1] if len(shape) else 0
  if D % BLOCK_FWD or not BLOCK_FWD <= D <= MAX_D:
    return f"the kernels need the normalised axis a multiple of {BLOCK_FWD} up to {MAX_D}; got {D}"
  if not any(jnp.dtype(dtype) == jnp.dtype(d) for d in DTYPES):
    return f"the kernels serve bfloat16 and float16 rows; got {jnp.dtype(dtype)}"
  return None


def _rows(x, N_pad):
  """`[..., D]` -> `[N_pad, D]`, zero rows after the N real ones."""
  D = x.shape[-1]
  x = x.reshape(-1, D)
  return x if x.shape[0] == N_pad else jnp.pad(x, [(0, N_pad - x.shape[0]), (0, 0)])


def _padded(N):
  return -(-N // ROWS_A_PROGRAM) * ROWS_A_PROGRAM


def _staged(out_s, slot, value, dst):
  """Writes `value` to the staging tile `out_s.at[slot]` once the copy that last read it is done, and
  copies it to the GMEM ref `dst`."""
  plgpu.wait_smem_to_gmem(1, wait_read_only=True)
  out_s.at[slot][...] = value.astype(out_s.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_s.at[slot], dst)


def _check_block(D, bd, name):
  if bd % 64 or D % bd:
    raise ValueError(f"{name}={bd} must be a multiple of 64 that divides D={D}")


@lowered_once()
def forward(x, h, w, *, eps: float, out_dtype, block_d: int = BLOCK_FWD, interpret=None):
  """`(y, s, r)` for rows x `[N, D]` (h the same or None; w `[D]` float32; module docstring): y in
  `out_dtype`, s in x's dtype (None without h), r `[N]` float32. N a multiple of 64 (the caller pads);
  `block_d` columns a block."""
  N, D = x.shape
  dtype, bd = x.dtype, block_d
  _check_block(D, bd, "block_d")
  nb, R = D // bd, ROWS_A_PROGRAM
  add = h is not None
  # one staging tile for s (first pass) and y (second) where their dtypes agree
  shared = jnp.dtype(out_dtype) == jnp.dtype(dtype)
  scratch = dict(x_s=smem((2, R, bd), dtype), out_s=smem((2, R, bd), jnp.dtype(out_dtype)),
                 w_s=plgpu.SMEM((nb, bd), F32), r_s=plgpu.SMEM((R,), F32),
                 bar=plgpu.Barrier(num_arrivals=1 + add, num_barriers=2),
                 bar2=plgpu.Barrier(num_arrivals=1, num_barriers=2), bar_w=plgpu.Barrier(num_arrivals=1))
  if add:
    scratch["h_s"] = smem((2, R, bd), dtype)
    if not shared:
      scratch["s_out"] = smem((2, R, bd), dtype)

  def body(*refs, x_s, out_s, w_s, r_s, bar, bar2, bar_w, h_s=None, s_out=None):
    if add:
      x_r, h_r, w_r, y_r, s_r, r_r = refs
    else:
      (x_r, w_r, y_r, r_r), h_r, s_r = refs, None, None
    rows = pl.ds(lax.axis_index("n") * R, R)
    cols = lambda j: pl.ds(j * bd, bd)
    s_out = out_s if s_out is None else s_out
    plgpu.copy_gmem_to_smem(w_r, w_s, bar_w)

    def issue_first(j, slot):
      plgpu.copy_gmem_to_smem(x_r.at[rows, cols(j)], x_s.at[slot], bar.at[slot])
      if add:
        plgpu.copy_gmem_to_smem(h_r.at[rows, cols(j)], h_s.at[slot], bar.at[slot])

    def first(j, slot, ss):
      s = plgpu.load(x_s.at[slot], layout=WGMMA).astype(F32)
      if add:
        s = (s + plgpu.load(h_s.at[slot], layout=WGMMA).astype(F32)).astype(dtype)
        _staged(s_out, slot, s, s_r.at[rows, cols(j)])
        s = s.astype(F32)
      return ss + jnp.sum(s * s, axis=1)

    zeros = lambda: plgpu.layout_cast(jnp.zeros((R,), F32), ROWS)
    ss = walk_chunks(nb, issue_first, bar, zeros, first)
    r = lax.rsqrt(ss * (1.0 / D) + eps)
    if add:
      plgpu.wait_smem_to_gmem(0)   # s is read back from GMEM below

    def issue_second(j, slot):
      plgpu.copy_gmem_to_smem((s_r if add else x_r).at[rows, cols(j)], x_s.at[slot], bar2.at[slot])

    plgpu.barrier_wait(bar_w)

    def second(j, slot, carry):
      s = plgpu.load(x_s.at[slot], layout=WGMMA).astype(F32)
      w = plgpu.load(w_s.at[j], layout=COLS)
      mul = lax.broadcast_in_dim(r, s.shape, [0]) * lax.broadcast_in_dim(w, s.shape, [1])
      _staged(out_s, slot, s * mul, y_r.at[rows, cols(j)])
      return carry

    walk_chunks(nb, issue_second, bar2, lambda: jnp.int32(0), second)
    r_s[...] = r
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(r_s, r_r.at[rows])
    plgpu.wait_smem_to_gmem(0)

  args = (x, h, w.reshape(nb, bd)) if add else (x, w.reshape(nb, bd))
  rows_out = jax.ShapeDtypeStruct((N, D), out_dtype)
  out_type = (rows_out,) + ((jax.ShapeDtypeStruct((N, D), dtype),) if add else ()) + (
      jax.ShapeDtypeStruct((N,), F32),)
  outs = vary_like(plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=(N // R,), grid_names=("n",),
      compiler_params=compiler_params(approx_math=False), interpret=interpret,
      kernel_name="rms_norm_fwd")(*args), args)
  return (outs[0], outs[1], outs[2]) if add else (outs[0], None, outs[1])


@lowered_once()
def backward(s, dy, ds_out, r, w, *, block_d: int = BLOCK_BWD, interpret=None):
  """`(ds, dw)` for rows s `[N, D]` (the normalised rows), dy `[N, D]` (y's cotangent), ds_out (s's
  cotangent from elsewhere, s's shape and dtype, or None), r `[N]` and w `[D]` float32 (module
  docstring): ds in s's dtype, dw `[D]` float32. N a multiple of 64 (the caller pads); `block_d` columns
  a block."""
  N, D = s.shape
  dtype, bd = s.dtype, block_d
  _check_block(D, bd, "block_d")
  nb, R = D // bd, ROWS_A_PROGRAM
  more = ds_out is not None
  scratch = dict(s_s=smem((2, R, bd), dtype), dy_s=smem((2, R, bd), dy.dtype), out_s=smem((2, R, bd), dtype),
                 w_s=plgpu.SMEM((nb, bd), F32), r_s=plgpu.SMEM((R,), F32), dw_s=plgpu.SMEM((2, bd), F32),
                 bar=plgpu.Barrier(num_arrivals=2, num_barriers=2),
                 bar2=plgpu.Barrier(num_arrivals=2 + more, num_barriers=2), bar_w=plgpu.Barrier(num_arrivals=2))
  if more:
    scratch["o_s"] = smem((2, R, bd), dtype)

  def body(*refs, s_s, dy_s, out_s, w_s, r_s, dw_s, bar, bar2, bar_w, o_s=None):
    if more:
      s_r, dy_r, o_r, r_r, w_r, ds_r, dw_r = refs
    else:
      (s_r, dy_r, r_r, w_r, ds_r, dw_r), o_r = refs, None
    n = lax.axis_index("n")
    rows = pl.ds(n * R, R)
    cols = lambda j: pl.ds(j * bd, bd)
    plgpu.copy_gmem_to_smem(w_r, w_s, bar_w)
    plgpu.copy_gmem_to_smem(r_r.at[rows], r_s, bar_w)

    def issue(j, slot, barrier, with_out=False):
      plgpu.copy_gmem_to_smem(s_r.at[rows, cols(j)], s_s.at[slot], barrier.at[slot])
      plgpu.copy_gmem_to_smem(dy_r.at[rows, cols(j)], dy_s.at[slot], barrier.at[slot])
      if with_out:
        plgpu.copy_gmem_to_smem(o_r.at[rows, cols(j)], o_s.at[slot], barrier.at[slot])

    def tiles(j, slot):
      """x-hat = s r and g = dy w of block j, float32."""
      s = plgpu.load(s_s.at[slot], layout=WGMMA).astype(F32)
      dy = plgpu.load(dy_s.at[slot], layout=WGMMA).astype(F32)
      w = lax.broadcast_in_dim(plgpu.load(w_s.at[j], layout=COLS), s.shape, [1])
      xh = s * lax.broadcast_in_dim(r_rows(), s.shape, [0])
      return xh, dy, dy * w

    r_rows = lambda: plgpu.load(r_s, layout=ROWS)

    def first(j, slot, c):
      xh, dy, g = tiles(j, slot)
      _staged(dw_s, slot, jnp.sum(dy * xh, axis=0), dw_r.at[n, cols(j)])
      return c + jnp.sum(g * xh, axis=1)

    def init():
      plgpu.barrier_wait(bar_w)
      return plgpu.layout_cast(jnp.zeros((R,), F32), ROWS)

    c = walk_chunks(nb, lambda j, slot: issue(j, slot, bar), bar, init, first) * (1.0 / D)

    def second(j, slot, carry):
      xh, _, g = tiles(j, slot)
      rows_ = lambda v: lax.broadcast_in_dim(v, xh.shape, [0])
      ds = rows_(r_rows()) * (g - xh * rows_(c))
      if more:
        ds = ds + plgpu.load(o_s.at[slot], layout=WGMMA).astype(F32)
      _staged(out_s, slot, ds, ds_r.at[rows, cols(j)])
      return carry

    walk_chunks(nb, lambda j, slot: issue(j, slot, bar2, more), bar2, lambda: jnp.int32(0), second)
    plgpu.wait_smem_to_gmem(0)

  args = (s, dy) + ((ds_out,) if more else ()) + (r, w.reshape(nb, bd))
  out_type = (jax.ShapeDtypeStruct((N, D), dtype), jax.ShapeDtypeStruct((N // R, D), F32))
  ds, dw = vary_like(plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=(N // R,), grid_names=("n",),
      compiler_params=compiler_params(approx_math=False), interpret=interpret,
      kernel_name="rms_norm_bwd")(*args), args)
  return ds, jnp.sum(dw, axis=0)


def add_rms_norm(x, h, w, *, eps: float, out_dtype=None, blocks: tuple[int, int] = (BLOCK_FWD, BLOCK_BWD)):
  """The module docstring's y for x `[..., D]` and w `[D]` (its float32 value; dw in its dtype), in
  `out_dtype` (default x's); with h (x's
  shape and dtype) `(y, s)`, s = x + h in x's dtype. Differentiable in x, h and w. Callers check
  `reason(x.shape, x.dtype)` first. `blocks`: the columns of a block, forward and backward."""
  out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
  for name, bd in zip(("forward", "backward"), blocks):
    _check_block(x.shape[-1], bd, f"blocks' {name} width")
  if h is not None and (h.shape != x.shape or h.dtype != x.dtype):
    raise ValueError(f"h must have x's shape {tuple(x.shape)} and dtype {x.dtype}; got {tuple(h.shape)} "
                     f"{h.dtype}")
  if w.shape != x.shape[-1:]:
    raise ValueError(f"w must be [{x.shape[-1]}]; got shape {tuple(w.shape)}")
  static = (float(eps), out_dtype, interpreting(), tuple(int(b) for b in blocks))
  return _rms_norm(x, w, static) if h is None else _add_rms_norm(x, h, w, static)


def _forward_rows(x, h, w, static):
  """`(y, s, r)`, y and s shaped as x (s None without h), r `[N rounded up to 64]`."""
  eps, out_dtype, interpret, blocks = static
  N = x.size // x.shape[-1]
  y, s, r = forward(_rows(x, _padded(N)), None if h is None else _rows(h, _padded(N)), w.astype(F32),
                    eps=eps, out_dtype=out_dtype, block_d=blocks[0], interpret=interpret)
  back = lambda a: None if a is None else a[:N].reshape(x.shape)
  return back(y), back(s), r


def _backward_rows(static, s, r, w, dy, ds_out):
  """`(ds shaped as s, dw in w's dtype)`; ds_out None or s's cotangent."""
  N = s.size // s.shape[-1]
  rows = lambda a: None if a is None else _rows(a, _padded(N))
  ds, dw = backward(rows(s), rows(dy), rows(ds_out), r, w.astype(F32), block_d=static[3][1],
                    interpret=static[2])
  return ds[:N].reshape(s.shape), dw.astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm(x, w, static):
  return _forward_rows(x, None, w, static)[0]


def _rms_norm_fwd(x, w, static):
  y, _, r = _forward_rows(x, None, w, static)
  return y, (x, r, w)


def _rms_norm_bwd(static, res, dy):
  x, r, w = res
  return _backward_rows(static, x, r, w, dy, None)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _add_rms_norm(x, h, w, static):
  return _forward_rows(x, h, w, static)[:2]


def _add_rms_norm_fwd(x, h, w, static):
  # symbolic zeros: an unused s (the last block's) passes no cotangent, and the backward reads none
  y, s, r = _forward_rows(x.value, h.value, w.value, static)
  return (y, s), (s, r, w.value)


def _add_rms_norm_bwd(static, res, cts):
  s, r, w = res
  dy, ds_out = cts
  if isinstance(dy, SymbolicZero):
    dy = jnp.zeros(dy.aval.shape, dy.aval.dtype)
  ds_out = None if isinstance(ds_out, SymbolicZero) else ds_out.astype(s.dtype)
  ds, dw = _backward_rows(static, s, r, w, dy, ds_out)
  return ds, ds, dw


_add_rms_norm.defvjp(_add_rms_norm_fwd, _add_rms_norm_bwd, symbolic_zeros=True)
