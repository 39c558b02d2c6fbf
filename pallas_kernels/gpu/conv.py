"""The short convolution (`linear_attention_jax.layers.ShortConvolution`) as two Mosaic GPU kernels:
forward and backward, each reading its inputs once.

    y_t = act(pre_t),   pre_t = sum_{w < W} kernel[w] * x_{t - W + 1 + w} + bias

with x before the sequence's start taken from `head` (the cached window, or zeros). One program a
(batch row, block of `bt` tokens, block of `bd` channels) copies its tokens and the `W - 1` before them
(a halo of `HALO` rows) into shared memory and walks them in order, each thread holding its own channels:
the window of the last `W - 1` inputs stays in registers, so a token costs W multiply-adds a channel and
the whole pass moves x in and y out once. The layer's XLA form (autodiff of a shifted sum) moves, in its
backward, a float32 `act'(pre) dy` that four reductions and dx read again; here

    dpre_s = act'(pre_s) dy_s
    dx_t   = sum_w kernel[w] dpre_{t + W - 1 - w}          (the next `W - 1` tokens: a halo after the block)
    dkernel[w] = sum_t dpre_t x_{t - W + 1 + w},   dbias = sum_t dpre_t

each program writes dx for its tokens and its block's partial sums of dkernel and dbias (`[B, NT, W + 1, D]`
float32), which XLA adds up; the programs of the first block also write d(head), the gradient of the
window before the sequence.

Everything is float32 in registers (x, the window, pre, dpre), rounded once to the output dtype, as the
XLA form computes it; the sum over taps runs in the same order (w = 0 first).

`splits`: one call convolves several arrays whose channels lie side by side in x (a mixer's q, k and v
from one joined projection): y comes out as one array a split, and the backward reads one dy a split and
writes dx joined, the layout of the projection's output, so the projection's backward is one product.
A channel block never straddles two splits (each a multiple of the block).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from .. import common
from .interpret import interpreting
from .once import lowered_once
from .plan import hopper_reason
from .tiles import F32, compiler_params, vary_like

HALO = 8          # rows kept before (and, in the backward, after) a block: W - 1 <= HALO
BLOCK_T = (32, 16, 8)         # tokens a program, the largest that divides T (32: NOTES v47)
BLOCK_D = (128,)              # channels a program (128: NOTES v47; 256 is allowed by block_d)
UNROLL = 4                    # tokens a loop iteration (8: twice the kernels' lowering time, NOTES v47)
ACTIVATIONS = ("silu", "identity")


def blocks(T: int, D: int, block_t: int | None = None, block_d: int | None = None,
           splits: tuple[int, ...] | None = None):
  """`(bt, bd)` for a `[B, T, D]` input (the largest of BLOCK_T, BLOCK_D that divide T and D, and every
  split of D, or the sizes given), or None where none divides them."""
  sizes = (D,) if splits is None else tuple(splits)
  if sum(sizes) != D or min(sizes) < 1:
    raise ValueError(f"splits={splits} must be positive sizes summing to D={D}")
  bt = next((b for b in BLOCK_T if T % b == 0), None) if block_t is None else block_t
  bd = (next((b for b in BLOCK_D if all(d % b == 0 for d in sizes)), None) if block_d is None
        else block_d)
  if bt is None or bd is None:
    return None
  if T % bt or any(d % bd for d in sizes) or bt % UNROLL or bt < HALO or bd % 128:
    raise ValueError(f"block_t={bt} must divide T={T}, be a multiple of {UNROLL} and >= {HALO}; "
                     f"block_d={bd} must divide D={D} and each of splits={splits}, and be a multiple "
                     f"of 128")
  return bt, bd


def reason(x_shape, kernel_size: int, activation: str, dtype, backend: str | None = None,
           splits: tuple[int, ...] | None = None) -> str | None:
  """None if the kernels serve a convolution of `x: [B, T, D]` (dtype `dtype`) with `kernel_size` taps
  and `activation` (split into arrays of `splits` channels, if given), else why not."""
  why = hopper_reason(backend)
  if why is not None:
    return why
  if len(x_shape) != 3:
    return f"x must be [B, T, D]; got shape {tuple(x_shape)}"
  _, T, D = x_shape
  if splits is not None and (sum(splits) != D or min(splits) < 1):
    return f"splits={tuple(splits)} must be positive sizes summing to D={D}"
  if blocks(T, D, splits=splits) is None:
    what = "D" if splits is None else "each split of D"
    return (f"the kernels need T a multiple of {BLOCK_T[-1]} and {what} a multiple of {BLOCK_D[-1]}; "
            f"got T={T}, D={D}" + ("" if splits is None else f", splits={tuple(splits)}"))
  if not 1 <= kernel_size <= HALO + 1:
    return f"the kernels serve 1 <= kernel_size <= {HALO + 1}; got {kernel_size}"
  if activation not in ACTIVATIONS:
    return f"the kernels serve the activations {ACTIVATIONS}; got {activation!r}"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(F32)):
    return f"the kernels serve bfloat16, float16 and float32 inputs; got {jnp.dtype(dtype)}"
  return None


def _act(activation, pre):
  if activation == "identity":
    return pre
  return pre / (1.0 + jnp.exp(-pre))


def _act_grad(activation, pre):
  """d act / d pre."""
  if activation == "identity":
    return jnp.ones_like(pre)
  s = 1.0 / (1.0 + jnp.exp(-pre))
  return s * (1.0 + pre * (1.0 - s))


def _params():
  return compiler_params(approx_math=False)


def _staged(kernel, bias, head):
  """`(params [W + 1, D], head_rows [B, HALO, D])` float32: the taps and bias as one array, and the window
  before the sequence as the HALO rows ending at its first token."""
  W = kernel.shape[0]
  params = jnp.concatenate([kernel.astype(F32), bias.astype(F32)[None]], axis=0)
  return params, jnp.pad(head.astype(F32), [(0, 0), (HALO - (W - 1), 0), (0, 0)])


def _geometry(x, kernel, block_t, block_d, splits):
  """`(B, T, D, W, bt, bd, NT, ND)`: the call's sizes, its program blocks and the grid."""
  B, T, D = x.shape
  bt, bd = blocks(T, D, block_t, block_d, splits)
  return B, T, D, kernel.shape[0], bt, bd, T // bt, D // bd


