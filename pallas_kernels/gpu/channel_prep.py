"""Per-channel decay (gla, kda): the per-chunk tensors in one Mosaic GPU kernel, every chunk in parallel,
packed or not.

One program per (batch, value head, chunk) reads q, k, v, beta and the chunk-local cumulative
log-decay G `[C, K]` once and writes the walk's inputs (`prep.ChunkTensors`, module docstring of prep.py)
in the operand dtype: `qg = q e^G`, `kd = k e^(G_C - G)`, `P` (the decayed gram of q and k, j <= i)
and, for the delta family (kda), `w = X (beta k e^G)`, `u = X (beta v)` with `X = (I + L)^-1`,
`L = Diag(beta) M`, `M` the strict decayed gram of k.

The decayed gram `M_ij = sum_c a_ic b_jc e^(G_ic - G_jc)` must not form `e^G` and `e^-G` apart (at
g = -20 a token the second overflows after five tokens). prep.decayed_gram builds it like a merge
sort: pairing the diagonal blocks of s tokens, the new lower-left block is
`(a_later e^(G_later - G_r)) (b_earlier e^(G_r - G_earlier))^T`, r the earlier block's last token, so
both exponents are <= 0. Here every level is one whole-tile product: with
`ref(i) = (i // 2s) 2s + s - 1` (the reference token of i's 2s block),

    A_s = a e^(G - G[ref])  on rows with bit s set (the later half of their 2s block), else 0
    B_s = b e^(G[ref] - G)  on rows with bit s clear, else 0
    M  += (A_s B_s^T) * [(i XOR j) in [s, 2s)]          s = 1, 2, ..., C / 2

(the mask keeps pairs of one 2s block; `i XOR j` in `[s, 2s)` with A_s, B_s's rows says i is in the later
half, j in the earlier). `G[ref]` is a row gather, done on the tensor cores: a 0/1 selection matrix
times G split into two float16 pieces (`G = hi + lo`, 22 bits: an error of |G| 2^-22 in the exponent,
against the operands' 2^-8), exact in the float32 accumulator. Every exponent is <= 0, so nothing
overflows at any decay strength. The inclusive gram adds `rowsum(q * k)` on its diagonal.
The backward is unchanged (prep.py's vjp recomputes in XLA).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import prep
from pallas_kernels.gpu.delta_prep import unit_lower_inverse
from pallas_kernels.gpu.fused import ROWS, SEG_ROWS, _segment_masks, segment_vectors
from pallas_kernels.gpu.walk import F32, WGMMA, _vary_like, matmul, matmuls, smem

F16 = jnp.float16


def serves(g, beta, segment_ids) -> bool:
  """True for the calls this kernel prepares: per-channel decay `[B, T, H_v, K]`, either family."""
  del beta, segment_ids  # both families; packed rows are served (`fused.segment_vectors`)
  return g is not None and g.ndim == 4


def local_cumsum(g, B: int, T_pad: int, Hv: int, C: int):
  """`[B, H_v, T_pad, K]` float32: the cumulative log-decay of every channel from its chunk's start."""
  K = g.shape[-1]
  g = jnp.pad(g.astype(F32), [(0, 0), (0, T_pad - g.shape[1]), (0, 0), (0, 0)])
  g = jnp.swapaxes(g, 1, 2).reshape(B, Hv, T_pad // C, C, K)
  return jnp.cumsum(g, axis=3).reshape(B, Hv, T_pad, K)


def prepare(q, k, v, g, beta, *, chunk_size: int, dtype, segment_ids=None, interpret=None,
            chunk_multiple: int = 1):
  """`prep.prepare(q, k, v, g, beta, segment_ids, ...)` for per-channel `g: [B, T, H_v, K]`, with every
  matmul operand in `dtype` (16-bit), the tensors in `dtype` and `decay` float32; shapes as there
  (`[B, H_v, NC, C, ...]`); beta None (gla) or `[B, T, H_v]` (kda). chunk_multiple: T is padded to
  whole groups of this many chunks (as in prep.py)."""
  B, T, H, K = q.shape
  Hv, V = v.shape[2:]
  C = chunk_size
  T_pad = prep.padded_length(T, C, chunk_multiple)
  NC = T_pad // C
  group = Hv // H
  delta = beta is not None
  pad = lambda x: jnp.pad(x.astype(dtype), [(0, 0), (0, T_pad - T), (0, 0), (0, 0)])
  q, k, v = pad(q), pad(k), pad(v)
  G = local_cumsum(g, B, T_pad, Hv, C)
  G_hi = G.astype(F16)
  G_lo = (G - G_hi.astype(F32)).astype(F16)
  b = (jnp.swapaxes(jnp.pad(beta.astype(F32), [(0, 0), (0, T_pad - T), (0, 0)]), 1, 2) if delta
       else None)
  has_seg = segment_ids is not None
  masks = segment_vectors(segment_ids, C, T_pad) if has_seg else None
  levels = []
  s = 1
  while s < C:
    levels.append(s)
    s *= 2

  scratch = dict(
      q_s=smem((C, K), dtype), k_s=smem((C, K), dtype), v_s=smem((C, V), dtype),
      gh_s=smem((C, K), F16), gl_s=smem((C, K), F16), sel_s=smem((C, C), F16),
      a_s=smem((C, K), dtype), bk_s=smem((C, K), dtype), p_s=smem((C, C), dtype),
      out_v=smem((C, V), dtype),
      bar=plgpu.Barrier(num_arrivals=5 + delta + SEG_ROWS * has_seg))
  if delta:
    scratch.update(ak_s=smem((C, K), dtype), b_s=plgpu.SMEM((C,), F32), x_s=smem((C, C), dtype),
                   e_s=smem((C, C), dtype), y_s=smem((C, C), dtype), l_s=smem((C, C), dtype))
  if has_seg:
    scratch["m_s"] = plgpu.SMEM((SEG_ROWS, C), F32)

  def body(*refs, q_s, k_s, v_s, gh_s, gl_s, sel_s, a_s, bk_s, p_s, out_v, bar, ak_s=None, b_s=None,
           x_s=None, e_s=None, y_s=None, l_s=None, m_s=None):
    q_r, k_r, v_r, gh_r, gl_r = refs[:5]
    rest = list(refs[5:])
    b_r = rest.pop(0) if delta else None
    m_r = rest.pop(0) if has_seg else None
    qg_r, kd_r, p_r = rest[:3]
    w_r, u_r = rest[3:5] if delta else (None, None)
    bi, h, n = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
    hk = lax.div(h, group)
    rows_t = pl.ds(n * C, C)
    copies = [(q_r.at[bi, rows_t, hk], q_s), (k_r.at[bi, rows_t, hk], k_s), (v_r.at[bi, rows_t, h], v_s),
              (gh_r.at[bi, h, rows_t], gh_s), (gl_r.at[bi, h, rows_t], gl_s)]
    if delta:
      copies.append((b_r.at[bi, h, rows_t], b_s))
    copies += [(m_r.at[bi, r, rows_t], m_s.at[r]) for r in range(SEG_ROWS if has_seg else 0)]
    for src, dst in copies:
      plgpu.copy_gmem_to_smem(src, dst, bar)
    plgpu.barrier_wait(bar)

    rows = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])
    sq, ck, cv = (C, C), (C, K), (C, V)
    load = lambda ref: plgpu.load(ref, layout=WGMMA).astype(F32)
    fresh = lax.optimization_barrier
    load_G = lambda: fresh(load(gh_s) + load(gl_s))
    i_sq = plgpu.broadcasted_iota(jnp.int32, sq, 0, layout=WGMMA)
    j_sq = plgpu.broadcasted_iota(jnp.int32, sq, 1, layout=WGMMA)
    i_ck = lambda: fresh(plgpu.broadcasted_iota(jnp.int32, ck, 0, layout=WGMMA))

    # the decayed grams, one whole-tile product per level (module docstring)
    P = jnp.where(i_sq == j_sq, rows(jnp.sum(load(q_s) * load(k_s), axis=1), sq), 0.0)
    M = jnp.zeros(sq, F32) if delta else None
    for s in levels:
      sel_s[...] = jnp.where(j_sq == (i_sq & ~(2 * s - 1)) + (s - 1), 1.0, 0.0).astype(F16)
      plgpu.commit_smem()
      (G_ref,) = matmuls((ck, [(sel_s, gh_s), (sel_s, gl_s)]))
      later = (i_ck() & s) != 0
      G = load_G()
      E = jnp.exp(jnp.where(later, G - G_ref, G_ref - G))   # every exponent <= 0
      kt = load(k_s)
      bk_s[...] = jnp.where(later, 0.0, kt * E).astype(dtype)
      if delta:
        ak_s[...] = jnp.where(later, kt * E, 0.0).astype(dtype)
      a_s[...] = jnp.where(later, load(q_s) * E, 0.0).astype(dtype)
      plgpu.commit_smem()
      inside = ((i_sq ^ j_sq) >= s) & ((i_sq ^ j_sq) < 2 * s)
      if delta:
        Pq, Mk = matmuls((sq, [(a_s, bk_s.T)]), (sq, [(ak_s, bk_s.T)]))
        M = M + jnp.where(inside, Mk, 0.0)
      else:
        (Pq,) = matmuls((sq, [(a_s, bk_s.T)]))
      P = P + jnp.where(inside, Pq, 0.0)

    same = carry = to_last = None
    if has_seg:
      same, carry, to_last, _ = _segment_masks(m_s, None, C)
    keep = (i_sq >= j_sq) if same is None else (i_sq >= j_sq) & same
    p_s[...] = jnp.where(keep, P, 0.0).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(p_s, p_r.at[bi, h, rows_t])

    def emit(x, tile, dst):
      """Stages the float32 tile `x` in the operand dtype and copies it to `dst`."""
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      tile[...] = x.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(tile, dst)

    # qg = q e^G (rows reading the carried state); kd = k e^(G_C - G) (rows whose write reaches the
    # chunk's end), G_C gathered like G[ref]
    e_q = jnp.exp(load_G())
    if carry is not None:
      e_q = e_q * rows(carry, ck)
    emit(load(q_s) * e_q, a_s, qg_r.at[bi, h, rows_t])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    sel_s[...] = jnp.where(j_sq == C - 1, 1.0, 0.0).astype(F16)
    plgpu.commit_smem()
    (G_C,) = matmuls((ck, [(sel_s, gh_s), (sel_s, gl_s)]))
    e_k = jnp.exp(G_C - load_G())
    if to_last is not None:
      e_k = e_k * rows(to_last, ck)
    emit(load(k_s) * e_k, bk_s, kd_r.at[bi, h, rows_t])
    if not delta:
      plgpu.wait_smem_to_gmem(0)
      return

    # kda: L = Diag(beta) M (strict, one run), X = (I + L)^-1 by block doubling (delta_prep.py)
    beta_rows = lambda: fresh(plgpu.load(b_s, layout=ROWS))
    keep = (i_sq > j_sq) if same is None else (i_sq > j_sq) & same
    l_s[...] = (jnp.where(keep, M, 0.0) * rows(beta_rows(), sq)).astype(dtype)
    plgpu.commit_smem()
    unit_lower_inverse(l_s, x_s, e_s, y_s)
    # beta k e^G and beta v replace k and v (their other uses are done); w = X (beta k e^G), u = X (beta v)
    e_q = jnp.exp(load_G())
    if carry is not None:
      e_q = e_q * rows(carry, ck)
    k_s[...] = (load(k_s) * e_q * rows(beta_rows(), ck)).astype(dtype)
    v_s[...] = (load(v_s) * rows(beta_rows(), cv)).astype(dtype)
    plgpu.commit_smem()
    emit(matmul(x_s, k_s, ck), a_s, w_r.at[bi, h, rows_t])
    emit(matmul(x_s, v_s, cv), out_v, u_r.at[bi, h, rows_t])
    plgpu.wait_smem_to_gmem(0)

  args = (q, k, v, G_hi, G_lo) + ((b,) if delta else ()) + ((masks,) if has_seg else ())
  shape = lambda d: jax.ShapeDtypeStruct((B, Hv, T_pad, d), dtype)
  out_type = (shape(K), shape(K), shape(C)) + ((shape(K), shape(V)) if delta else ())
  outs = plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=(B, Hv, NC), grid_names=("b", "h", "n"),
      compiler_params=plgpu.CompilerParams(approx_math=True), interpret=interpret,
      kernel_name="chunk_prep_channel")(*args)
  outs = [x.reshape(B, Hv, NC, C, x.shape[-1]) for x in _vary_like(outs, args)]
  qg, kd, p = outs[:3]
  G_last = G.reshape(B, Hv, NC, C, K)[:, :, :, -1]
  decay = jnp.exp(G_last)
  if has_seg:
    carry_last = masks[:, 2].reshape(B, NC, C)[..., -1]
    decay = decay * carry_last[:, None, :, None]
  if delta:
    w, u = outs[3:]
  else:
    w, u = None, prep.to_chunks(v, C, T_pad)
  return prep.ChunkTensors(qg=qg, kd=kd, w=w, u=u, p=p, decay=decay)
