"""The l2 norms' backward for q and k in one Mosaic GPU kernel: `GpuConfig.l2_grads="kernel"`.

Where the kernels normalise q and k on load (`qk_l2norm`), the gradient of the raw rows follows from
that of the normalised ones, `dy`, row by row:

    y = x r,  r = (sum(x^2) + eps)^(-1/2)      dx = r (dy - y sum(y dy)) = r dy - r^3 x sum(x dy)

XLA's vjp of `common.l2_normalize` reads x and dy once for the two row sums and once more for dx,
through float32 temporaries (on an H100 the trained KDA LM's four layers spent 1.29 ms a step there,
NOTES.md v68); the two-warpgroup key side's epilogue, which does it without those reads, made that
kernel ~1 ms a step slower (v68). Here one program takes 64 rows of both q and k: it copies x and dy of
each into shared memory, forms both sums and dx in float32 in registers, rounds dx to the operands'
dtype (as XLA's vjp does) and writes it over dy's tile before copying it out: each byte of q, k, dq
and dk read once, dq and dk written once. Rows are padded to whole programs (zero rows give zero).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from .once import lowered_once
from .tiles import F32, L2_EPS, WGMMA, compiler_params, smem, vary_like

ROWS_A_PROGRAM = 64   # a warpgroup's WGMMA-layout tile
DIMS = (64, 128)      # K: one [64, K] tile of x and of dy per tensor in registers
DTYPES = (jnp.bfloat16, jnp.float16)


def serves(K: int, dtype) -> bool:
  """Whether the kernel takes rows of K channels in `dtype` (16-bit: the tiles' swizzle and registers)."""
  return K in DIMS and any(jnp.dtype(dtype) == jnp.dtype(d) for d in DTYPES)


def _grad(x, dy):
  """dx of `l2_normalize` for the float32 `[64, K]` tiles x, dy (module docstring)."""
  rows = lambda v: lax.broadcast_in_dim(v, x.shape, [0])
  r = lax.rsqrt(jnp.sum(x * x, axis=1) + L2_EPS)
  y = x * rows(r)
  return rows(r) * (dy - y * rows(jnp.sum(y * dy, axis=1)))


@lowered_once()
def backward(q, dq, k, dk, *, interpret=None):
  """`(dq_raw, dk_raw)`: the gradients of the raw q, k `[..., K]` from those of `l2_normalize(q)`,
  `l2_normalize(k)` (`dq`, `dk`, the same shapes and dtypes as q, k; module docstring), in q's and k's
  dtype. q and k have one shape; K and the dtype as `serves` takes them."""
  for name, x, dx in (("q", q, dq), ("k", k, dk)):
    if x.shape != q.shape or dx.shape != q.shape or x.dtype != q.dtype or dx.dtype != q.dtype:
      raise ValueError(f"{name} and d{name} must have q's shape {tuple(q.shape)} and dtype {q.dtype}; got "
                       f"{tuple(x.shape)} {x.dtype} and {tuple(dx.shape)} {dx.dtype}")
  K, dtype = q.shape[-1], q.dtype
  if not serves(K, dtype):
    raise ValueError(f"the l2 gradient kernel takes K in {DIMS} and 16-bit rows; got K={K}, {dtype}")
  N = q.size // K
  N_pad = -(-N // ROWS_A_PROGRAM) * ROWS_A_PROGRAM
  flat = lambda x: jnp.pad(x.reshape(N, K), [(0, N_pad - N), (0, 0)])
  args = [flat(x) for x in (q, dq, k, dk)]
  tile = lambda: smem((2, ROWS_A_PROGRAM, K), dtype)
  scratch = dict(x_s=tile(), dy_s=tile(), bar=plgpu.Barrier(num_arrivals=4))

  def body(q_r, dq_r, k_r, dk_r, oq_r, ok_r, x_s, dy_s, bar):
    rows = pl.ds(lax.axis_index("n") * ROWS_A_PROGRAM, ROWS_A_PROGRAM)
    for i, (x_r, dy_r) in enumerate(((q_r, dq_r), (k_r, dk_r))):
      plgpu.copy_gmem_to_smem(x_r.at[rows], x_s.at[i], bar)
      plgpu.copy_gmem_to_smem(dy_r.at[rows], dy_s.at[i], bar)
    plgpu.barrier_wait(bar)
    for i, out_r in enumerate((oq_r, ok_r)):
      load = lambda ref: plgpu.load(ref.at[i], layout=WGMMA).astype(F32)
      dy_s.at[i][...] = _grad(load(x_s), load(dy_s)).astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(dy_s.at[i], out_r.at[rows])
    plgpu.wait_smem_to_gmem(0)

  out = jax.ShapeDtypeStruct((N_pad, K), dtype)
  outs = vary_like(plgpu.kernel(
      body, out_type=(out, out), scratch_types=scratch, grid=(N_pad // ROWS_A_PROGRAM,), grid_names=("n",),
      compiler_params=compiler_params(approx_math=False), interpret=interpret,
      kernel_name="l2_grads")(*args), args)
  return tuple(x[:N].reshape(q.shape) for x in outs)