def _in_split(c, splits, bd, fn):
  """`fn(i, cc)` for the split i that holds channel block `c` (its block cc within split i); with one
  split, unconditionally."""
  if len(splits) == 1:
    fn(0, c)
    return
  start = 0
  for i, d in enumerate(splits):
    lo, hi = start // bd, (start + d) // bd
    pl.when((c >= lo) & (c < hi))(functools.partial(fn, i, c - lo))
    start += d


def _copy_rows_before(x_r, x_s, b, n, bt, cols, bar):
  """Outside the first block, the HALO tokens before block `n` into `x_s`'s first rows (waited for)."""
  @pl.when(n > 0)
  def _():
    plgpu.copy_gmem_to_smem(x_r.at[b, pl.ds(n * bt - HALO, HALO), cols], x_s.at[pl.ds(0, HALO)], bar)
    plgpu.barrier_wait(bar)


def _first_window(first, h_s, x_s, back):
  """The `back` inputs before the block's first token, float32: the staged head in the first block
  (`first`, a predicate row: select_n does not broadcast a scalar one), else the rows before it."""
  return tuple(jnp.where(first, h_s[HALO - back + j], x_s[HALO - back + j].astype(F32))
               for j in range(back))


def _pre(taps, rows):
  """`sum_w taps[w] rows[w]`, w = 0 first (the shifted sum's order)."""
  pre = taps[0] * rows[0]
  for tap, row in zip(taps[1:], rows[1:]):
    pre = pre + tap * row
  return pre


