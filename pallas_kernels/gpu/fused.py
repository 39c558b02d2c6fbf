"""The additive family's forward in one Mosaic GPU kernel: the chunk preparation fused into the walk.

For scalar or no decay and no packing, the per-chunk tensors of the additive family are cheap to form
from the raw tiles, so the kernel reads q, k, v and the chunk-local cumulative log-decay `G` once and
never writes `qg`, `kd` or `P` to device memory (prep.py's tensors, formed in shared memory instead):

    P    = (q k^T) * e^(G_i - G_j)   on j <= i, else 0      (exponent masked before the exponential)
    o    = (q * e^G) S + P v                              (unscaled)
    S   <- e^(G_C) S + (k * e^(G_C - G))^T v

Every exponent is <= 0 (G is non-increasing). Per program (batch, value head, 64 value columns) the walk
is that of `walk.forward`; q and k are read from their `[B, T, H, K]` layout (grouped value heads read
their q/k head), v from `[B, T, H_v, V]`. The backward is unchanged (`vjp.py`: XLA preparation and the
reverse walk), so this speeds up the forward pass only. Opt-in (`chunked_attention(..., fused=True)`):
it has run in the Mosaic GPU interpreter and lowered for an H200, not yet on the GPU itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.gpu.walk import (BLOCK_V, COLS, F32, WGMMA, _initial, _program, _store_last,
                                     _vary_like, matmul, smem)

ROWS = plgpu.Layout.WGMMA.reduce(1)   # one value per row of a WGMMA-layout tile


def serves(g, beta, segment_ids) -> bool:
  """True for the calls this kernel takes: additive family, no or scalar decay, no packing."""
  return beta is None and segment_ids is None and (g is None or g.ndim == 3)


def local_cumsum(g, B: int, T_pad: int, Hv: int, C: int):
  """`[B, H_v, T_pad]` float32: the cumulative log-decay from each chunk's start (zeros for no decay)."""
  if g is None:
    return jnp.zeros((B, Hv, T_pad), F32)
  g = jnp.pad(g.astype(F32), [(0, 0), (0, T_pad - g.shape[1]), (0, 0)])
  return jnp.cumsum(jnp.swapaxes(g, 1, 2).reshape(B, Hv, T_pad // C, C), axis=-1).reshape(B, Hv, T_pad)


def forward(q, k, v, g, h0, *, chunk_size: int, dtype, out_dtype, interpret=None,
            block_v: int = BLOCK_V):
  """`(o [B, H_v, NC, C, V] unscaled in out_dtype, final [B, H_v, K, V] float32)`.

  q, k: `[B, T, H, K]`; v: `[B, T, H_v, V]`; g: None or `[B, T, H_v]`; h0: None or `[B, H_v, K, V]`.
  Matmul operands in `dtype` (bfloat16 or float16), accumulation and state in float32.
  """
  B, T, H, K = q.shape
  Hv, V = v.shape[2:]
  C = chunk_size
  NC = -(-T // C)
  T_pad = NC * C
  bv = min(block_v, V)
  group = Hv // H
  has_h0 = h0 is not None
  pad = lambda x: jnp.pad(x.astype(dtype), [(0, 0), (0, T_pad - T), (0, 0), (0, 0)])
  q, k, v = pad(q), pad(k), pad(v)
  G = local_cumsum(g, B, T_pad, Hv, C)

  scratch = dict(
      q_s=smem((2, C, K), dtype), k_s=smem((2, C, K), dtype), v_s=smem((2, C, bv), dtype),
      g_s=plgpu.SMEM((2, C), F32), gc_s=plgpu.SMEM((2, C), F32),
      qg_s=smem((C, K), dtype), kd_s=smem((C, K), dtype), p_s=smem((C, C), dtype),
      h_s=smem((2, bv, K), dtype), o_s=smem((2, C, bv), out_dtype), state_s=plgpu.SMEM((bv, K), F32),
      in_bar=plgpu.Barrier(num_arrivals=5, num_barriers=2), state_bar=plgpu.Barrier())

  def body(q_r, k_r, v_r, g_r, *refs, q_s, k_s, v_s, g_s, gc_s, qg_s, kd_s, p_s, h_s, o_s, state_s, in_bar,
           state_bar):
    refs = list(refs)
    h0_r = refs.pop(0) if has_h0 else None
    o_r, final_r = refs
    b, h, vs = _program(bv)
    hk = lax.div(h, group)

    def issue(n, slot):
      rows, bar = pl.ds(n * C, C), in_bar.at[slot]
      plgpu.copy_gmem_to_smem(q_r.at[b, rows, hk], q_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(k_r.at[b, rows, hk], k_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(v_r.at[b, rows, h, vs], v_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(g_r.at[b, h, rows], g_s.at[slot], bar)
      # the same G again: Mosaic GPU's layout inference wants one layout per buffer (rows, columns)
      plgpu.copy_gmem_to_smem(g_r.at[b, h, rows], gc_s.at[slot], bar)

    issue(0, 0)
    s0 = _initial(h0_r.at[b, h, vs] if has_h0 else None, state_s, state_bar, bv, K)

    def step(n, s_t):
      slot = lax.rem(n, 2)
      plgpu.barrier_wait(in_bar.at[slot])

      @pl.when(n + 1 < NC)
      def _prefetch():
        issue(n + 1, 1 - slot)

      # The chunk's tensors, in shared memory: P, q e^G and k e^(G_C - G).
      G_rows = plgpu.load(g_s.at[slot], layout=ROWS)
      G_cols = plgpu.load(gc_s.at[slot], layout=COLS)
      G_last = g_s[slot, C - 1]
      rows = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])
      sq = (C, C)
      causal = (plgpu.broadcasted_iota(jnp.int32, sq, 0, layout=WGMMA)
                >= plgpu.broadcasted_iota(jnp.int32, sq, 1, layout=WGMMA))
      expo = jnp.where(causal, rows(G_rows, sq) - lax.broadcast_in_dim(G_cols, sq, [1]), -jnp.inf)
      p_s[...] = (matmul(q_s.at[slot], k_s.at[slot].T, sq) * jnp.exp(expo)).astype(dtype)
      qk = (C, K)
      qg_s[...] = (plgpu.load(q_s.at[slot], layout=WGMMA).astype(F32)
                   * rows(jnp.exp(G_rows), qk)).astype(dtype)
      kd_s[...] = (plgpu.load(k_s.at[slot], layout=WGMMA).astype(F32)
                   * rows(jnp.exp(G_last - G_rows), qk)).astype(dtype)
      # The walk (walk.forward, additive): o^T = S^T Qg^T + v^T P^T, S^T <- e^(G_C) S^T + v^T Kd.
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)
      s_lo = h_s.at[slot]
      s_lo[...] = s_t.astype(dtype)
      plgpu.commit_smem()
      v_t = v_s.at[slot].T
      o_t = matmul(s_lo, qg_s.T, (bv, C))
      o_t = matmul(v_t, p_s.T, (bv, C), init=o_t)
      o_s.at[slot].T[...] = o_t.astype(out_dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_s.at[slot], o_r.at[b, h, pl.ds(n * C, C), vs])
      return matmul(v_t, kd_s, (bv, K), init=s_t * jnp.exp(G_last))

    _store_last(lax.fori_loop(0, NC, step, s0), state_s, final_r.at[b, h, vs])

  args = [q, k, v, G] + ([jnp.swapaxes(h0.astype(F32), -1, -2)] if has_h0 else [])
  out_type = (jax.ShapeDtypeStruct((B, Hv, T_pad, V), out_dtype), jax.ShapeDtypeStruct((B, Hv, V, K), F32))
  o, final = plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=(B, Hv, V // bv), grid_names=("b", "h", "v"),
      compiler_params=plgpu.CompilerParams(approx_math=True), interpret=interpret,
      kernel_name="chunk_walk_fused_fwd")(*args)
  o, final = _vary_like((o, final), args)
  return o.reshape(B, Hv, NC, C, V), jnp.swapaxes(final, -1, -2)
