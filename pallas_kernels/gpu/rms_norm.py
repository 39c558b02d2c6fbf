"""The residual stream's RMSNorm, with the residual addition in front of it, as two Mosaic GPU kernels
(forward and backward) that read each row array once.

A pre-norm block adds its mixer's (or MLP's) output h to the stream x and normalises the sum for what
comes next. With s the new stream (rounded to x's dtype, as the addition alone gives it):

    s = x + h                                   (no h: s = x)
    y = s * (r w),  r = (mean(s^2) + eps)^(-1/2)          (float32; y rounded to `out_dtype`)

and in the backward, with dy the cotangent of y and ds_out that of s from the rest of the model:

    g  = dy w,  c = mean(g s r)
    ds = r (g - s r c) + ds_out                 (the cotangent of x and of h; rounded to s's dtype)
    dw = sum over rows of dy s r

The row sums need a whole row before anything is written, so a program holds its rows in shared memory
from the first read to the last write. A warpgroup's WGMMA-layout tile has 64 rows; 64 rows of a
1024-wide stream are 128 KB an array, which leaves one program an SM and streaming them twice through the
L2 cache missed it (NOTES.md v79). Here a row of D features is cut into P parts of D / P, and a program
takes 64 / P tokens: tile row `p * (64 / P) + t` holds part p of token t (P copies a tile, one a part).
Each tile row sums its part; a token's sum adds the P parts' sums, which lie 64 / P rows apart, through
shared memory (the sums written twice over, read back at P offsets). At D = 1024, P = 4: 16 tokens, a
32 KB tile an array, two or three programs an SM, each array read from HBM once.

The forward's multiplication order, `s * (r * w)` in float32, is flax's `nnx.RMSNorm`'s, so that the
kernels' y equals the module's to its last rounding (given its scale rounded as the module rounds it).
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
from .plan import hopper_reason
from .tiles import COLS, F32, ROWS, WGMMA, compiler_params, smem, vary_like

ROWS_A_PROGRAM = 64      # a warpgroup's WGMMA-layout tile
PARTS = (1, 2, 4, 8)     # parts a row is cut into: 64 / P tokens a program, at least a tile's 8 rows
MAX_PART = 256           # features a part: the backward's four 32 KB tiles (16-bit) fit an SM twice
BLOCK = 128              # columns computed at once: [64, 128] float32 is 64 registers a thread
DTYPES = (jnp.bfloat16, jnp.float16)


def parts(D: int) -> int | None:
  """P for rows of D features: the fewest parts of at most MAX_PART features, each a multiple of 64 (a
  128-byte swizzle of 16-bit values); None where none fits."""
  return next((P for P in PARTS if D % P == 0 and (D // P) % 64 == 0 and D // P <= MAX_PART), None)


def reason(shape, dtype, backend: str | None = None) -> str | None:
  """None if the kernels serve rows `shape = [..., D]` of `dtype`, else why not."""
  why = hopper_reason(backend)
  if why is not None:
    return why
  D = shape[-1] if len(shape) else 0
  if D < 64 or parts(D) is None:
    return (f"the kernels need the normalised axis cut into at most {PARTS[-1]} parts of a multiple of 64 "
            f"features, at most {MAX_PART} each; got {D}")
  if not any(jnp.dtype(dtype) == jnp.dtype(d) for d in DTYPES):
    return f"the kernels serve bfloat16 and float16 rows; got {jnp.dtype(dtype)}"
  return None


def _layout(D):
  P = parts(D)
  if P is None:
    raise ValueError(reason((D,), jnp.bfloat16, backend="hopper"))
  F = D // P
  return P, F, ROWS_A_PROGRAM // P, min(F, BLOCK) if F % min(F, BLOCK) == 0 else 64


def _rows(x, N_pad):
  """`[..., D]` -> `[N_pad, D]`, zero rows after the N real ones."""
  D = x.shape[-1]
  x = x.reshape(-1, D)
  return x if x.shape[0] == N_pad else jnp.pad(x, [(0, N_pad - x.shape[0]), (0, 0)])


def _padded(N, D):
  TP = ROWS_A_PROGRAM // _layout(D)[0]
  return -(-N // TP) * TP


class _Tile:
  """A program's tile geometry: P parts of F features, TP tokens, column blocks of CB."""

  def __init__(self, D):
    self.D = D
    self.P, self.F, self.TP, self.CB = _layout(D)
    self.blocks = self.F // self.CB

  def copies(self, gmem, tile, tokens, barrier=None, *, out=False):
    """The P TMA copies between a `[N, D]` GMEM ref's tokens and a `[64, F]` tile (part-major rows)."""
    for p in range(self.P):
      g = gmem.at[tokens, pl.ds(p * self.F, self.F)]
      t = tile.at[pl.ds(p * self.TP, self.TP)]
      if out:
        plgpu.copy_smem_to_gmem(t, g)
      else:
        plgpu.copy_gmem_to_smem(g, t, barrier)

  def token_sums(self, rows, buf):
    """Each tile row's token's sum over its P parts, from the rows' own sums (ROWS layout)."""
    if self.P == 1:
      return rows
    n = ROWS_A_PROGRAM
    buf.at[pl.ds(0, n)][...] = rows
    buf.at[pl.ds(n, n)][...] = rows
    plgpu.commit_smem()
    out = rows
    for p in range(1, self.P):
      out = out + plgpu.load(buf.at[pl.ds(p * self.TP, n)], layout=ROWS)
    return out

  def weights(self, w_s, j, shape):
    """Block j's weights for every tile row (its part's), float32 `shape` = [64, CB]."""
    col = lambda p: lax.broadcast_in_dim(plgpu.load(w_s.at[p, pl.ds(j * self.CB, self.CB)], layout=COLS),
                                         shape, [1])
    if self.P == 1:
      return col(0)
    part = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=WGMMA) // self.TP
    out = col(0)
    for p in range(1, self.P):
      out = jnp.where(part == p, col(p), out)
    return out