# traced and lowered once for every call at the same shapes (a model's q, k, v convolutions in every
# layer): each kernel's lowering costs seconds (NOTES v47, once.py)
@lowered_once()
def _forward(x, kernel, bias, head, *, activation: str, out_dtype, splits: tuple[int, ...] | None = None,
             block_t=None, block_d=None, interpret=None):
  """ys: one `[B, T, D_i]` in `out_dtype` for each of `splits` (default `(D,)`); `kernel [W, D]`,
  `bias [D]`, `head [B, W - 1, D]` float32."""
  B, T, D, W, bt, bd, NT, ND = _geometry(x, kernel, block_t, block_d, splits)
  splits = (D,) if splits is None else tuple(splits)
  back = W - 1
  params, head_rows = _staged(kernel, bias, head)
  in_place = jnp.dtype(out_dtype) == x.dtype   # y of token i overwrites x of token i, once read
  scratch = dict(x_s=plgpu.SMEM((HALO + bt, bd), x.dtype), p_s=plgpu.SMEM((W + 1, bd), F32),
                 h_s=plgpu.SMEM((HALO, bd), F32), bar=plgpu.Barrier(num_arrivals=3),
                 bar_halo=plgpu.Barrier(num_arrivals=1))
  if not in_place:
    scratch["y_s"] = plgpu.SMEM((bt, bd), out_dtype)

  def body(x_r, p_r, h_r, *y_rs, x_s, p_s, h_s, bar, bar_halo, y_s=None):
    b, n, c = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("c")
    cols = pl.ds(c * bd, bd)
    rows_t = pl.ds(n * bt, bt)
    out = x_s.at[pl.ds(HALO, bt)] if in_place else y_s
    plgpu.copy_gmem_to_smem(x_r.at[b, rows_t, cols], x_s.at[pl.ds(HALO, bt)], bar)
    plgpu.copy_gmem_to_smem(p_r.at[:, cols], p_s, bar)
    plgpu.copy_gmem_to_smem(h_r.at[b, :, cols], h_s, bar)

    _copy_rows_before(x_r, x_s, b, n, bt, cols, bar_halo)
    plgpu.barrier_wait(bar)
    taps = [p_s[w] for w in range(W)]
    bias_row = p_s[W]
    window = _first_window(lax.broadcast(n == 0, (bd,)), h_s, x_s, back)

    def token(i, window):
      xi = x_s[HALO + i].astype(F32)
      rows = window + (xi,)
      out[i] = _act(activation, _pre(taps, rows) + bias_row).astype(out_dtype)
      return rows[1:]

    def unrolled(u, window):
      for j in range(UNROLL):
        window = token(u * UNROLL + j, window)
      return window

    lax.fori_loop(0, bt // UNROLL, unrolled, window)
    plgpu.commit_smem()
    _in_split(c, splits, bd, lambda i, cc: plgpu.copy_smem_to_gmem(
        out, y_rs[i].at[b, rows_t, pl.ds(cc * bd, bd)]))
    plgpu.wait_smem_to_gmem(0)

  args = (x, params, head_rows)
  out_type = tuple(jax.ShapeDtypeStruct((B, T, d), out_dtype) for d in splits)
  return tuple(vary_like(plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch,
      grid=(B, NT, ND), grid_names=("b", "n", "c"), compiler_params=_params(),
      interpret=interpret, kernel_name="short_conv_fwd")(*args), args))


