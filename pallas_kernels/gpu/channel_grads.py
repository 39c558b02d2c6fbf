"""Per-channel decay, additive family (gla): every chunk's gradients in one Mosaic GPU kernel, every chunk
in parallel, from the raw tiles, the state entering each chunk and the gradient of the state leaving it.

With `G` the chunk-local cumulative log-decay `[C, K]` (inclusive), `R` one reference value per channel
of the chunk (the middle of the channel's range, `prep.decayed_gram`'s "auto" form), `S` the state
entering the chunk `[K, V]` and `dS` the gradient of the state leaving it, the chunk's forward is

    Qr = q e^(G - R),  Kr = k e^(R - G),  P = tril(Qr Kr^T)        (every factor within e^(+-bound))
    o  = (q e^G) S + P v                                             (the unscaled output)
    S' = Diag(e^(G_C)) S + (k e^(G_C - G))^T v

so, with `dP = tril(do v^T)`:

    dq = e^G (do S^T) + e^(G - R) (dP Kr)
    dk = e^(G_C - G) (v dS^T) + e^(R - G) (dP^T Qr)
    dv = P^T do + (k e^(G_C - G)) dS
    dG = q dq - k dk,  and the last token also takes  sum_i kd_i (v dS^T)_i + e^(G_C) colsum(S dS)

(the e^G-weighted terms of dG collapse into `q dq` and `k dk`: each of q's and k's factors is an
exponential of +-G). The gram terms of dG are taken as `Qr (dP Kr) - Kr (dP^T Qr)` from the rounded
operands the products read (each product's own, in the groups' form), so that a pair's shares of dG at
its two tokens cancel in dg's reverse cumsum as they do exactly; from `q e^(G - R)` in float32 they
differ by the operands' rounding, which under strong gates is the size of dg (NOTES.md v64). dg is dG's reverse cumsum within the chunk (the kernel's, for bfloat16 and C = 64;
else XLA's). The key channels are processed in halves of 64 columns (`[C, 64]` float32 tiles, 32
registers a thread), so the only full-width products are P, dP and dv. Shared memory is reused for the
outputs: dq leaves through q's tile, dk through k's, kd through Kr's, dG through G's and dv through v's.

This form needs every chunk's decay to fit the one-reference bound (`prep.one_reference_fits`); a call
where some chunk does not takes the 8-token groups' products (`grams="groups"`, groups.py), the same
terms with each product's factors about its own references.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from .. import common, prep
from . import groups, walk
from .channel import HALF, fits, key_grads
from .channel import chunk_cumsum  # noqa: F401  (the dispatch calls it from here)
from .masks import SEG_ROWS, segment_masks, segment_vectors
from .once import lowered_once
from .tiles import (COLS, F32, WGMMA, compiler_params, matmul, matmuls, reverse_cumsum_rows, smem,
                    upper_ones, vary_like)


def serves(g, beta, segment_ids) -> bool:
  """True for the calls this kernel takes the gradients of: additive family, per-channel decay."""
  del segment_ids   # packed rows are served (`segment_vectors`)
  return beta is None and g is not None and g.ndim == 4


@lowered_once(arrays=("masks",))
def chunk_grads(q, k, v, G, refs, states, dstates, do, *, dtype, masks=None, interpret=None,
                grams: str = "one", reverse_cumsum: bool = False):
  """Every chunk's `(dq, dk, dv, dG)` (module docstring), one program per chunk of one value head.

  Args: q, k `[B, T_pad, H, K]`, v, do `[B, T_pad, H_v, V]` (16-bit; do the gradient of the unscaled
    o); G, refs as `chunk_cumsum` returns them; states, dstates `[B, H_v, NC, V, K]` (transposed, the
    walks' layout); masks None or `segment_vectors(...)`.
  Returns: dq, dk `[B, T_pad, H_v, K]` (per value head) and dv `[B, T_pad, H_v, V]` in `dtype`; dG
    `[B, T_pad, H_v, K]` float32 with the last token's terms added.
  grams: "one" (the module docstring's one reference) or "groups" (groups.py's products, for chunks
    beyond the one-reference bound: every gram term above is their sum, each product's factors about
    its own references).
  reverse_cumsum: return dG's reverse cumsum within each chunk instead of dG (`tiles.reverse_cumsum_rows`
    at the end of the program, U in dP's tile and dG's parts in tiles free by then; bfloat16 operands
    and C = 64 only).
  """
  if grams not in ("one", "groups"):
    raise ValueError(f"grams must be 'one' or 'groups'; got {grams!r}")
  B, T_pad, H, K = q.shape
  Hv, V = v.shape[2:]
  NC = states.shape[2]
  C = T_pad // NC
  if reverse_cumsum and (jnp.dtype(dtype) != jnp.bfloat16 or C != HALF):
    raise ValueError(f"reverse_cumsum takes bfloat16 operands and C = {HALF}; got "
                     f"{jnp.dtype(dtype).name} and C = {C}")
  group = Hv // H
  if K % HALF:
    raise ValueError(f"K must be a multiple of {HALF}; got {K}")
  KH = K // HALF
  has_seg = masks is not None
  halves = lambda rows: smem((KH, rows, HALF), dtype)
  scratch = dict(
      q_s=halves(C), k_s=halves(C), a_s=smem((1, C, HALF), dtype) if grams == "groups" else halves(C),
      b_s=halves(C), st_s=halves(V), dst_s=halves(V),
      g_s=smem((KH, C, HALF), F32), v_s=smem((C, V), dtype), do_s=smem((C, V), dtype),
      p_s=smem((C, C), dtype), dp_s=smem((C, C), dtype), r_s=plgpu.SMEM((refs.shape[2], K), F32),
      bar=plgpu.Barrier(num_arrivals=5 * KH + 3 + SEG_ROWS * has_seg))
  if has_seg:
    scratch["m_s"] = plgpu.SMEM((SEG_ROWS, C), F32)
  if grams == "groups":
    scratch["dpl_s"] = smem((C, C), dtype)   # dP kept on one product's entries

  def body(*refs_, q_s, k_s, a_s, b_s, st_s, dst_s, g_s, v_s, do_s, p_s, dp_s, r_s, bar, m_s=None,
           dpl_s=None):
    q_r, k_r, v_r, g_r, ref_r, st_r, dst_r, do_r = refs_[:8]
    m_r = refs_[8] if has_seg else None
    dq_r, dk_r, dv_r, dg_r = refs_[8 + has_seg:]
    b, h, n = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
    hk = lax.div(h, group)
    rows_t = pl.ds(n * C, C)
    cols = lambda i: pl.ds(i * HALF, HALF)
    copies = [(v_r.at[b, rows_t, h], v_s), (do_r.at[b, rows_t, h], do_s), (ref_r.at[b, n, :, h], r_s)]
    for i in range(KH):
      copies += [(q_r.at[b, rows_t, hk, cols(i)], q_s.at[i]), (k_r.at[b, rows_t, hk, cols(i)], k_s.at[i]),
                 (g_r.at[b, rows_t, h, cols(i)], g_s.at[i]), (st_r.at[b, h, n, :, cols(i)], st_s.at[i]),
                 (dst_r.at[b, h, n, :, cols(i)], dst_s.at[i])]
    copies += [(m_r.at[b, j, rows_t], m_s.at[j]) for j in range(SEG_ROWS if has_seg else 0)]
    for src, dst in copies:   # one arrival each
      plgpu.copy_gmem_to_smem(src, dst, bar)
    plgpu.barrier_wait(bar)

    ck, sq = (C, HALF), (C, C)
    rows = lambda x: lax.broadcast_in_dim(x, ck, [0])
    colv = lambda row, i: lax.broadcast_in_dim(plgpu.load(r_s.at[row, cols(i)], layout=COLS), ck, [1])
    i_sq = plgpu.broadcasted_iota(jnp.int32, sq, 0, layout=WGMMA)
    j_sq = plgpu.broadcasted_iota(jnp.int32, sq, 1, layout=WGMMA)
    lower = i_sq >= j_sq
    carry = to_last = None
    carry_last = 1.0
    if has_seg:
      same, carry, to_last, carry_last = segment_masks(m_s, None, C)
      lower = lower & same
    load = lambda ref: plgpu.load(ref, layout=WGMMA).astype(F32)
    fresh = lax.optimization_barrier
    clamp = lambda x: jnp.exp(jnp.minimum(x, prep.ref_bound(dtype)))

    gb = groups.group_bound(dtype)
    vec_end = lambda i: lambda t: colv(groups.FIRST_ROW + t, i)

    def factors(Gt, i, s):
      """Product s's `(up, down)` for half i: q's rows take up, k's down. A level's are one tile
      (`groups.level_factor`: each is read only on the rows where the other is not)."""
      if s is None:
        return groups.factors(Gt, vec_end(i), s, gb)
      E = groups.level_factor(Gt, vec_end(i), s)
      return E, E
    if grams == "one":
      # Qr = q e^(G - R), Kr = k e^(R - G), half by half
      for i in range(KH):
        Gt, R = load(g_s.at[i]), colv(0, i)
        a_s.at[i][...] = (load(q_s.at[i]) * clamp(Gt - R)).astype(dtype)
        b_s.at[i][...] = (load(k_s.at[i]) * clamp(R - Gt)).astype(dtype)
      plgpu.commit_smem()
      P = matmul(a_s.at[0], b_s.at[0].T, sq)
      for i in range(1, KH):
        P = matmul(a_s.at[i], b_s.at[i].T, sq, init=P)
    else:   # each product of the groups (groups.py) over both halves, kept on its own entries
      # (q's factor tile holds one half at a time: the groups' kernel needs the room for dP's staging)
      P = 0.0
      for s in groups.products(C):
        Ps = None
        for i in range(KH):
          up, down = factors(load(g_s.at[i]), i, s)
          a_s.at[0][...] = (load(q_s.at[i]) * up).astype(dtype)
          b_s.at[i][...] = (load(k_s.at[i]) * down).astype(dtype)
          plgpu.commit_smem()
          Ps = matmul(a_s.at[0], b_s.at[i].T, sq, init=Ps)
        P = P + jnp.where(groups.keep_mask(C, s), Ps, 0.0)
      for i in range(KH):
        P = groups.with_diagonal(P, load(q_s.at[i]), load(k_s.at[i]))
    # above the diagonal the factors do not cancel (they may overflow): the where drops them
    p_s[...] = jnp.where(lower, P, 0.0).astype(dtype)
    dp_s[...] = jnp.where(lower, matmul(do_s, v_s.T, sq), 0.0).astype(dtype)
    plgpu.commit_smem()

    last_row = plgpu.broadcasted_iota(jnp.int32, ck, 0, layout=WGMMA) == C - 1
    for i in range(KH):
      Gt, R, Gc = load(g_s.at[i]), colv(0, i), colv(1, i)
      e_q, e_k = jnp.exp(Gt), jnp.exp(Gc - Gt)
      if has_seg:
        e_q, e_k = e_q * rows(carry), e_k * rows(to_last)
      # dG's gram terms from the rounded operands the products took (Qr (dP Kr) - Kr (dP^T Qr) per
      # product), so that each pair's share of q dq and of k dk cancel in dg's reverse cumsum as
      # they do exactly: from q e^(G - R) in float32 they differ by the operands' rounding, which
      # strong gates make the size of dg itself
      if grams == "one":
        # dq = e^G (do S^T) + e^(G - R) (dP Kr);  dk = e^(G_C - G) (v dS^T) + e^(R - G) (dP^T Qr)
        dPK, dPQ = matmuls((ck, [(dp_s, b_s.at[i])]), (ck, [(dp_s.T, a_s.at[i])]))
        dq_p, dk_p = clamp(Gt - R) * dPK, clamp(R - Gt) * dPQ
        dG_p = load(a_s.at[i]) * dPK - load(b_s.at[i]) * dPQ
      else:   # the same gram terms, product by product, dP kept on each product's entries
        # (dP's own diagonal in float32: groups.py; its pairs cancel in q dq - k dk exactly)
        d = rows(groups.diagonal_of(load(dp_s)))
        dq_p, dk_p = d * load(k_s.at[i]), d * load(q_s.at[i])
        dG_p = 0.0
        for s in groups.products(C):
          up, down = factors(fresh(load(g_s.at[i])), i, s)
          a_s.at[0][...] = (load(q_s.at[i]) * up).astype(dtype)
          b_s.at[i][...] = (load(k_s.at[i]) * down).astype(dtype)
          keep = groups.keep_mask(C, s)
          dpl_s[...] = jnp.where(keep, load(dp_s), 0.0).astype(dtype)
          plgpu.commit_smem()
          dPK, dPQ = matmuls((ck, [(dpl_s, b_s.at[i])]), (ck, [(dpl_s.T, a_s.at[0])]))
          dq_p, dk_p = dq_p + up * dPK, dk_p + down * dPQ
          dG_p = dG_p + load(a_s.at[0]) * dPK - load(b_s.at[i]) * dPQ
      doS = e_q * matmul(do_s, st_s.at[i], ck)
      dq = doS + dq_p
      qt = load(q_s.at[i])
      dG = qt * doS + dG_p
      q_s.at[i][...] = dq.astype(dtype)
      v_ds = matmul(v_s, dst_s.at[i], ck)
      dk = e_k * v_ds + dk_p
      kt = load(k_s.at[i])
      kd = kt * e_k
      dG = dG - kt * (e_k * v_ds)
      k_s.at[i][...] = dk.astype(dtype)
      b_s.at[i][...] = kd.astype(dtype)   # for dv; Kr is no longer read
      # the last token: sum_i kd_i (v dS^T)_i + e^(G_C) colsum(S dS), S and dS `[V, 64]` tiles
      s_ds = jnp.sum(load(st_s.at[i]) * load(dst_s.at[i]), axis=0)
      s_decay = plgpu.load(r_s.at[1, cols(i)], layout=COLS)
      term = jnp.sum(kd * v_ds, axis=0) + jnp.exp(s_decay) * carry_last * s_ds
      dG = dG + jnp.where(last_row, lax.broadcast_in_dim(term, ck, [1]), 0.0)
      g_s.at[i][...] = dG
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_s.at[i], dq_r.at[b, rows_t, h, cols(i)])
      plgpu.copy_smem_to_gmem(k_s.at[i], dk_r.at[b, rows_t, h, cols(i)])
      if not reverse_cumsum:
        plgpu.copy_smem_to_gmem(g_s.at[i], dg_r.at[b, rows_t, h, cols(i)])

    # dv = P^T do + kd dS
    dv = matmul(p_s.T, do_s, (C, V))
    for i in range(KH):
      dv = matmul(b_s.at[i], dst_s.at[i].T, (C, V), init=dv)
    v_s[...] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(v_s, dv_r.at[b, rows_t, h])
    if reverse_cumsum:   # dg = U dG: U in dP's tile, dG's parts in kd's, Qr's and P's (all read by now)
      upper_ones(dp_s)
      parts = ([b_s.at[i] for i in range(KH)] + [a_s.at[i] for i in range(a_s.shape[0])] + [p_s])[:3]
      for i in range(KH):
        reverse_cumsum_rows(g_s.at[i], dp_s, parts)
        plgpu.copy_smem_to_gmem(g_s.at[i], dg_r.at[b, rows_t, h, cols(i)])
    plgpu.wait_smem_to_gmem(0)

  args = [q.astype(dtype), k.astype(dtype), v.astype(dtype), G, refs, states.astype(dtype),
          dstates.astype(dtype), do.astype(dtype)] + ([masks] if has_seg else [])
  out_type = (jax.ShapeDtypeStruct((B, T_pad, Hv, K), dtype), jax.ShapeDtypeStruct((B, T_pad, Hv, K), dtype),
              jax.ShapeDtypeStruct((B, T_pad, Hv, V), dtype), jax.ShapeDtypeStruct((B, T_pad, Hv, K), F32))
  outs = plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=(B, Hv, NC), grid_names=("b", "h", "n"),
      compiler_params=compiler_params(approx_math=True), interpret=interpret,
      kernel_name="chunk_grads_channel" + ("_groups" if grams == "groups" else ""))(*args)
  return vary_like(outs, args)


class Saved(NamedTuple):
  """What gla's differentiated forward keeps for `backward` (all from the prepared forward)."""

  states: jax.Array            # [B, H_v, NC, V, K], the state entering every chunk (transposed)
  transitions: Any             # the sequence pieces' A (`walk.forward(..., return_transitions=True)`)
  qg: jax.Array                # [B, H_v, NC, C, K], q e^G on the rows that read the carried state
  decay: jax.Array             # [B, H_v, NC, K] float32
  G: jax.Array                 # chunk_cumsum(g, T_pad, C)
  refs: jax.Array