@lowered_once()
def forward(x, h, w, *, eps: float, out_dtype, interpret=None):
  """`(y, s, r)` for rows x `[N, D]` (h the same or None; w `[D]` float32; module docstring): y in
  `out_dtype`, s in x's dtype (None without h), r `[N]` float32. N a multiple of `64 / parts(D)` (the
  caller pads)."""
  N, D = x.shape
  dtype, t = x.dtype, _Tile(D)
  add = h is not None
  R = ROWS_A_PROGRAM
  scratch = dict(x_s=smem((R, t.F), dtype), w_s=plgpu.SMEM((t.P, t.F), F32), buf=plgpu.SMEM((2 * R,), F32),
                 r_o=plgpu.SMEM((R,), F32), bar=plgpu.Barrier(num_arrivals=t.P * (1 + add)),
                 bar_w=plgpu.Barrier(num_arrivals=1))
  if add:
    scratch["h_s"] = smem((R, t.F), dtype)
  # y's tile: h's once s is formed, else x's (s = x), each block written by the threads that read it;
  # a tile of its own where y's dtype is not x's
  if jnp.dtype(out_dtype) != jnp.dtype(dtype):
    scratch["y_s"] = smem((R, t.F), jnp.dtype(out_dtype))

  def body(*refs, x_s, w_s, buf, r_o, bar, bar_w, h_s=None, y_s=None):
    if add:
      x_r, h_r, w_r, y_r, s_r, r_r = refs
    else:
      (x_r, w_r, y_r, r_r), h_r, s_r = refs, None, None
    tokens = pl.ds(lax.axis_index("n") * t.TP, t.TP)
    cols = lambda j: pl.ds(j * t.CB, t.CB)
    plgpu.copy_gmem_to_smem(w_r, w_s, bar_w)
    t.copies(x_r, x_s, tokens, bar)
    if add:
      t.copies(h_r, h_s, tokens, bar)
    plgpu.barrier_wait(bar)
    ss = None
    for j in range(t.blocks):
      s = plgpu.load(x_s.at[:, cols(j)], layout=WGMMA).astype(F32)
      if add:   # s rounded to x's dtype, written over x's tile and out
        s = (s + plgpu.load(h_s.at[:, cols(j)], layout=WGMMA).astype(F32)).astype(dtype)
        x_s.at[:, cols(j)][...] = s
        s = s.astype(F32)
      part = jnp.sum(s * s, axis=1)
      ss = part if ss is None else ss + part
    if add:
      plgpu.commit_smem()
      t.copies(s_r, x_s, tokens, out=True)
    r = lax.rsqrt(t.token_sums(ss, buf) * (1.0 / D) + eps)
    plgpu.barrier_wait(bar_w)
    out_s = y_s if y_s is not None else (h_s if add else x_s)
    for j in range(t.blocks):
      s = plgpu.load(x_s.at[:, cols(j)], layout=WGMMA).astype(F32)
      mul = lax.broadcast_in_dim(r, s.shape, [0]) * t.weights(w_s, j, s.shape)
      out_s.at[:, cols(j)][...] = (s * mul).astype(out_s.dtype)
    r_o[...] = r
    plgpu.commit_smem()
    t.copies(y_r, out_s, tokens, out=True)
    plgpu.copy_smem_to_gmem(r_o.at[pl.ds(0, t.TP)], r_r.at[tokens])
    plgpu.wait_smem_to_gmem(0)

  w2 = w.reshape(t.P, t.F)
  args = (x, h, w2) if add else (x, w2)
  out_type = ((jax.ShapeDtypeStruct((N, D), out_dtype),) + ((jax.ShapeDtypeStruct((N, D), dtype),) if add
              else ()) + (jax.ShapeDtypeStruct((N,), F32),))
  outs = vary_like(plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=(N // t.TP,), grid_names=("n",),
      compiler_params=compiler_params(approx_math=False), interpret=interpret,
      kernel_name="rms_norm_fwd")(*args), args)
  return (outs[0], outs[1], outs[2]) if add else (outs[0], None, outs[1])


