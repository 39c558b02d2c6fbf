"""Per-channel decay, delta family (kda): every chunk's gradients in two Mosaic GPU kernels, every chunk in
parallel, from what the forward kept (the prepared tensors, `X = (I + L)^-1`, the state entering each
chunk) and the gradient of the state leaving each chunk (the reverse walk).

Per chunk (prep.py's and channel_grads.py's notation; `G [C, K]` the chunk-local cumulative log-decay,
`R` the chunk's per-channel reference, `E = e^G`, `Ec = e^(G_C - G)`; packed rows multiply E by
`carry`, Ec by `to_last`, e^(G_C) by the last token's carry, and mask the grams to one run):

    B_k = beta k E,  B_v = beta v,  W = X B_k,  U = X B_v,  u = U - W S = X (B_v - B_k S)
    P = tril(Qr Kr^T),  M = strict(Ar Kr^T),  Qr = q e^(G - R),  Kr = k e^(R - G),  Ar = k e^(G - R)
    L = Diag(beta) M,   o = (q E) S + P u,   S' = Diag(e^(G_C)) S + (k Ec)^T u

so, with `dS` the gradient of S' and `do` that of the unscaled o:

    value side (`value_side`, full-width tiles):
      dP = tril(do u^T)     du = P^T do + kd dS     dr = X^T du     dL = -strict(dr u^T)
      dv = beta dr          dM = Diag(beta) dL      dbeta = rowsum(dr v) + rowsum(dL M) + ...
    key side (`key_side`, key channels in halves of 64):
      dB_k = -dr S^T
      dq = E (do S^T) + e^(G - R) (dP Kr)
      dk = [Ec (u dS^T) + e^(R - G) (dP^T Qr + dM^T Ar)]  +  [beta E dB_k + e^(G - R) (dM Kr)]
                     (k's factors e^-G: "minus")                 (k's factors e^+G: "plus")
      dbeta += rowsum(dB_k k E)
      dG = q dq + k (plus - minus),  and the last token also takes
           colsum(kd (u dS^T)) + e^(G_C) colsum(S dS)

(`dL = -X^T (du r^T) X^T = -(X^T du)(X r)^T = -dr u^T`: one product.) dg is dG's reverse cumsum within
the chunk: with bfloat16 operands the key side takes it at the end of its program (`U dG` on the
tensor cores), else XLA after it. The value side writes u, dr, dP and dM (16-bit) for the key side: two
kernels, because one program holding both sides' tiles needs more than the 227 KB of shared memory. M
is the preparation kernel's (`channel_prep.prepare(..., with_inverse=True)`, saved by the forward): the
value side reads it for dbeta, and no program forms it again (NOTES.md v52).

Like channel_grads.py, a call where some chunk's decay does not fit the one-reference bound takes the
8-token groups' products in the key side (`grams="groups"`, groups.py); the value side has no decayed
gram. With `qk_l2norm` the key side normalises the q, k it loads (as the preparation kernel did) and
XLA takes the norm's backward after it; the value side reads neither. The final state's cotangent reaches
the last chunk's inputs in float32 (`channel.add_final_state_grads`; the kernels' dS there is zero).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from .. import common, prep
from . import channel, channel_delta_keys, groups, walk
from . import l2_grads as l2_kernel
from .channel import HALF, fits, key_grads
from .masks import SEG_ROWS, segment_masks, segment_vectors
from .once import lowered_once
from .tiles import (COLS, F32, ROWS, WGMMA, compiler_params, flat, l2_normalize_halves, matmul, matmuls,
                    phase, reverse_cumsum_rows, smem, upper_ones, vary_like)


def serves(g, beta, segment_ids) -> bool:
  """True for the calls these kernels take the gradients of: delta family, per-channel decay."""
  del segment_ids   # packed rows are served (`segment_vectors`)
  return beta is not None and g is not None and g.ndim == 4


class Saved(NamedTuple):
  """What kda's differentiated forward keeps for `backward`."""

  t: prep.ChunkTensors         # the prepared tensors (qg, kd, w, u = X B_v, p, decay), [B, H_v, NC, ...]
  X: jax.Array                 # [B, H_v, NC, C, C], (I + L)^-1 in the operand dtype
  states: jax.Array            # [B, H_v, NC, V, K], the state entering every chunk (transposed)
  transitions: Any             # the sequence pieces' A (`walk.forward(..., return_transitions=True)`)
  G: jax.Array                 # channel.chunk_cumsum(g, T_pad, C)
  refs: jax.Array
  M: jax.Array                 # [B, H_v, NC, C, C], the strict decayed gram of k (channel_prep's)
  last_start: Any = None       # [B, H_v, V, K] float32, the state entering the last chunk (transposed)


