"""The delta family's gradient terms that both per-chunk gradient kernels form alike
(`delta_grads.chunk_grads`, `delta_grads_pair.chunk_grads_pair`; delta_grads.py's docstring for the
notation): dB_k and its row sums, dL and M, and dk's dM terms.
"""

from __future__ import annotations

import jax.numpy as jnp
import jax.experimental.pallas.mosaic_gpu as plgpu

from .tiles import F32, WGMMA, matmul, matmuls


def dbk_term(dbv, st, k_s, vectors, ck):
  """`dB_k = X^T dW = -dB_v S^T` (`dbv`: dB_v staged in shared memory) and `r = e^G rowsum(dB_k k)`,
  which dG (times beta) and dbeta take; dk takes `dB_k beta e^G`."""
  dBk = -matmul(dbv, st, ck)
  beta, e_q, _ = vectors()
  r = e_q * jnp.sum(dBk * plgpu.load(k_s, layout=WGMMA).astype(F32), axis=1)
  return dBk, beta, e_q, r


def dl_and_m(x_s, dx, k_s, tmp, decay, dtype, sq):
  """`dL = -X^T dX X^T` (X^T dX staged in `tmp`) and `M = (k k^T) D_excl`."""
  tmp[...] = matmul(x_s.T, dx, sq).astype(dtype)
  plgpu.commit_smem()
  kk, dL = matmuls((sq, [(k_s, k_s.T)]), (sq, [(tmp, x_s.T)]))
  return -dL, kk * decay(True, True)


def dm_k(dM, a, k_s, decay, dtype, ck):
  """dk's `(dM D_excl) k + (dM D_excl)^T k`, with `dM D_excl` staged in `a`."""
  a[...] = (dM * decay(True, True)).astype(dtype)
  plgpu.commit_smem()
  (dMk,) = matmuls((ck, [(a, k_s), (a.T, k_s)]))
  return dMk