def backward(q, k, v, g, h0, do, dfinal, *, chunk_size: int, dtype, segment_ids=None, interpret=None,
             sequence_pieces=None, scale: float = 1.0, saved: Saved, grams: str = "one",
             dg_cumsum: str = "xla", cumsums: str = "xla"):
  """`(dq, dk, dv, dg, None, dh0)` of the prepared forward of gla (`o` scaled by `scale`; dq, dk, dv,
  dg in q, k, v, g's dtypes, dh0 float32) for `do: [B, T, H_v, V]` and `dfinal` None or
  `[B, H_v, K, V]`, from what the forward `saved`.

  The reverse walk (`walk.backward_states`, over the saved q e^G and decay) gives the gradient of the
  state leaving every chunk; then `chunk_grads` forms every chunk's gradients, dG's reverse cumsum within the
  chunks follows (`cumsums`: `cumsum.reverse`'s walk or XLA's product) (or `chunk_grads` with
  `dg_cumsum="kernel"`: bfloat16, C = 64, `GpuConfig.dg_cumsum`), and XLA masks dg below the gate's floor and,
  for grouped heads, adds the value heads' dq, dk. `grams`:
  `chunk_grads`'; the caller's `lax.cond` (`vjp.py`) takes "one" where every chunk's decay fits the
  one-reference bound (`fits`), else "groups" (or XLA's vjp, for float16 beyond the groups' bound).
  """
  del h0   # the state entering each chunk is saved
  B, T, H, K = q.shape
  Hv, V = v.shape[2:]
  C = chunk_size
  NC = saved.states.shape[2]
  T_pad = NC * C
  G, refs = saved.G, saved.refs
  pad = lambda x: jnp.pad(x.astype(dtype), [(0, 0), (0, T_pad - T), (0, 0), (0, 0)])

  def kernels():
    qp, kp, vp = pad(q), pad(k), pad(v)
    # the cotangent of the unscaled o, rounded to the operand dtype (as the prepared path's)
    dos = pad(do.astype(F32) * scale)
    masks = None if segment_ids is None else segment_vectors(segment_ids, C, T_pad)
    t = prep.ChunkTensors(qg=saved.qg, kd=None, w=None, u=None, p=None, decay=saved.decay)
    dstates, dh0 = walk.backward_states(t, dos, dfinal, interpret=interpret, sequence_pieces=sequence_pieces,
                                        transitions=saved.transitions, token_do=True)
    summed = dg_cumsum == "kernel"   # the kernel takes dG's reverse cumsum
    dq, dk, dv, dG = chunk_grads(qp, kp, vp, G, refs, saved.states, dstates, dos, dtype=dtype,
                                 masks=masks, interpret=interpret, grams=grams, reverse_cumsum=summed)
    dq, dk, dg = key_grads(dq, dk, dG, q, k, g, C, summed=summed, kernel=cumsums == "kernel",
                           interpret=interpret)
    grads = (dq, dk, dv[:, :T].astype(v.dtype), dg)
    return common.summed_like(grads, (q, k, v, g)) + (None, dh0.astype(F32))

  return kernels()


