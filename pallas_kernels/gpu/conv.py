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

`short_conv_many` convolves several inputs `x_i [B, T, D_i]` (a mixer's q, k and v: same B, T and dtype,
each with its own taps, bias and head) in one forward and one backward launch: the grid's channel axis
runs over the `bd`-blocks of all inputs in order (input i holds blocks `starts[i] <= c < starts[i + 1]`),
a program copies its block of x (dy) from its input and writes y (dx) to its output, chosen by static
ranges; the taps, bias and head of all inputs are one array each (concatenated over channels in XLA), as
are the partial sums of dkernel and dbias and d(head). The loop over tokens is the one of `short_conv`,
emitted once whatever the number of inputs, so each channel's numbers are the single-input kernel's.
`short_conv` is its one-input case.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from .. import common
from .interpret import interpreting
from .plan import hopper_reason
from .tiles import F32, vary_like

HALO = 8          # rows kept before (and, in the backward, after) a block: W - 1 <= HALO
BLOCK_T = (32, 16, 8)         # tokens a program, the largest that divides T (32: NOTES v47)
BLOCK_D = (128,)              # channels a program (128: NOTES v47; 256 is allowed by block_d)
UNROLL = 4                    # tokens a loop iteration (8: twice the kernels' lowering time, NOTES v47)
ACTIVATIONS = ("silu", "identity")


def blocks(T: int, D: int, block_t: int | None = None, block_d: int | None = None):
  """`(bt, bd)` for a `[B, T, D]` input (the largest of BLOCK_T, BLOCK_D that divide T and D, or the
  sizes given), or None where none divides it."""
  bt = next((b for b in BLOCK_T if T % b == 0), None) if block_t is None else block_t
  bd = next((b for b in BLOCK_D if D % b == 0), None) if block_d is None else block_d
  if bt is None or bd is None:
    return None
  if T % bt or D % bd or bt % UNROLL or bt < HALO or bd % 128:
    raise ValueError(f"block_t={bt} must divide T={T}, be a multiple of {UNROLL} and >= {HALO}; "
                     f"block_d={bd} must divide D={D} and be a multiple of 128")
  return bt, bd


def reason(x_shape, kernel_size: int, activation: str, dtype, backend: str | None = None) -> str | None:
  """None if the kernels serve a convolution of `x: [B, T, D]` (dtype `dtype`) with `kernel_size` taps
  and `activation`, else why not."""
  why = hopper_reason(backend)
  if why is not None:
    return why
  if len(x_shape) != 3:
    return f"x must be [B, T, D]; got shape {tuple(x_shape)}"
  _, T, D = x_shape
  if blocks(T, D) is None:
    return (f"the kernels need T a multiple of {BLOCK_T[-1]} and D a multiple of {BLOCK_D[-1]}; "
            f"got T={T}, D={D}")
  if not 1 <= kernel_size <= HALO + 1:
    return f"the kernels serve 1 <= kernel_size <= {HALO + 1}; got {kernel_size}"
  if activation not in ACTIVATIONS:
    return f"the kernels serve the activations {ACTIVATIONS}; got {activation!r}"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(F32)):
    return f"the kernels serve bfloat16, float16 and float32 inputs; got {jnp.dtype(dtype)}"
  return None


def reason_many(x_shapes, kernel_size: int, activation: str, dtypes,
                backend: str | None = None) -> str | None:
  """None if the kernels serve the convolutions of the inputs `x_i: [B, T, D_i]` (dtypes `dtypes`) in one
  call (`short_conv_many`): each one alone (`reason`), and all of one B, T and dtype; else why not."""
  x_shapes, dtypes = [tuple(s) for s in x_shapes], [jnp.dtype(d) for d in dtypes]
  if not x_shapes or len(x_shapes) != len(dtypes):
    return f"one dtype an input: got {len(x_shapes)} shapes and {len(dtypes)} dtypes"
  for i, (shape, dtype) in enumerate(zip(x_shapes, dtypes)):
    why = reason(shape, kernel_size, activation, dtype, backend)
    if why is not None:
      return f"input {i}: {why}"
  if len({s[:2] for s in x_shapes}) > 1:
    return f"the inputs of one call share B and T; got shapes {x_shapes}"
  if len(set(dtypes)) > 1:
    return f"the inputs of one call share a dtype; got {[d.name for d in dtypes]}"
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
  return plgpu.CompilerParams(approx_math=False)