@lowered_once()
def _backward(x, kernel, bias, head, dys, *, activation: str, splits: tuple[int, ...] | None = None,
              block_t=None, block_d=None, interpret=None):
  """`(dx [B, T, D] in x's dtype, dkernel [W, D], dbias [D], dhead [B, W - 1, D])`, float32 but dx, from
  `dys`, one `[B, T, D_i]` for each of `splits` (default `(D,)`), all of one dtype."""
  B, T, D, W, bt, bd, NT, ND = _geometry(x, kernel, block_t, block_d, splits)
  splits = (D,) if splits is None else tuple(splits)
  back = W - 1
  params, head_rows = _staged(kernel, bias, head)
  dy = dys[0]
  if len(dys) != len(splits) or any(d.shape != (B, T, n) or d.dtype != dy.dtype
                                    for d, n in zip(dys, splits)):
    raise ValueError(f"dys must be one [B, T, D_i] array of one dtype for each of splits={splits}; got "
                     f"{[(d.shape, d.dtype) for d in dys]}")
  # dx of token i - W + 1 is complete after token i (whose dy is read): it overwrites that token's dy
  in_place = dy.dtype == x.dtype
  scratch = dict(x_s=plgpu.SMEM((HALO + bt + HALO, bd), x.dtype),
                 dy_s=plgpu.SMEM((bt + HALO, bd), dy.dtype),
                 p_s=plgpu.SMEM((W + 1, bd), F32), h_s=plgpu.SMEM((HALO, bd), F32),
                 bar=plgpu.Barrier(num_arrivals=4), bar_before=plgpu.Barrier(num_arrivals=1),
                 bar_after=plgpu.Barrier(num_arrivals=2))
  if not in_place:
    scratch["dx_s"] = plgpu.SMEM((bt, bd), x.dtype)

  def body(x_r, *refs, x_s, dy_s, p_s, h_s, bar, bar_before, bar_after, dx_s=None):
    dy_rs, (p_r, h_r, dx_r, g_r, dh_r) = refs[:len(splits)], refs[len(splits):]
    b, n, c = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("c")
    cols = pl.ds(c * bd, bd)
    rows_t = pl.ds(n * bt, bt)
    out = dy_s if in_place else dx_s
    plgpu.copy_gmem_to_smem(x_r.at[b, rows_t, cols], x_s.at[pl.ds(HALO, bt)], bar)
    _in_split(c, splits, bd, lambda i, cc: plgpu.copy_gmem_to_smem(
        dy_rs[i].at[b, rows_t, pl.ds(cc * bd, bd)], dy_s.at[pl.ds(0, bt)], bar))
    plgpu.copy_gmem_to_smem(p_r.at[:, cols], p_s, bar)
    plgpu.copy_gmem_to_smem(h_r.at[b, :, cols], h_s, bar)
    first, last = n == 0, n == NT - 1
    first_v, last_v = lax.broadcast(first, (bd,)), lax.broadcast(last, (bd,))   # for select_n

    _copy_rows_before(x_r, x_s, b, n, bt, cols, bar_before)

    @pl.when(n < NT - 1)
    def _():
      after = pl.ds((n + 1) * bt, HALO)
      plgpu.copy_gmem_to_smem(x_r.at[b, after, cols], x_s.at[pl.ds(HALO + bt, HALO)], bar_after)
      _in_split(c, splits, bd, lambda i, cc: plgpu.copy_gmem_to_smem(
          dy_rs[i].at[b, after, pl.ds(cc * bd, bd)], dy_s.at[pl.ds(bt, HALO)], bar_after))
      plgpu.barrier_wait(bar_after)

    plgpu.barrier_wait(bar)
    taps = [p_s[w] for w in range(W)]
    bias_row = p_s[W]
    zero = jnp.zeros_like(bias_row)
    window = _first_window(first_v, h_s, x_s, back)

    def token(i, carry, *, inside: bool):
      """Token t0 + i: its dpre, its share of dkernel (tokens of the block only) and of dx of the W
      tokens ending at it; dx of token t0 + i - W + 1 is then complete and returned."""
      window, partial, sums = carry
      xi = x_s[HALO + i].astype(F32)
      rows = window + (xi,)
      dpre = _act_grad(activation, _pre(taps, rows) + bias_row) * dy_s[i].astype(F32)
      if not inside:   # after the block: past the sequence's end in the last block (rows not read)
        dpre = jnp.where(last_v, zero, dpre)
      if inside:
        sums = tuple(s + dpre * r for s, r in zip(sums[:W], rows)) + (sums[W] + dpre,)
      grown = partial + (zero,)       # dx of tokens t0 + i - W + 1 ... t0 + i
      grown = tuple(d + taps[j] * dpre for j, d in enumerate(grown))
      return (rows[1:], grown[1:], sums), grown[0]

    def emit(i, done):
      out[i - back] = done.astype(out.dtype)

    def unrolled(u, carry):
      for j in range(UNROLL):
        carry, done = token(u * UNROLL + j, carry, inside=True)
        emit(u * UNROLL + j, done)
      return carry

    carry = (window, (zero,) * back, (zero,) * (W + 1))
    # the first W - 1 tokens complete dx of the tokens before the block: d(head) in the first block
    before = []
    for i in range(back):
      carry, done = token(i, carry, inside=True)
      before.append(done)
    start = -(-back // UNROLL) * UNROLL   # the rest of the groups of UNROLL tokens that hold them
    for i in range(back, start):
      carry, done = token(i, carry, inside=True)
      emit(i, done)
    carry = lax.fori_loop(start // UNROLL, bt // UNROLL, unrolled, carry)
    for i in range(bt, bt + back):
      carry, done = token(i, carry, inside=False)
      emit(i, done)
    _, _, sums = carry
    for w in range(W + 1):   # the taps were read into registers: p_s takes the block's sums
      p_s[w] = sums[w]
    for j in range(back):
      h_s[HALO - back + j] = before[j]
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out.at[pl.ds(0, bt)], dx_r.at[b, rows_t, cols])
    plgpu.copy_smem_to_gmem(p_s, g_r.at[b, n, :, cols])

    @pl.when(first)
    def _():
      plgpu.copy_smem_to_gmem(h_s, dh_r.at[b, :, cols])

    plgpu.wait_smem_to_gmem(0)

  args = (x, *dys, params, head_rows)
  out_type = (jax.ShapeDtypeStruct((B, T, D), x.dtype), jax.ShapeDtypeStruct((B, NT, W + 1, D), F32),
              jax.ShapeDtypeStruct((B, HALO, D), F32))
  dx, partial, dhead = vary_like(plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=(B, NT, ND), grid_names=("b", "n", "c"),
      compiler_params=_params(), interpret=interpret,
      kernel_name="short_conv_bwd")(*args), args)
  sums = jnp.sum(partial, axis=(0, 1))
  return dx, sums[:W], sums[W], dhead[:, HALO - back:]