@lowered_once()
def backward(s, dy, ds_out, r, w, *, interpret=None):
  """`(ds, dw)` for rows s `[N, D]` (the normalised rows), dy `[N, D]` (y's cotangent), ds_out (s's
  cotangent from elsewhere, s's shape and dtype, or None), r `[N]` and w `[D]` float32 (module
  docstring): ds in s's dtype, dw `[D]` float32. N a multiple of `64 / parts(D)` (the caller pads)."""
  N, D = s.shape
  dtype, t = s.dtype, _Tile(D)
  more = ds_out is not None
  R = ROWS_A_PROGRAM
  scratch = dict(s_s=smem((R, t.F), dtype), dy_s=smem((R, t.F), dy.dtype), w_s=plgpu.SMEM((t.P, t.F), F32),
                 r_s=plgpu.SMEM((R,), F32), buf=plgpu.SMEM((2 * R,), F32), dw_s=plgpu.SMEM((t.P, t.F), F32),
                 bar=plgpu.Barrier(num_arrivals=t.P * (3 + more) + 1))
  if more:
    scratch["o_s"] = smem((R, t.F), dtype)

  def body(*refs, s_s, dy_s, w_s, r_s, buf, dw_s, bar, o_s=None):
    if more:
      s_r, dy_r, o_r, r_r, w_r, ds_r, dw_r = refs
    else:
      (s_r, dy_r, r_r, w_r, ds_r, dw_r), o_r = refs, None
    n = lax.axis_index("n")
    tokens = pl.ds(n * t.TP, t.TP)
    cols = lambda j: pl.ds(j * t.CB, t.CB)
    plgpu.copy_gmem_to_smem(w_r, w_s, bar)
    for p in range(t.P):   # r of tile row p * TP + i is token i's
      plgpu.copy_gmem_to_smem(r_r.at[tokens], r_s.at[pl.ds(p * t.TP, t.TP)], bar)
    t.copies(s_r, s_s, tokens, bar)
    t.copies(dy_r, dy_s, tokens, bar)
    if more:
      t.copies(o_r, o_s, tokens, bar)
    plgpu.barrier_wait(bar)
    r = plgpu.load(r_s, layout=ROWS)
    part = plgpu.broadcasted_iota(jnp.int32, (R, t.CB), 0, layout=WGMMA) // t.TP

    def tiles(j):
      """x-hat = s r, dy and g = dy w of block j, float32."""
      x = plgpu.load(s_s.at[:, cols(j)], layout=WGMMA).astype(F32)
      d = plgpu.load(dy_s.at[:, cols(j)], layout=WGMMA).astype(F32)
      xh = x * lax.broadcast_in_dim(r, x.shape, [0])
      return xh, d, d * t.weights(w_s, j, x.shape)

    c = None
    for j in range(t.blocks):
      xh, d, g = tiles(j)
      prod = d * xh
      for p in range(t.P):   # each part's columns of dw: its rows' sums
        dw_s.at[p, cols(j)][...] = jnp.sum(prod if t.P == 1 else jnp.where(part == p, prod, 0.0), axis=0)
      rows = jnp.sum(g * xh, axis=1)
      c = rows if c is None else c + rows
    c = t.token_sums(c, buf) * (1.0 / D)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dw_s, dw_r.at[n])
    for j in range(t.blocks):
      xh, _, g = tiles(j)
      rows_ = lambda v: lax.broadcast_in_dim(v, xh.shape, [0])
      ds = rows_(r) * (g - xh * rows_(c))
      if more:
        ds = ds + plgpu.load(o_s.at[:, cols(j)], layout=WGMMA).astype(F32)
      s_s.at[:, cols(j)][...] = ds.astype(dtype)   # over s's block j, read for the last time
    plgpu.commit_smem()
    t.copies(ds_r, s_s, tokens, out=True)
    plgpu.wait_smem_to_gmem(0)

  args = (s, dy) + ((ds_out,) if more else ()) + (r, w.reshape(t.P, t.F))
  out_type = (jax.ShapeDtypeStruct((N, D), dtype), jax.ShapeDtypeStruct((N // t.TP, t.P, t.F), F32))
  ds, dw = vary_like(plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=(N // t.TP,), grid_names=("n",),
      compiler_params=compiler_params(approx_math=False), interpret=interpret,
      kernel_name="rms_norm_bwd")(*args), args)
  return ds, jnp.sum(dw, axis=0).reshape(D)


def add_rms_norm(x, h, w, *, eps: float, out_dtype=None):
  """The module docstring's y for x `[..., D]` and w `[D]` (its float32 value; dw in its dtype), in
  `out_dtype` (default x's); with h (x's shape and dtype) `(y, s)`, s = x + h in x's dtype.
  Differentiable in x, h and w. Callers check `reason(x.shape, x.dtype)` first."""
  out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
  if h is not None and (h.shape != x.shape or h.dtype != x.dtype):
    raise ValueError(f"h must have x's shape {tuple(x.shape)} and dtype {x.dtype}; got {tuple(h.shape)} "
                     f"{h.dtype}")
  if w.shape != x.shape[-1:]:
    raise ValueError(f"w must be [{x.shape[-1]}]; got shape {tuple(w.shape)}")
  static = (float(eps), out_dtype, interpreting())
  return _rms_norm(x, w, static) if h is None else _add_rms_norm(x, h, w, static)


def _forward_rows(x, h, w, static):
  """`(y, s, r)`, y and s shaped as x (s None without h), r `[N padded]`."""
  eps, out_dtype, interpret = static
  N, D = x.size // x.shape[-1], x.shape[-1]
  rows = lambda a: None if a is None else _rows(a, _padded(N, D))
  y, s, r = forward(rows(x), rows(h), w.astype(F32), eps=eps, out_dtype=out_dtype, interpret=interpret)
  back = lambda a: None if a is None else a[:N].reshape(x.shape)
  return back(y), back(s), r


def _backward_rows(static, s, r, w, dy, ds_out):
  """`(ds shaped as s, dw in w's dtype)`; ds_out None or s's cotangent."""
  N, D = s.size // s.shape[-1], s.shape[-1]
  rows = lambda a: None if a is None else _rows(a, _padded(N, D))
  ds, dw = backward(rows(s), rows(dy), rows(ds_out), r, w.astype(F32), interpret=static[2])
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
  # symbolic zeros: an unused s passes no cotangent, and the backward reads none
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