def _staged(kernels, biases, heads):
  """`(params [W + 1, sum D_i], head_rows [B, HALO, sum D_i])` float32: the taps and bias of all inputs
  as one array (input i's channels after those of the inputs before it), and the windows before the
  sequence as the HALO rows ending at its first token."""
  W = kernels[0].shape[0]
  cat = lambda arrays, axis: arrays[0] if len(arrays) == 1 else jnp.concatenate(arrays, axis=axis)
  params = jnp.concatenate([cat([k.astype(F32) for k in kernels], 1),
                            cat([b.astype(F32) for b in biases], 0)[None]], axis=0)
  head = cat([h.astype(F32) for h in heads], 2)
  return params, jnp.pad(head, [(0, 0), (HALO - (W - 1), 0), (0, 0)])


def _geometry(xs, kernels, block_t, block_d):
  """`(B, T, Ds, W, bt, bd, NT, starts)`: the call's sizes, its program blocks, the token blocks and the
  first channel block of each input (`starts[i]`; `starts[-1]`, the grid's channel blocks)."""
  B, T, _ = xs[0].shape
  Ds = tuple(x.shape[2] for x in xs)
  bt, bd = blocks(T, math.gcd(*Ds), block_t, block_d)   # the largest block that divides every D_i
  starts = (0, *itertools.accumulate(D // bd for D in Ds))
  return B, T, Ds, kernels[0].shape[0], bt, bd, T // bt, starts


def _each_input(c, cols, starts, bd, fn):
  """`fn(i, mine)` in the programs of input i's channel blocks (`starts[i] <= c < starts[i + 1]`), `mine`
  its channels there (`cols`, the program's channels of all inputs, for the first input); with one input,
  in every program."""
  for i in range(len(starts) - 1):
    mine = cols if i == 0 else pl.ds((c - starts[i]) * bd, bd)
    if len(starts) == 2:
      fn(i, mine)
      continue
    ours = c < starts[i + 1] if i == 0 else (c >= starts[i] if i == len(starts) - 2
                                             else (c >= starts[i]) & (c < starts[i + 1]))
    pl.when(ours)(functools.partial(fn, i, mine))


def _check(xs, kernels, biases, heads):
  """Raises ValueError, naming the argument, where the inputs are not one call's (`short_conv_many`)."""
  n = len(xs)
  if n < 1:
    raise ValueError("xs must hold at least one input")
  for name, arg in (("kernels", kernels), ("biases", biases), ("heads", heads)):
    if len(arg) != n:
      raise ValueError(f"{name} must hold one entry an input: {len(arg)} for {n} inputs in xs")
  if any(getattr(x, "ndim", None) != 3 for x in xs):
    i = next(i for i, x in enumerate(xs) if getattr(x, "ndim", None) != 3)
    raise ValueError(f"xs[{i}] must be [B, T, D]; got shape {jnp.shape(xs[i])}")
  B, T, _ = xs[0].shape
  W = jnp.shape(kernels[0])[0] if jnp.ndim(kernels[0]) == 2 else None
  for i, (x, kernel, bias, head) in enumerate(zip(xs, kernels, biases, heads)):
    D = x.shape[2]
    if x.shape[:2] != (B, T):
      raise ValueError(f"xs[{i}] has B, T = {x.shape[:2]} and xs[0] {(B, T)}: the inputs of one call "
                       f"share B and T")
    if x.dtype != xs[0].dtype:
      raise ValueError(f"xs[{i}] is {x.dtype} and xs[0] {xs[0].dtype}: the inputs of one call share a "
                       f"dtype")
    if W is None or jnp.shape(kernel) != (W, D):
      raise ValueError(f"kernels[{i}] must be [W, D] = {(W, D)} (W: kernels[0]'s taps); got "
                       f"{jnp.shape(kernel)}")
    if jnp.shape(bias) != (D,):
      raise ValueError(f"biases[{i}] must be [D] = {(D,)}; got {jnp.shape(bias)}")
    if jnp.shape(head) != (B, W - 1, D):
      raise ValueError(f"heads[{i}] must be [B, W - 1, D] = {(B, W - 1, D)}; got {jnp.shape(head)}")


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


# jitted, so that every call at the same shapes (a model's q, k, v convolutions in every layer) shares
# one traced jaxpr, which XLA's lowering emits once: each kernel's lowering costs seconds (NOTES v47)
@functools.partial(jax.jit, static_argnames=("activation", "out_dtype", "block_t", "block_d",
                                             "interpret"))
def _forward(xs, kernels, biases, heads, *, activation: str, out_dtype, block_t=None, block_d=None,
             interpret=None):
  """The tuple of y_i `[B, T, D_i]` in `out_dtype`; `kernels[i] [W, D_i]`, `biases[i] [D_i]`,
  `heads[i] [B, W - 1, D_i]` float32."""
  B, T, Ds, W, bt, bd, NT, starts = _geometry(xs, kernels, block_t, block_d)
  back, dtype, n_in = W - 1, xs[0].dtype, len(xs)
  params, head_rows = _staged(kernels, biases, heads)
  in_place = jnp.dtype(out_dtype) == dtype   # y of token i overwrites x of token i, once read
  scratch = dict(x_s=plgpu.SMEM((HALO + bt, bd), dtype), p_s=plgpu.SMEM((W + 1, bd), F32),
                 h_s=plgpu.SMEM((HALO, bd), F32), bar=plgpu.Barrier(num_arrivals=3),
                 bar_halo=plgpu.Barrier(num_arrivals=1))
  if not in_place:
    scratch["y_s"] = plgpu.SMEM((bt, bd), out_dtype)

  def body(*refs, x_s, p_s, h_s, bar, bar_halo, y_s=None):
    x_rs, (p_r, h_r), y_rs = refs[:n_in], refs[n_in:n_in + 2], refs[n_in + 2:]
    b, n, c = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("c")
    cols = pl.ds(c * bd, bd)      # of all inputs' channels: the taps, bias and head
    rows_t = pl.ds(n * bt, bt)
    out = x_s.at[pl.ds(HALO, bt)] if in_place else y_s
    _each_input(c, cols, starts, bd, lambda i, mine: plgpu.copy_gmem_to_smem(
        x_rs[i].at[b, rows_t, mine], x_s.at[pl.ds(HALO, bt)], bar))
    plgpu.copy_gmem_to_smem(p_r.at[:, cols], p_s, bar)
    plgpu.copy_gmem_to_smem(h_r.at[b, :, cols], h_s, bar)

    _each_input(c, cols, starts, bd,
                lambda i, mine: _copy_rows_before(x_rs[i], x_s, b, n, bt, mine, bar_halo))
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
    _each_input(c, cols, starts, bd,
                lambda i, mine: plgpu.copy_smem_to_gmem(out, y_rs[i].at[b, rows_t, mine]))
    plgpu.wait_smem_to_gmem(0)

  args = (*xs, params, head_rows)
  out_type = tuple(jax.ShapeDtypeStruct((B, T, D), out_dtype) for D in Ds)
  return tuple(vary_like(plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=(B, NT, starts[-1]),
      grid_names=("b", "n", "c"), compiler_params=_params(), interpret=interpret,
      kernel_name="short_conv_fwd")(*args), args))


@functools.partial(jax.jit, static_argnames=("activation", "block_t", "block_d", "interpret"))
def _backward(xs, kernels, biases, heads, dys, *, activation: str, block_t=None, block_d=None,
              interpret=None):
  """`(dxs, dkernels, dbiases, dheads)`, a tuple each: dx_i `[B, T, D_i]` in x's dtype, dkernel_i
  `[W, D_i]`, dbias_i `[D_i]`, dhead_i `[B, W - 1, D_i]` float32."""
  B, T, Ds, W, bt, bd, NT, starts = _geometry(xs, kernels, block_t, block_d)
  back, dtype, n_in = W - 1, xs[0].dtype, len(xs)
  params, head_rows = _staged(kernels, biases, heads)
  # dx of token i - W + 1 is complete after token i (whose dy is read): it overwrites that token's dy
  in_place = dys[0].dtype == dtype
  scratch = dict(x_s=plgpu.SMEM((HALO + bt + HALO, bd), dtype),
                 dy_s=plgpu.SMEM((bt + HALO, bd), dys[0].dtype),
                 p_s=plgpu.SMEM((W + 1, bd), F32), h_s=plgpu.SMEM((HALO, bd), F32),
                 bar=plgpu.Barrier(num_arrivals=4), bar_before=plgpu.Barrier(num_arrivals=1),
                 bar_after=plgpu.Barrier(num_arrivals=2))
  if not in_place:
    scratch["dx_s"] = plgpu.SMEM((bt, bd), dtype)

  def body(*refs, x_s, dy_s, p_s, h_s, bar, bar_before, bar_after, dx_s=None):
    x_rs, dy_rs = refs[:n_in], refs[n_in:2 * n_in]
    p_r, h_r = refs[2 * n_in:2 * n_in + 2]
    dx_rs, (g_r, dh_r) = refs[2 * n_in + 2:3 * n_in + 2], refs[3 * n_in + 2:]
    b, n, c = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("c")
    cols = pl.ds(c * bd, bd)      # of all inputs' channels: the taps, bias, their sums and head
    rows_t = pl.ds(n * bt, bt)
    out = dy_s if in_place else dx_s

    def load(i, mine):
      plgpu.copy_gmem_to_smem(x_rs[i].at[b, rows_t, mine], x_s.at[pl.ds(HALO, bt)], bar)
      plgpu.copy_gmem_to_smem(dy_rs[i].at[b, rows_t, mine], dy_s.at[pl.ds(0, bt)], bar)

    _each_input(c, cols, starts, bd, load)
    plgpu.copy_gmem_to_smem(p_r.at[:, cols], p_s, bar)
    plgpu.copy_gmem_to_smem(h_r.at[b, :, cols], h_s, bar)
    first, last = n == 0, n == NT - 1
    first_v, last_v = lax.broadcast(first, (bd,)), lax.broadcast(last, (bd,))   # for select_n

    def load_halos(i, mine):
      _copy_rows_before(x_rs[i], x_s, b, n, bt, mine, bar_before)

      @pl.when(n < NT - 1)
      def _():
        after = pl.ds((n + 1) * bt, HALO)
        plgpu.copy_gmem_to_smem(x_rs[i].at[b, after, mine], x_s.at[pl.ds(HALO + bt, HALO)], bar_after)
        plgpu.copy_gmem_to_smem(dy_rs[i].at[b, after, mine], dy_s.at[pl.ds(bt, HALO)], bar_after)
        plgpu.barrier_wait(bar_after)

    _each_input(c, cols, starts, bd, load_halos)
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
    _each_input(c, cols, starts, bd, lambda i, mine: plgpu.copy_smem_to_gmem(
        out.at[pl.ds(0, bt)], dx_rs[i].at[b, rows_t, mine]))
    plgpu.copy_smem_to_gmem(p_s, g_r.at[b, n, :, cols])

    @pl.when(first)
    def _():
      plgpu.copy_smem_to_gmem(h_s, dh_r.at[b, :, cols])

    plgpu.wait_smem_to_gmem(0)

  args = (*xs, *dys, params, head_rows)
  D_all = sum(Ds)
  out_type = (*(jax.ShapeDtypeStruct((B, T, D), dtype) for D in Ds),
              jax.ShapeDtypeStruct((B, NT, W + 1, D_all), F32), jax.ShapeDtypeStruct((B, HALO, D_all), F32))
  *dxs, partial, dhead = vary_like(plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=(B, NT, starts[-1]),
      grid_names=("b", "n", "c"), compiler_params=_params(), interpret=interpret,
      kernel_name="short_conv_bwd")(*args), args)
  spans = [slice(s * bd, e * bd) for s, e in zip(starts[:-1], starts[1:])]   # input i's channels
  sums = [jnp.sum(partial[..., cs], axis=(0, 1)) for cs in spans]   # each as its own call sums them
  return (tuple(dxs), tuple(s[:W] for s in sums), tuple(s[W] for s in sums),
          tuple(dhead[:, HALO - back:, cs] for cs in spans))


