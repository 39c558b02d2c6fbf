"""The linear mixers' gated output norm (`linear_attention_jax.layers.GatedRMSNorm`) as two Mosaic GPU
kernels, forward and backward, each reading its inputs once.

Over the V channels of a row (one token of one value head):

    r = (mean(x^2) + eps)^(-1/2),   y = x r w act(g)                  (w: [V], shared by the rows)

    dx = r dyh - r^3 x mean(dyh x),   dyh = dy w act(g)
    dg = dy x r w act'(g),            dw = sum over rows of dy x r act(g)

XLA's autodiff of the layer's jnp form reads x, g and dy once for the row sums, again for dx and dg, and a
third time for dw's sum over the rows (a G LM step at x `[8, 4096, 8, 256]` spent ~1.2 ms in the four
layers' norms on an H100, NOTES.md v71). Here one program takes 64 rows: it copies them into shared memory,
forms the row sums and then the outputs 64 channels at a time in float32 registers, rounds them to the
operands' dtype (as the jnp form rounds its result) over the input tiles and copies them out, and adds its
rows' share of dw over the rows (`[programs, V]` float32, which XLA sums). Rows are padded to whole
programs (zero rows give zero). Without a gate, act(g) = 1 and there is no dg.
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
from .tiles import COLS, F32, WGMMA, compiler_params, smem, vary_like

ROWS_A_PROGRAM = 64   # a warpgroup's WGMMA-layout tile
CHUNK = 64            # channels in registers at a time
DIMS = (64, 128, 256)
DTYPES = (jnp.bfloat16, jnp.float16)
ACTIVATIONS = ("swish", "sigmoid")


def reason(x_shape, dtype, *, gate_dtype=None, out_dtype=None, activation: str = "swish",
           backend: str | None = None) -> str | None:
  """None if the kernels serve the norm of `x: [..., V]` in `dtype` (with a gate of `gate_dtype`, None
  for none, and the result in `out_dtype`, default dtype), else why not."""
  why = hopper_reason(backend)
  if why is not None:
    return why
  if len(x_shape) < 1 or x_shape[-1] not in DIMS:
    return f"the kernels serve rows of V in {DIMS} channels; got x of shape {tuple(x_shape)}"
  if not any(jnp.dtype(dtype) == jnp.dtype(d) for d in DTYPES):
    return f"the kernels serve 16-bit rows (bfloat16, float16); got {jnp.dtype(dtype)}"
  for name, other in (("gate", gate_dtype), ("the result", out_dtype)):
    if other is not None and jnp.dtype(other) != jnp.dtype(dtype):
      return f"the kernels take {name} in x's dtype {jnp.dtype(dtype)}; got {jnp.dtype(other)}"
  if activation not in ACTIVATIONS:
    return f"the kernels serve the gate activations {ACTIVATIONS}; got {activation!r}"
  return None


def _act(activation, g):
  s = 1.0 / (1.0 + jnp.exp(-g))
  return g * s if activation == "swish" else s


def _act_grad(activation, g):
  s = 1.0 / (1.0 + jnp.exp(-g))
  return s * (1.0 + g * (1.0 - s)) if activation == "swish" else s * (1.0 - s)


def _rows(x2d, N_pad):
  return jnp.pad(x2d, [(0, N_pad - x2d.shape[0]), (0, 0)])


def _layout(x):
  V = x.shape[-1]
  N = x.size // V
  return V, N, -(-N // ROWS_A_PROGRAM) * ROWS_A_PROGRAM


@lowered_once(arrays=("gate",))
def forward(x, weight, *, gate=None, eps: float, activation: str = "swish", interpret=None):
  """y `[..., V]` in x's dtype (module docstring) for x and gate (None: no gate) of one shape and weight
  `[V]`. Callers check `reason(...)` first."""
  V, N, N_pad = _layout(x)
  dtype, gated = x.dtype, gate is not None
  args = [_rows(x.reshape(N, V), N_pad)] + ([_rows(gate.reshape(N, V), N_pad)] if gated else [])
  args.append(weight.astype(F32))
  tile = lambda: smem((ROWS_A_PROGRAM, V), dtype)
  scratch = dict(x_s=tile(), w_s=plgpu.SMEM((V,), F32), bar=plgpu.Barrier(num_arrivals=len(args)))
  if gated:
    scratch["g_s"] = tile()
  chunks = [pl.ds(c * CHUNK, CHUNK) for c in range(V // CHUNK)]

  def body(*refs, x_s, w_s, bar, g_s=None):
    ins, (y_r,) = refs[:-1], refs[-1:]
    rows = pl.ds(lax.axis_index("n") * ROWS_A_PROGRAM, ROWS_A_PROGRAM)
    plgpu.copy_gmem_to_smem(ins[0].at[rows], x_s, bar)
    if gated:
      plgpu.copy_gmem_to_smem(ins[1].at[rows], g_s, bar)
    plgpu.copy_gmem_to_smem(ins[-1], w_s, bar)
    plgpu.barrier_wait(bar)
    load = lambda ref, cols: plgpu.load(ref.at[:, cols], layout=WGMMA).astype(F32)
    ss = sum(jnp.sum(jnp.square(load(x_s, cols)), axis=1) for cols in chunks)
    r = lax.broadcast_in_dim(lax.rsqrt(ss * (1.0 / V) + eps), (ROWS_A_PROGRAM, CHUNK), [0])
    for cols in chunks:
      w = lax.broadcast_in_dim(plgpu.load(w_s.at[cols], layout=COLS), (ROWS_A_PROGRAM, CHUNK), [1])
      y = load(x_s, cols) * r * w
      if gated:
        y = y * _act(activation, load(g_s, cols))
      x_s.at[:, cols][...] = y.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(x_s, y_r.at[rows])
    plgpu.wait_smem_to_gmem(0)

  out = jax.ShapeDtypeStruct((N_pad, V), dtype)
  (y,) = vary_like(plgpu.kernel(
      body, out_type=(out,), scratch_types=scratch, grid=(N_pad // ROWS_A_PROGRAM,), grid_names=("n",),
      compiler_params=compiler_params(approx_math=False), interpret=interpret,
      kernel_name="gated_norm_fwd")(*args), args)
  return y[:N].reshape(x.shape)


@lowered_once(arrays=("gate",))
def backward(x, weight, dy, *, gate=None, eps: float, activation: str = "swish", interpret=None):
  """`(dx, dgate or None, dweight)` of the module docstring's norm for the cotangent dy of y (x's shape
  and dtype); dx and dgate in x's dtype, dweight `[V]` float32."""
  V, N, N_pad = _layout(x)
  dtype, gated = x.dtype, gate is not None
  if dy.shape != x.shape or dy.dtype != dtype:
    raise ValueError(f"dy must have x's shape {tuple(x.shape)} and dtype {dtype}; got "
                     f"{tuple(dy.shape)} {dy.dtype}")
  flat = lambda a: _rows(a.reshape(N, V), N_pad)
  args = [flat(x), flat(dy)] + ([flat(gate)] if gated else []) + [weight.astype(F32)]
  tile = lambda: smem((ROWS_A_PROGRAM, V), dtype)
  scratch = dict(x_s=tile(), dy_s=tile(), w_s=plgpu.SMEM((V,), F32), dw_s=plgpu.SMEM((V,), F32),
                 bar=plgpu.Barrier(num_arrivals=len(args)))
  if gated:
    scratch["g_s"] = tile()
  chunks = [pl.ds(c * CHUNK, CHUNK) for c in range(V // CHUNK)]
  shape = (ROWS_A_PROGRAM, CHUNK)

  def body(*refs, x_s, dy_s, w_s, dw_s, bar, g_s=None):
    ins, outs = refs[:len(args)], refs[len(args):]
    n = lax.axis_index("n")
    rows = pl.ds(n * ROWS_A_PROGRAM, ROWS_A_PROGRAM)
    for ref, buf in zip(ins, (x_s, dy_s) + ((g_s,) if gated else ()) + (w_s,)):
      plgpu.copy_gmem_to_smem(ref if buf is w_s else ref.at[rows], buf, bar)
    plgpu.barrier_wait(bar)
    load = lambda ref, cols: plgpu.load(ref.at[:, cols], layout=WGMMA).astype(F32)
    weight_of = lambda cols: lax.broadcast_in_dim(plgpu.load(w_s.at[cols], layout=COLS), shape, [1])
    act = lambda cols: _act(activation, load(g_s, cols)) if gated else 1.0
    ss = sum(jnp.sum(jnp.square(load(x_s, cols)), axis=1) for cols in chunks)
    s = sum(jnp.sum(load(dy_s, cols) * weight_of(cols) * act(cols) * load(x_s, cols), axis=1)
            for cols in chunks)
    r_rows = lax.rsqrt(ss * (1.0 / V) + eps)
    r = lax.broadcast_in_dim(r_rows, shape, [0])
    r3s = lax.broadcast_in_dim(r_rows * r_rows * r_rows * s * (1.0 / V), shape, [0])
    for cols in chunks:
      x, dy, w = load(x_s, cols), load(dy_s, cols), weight_of(cols)
      xr = x * r
      if gated:
        g = load(g_s, cols)
        a = _act(activation, g)
        g_s.at[:, cols][...] = (dy * w * xr * _act_grad(activation, g)).astype(dtype)
      else:
        a = 1.0
      dw_s[cols] = jnp.sum(dy * xr * a, axis=0)
      x_s.at[:, cols][...] = (r * dy * w * a - r3s * x).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(x_s, outs[0].at[rows])
    if gated:
      plgpu.copy_smem_to_gmem(g_s, outs[1].at[rows])
    plgpu.copy_smem_to_gmem(dw_s, outs[-1].at[n])
    plgpu.wait_smem_to_gmem(0)

  grads = [jax.ShapeDtypeStruct((N_pad, V), dtype)] * (2 if gated else 1)
  out_type = (*grads, jax.ShapeDtypeStruct((N_pad // ROWS_A_PROGRAM, V), F32))
  outs = vary_like(plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=(N_pad // ROWS_A_PROGRAM,), grid_names=("n",),
      compiler_params=compiler_params(approx_math=False), interpret=interpret,
      kernel_name="gated_norm_bwd")(*args), args)
  dx = outs[0][:N].reshape(x.shape)
  dgate = outs[1][:N].reshape(x.shape) if gated else None
  return dx, dgate, jnp.sum(outs[-1], axis=0)


def gated_rms_norm(x, gate, weight, *, eps: float, activation: str = "swish"):
  """The module docstring's y for x `[..., V]`, gate (x's shape and dtype, or None) and weight `[V]`, in
  x's dtype; differentiable in x, gate and weight (its gradient in weight's dtype). Callers check
  `reason(...)` first."""
  if gate is not None and (gate.shape != x.shape or gate.dtype != x.dtype):
    raise ValueError(f"gate must have x's shape {tuple(x.shape)} and dtype {x.dtype}; got "
                     f"{tuple(gate.shape)} {gate.dtype}")
  if weight.shape != (x.shape[-1],):
    raise ValueError(f"weight must be [V] = [{x.shape[-1]}]; got shape {tuple(weight.shape)}")
  # the interpreter switch is read here: the jitted kernels' caches key on it
  static = (float(eps), activation, interpreting())
  if gate is None:
    return _norm_ungated(x, weight, static)
  return _norm(x, gate, weight, static)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _norm(x, gate, weight, static):
  eps, activation, interpret = static
  return forward(x, weight, gate=gate, eps=eps, activation=activation, interpret=interpret)


def _fwd(x, gate, weight, static):
  return _norm(x, gate, weight, static), (x, gate, weight)


def _bwd(static, res, dy):
  eps, activation, interpret = static
  x, gate, weight = res
  dx, dgate, dweight = backward(x, weight, dy, gate=gate, eps=eps, activation=activation,
                                interpret=interpret)
  # under shard_map, dweight is this shard's rows only: add the other rows' shards
  return dx, dgate, common.sum_over_extra_axes(dweight.astype(weight.dtype), weight)


_norm.defvjp(_fwd, _bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _norm_ungated(x, weight, static):
  eps, activation, interpret = static
  return forward(x, weight, eps=eps, activation=activation, interpret=interpret)


def _fwd_ungated(x, weight, static):
  return _norm_ungated(x, weight, static), (x, weight)


def _bwd_ungated(static, res, dy):
  eps, activation, interpret = static
  x, weight = res
  dx, _, dweight = backward(x, weight, dy, eps=eps, activation=activation, interpret=interpret)
  return dx, common.sum_over_extra_axes(dweight.astype(weight.dtype), weight)


_norm_ungated.defvjp(_fwd_ungated, _bwd_ungated)