def _masks_of(m_s, C):
  """(same-run [C, C] or None, carry, to_last, carry of the last token) of this chunk."""
  if m_s is None:
    return None, None, None, 1.0
  return segment_masks(m_s, None, C)


@lowered_once(arrays=("masks",))
def value_side(t: prep.ChunkTensors, X, M, states, dstates, do, v, b, *, dtype, masks=None, interpret=None,
               key_products: bool = False):
  """The value side of every chunk (module docstring), one program per chunk of one value head.

  Args: t the forward's prepared tensors, X and M `[B, H_v, NC, C, C]` (`Saved`), states, dstates `[B, H_v, NC, V, K]`
    (transposed), do `[B, T_pad, H_v, V]` (the unscaled o's cotangent, in o's token layout), v
    `[B, T_pad, H_v, V]`, b
    `[B, H_v, T_pad]` float32 (beta), all 16-bit but b; masks None or `segment_vectors(...)`.
  Returns: u, dr `[B, H_v, T_pad, V]`, dP, dM `[B, H_v, T_pad, C]` (masked) in `dtype`; dv
    `[B, T_pad, H_v, V]` in `dtype`; `rowsum(dr v) + rowsum(dL M)` `[B, H_v, T_pad]` float32.
  key_products: instead of u and dr, the key side's three products without a decayed gram, formed here
    where their operands are (`channel_delta_keys`): `do S^T`, `u dS^T`, `dr S^T` `[B, H_v, T_pad, K]`
    in `dtype`, and `colsum(S dS)` `[B, H_v, NC, K / 64, 64]` float32, then dP, dM, dv and the vector.
  """
  B, Hv, NC, C, K = t.qg.shape
  V = v.shape[-1]
  T_pad = NC * C
  has_seg = masks is not None
  scratch = dict(
      w_s=smem((C, K), dtype), u_s=smem((C, V), dtype), st_s=smem((V, K), dtype), p_s=smem((C, C), dtype),
      do_s=smem((C, V), dtype), kd_s=smem((C, K), dtype), dst_s=smem((V, K), dtype),
      x_s=smem((C, C), dtype), v_s=smem((C, V), dtype), du_s=smem((C, V), dtype),
      dp_s=smem((C, C), dtype), dm_s=smem((C, C), dtype), m_gram=smem((C, C), dtype),
      b_s=plgpu.SMEM((C,), F32), vec_s=plgpu.SMEM((C,), F32),
      bar=plgpu.Barrier(num_arrivals=11 + SEG_ROWS * has_seg))
  if has_seg:
    scratch["m_s"] = plgpu.SMEM((SEG_ROWS, C), F32)
  if key_products:
    if K % HALF:
      raise ValueError(f"key_products takes K a multiple of {HALF}; got {K}")
    scratch["sds_s"] = plgpu.SMEM((K // HALF, HALF), F32)

  def body(*refs_, w_s, u_s, st_s, p_s, do_s, kd_s, dst_s, x_s, v_s, du_s, dp_s, dm_s, m_gram, b_s, vec_s,
           bar, m_s=None, sds_s=None):
    w_r, U_r, st_r, p_r, do_r, kd_r, dst_r, x_r, v_r, b_r, gram_r = refs_[:11]
    m_r = refs_[11] if has_seg else None
    if key_products:
      dqg_r, dkd_r, dbk_r, sds_r, dp_r, dm_r, dv_r, db_r = refs_[11 + has_seg:]
      u_r = dr_r = None
    else:
      u_r, dr_r, dp_r, dm_r, dv_r, db_r = refs_[11 + has_seg:]
    bi, h, n = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
    rows_t = pl.ds(n * C, C)
    copies = [(w_r.at[bi, h, rows_t], w_s), (U_r.at[bi, h, rows_t], u_s), (st_r.at[bi, h, n], st_s),
              (p_r.at[bi, h, rows_t], p_s), (do_r.at[bi, rows_t, h], do_s), (kd_r.at[bi, h, rows_t], kd_s),
              (dst_r.at[bi, h, n], dst_s), (x_r.at[bi, h, rows_t], x_s), (v_r.at[bi, rows_t, h], v_s),
              (b_r.at[bi, h, rows_t], b_s), (gram_r.at[bi, h, rows_t], m_gram)]
    copies += [(m_r.at[bi, j, rows_t], m_s.at[j]) for j in range(SEG_ROWS if has_seg else 0)]
    for src, dst in copies:
      plgpu.copy_gmem_to_smem(src, dst, bar)
    plgpu.barrier_wait(bar)

    sq, cv = (C, C), (C, V)
    load = lambda ref: plgpu.load(ref, layout=WGMMA).astype(F32)
    rows = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])
    i_sq = plgpu.broadcasted_iota(jnp.int32, sq, 0, layout=WGMMA)
    j_sq = plgpu.broadcasted_iota(jnp.int32, sq, 1, layout=WGMMA)
    same = _masks_of(m_s, C)[0]
    lower, strict = i_sq >= j_sq, i_sq > j_sq
    if same is not None:
      lower, strict = lower & same, strict & same

    # u = U - W S (as the forward walk formed it), in u's tile
    u_s[...] = (load(u_s) - matmul(w_s, st_s.T, cv)).astype(dtype)
    plgpu.commit_smem()
    if not key_products:
      plgpu.copy_smem_to_gmem(u_s, u_r.at[bi, h, rows_t])
    # dP = tril(do u^T); du = P^T do + kd dS (issued together)
    dP, du = matmuls((sq, [(do_s, u_s.T)]), (cv, [(p_s.T, do_s), (kd_s, dst_s.T)]))
    dp_s[...] = jnp.where(lower, dP, 0.0).astype(dtype)
    du_s[...] = du.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dp_s, dp_r.at[bi, h, rows_t])
    # dr = X^T du; dv = beta dr; rowsum(dr v) for dbeta
    dr = matmul(x_s.T, du_s, cv)
    beta = plgpu.load(b_s, layout=ROWS)
    dbeta = jnp.sum(dr * load(v_s), axis=1)
    du_s[...] = dr.astype(dtype)                 # du's tile now holds dr
    v_s[...] = (dr * rows(beta, cv)).astype(dtype)   # and v's, dv
    plgpu.commit_smem()
    if not key_products:
      plgpu.copy_smem_to_gmem(du_s, dr_r.at[bi, h, rows_t])
    plgpu.copy_smem_to_gmem(v_s, dv_r.at[bi, rows_t, h])
    # dL = -strict(dr u^T); dbeta's rowsum(dL M) (M strict and one run, as saved); dM = Diag(beta) dL
    dL = jnp.where(strict, -matmul(du_s, u_s.T, sq), 0.0)
    vec_s[...] = dbeta + jnp.sum(dL * load(m_gram), axis=1)
    dm_s[...] = (dL * rows(beta, sq)).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(vec_s, db_r.at[bi, h, rows_t])
    plgpu.copy_smem_to_gmem(dm_s, dm_r.at[bi, h, rows_t])
    if key_products:
      # do S^T, u dS^T (W's and kd's tiles are free), then dr S^T in W's once its copy has read it;
      # colsum(S dS) a half of the key channels at a time
      dqg, dkd = matmuls(((C, K), [(do_s, st_s)]), ((C, K), [(u_s, dst_s)]))
      w_s[...] = dqg.astype(dtype)
      kd_s[...] = dkd.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(w_s, dqg_r.at[bi, h, rows_t])
      plgpu.copy_smem_to_gmem(kd_s, dkd_r.at[bi, h, rows_t])
      dbk = matmul(du_s, st_s, (C, K))
      for i in range(K // HALF):
        half = pl.ds(i * HALF, HALF)
        sds_s.at[i][...] = jnp.sum(load(st_s.at[:, half]) * load(dst_s.at[:, half]), axis=0)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      w_s[...] = dbk.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(w_s, dbk_r.at[bi, h, rows_t])
      plgpu.copy_smem_to_gmem(sds_s, sds_r.at[bi, h, n])
    plgpu.wait_smem_to_gmem(0)

  args = [flat(t.w), flat(t.u), states, flat(t.p), do, flat(t.kd), dstates, flat(X), v, b, flat(M)]
  args = [x.astype(dtype) if i != 9 else x for i, x in enumerate(args)] + ([masks] if has_seg else [])
  by_head = lambda d: jax.ShapeDtypeStruct((B, Hv, T_pad, d), dtype)
  first = ((by_head(K),) * 3 + (jax.ShapeDtypeStruct((B, Hv, NC, K // HALF, HALF), F32),) if key_products
           else (by_head(V), by_head(V)))
  out_type = first + (by_head(C), by_head(C), jax.ShapeDtypeStruct((B, T_pad, Hv, V), dtype),
                      jax.ShapeDtypeStruct((B, Hv, T_pad), F32))
  outs = plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=(B, Hv, NC), grid_names=("b", "h", "n"),
      compiler_params=compiler_params(approx_math=True), interpret=interpret,
      kernel_name="chunk_grads_channel_delta_v")(*args)
  return vary_like(outs, args)


@lowered_once(arrays=("masks",))
def key_side(q, k, G, refs, b, do, u, dr, dP, dM, states, dstates, *, dtype, masks=None, interpret=None,
             grams: str = "one", unit_bound: bool = False, qk_l2norm: bool = False,
             reverse_cumsum: bool = False):
  """The key side of every chunk (module docstring), one program per chunk of one value head.

  Args: q, k `[B, T_pad, H, K]`; G, refs as `channel.chunk_cumsum` returns them; b `[B, H_v,
    T_pad]` float32; do `[B, T_pad, H_v, V]` (o's token layout), u, dr `[B, H_v, T_pad, V]`, dP, dM `[B, H_v, T_pad, C]` (value_side's);
    states, dstates `[B, H_v, NC, V, K]` (transposed); masks None or `segment_vectors(...)`.
  Returns: dq, dk `[B, T_pad, H_v, K]` (per value head) in `dtype`; dG `[B, T_pad, H_v, K]` float32
    with the last token's terms added; `rowsum(dB_k k E)` `[B, H_v, T_pad]` float32.
  grams: "one" (the module docstring's one reference), "groups" (groups.py's products, for chunks
    beyond the one-reference bound: every gram term is their sum, each product's factors about its own
    references, dP and dM kept on each product's entries in turn), "halves" (the same with 32-token
    diagonal blocks) or "chunk" (each half of a chunk's key channels the first of one, halves, groups
    that fits its channels, `channel.chunk_forms(..., width=HALF)`: a `lax.cond` in the kernel on
    `channel.form_tokens`; a chunk whose strong channels lie in one half takes one reference in the
    other).
  unit_bound: q and k are l2-normalised (entries within [-1, 1]): with `grams="chunk"`, a chunk takes one
    reference up to its own bound from its cotangents (`channel.cotangent_bound`, at most
    `prep.UNIT_REF_BOUND`) instead of `prep.ref_bound(dtype)`.
  qk_l2norm: q and k are l2-normalised as they load (their halves' norm over all K, as the forward's
    `channel_prep.prepare(..., qk_l2norm=True)`), and dq, dk are the gradients of the normalised q, k
    (the caller applies the norm's backward).
  reverse_cumsum: return dG's reverse cumsum within each chunk (dg before the floor's mask) instead of
    dG, formed at the end of the program as `U dG` (U the `[C, C]` upper triangle of ones) on the
    tensor cores, dG split into three bfloat16 tiles whose sum is dG to float32's precision (bfloat16
    operands only: float16's range does not hold dG).
  """
  if grams not in ("one", "halves", "groups", "chunk"):
    raise ValueError(f"grams must be 'one', 'halves', 'groups' or 'chunk'; got {grams!r}")
  if reverse_cumsum and jnp.dtype(dtype) != jnp.bfloat16:
    raise ValueError(f"reverse_cumsum splits dG into bfloat16 tiles: dtype must be bfloat16; got "
                     f"{jnp.dtype(dtype).name}")
  B, T_pad, H, K = q.shape
  Hv, NC = states.shape[1], states.shape[2]
  V = states.shape[3]
  C = T_pad // NC
  group = Hv // H
  if K % HALF:
    raise ValueError(f"K must be a multiple of {HALF}; got {K}")
  KH = K // HALF
  chunkwise = grams == "chunk"
  unit = unit_bound and chunkwise
  # the clamp of the one-reference factors: no chunk that takes that form reaches it
  bound = prep.ref_bound(dtype, unit=unit)
  if grams != "one" and C != HALF:
    raise ValueError(f"the group form stages dP and dM in a [C, {HALF}] tile: C must be {HALF}; got {C}")
  has_seg = masks is not None
  halves = lambda rows: smem((KH, rows, HALF), dtype)
  scratch = dict(
      q_s=halves(C), k_s=halves(C), st_s=halves(V), dst_s=halves(V), g_s=smem((KH, C, HALF), F32),
      do_s=smem((C, V), dtype), u_s=smem((C, V), dtype), dr_s=smem((C, V), dtype),
      dp_s=smem((C, C), dtype), dm_s=smem((C, C), dtype), qr_s=smem((C, HALF), dtype),
      kr_s=smem((C, HALF), dtype), ar_s=smem((C, HALF), dtype), r_s=plgpu.SMEM((refs.shape[2], K), F32),
      b_s=plgpu.SMEM((C,), F32), vec_s=plgpu.SMEM((C,), F32),
      bar=plgpu.Barrier(num_arrivals=5 * KH + 7 + SEG_ROWS * has_seg + chunkwise))
  if has_seg:
    scratch["m_s"] = plgpu.SMEM((SEG_ROWS, C), F32)

  def body(*refs_, q_s, k_s, st_s, dst_s, g_s, do_s, u_s, dr_s, dp_s, dm_s, qr_s, kr_s, ar_s, r_s, b_s,
           vec_s, bar, m_s=None):
    q_r, k_r, g_r, ref_r, b_r, do_r, u_r, dr_r, dp_r, dm_r, st_r, dst_r = refs_[:12]
    m_r = refs_[12] if has_seg else None
    fit_r = refs_[12 + has_seg] if chunkwise else None
    dq_r, dk_r, dg_r, db_r = refs_[12 + has_seg + chunkwise:]
    bi, h, n = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
    hk = lax.div(h, group)
    rows_t = pl.ds(n * C, C)
    cols = lambda i: pl.ds(i * HALF, HALF)
    copies = [(do_r.at[bi, rows_t, h], do_s), (u_r.at[bi, h, rows_t], u_s), (dr_r.at[bi, h, rows_t], dr_s),
              (dp_r.at[bi, h, rows_t], dp_s), (dm_r.at[bi, h, rows_t], dm_s), (ref_r.at[bi, n, :, h], r_s),
              (b_r.at[bi, h, rows_t], b_s)]
    for i in range(KH):
      copies += [(q_r.at[bi, rows_t, hk, cols(i)], q_s.at[i]), (k_r.at[bi, rows_t, hk, cols(i)], k_s.at[i]),
                 (g_r.at[bi, rows_t, h, cols(i)], g_s.at[i]), (st_r.at[bi, h, n, :, cols(i)], st_s.at[i]),
                 (dst_r.at[bi, h, n, :, cols(i)], dst_s.at[i])]
    copies += [(m_r.at[bi, j, rows_t], m_s.at[j]) for j in range(SEG_ROWS if has_seg else 0)]
    if chunkwise:   # each half's form (`channel.form_tokens`), in dbeta's tile until dbeta is written
      copies.append((fit_r.at[bi, h, rows_t], vec_s))
    for src, dst in copies:   # one arrival each
      plgpu.copy_gmem_to_smem(src, dst, bar)
    with phase("keys.loads"):
      plgpu.barrier_wait(bar)
    if qk_l2norm:
      with phase("keys.l2"):
        l2_normalize_halves(q_s)
        l2_normalize_halves(k_s)

    ck = (C, HALF)
    rows = lambda x, shape=ck: lax.broadcast_in_dim(x, shape, [0])
    colv = lambda row, i: lax.broadcast_in_dim(plgpu.load(r_s.at[row, cols(i)], layout=COLS), ck, [1])
    load = lambda ref: plgpu.load(ref, layout=WGMMA).astype(F32)
    fresh = lax.optimization_barrier
    beta_rows = lambda: fresh(plgpu.load(b_s, layout=ROWS))
    clamp = lambda x: jnp.exp(jnp.minimum(x, bound))
    _, carry, to_last, carry_last = _masks_of(m_s, C)
    last_row = plgpu.broadcasted_iota(jnp.int32, ck, 0, layout=WGMMA) == C - 1

    gb = groups.group_bound(dtype)
    vec_end = lambda i: lambda t: colv(groups.FIRST_ROW + t, i)

    # "chunk": each half of the key channels its own form (`channel.chunk_forms(..., width=HALF)`),
    # the chunk's token i holding half i's (`channel.form_tokens`)
    forms = [vec_s[i] for i in range(KH)] if chunkwise else None
    blocks = {"halves": groups.HALVES, "groups": groups.GROUP}

    def by_form(i, one, grouped):
      if grams == "one":
        return one()
      if grams in blocks:
        return grouped(blocks[grams])
      return groups.by_form(forms[i], one, grouped)

    dbeta = 0.0   # the value side took rowsum(dL M)

    def one_terms(i):
      Gt, R = fresh(load(g_s.at[i])), colv(0, i)
      qt, kt = load(q_s.at[i]), load(k_s.at[i])
      up = clamp(Gt - R)
      qr_s[...] = (qt * up).astype(dtype)
      ar_s[...] = (kt * up).astype(dtype)
      kr_s[...] = (kt * clamp(R - Gt)).astype(dtype)
      plgpu.commit_smem()
      # dq = E (do S^T) + e^(G - R) (dP Kr)
      dqg, dPK = matmuls((ck, [(do_s, st_s.at[i])]), (ck, [(dp_s, kr_s)]))
      # k's terms: dkd = u dS^T, dB_k = -dr S^T, and the grams' (issued together)
      dkd, dBk, minus, plus = matmuls((ck, [(u_s, dst_s.at[i])]), (ck, [(dr_s, st_s.at[i])]),
                                      (ck, [(dp_s.T, qr_s), (dm_s.T, ar_s)]), (ck, [(dm_s, kr_s)]))
      return dqg, dkd, dBk, clamp(Gt - R) * dPK, clamp(R - Gt) * minus, clamp(Gt - R) * plus

    def group_terms(i, block):   # the grams' terms product by product: dP, then dM, on its entries
      # dP's own diagonal in float32 (groups.py); dM has none
      d = rows(groups.diagonal_of(load(dp_s)))
      dq_p, minus, plus = d * load(k_s.at[i]), d * load(q_s.at[i]), 0.0
      for s in groups.products(C, block):
        if s is None:   # the diagonal blocks: both factors on the same rows
          up, down = groups.factors(fresh(load(g_s.at[i])), vec_end(i), s, gb, block)
        else:   # a level: one tile (`groups.level_factor`); k E is Kr on earlier rows, Ar on later ones
          up = down = groups.level_factor(fresh(load(g_s.at[i])), vec_end(i), s)
        kr_s[...] = (load(k_s.at[i]) * down).astype(dtype)
        qr_s[...] = (load(q_s.at[i]) * up).astype(dtype)
        ar_s[...] = jnp.where(groups.keep_mask(C, s, block), load(dp_s), 0.0).astype(dtype)
        plgpu.commit_smem()
        dPK, dPQ = matmuls((ck, [(ar_s, kr_s)]), (ck, [(ar_s.T, qr_s)]))
        # each product's terms summed as soon as they land: fewer [C, 64] tiles live at once
        dq_p, minus = dq_p + up * dPK, minus + down * dPQ
        if s is None:
          qr_s[...] = (load(k_s.at[i]) * up).astype(dtype)   # Ar
        ar_s[...] = jnp.where(groups.keep_mask(C, s, block), load(dm_s), 0.0).astype(dtype)
        plgpu.commit_smem()
        dMK, dMA = matmuls((ck, [(ar_s, kr_s)]), (ck, [(ar_s.T, qr_s if s is None else kr_s)]))
        minus, plus = minus + down * dMA, plus + up * dMK
      # the products without a decayed gram after the grams' loop, so their tiles are not live through it
      dqg, dkd, dBk = matmuls((ck, [(do_s, st_s.at[i])]), (ck, [(u_s, dst_s.at[i])]),
                              (ck, [(dr_s, st_s.at[i])]))
      return dqg, dkd, dBk, dq_p, minus, plus

    for i in range(KH):
      with phase(f"keys.terms_{i}"):
        dqg, dkd, dBk, dq_p, minus, plus = by_form(i, lambda: one_terms(i), lambda b: group_terms(i, b))
      with phase(f"keys.dq_{i}"):
        Gt = fresh(load(g_s.at[i]))
        qt = load(q_s.at[i])
        e_q = jnp.exp(Gt)
        if carry is not None:
          e_q = e_q * rows(carry)
        dq = e_q * dqg + dq_p
        dG = qt * dq
        q_s.at[i][...] = dq.astype(dtype)
      with phase(f"keys.dk_{i}"):   # each tile consumed where it is last read: fewer live at once
        Gt, Gc = fresh(load(g_s.at[i])), colv(1, i)
        kt = load(k_s.at[i])
        e_k = jnp.exp(Gc - Gt)
        if carry is not None:
          e_k = e_k * rows(to_last)
        kd_dkd = jnp.sum(kt * e_k * dkd, axis=0)   # the last token's colsum(kd (u dS^T))
        minus = e_k * dkd + minus
        e_q = jnp.exp(Gt)
        if carry is not None:
          e_q = e_q * rows(carry)
        dbeta = dbeta - jnp.sum(dBk * (kt * e_q), axis=1)   # kt e_q = B_k / beta
        plus = plus - rows(beta_rows()) * e_q * dBk
        dG = dG + kt * (plus - minus)
      with phase(f"keys.last_{i}"):
        # the last token: colsum(kd (u dS^T)) + e^(G_C) colsum(S dS), S and dS `[V, 64]` tiles
        s_ds = jnp.sum(load(st_s.at[i]) * load(dst_s.at[i]), axis=0)
        s_decay = plgpu.load(r_s.at[1, cols(i)], layout=COLS)
        term = kd_dkd + jnp.exp(s_decay) * carry_last * s_ds
        dG = dG + jnp.where(last_row, lax.broadcast_in_dim(term, ck, [1]), 0.0)
      with phase(f"keys.out_{i}"):
        k_s.at[i][...] = (plus + minus).astype(dtype)
        g_s.at[i][...] = dG
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_s.at[i], dq_r.at[bi, rows_t, h, cols(i)])
        plgpu.copy_smem_to_gmem(k_s.at[i], dk_r.at[bi, rows_t, h, cols(i)])
        if not reverse_cumsum:
          plgpu.copy_smem_to_gmem(g_s.at[i], dg_r.at[bi, rows_t, h, cols(i)])
    if reverse_cumsum:   # dg = U dG, U in dP's tile and dG's three parts in the grams' tiles (all free now)
      with phase("keys.dg"):
        upper_ones(dp_s)
        for i in range(KH):
          reverse_cumsum_rows(g_s.at[i], dp_s, (qr_s, kr_s, ar_s))
          plgpu.copy_smem_to_gmem(g_s.at[i], dg_r.at[bi, rows_t, h, cols(i)])
    vec_s[...] = dbeta
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(vec_s, db_r.at[bi, h, rows_t])
    with phase("keys.exit"):
      plgpu.wait_smem_to_gmem(0)

  args = [q.astype(dtype), k.astype(dtype), G, refs, b, do.astype(dtype), u, dr, dP, dM,
          states.astype(dtype), dstates.astype(dtype)] + ([masks] if has_seg else [])
  if chunkwise:
    args.append(channel.form_tokens(refs, C, dtype, channel.cotangent_bound(dP, dM, C) if unit else None,
                                    width=HALF))
  out_type = (jax.ShapeDtypeStruct((B, T_pad, Hv, K), dtype), jax.ShapeDtypeStruct((B, T_pad, Hv, K), dtype),
              jax.ShapeDtypeStruct((B, T_pad, Hv, K), F32), jax.ShapeDtypeStruct((B, Hv, T_pad), F32))
  outs = plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=(B, Hv, NC), grid_names=("b", "h", "n"),
      compiler_params=compiler_params(approx_math=True), interpret=interpret,
      kernel_name="chunk_grads_channel_delta_k" + ("" if grams == "one" else "_" + grams))(*args)
  return vary_like(outs, args)


def backward(q, k, v, g, beta, h0, do, dfinal, *, chunk_size: int, dtype, segment_ids=None,
             interpret=None, sequence_pieces=None, scale: float = 1.0, saved: Saved, grams: str = "one",
             unit_bound: bool = False, qk_l2norm: bool = False, dg_cumsum: str = "xla",
             key_warpgroups: int = 1, cumsums: str = "xla", gate=None, l2_grads: str | None = None):
  """`(dq, dk, dv, dg, dbeta, dh0)` of kda's prepared forward (`o` scaled by `scale`; in q, k, v, g,
  beta's dtypes, dh0 float32) for `do: [B, T, H_v, V]` and `dfinal` None or `[B, H_v, K, V]`, from what
  the forward `saved`: the reverse walk over the saved tensors, then `value_side` and `key_side`; dG's
  reverse cumsum within the chunks after them (`cumsums`: `cumsum.reverse`'s walk or XLA's product),
  or in `key_side` with `dg_cumsum="kernel"` (bfloat16 operands: `GpuConfig.dg_cumsum`); XLA masks dg below
  the gate's floor and, for grouped heads, adds the value heads' dq, dk.
  `grams`: `key_side`'s; the caller's `lax.cond` (`vjp.py`) takes "one" where every chunk's decay fits the
  one-reference bound, else "groups" (or XLA's vjp, for float16 beyond the groups' bound). `unit_bound`:
  `key_side`'s (q, k l2-normalised). `qk_l2norm`: the forward normalised q, k on load; the key side
  does too, and the norms' backward from its dq, dk and the raw q, k runs where `l2_grads` says
  (`GpuConfig.l2_grads`: "key_side", the two-warpgroup key side's epilogue; "kernel", `l2_grads.py`
  for 16-bit q, k, else XLA; "xla"; None or the plan's "none": "key_side" on two warpgroups, else
  "xla"). `key_warpgroups=2`
  (K = 128, `dg_cumsum="xla"`): the value side also forms the key side's products without a decayed
  gram, and `channel_delta_keys.key_side` takes the two halves of the key channels on two warpgroups.
  `gate` (a `gate.Gate`; g is its pre-activation f): the fourth is `(df, dA_log, ddt_bias)`
  (`channel.key_grads`)."""
  if key_warpgroups not in (1, 2):
    raise ValueError(f"key_warpgroups must be 1 or 2; got {key_warpgroups!r}")
  split = key_warpgroups == 2
  l2_grads = ("key_side" if split else "xla") if l2_grads in (None, "none") else l2_grads
  if l2_grads not in ("key_side", "kernel", "xla") or (l2_grads == "key_side" and qk_l2norm and not split):
    raise ValueError(f"l2_grads must be 'kernel', 'xla' or (on two warpgroups) 'key_side'; got {l2_grads!r} "
                     f"with key_warpgroups={key_warpgroups}")
  in_keys = qk_l2norm and l2_grads == "key_side"
  if split and (dg_cumsum != "xla" or not channel_delta_keys.serves(q.shape[-1])):
    raise ValueError(f"key_warpgroups=2 takes K = 128 and dg_cumsum='xla'; got K={q.shape[-1]}, "
                     f"dg_cumsum={dg_cumsum!r}")
  del h0   # the state entering each chunk is saved
  B, T, H, K = q.shape
  Hv, V = v.shape[2:]
  C = chunk_size
  NC = saved.states.shape[2]
  T_pad = NC * C
  G, refs = saved.G, saved.refs
  pad = lambda x: jnp.pad(x.astype(dtype), [(0, 0), (0, T_pad - T), (0, 0), (0, 0)])
  exact_last = saved.last_start is not None and dfinal is not None

  def kernels():
    # the cotangent of the unscaled o, rounded to the operand dtype (as the prepared path's), in o's
    # token layout: every kernel reads it there
    do_t = pad(do.astype(F32) * scale)
    dstates, dh0 = walk.backward_states(saved.t, do_t, dfinal, interpret=interpret,
                                        sequence_pieces=sequence_pieces, transitions=saved.transitions,
                                        token_do=True)
    masks = None if segment_ids is None else segment_vectors(segment_ids, C, T_pad)
    if exact_last:   # the final state's cotangent reaches the last chunk's inputs in float32 below
      dstates = dstates.at[:, :, -1].set(0)
    b = jnp.swapaxes(jnp.pad(beta.astype(F32), [(0, 0), (0, T_pad - T), (0, 0)]), 1, 2)
    sides = value_side(saved.t, saved.X, saved.M, saved.states, dstates, do_t, pad(v), b, dtype=dtype,
                       masks=masks, interpret=interpret, key_products=split)
    summed = dg_cumsum == "kernel"   # the key side takes dG's reverse cumsum itself
    keys = dict(dtype=dtype, masks=masks, interpret=interpret, grams=grams, unit_bound=unit_bound,
                qk_l2norm=qk_l2norm)
    if split:
      dqg, dkd, dbk, s_ds, dP, dM, dv, dbeta_v = sides
      dq, dk, dG, dbeta_k = channel_delta_keys.key_side(pad(q), pad(k), G, refs, b, dP, dM, dqg, dkd, dbk,
                                                        s_ds, **keys, norm_grads=in_keys)
    else:
      u, dr, dP, dM, dv, dbeta_v = sides
      dq, dk, dG, dbeta_k = key_side(pad(q), pad(k), G, refs, b, do_t, u, dr, dP, dM, saved.states, dstates,
                                     **keys, reverse_cumsum=summed)
    if exact_last:
      dk, dv, dbeta_k, dG = channel.add_final_state_grads(
          (dk, dv, dbeta_k, dG), dfinal, saved.last_start, G, pad(k), pad(v), b, segment_ids, C,
          summed=summed, k_basis="raw" if in_keys else ("normalised" if qk_l2norm else "as_given"))
    dq, dk, dg = key_grads(dq, dk, dG, q, k, g, C, summed=summed, kernel=cumsums == "kernel",
                           interpret=interpret, gate=gate)
    if qk_l2norm and not in_keys:
      if l2_grads == "kernel" and l2_kernel.serves(K, q.dtype) and q.dtype == k.dtype:
        dq, dk = l2_kernel.backward(q, dq, k, dk, interpret=interpret)
      else:
        dq, dk = (jax.vjp(common.l2_normalize, x)[1](dx)[0] for x, dx in ((q, dq), (k, dk)))
    dbeta = jnp.swapaxes(dbeta_v + dbeta_k, 1, 2)[:, :T].astype(beta.dtype)
    if gate is not None:   # the gate's cotangents vary as A_log and dt_bias do
      dg = (common.sum_over_extra_axes(dg[0], g),) + common.summed_like(dg[1:], gate[:2])
    grads = (dq, dk, dv[:, :T].astype(v.dtype), dg if gate is None else None, dbeta)
    grads = common.summed_like(grads, (q, k, v, g, beta))
    return grads[:3] + (dg if gate is not None else grads[3], grads[4], dh0.astype(F32))

  return kernels()