def short_conv(x, kernel, bias, head, *, activation: str = "silu", out_dtype=None,
               block_t: int | None = None, block_d: int | None = None):
  """The module docstring's y for x `[B, T, D]`, kernel `[W, D]`, bias `[D]` and head `[B, W - 1, D]`
  (the inputs before x), in `out_dtype` (default x's); differentiable in all four. block_t, block_d:
  the tokens and channels of a program (default `blocks`). Callers check `reason(...)` first."""
  (y,) = short_conv_many((x,), (kernel,), (bias,), (head,), activation=activation, out_dtype=out_dtype,
                         block_t=block_t, block_d=block_d)
  return y


def short_conv_many(xs, kernels, biases, heads, *, activation: str = "silu", out_dtype=None,
                    block_t: int | None = None, block_d: int | None = None):
  """The tuple of `short_conv(xs[i], kernels[i], biases[i], heads[i])` (the module docstring's y_i) in
  one forward and one backward kernel launch: x_i `[B, T, D_i]` of one B, T and dtype, kernel_i
  `[W, D_i]` of one W, bias_i `[D_i]`, head_i `[B, W - 1, D_i]`; every y_i `[B, T, D_i]` in `out_dtype`
  (default the inputs' dtype: the programs share one loop, which writes one dtype). Differentiable in
  every array; each channel's numbers are those of its own `short_conv`. block_t, block_d: as in
  `short_conv`, the same for every input (block_d must divide every D_i). Raises ValueError, naming the
  argument, where the inputs are not of one call; callers check `reason_many(...)` first."""
  xs, kernels, biases, heads = (tuple(a) for a in (xs, kernels, biases, heads))
  _check(xs, kernels, biases, heads)
  out_dtype = xs[0].dtype if out_dtype is None else jnp.dtype(out_dtype)
  # the interpreter switch is read here: the jitted kernels' caches key on it
  return _short_conv_many(xs, kernels, biases, heads,
                          (activation, out_dtype, block_t, block_d, interpreting()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _short_conv_many(xs, kernels, biases, heads, static):
  activation, out_dtype, block_t, block_d, interpret = static
  return _forward(xs, kernels, biases, heads, activation=activation, out_dtype=out_dtype,
                  block_t=block_t, block_d=block_d, interpret=interpret)


def _fwd(xs, kernels, biases, heads, static):
  return _short_conv_many(xs, kernels, biases, heads, static), (xs, kernels, biases, heads)


def _bwd(static, res, dys):
  activation, _, block_t, block_d, interpret = static
  xs, kernels, biases, heads = res
  dxs, dkernels, dbiases, dheads = _backward(xs, kernels, biases, heads, tuple(dys),
                                             activation=activation, block_t=block_t, block_d=block_d,
                                             interpret=interpret)
  # under shard_map, the taps' and bias' sums are this shard's rows only: add the other rows' shards
  grads = (dxs, tuple(d.astype(k.dtype) for d, k in zip(dkernels, kernels)),
           tuple(d.astype(b.dtype) for d, b in zip(dbiases, biases)),
           tuple(d.astype(h.dtype) for d, h in zip(dheads, heads)))
  return jax.tree.map(common.sum_over_extra_axes, grads, res)


_short_conv_many.defvjp(_fwd, _bwd)