def short_conv(x, kernel, bias, head, *, activation: str = "silu", out_dtype=None,
               splits: tuple[int, ...] | None = None, block_t: int | None = None,
               block_d: int | None = None):
  """The module docstring's y for x `[B, T, D]`, kernel `[W, D]`, bias `[D]` and head `[B, W - 1, D]`
  (the inputs before x), in `out_dtype` (default x's); differentiable in all four. `splits`: None (y
  one `[B, T, D]` array) or channel counts summing to D (y a tuple, one `[B, T, D_i]` each; the
  backward takes their cotangents apart and gives x's joined). block_t, block_d: the tokens and
  channels of a program (default `blocks`). Callers check `reason(...)` first."""
  out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
  parts = None if splits is None else tuple(int(d) for d in splits)
  # the interpreter switch is read here: the jitted kernels' caches key on it
  ys = _short_conv(x, kernel, bias, head, (activation, out_dtype, parts, block_t, block_d,
                                           interpreting()))
  return ys[0] if splits is None else ys


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _short_conv(x, kernel, bias, head, static):
  activation, out_dtype, splits, block_t, block_d, interpret = static
  return _forward(x, kernel, bias, head, activation=activation, out_dtype=out_dtype, splits=splits,
                  block_t=block_t, block_d=block_d, interpret=interpret)


def _fwd(x, kernel, bias, head, static):
  return _short_conv(x, kernel, bias, head, static), (x, kernel, bias, head)


def _bwd(static, res, dys):
  activation, _, splits, block_t, block_d, interpret = static
  x, kernel, bias, head = res
  dx, dkernel, dbias, dhead = _backward(x, kernel, bias, head, tuple(dys), activation=activation,
                                        splits=splits, block_t=block_t, block_d=block_d,
                                        interpret=interpret)
  # under shard_map, the taps' and bias' sums are this shard's rows only: add the other rows' shards
  grads = (dx, dkernel.astype(kernel.dtype), dbias.astype(bias.dtype), dhead.astype(head.dtype))
  return tuple(common.sum_over_extra_axes(g, p) for g, p in zip(grads, res))


_short_conv.defvjp(_fwd, _bwd)
