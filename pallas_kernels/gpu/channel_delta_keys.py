"""kda's key side (channel_delta_grads.py's module docstring) on two warpgroups, one a half of the key
channels (K = 128): `GpuConfig.key_warpgroups=2`.

The one-warpgroup key side (`channel_delta_grads.key_side`) holds both halves' tiles in ~218 KB, one
program an SM, and runs the halves one after the other on its 128 threads: a chain of tensor-core
products and their elementwise tails that leaves the SM waiting on itself (NOTES.md v50, v60). Here the
two halves run side by side, each on a warpgroup of its own with its own registers and staging tiles,
so that one computes while the other waits on its products or fences.

They fit one program because the products without a decayed gram (`do S^T`, `u dS^T`, `dr S^T`) and
`colsum(S dS)` come from the value side (`value_side(..., key_products=True)`, where do, u, dr, S and
dS already are, in 16-bit tiles): this program reads neither the states nor the value-width tiles,
~181 KB at K = 128 (~213 with the hand-over below). The grams' products, each half's form (one
reference, the halves' or the groups' products), dq, dk and dG are the one-warpgroup kernel's, half by
half; warpgroup 1 hands its part of dbeta to warpgroup 0, which writes the sum. With `qk_l2norm` each
warpgroup sums the squares of its own half of q and k, the two halves' sums meet in shared memory
(added half 0's first, as `tiles.l2_normalize_halves` adds them), and each scales its own half in
place; at the end each takes the norms' gradient for its half of dq and dk, `r (dy - y rowsum(y dy))`,
the two halves' row sums exchanged through shared memory, so that XLA does not read q, k, dq and dk
again for it (NOTES.md v67).

Where each chunk takes its form (`grams="chunk"`) and half 0 takes the halves' or the groups' products
while half 1 takes one reference (the strong channels in half 0, as the layers' order puts them), the
halves' work is unequal: warpgroup 1 then first takes half 0's odd products and hands their partial
terms to warpgroup 0, which takes the even ones and the diagonal's: dq's and the sum of k's two (dk's)
in the operand dtype, their difference (dG's) in float32, 32 KB more.

Nothing here sums over a tile's rows with `jnp.sum`: Mosaic GPU takes such a sum across the warps of a
warpgroup through one reduction scratch at one offset for every warpgroup of the program, so two
warpgroups summing at once read each other's partial sums (the Mosaic GPU interpreter does not model
it: on an H100 dg came out ~50x off, NOTES.md v63). The last token's `colsum(kd (u dS^T))` is a
product with a tile of ones instead, its operand split into a 16-bit high and low part so that the sum
keeps ~16 bits more than one 16-bit operand would (it cancels against the rows' own terms in dg's
reverse cumsum: a sum rounded as a 16-bit operand once put dg 7% off under strong gates). Sums along a
row stay within a warp and are safe.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from .. import prep
from . import channel, groups
from .channel import HALF
from .masks import SEG_ROWS, segment_masks
from .once import lowered_once
from .tiles import (COLS, F32, L2_EPS, ROWS, SMEM_BYTES, WGMMA, chunk_program, compiler_params, matmuls,
                    phase, phase_bytes, scratch_bytes, smem, vary_like)

WARPGROUPS = 2


def serves(K: int) -> bool:
  """True for the key dims this kernel takes: two halves of `HALF` channels."""
  return K == WARPGROUPS * HALF


@lowered_once(arrays=("masks",))
def key_side(q, k, G, refs, b, dP, dM, dqg, dkd, dbk, s_ds, *, dtype, masks=None, interpret=None,
             grams: str = "one", unit_bound: bool = False, qk_l2norm: bool = False, norm_grads: bool = True):
  """`channel_delta_grads.key_side` (without `reverse_cumsum`) on two warpgroups, from the value side's
  products.

  Args: q, k `[B, T_pad, H, K]`; G, refs as `channel.chunk_cumsum` returns them; b `[B, H_v, T_pad]`
    float32; dP, dM `[B, H_v, T_pad, C]`; dqg, dkd, dbk `[B, H_v, T_pad, K]` (`do S^T`, `u dS^T`,
    `dr S^T`) and s_ds `[B, H_v, NC, 2, 64]` (`value_side(..., key_products=True)`'s); masks None or
    `segment_vectors(...)`. grams, unit_bound, qk_l2norm: `channel_delta_grads.key_side`'s;
    norm_grads (with `qk_l2norm`): the norms' gradients in the epilogue (else dq, dk are those of the
    normalised q, k, for `l2_grads.py` or XLA).
  Returns: dq, dk `[B, T_pad, H_v, K]` in `dtype` (with `qk_l2norm` and `norm_grads`, of the raw q, k); dG
    `[B, T_pad, H_v, K]` float32 with the last token's terms added; `rowsum(dB_k k E)` `[B, H_v, T_pad]`
    float32.
  """
  if grams not in ("one", "halves", "groups", "chunk"):
    raise ValueError(f"grams must be 'one', 'halves', 'groups' or 'chunk'; got {grams!r}")
  B, T_pad, H, K = q.shape
  Hv, NC = dqg.shape[1], s_ds.shape[2]
  C = T_pad // NC
  group = Hv // H
  if not serves(K):
    raise ValueError(f"the two-warpgroup key side takes K = {WARPGROUPS * HALF} (a half each); got K={K}")
  if C != HALF:
    raise ValueError(f"the key side stages [C, C] tiles (dP and dM's parts, the column sums' ones) in "
                     f"[C, {HALF}] tiles: C must be {HALF}; got {C}")
  chunkwise = grams == "chunk"
  grads_in = qk_l2norm and norm_grads   # the norms' gradients in the epilogue
  bound = prep.ref_bound(dtype, unit=unit_bound and chunkwise)
  has_seg = masks is not None
  halves = lambda dt=dtype: smem((WARPGROUPS, C, HALF), dt)
  rows_of_refs = refs.shape[2]
  scratch = dict(
      q_s=halves(), k_s=halves(), g_s=halves(F32), dqg_s=halves(), dkd_s=halves(), dbk_s=halves(),
      qr_s=halves(), kr_s=halves(), ar_s=halves(), dp_s=smem((C, C), dtype), dm_s=smem((C, C), dtype),
      r_s=plgpu.SMEM((WARPGROUPS, rows_of_refs, HALF), F32), sds_s=plgpu.SMEM((WARPGROUPS, HALF), F32),
      b_s=plgpu.SMEM((C,), F32), form_s=plgpu.SMEM((C,), F32), vec_s=plgpu.SMEM((WARPGROUPS, C), F32),
      bar=plgpu.Barrier(num_arrivals=3 + 8 * WARPGROUPS + SEG_ROWS * has_seg + chunkwise),
      normed=plgpu.Barrier(num_arrivals=WARPGROUPS, num_barriers=2 + 2 * grads_in),
      handed=plgpu.Barrier())
  if grads_in:   # each warpgroup's rows' reciprocal norms and its half of the rows' dot products for the
    # norms' gradients (q's, k's): kept here, not in registers across the products
    scratch.update(norm_s=plgpu.SMEM((2, WARPGROUPS, C), F32), dot_s=plgpu.SMEM((2, WARPGROUPS, C), F32))
  if qk_l2norm:   # each warpgroup's half of the rows' sums of squares (q's, k's)
    scratch["sq_s"] = plgpu.SMEM((2, WARPGROUPS, C), F32)
  if has_seg:
    scratch["m_s"] = plgpu.SMEM((SEG_ROWS, C), F32)
  if chunkwise:   # warpgroup 1's share of half 0's products, handed over (module docstring)
    scratch.update(hq_s=smem((C, HALF), dtype), hs_s=smem((C, HALF), dtype), hd_s=smem((C, HALF), F32),
                   dealt=plgpu.Barrier())
  need = scratch_bytes(scratch) + phase_bytes(WARPGROUPS)
  if need > SMEM_BYTES:
    raise ValueError(f"the two-warpgroup key side needs {need} bytes of shared memory (at most {SMEM_BYTES})")

  def body(*refs_, q_s, k_s, g_s, dqg_s, dkd_s, dbk_s, qr_s, kr_s, ar_s, dp_s, dm_s, r_s, sds_s, b_s, form_s,
           vec_s, bar, normed, handed, norm_s=None, dot_s=None, sq_s=None, m_s=None, hq_s=None, hs_s=None,
           hd_s=None, dealt=None):
    q_r, k_r, g_r, ref_r, b_r, dp_r, dm_r, dqg_r, dkd_r, dbk_r, sds_r = refs_[:11]
    m_r = refs_[11] if has_seg else None
    fit_r = refs_[11 + has_seg] if chunkwise else None
    dq_r, dk_r, dg_r, db_r = refs_[11 + has_seg + chunkwise:]
    bi, h, n, hk, rows_t = chunk_program(C, group)
    w = lax.axis_index("wg")
    cols = lambda i: pl.ds(i * HALF, HALF)

    @pl.when(w == 0)
    def _copies():   # every tile of the program, from warpgroup 0 (one arrival each)
      copies = [(dp_r.at[bi, h, rows_t], dp_s), (dm_r.at[bi, h, rows_t], dm_s), (b_r.at[bi, h, rows_t], b_s)]
      for i in range(WARPGROUPS):
        copies += [(q_r.at[bi, rows_t, hk, cols(i)], q_s.at[i]), (k_r.at[bi, rows_t, hk, cols(i)], k_s.at[i]),
                   (g_r.at[bi, rows_t, h, cols(i)], g_s.at[i]), (ref_r.at[bi, n, :, h, cols(i)], r_s.at[i]),
                   (dqg_r.at[bi, h, rows_t, cols(i)], dqg_s.at[i]),
                   (dkd_r.at[bi, h, rows_t, cols(i)], dkd_s.at[i]),
                   (dbk_r.at[bi, h, rows_t, cols(i)], dbk_s.at[i]), (sds_r.at[bi, h, n, i], sds_s.at[i])]
      copies += [(m_r.at[bi, j, rows_t], m_s.at[j]) for j in range(SEG_ROWS if has_seg else 0)]
      if chunkwise:   # each half's form (`channel.form_tokens`: token i holds half i's)
        copies.append((fit_r.at[bi, h, rows_t], form_s))
      for src, dst in copies:
        plgpu.copy_gmem_to_smem(src, dst, bar)

    with phase("keys2.loads"):
      plgpu.barrier_wait(bar)
    q_w, k_w, g_w = q_s.at[w], k_s.at[w], g_s.at[w]
    qr, kr, ar = qr_s.at[w], kr_s.at[w], ar_s.at[w]
    load = lambda ref: plgpu.load(ref, layout=WGMMA).astype(F32)
    ck = (C, HALF)
    rows = lambda x, shape=ck: lax.broadcast_in_dim(x, shape, [0])
    if qk_l2norm:   # `tiles.l2_normalize_halves`'s sums in its order: each warpgroup sums its own half's
      # squares, and both add the two halves' sums read back from shared memory, half 0's first (the same
      # float32 values in the same order); each scales its own half, from the registers it summed
      with phase("keys2.l2"):
        own = [load(q_w), load(k_w)]
        for i, x in enumerate(own):
          sq_s.at[i, w][...] = jnp.sum(x ** 2, axis=1)
        plgpu.commit_smem()
        plgpu.barrier_arrive(normed.at[0])   # both halves' sums are in sq_s
        plgpu.barrier_wait(normed.at[0])
        norms = []
        for i in range(2):
          sums = plgpu.load(sq_s.at[i, 0], layout=ROWS) + plgpu.load(sq_s.at[i, 1], layout=ROWS)
          norms.append(lax.rsqrt(sums + L2_EPS))
          if grads_in:
            norm_s.at[i, w][...] = norms[-1]
        for tile, x, r in zip((q_w, k_w), own, norms):
          tile[...] = (x * rows(r)).astype(dtype)
        plgpu.commit_smem()
        plgpu.barrier_arrive(normed.at[1])   # both halves scaled: warpgroup 1 may read half 0's
        plgpu.barrier_wait(normed.at[1])

    colv = lambda row, half=w: lax.broadcast_in_dim(plgpu.load(r_s.at[half, row], layout=COLS), ck, [1])
    fresh = lax.optimization_barrier

    def unnormalised(i, dy, y):
      """The gradient of the raw rows from `dy`, that of their normalised rows `y` (this warpgroup's half;
      i = 0 for q, 1 for k): `r (dy - y rowsum(y dy))`, the row sums over both halves through `dot_s`
      (each warpgroup stores its half's, then both read both, in the same order)."""
      if not grads_in:
        return dy
      dot_s.at[i, w][...] = jnp.sum(y * dy, axis=1)
      plgpu.commit_smem()
      plgpu.barrier_arrive(normed.at[2 + i])
      plgpu.barrier_wait(normed.at[2 + i])
      dot = plgpu.load(dot_s.at[i, 0], layout=ROWS) + plgpu.load(dot_s.at[i, 1], layout=ROWS)
      return rows(plgpu.load(norm_s.at[i, w], layout=ROWS)) * (dy - y * rows(dot))

    clamp = lambda x: jnp.exp(jnp.minimum(x, bound))
    _, carry, to_last, carry_last = (None, None, None, 1.0) if m_s is None else segment_masks(m_s, None, C)
    last_row = plgpu.broadcasted_iota(jnp.int32, ck, 0, layout=WGMMA) == C - 1
    gb = groups.group_bound(dtype)
    vec_end = lambda t: colv(groups.FIRST_ROW + t)
    zero_ck = lambda: plgpu.broadcasted_iota(jnp.int32, ck, 0, layout=WGMMA).astype(F32) * 0.0
    blocks = {"halves": groups.HALVES, "groups": groups.GROUP}

    def one_terms():   # the grams' terms about the one reference R
      Gt, R = fresh(load(g_w)), colv(0)
      qt, kt = load(q_w), load(k_w)
      up = clamp(Gt - R)
      qr[...] = (qt * up).astype(dtype)
      ar[...] = (kt * up).astype(dtype)
      kr[...] = (kt * clamp(R - Gt)).astype(dtype)
      plgpu.commit_smem()
      dPK, minus, plus = matmuls((ck, [(dp_s, kr)]), (ck, [(dp_s.T, qr), (dm_s.T, ar)]), (ck, [(dm_s, kr)]))
      return clamp(Gt - R) * dPK, clamp(R - Gt) * minus, clamp(Gt - R) * plus

    def group_terms(block, half=None, parity=None):
      """groups.py's products (dP, then dM, on each product's entries) of this warpgroup's half, or of
      `half`; with `parity`, only the products of that index parity (0 also takes the diagonal's
      terms), staged in this warpgroup's tiles."""
      q_w, k_w, g_w = (q_s.at[w], k_s.at[w], g_s.at[w]) if half is None else (
          q_s.at[half], k_s.at[half], g_s.at[half])
      ends = vec_end if half is None else (lambda t: colv(groups.FIRST_ROW + t, half))
      if parity in (None, 0):
        d = rows(groups.diagonal_of(load(dp_s)))
        dq_p, minus = d * load(k_w), d * load(q_w)
      else:
        dq_p = minus = zero_ck()
      plus = 0.0
      for i, s in enumerate(groups.products(C, block)):
        if parity is not None and i % 2 != parity:
          continue
        if s is None:
          up, down = groups.factors(fresh(load(g_w)), ends, s, gb, block)
        else:
          up = down = groups.level_factor(fresh(load(g_w)), ends, s)
        kr[...] = (load(k_w) * down).astype(dtype)
        qr[...] = (load(q_w) * up).astype(dtype)
        ar[...] = jnp.where(groups.keep_mask(C, s, block), load(dp_s), 0.0).astype(dtype)
        plgpu.commit_smem()
        dPK, dPQ = matmuls((ck, [(ar, kr)]), (ck, [(ar.T, qr)]))
        dq_p, minus = dq_p + up * dPK, minus + down * dPQ
        if s is None:
          qr[...] = (load(k_w) * up).astype(dtype)   # Ar
        ar[...] = jnp.where(groups.keep_mask(C, s, block), load(dm_s), 0.0).astype(dtype)
        plgpu.commit_smem()
        dMK, dMA = matmuls((ck, [(ar, kr)]), (ck, [(ar.T, qr if s is None else kr)]))
        minus, plus = minus + down * dMA, plus + up * dMK
      return dq_p, minus, plus

    def terms():
      if grams == "one":
        return one_terms()
      if grams in blocks:
        return group_terms(blocks[grams])
      own = lambda: groups.by_form(form_s[w], one_terms, group_terms)
      if not chunkwise:
        return own()
      # warpgroup 0 keeps the even products of half 0 where warpgroup 1 takes the odd ones
      return lax.cond(dealing & (w == 0), lambda: groups.by_form(
          form_s[0], one_terms, lambda block: group_terms(block, parity=0)), own)

    # "chunk": where half 0 takes a groups' form and half 1 one reference (the strong channels in half 0,
    # as the layers' order puts them), warpgroup 1 first takes the odd products of half 0 and hands
    # their partial terms to warpgroup 0 (module docstring), then takes its own
    dealing = (form_s[0] >= 0.5) & (form_s[1] < 0.5) if chunkwise else False
    if chunkwise:
      @pl.when(dealing & (w == 1))
      def _deal():
        with phase("keys2.deal"):
          dq_h, minus_h, plus_h = groups.by_form(
              form_s[0], lambda: (zero_ck(),) * 3, lambda block: group_terms(block, half=0, parity=1))
          hq_s[...] = dq_h.astype(dtype)
          hs_s[...] = (plus_h + minus_h).astype(dtype)   # dk's sum: rounded as dk is
          hd_s[...] = plus_h - minus_h                    # dG's difference: float32
          plgpu.commit_smem()
          plgpu.barrier_arrive(dealt)

    with phase("keys2.terms"):
      dq_p, minus, plus = terms()
    if chunkwise:
      def received():   # plus + minus gains the sum, plus - minus the difference
        plgpu.barrier_wait(dealt)
        total, diff = load(hs_s), plgpu.load(hd_s, layout=WGMMA)
        return dq_p + load(hq_s), minus + 0.5 * (total - diff), plus + 0.5 * (total + diff)

      dq_p, minus, plus = lax.cond(dealing & (w == 0), received, lambda: (dq_p, minus, plus))
    with phase("keys2.dq"):
      Gt = fresh(load(g_w))
      e_q = jnp.exp(Gt) if carry is None else jnp.exp(Gt) * rows(carry)
      dq = e_q * load(dqg_s.at[w]) + dq_p
      qt = load(q_w)
      dG = qt * dq
      q_w[...] = unnormalised(0, dq, qt).astype(dtype)
    with phase("keys2.dk"):
      Gt, Gc = fresh(load(g_w)), colv(1)
      kt, dkd, dBk = load(k_w), load(dkd_s.at[w]), load(dbk_s.at[w])
      e_k = jnp.exp(Gc - Gt) if to_last is None else jnp.exp(Gc - Gt) * rows(to_last)
      kd_dkd = kt * e_k * dkd   # the last token's colsum(kd (u dS^T)) sums its rows (keys2.last)
      minus = e_k * dkd + minus
      e_q = jnp.exp(Gt) if carry is None else jnp.exp(Gt) * rows(carry)
      dbeta = -jnp.sum(dBk * (kt * e_q), axis=1)
      plus = plus - rows(fresh(plgpu.load(b_s, layout=ROWS))) * e_q * dBk
      dG = dG + kt * (plus - minus)
    with phase("keys2.last"):   # the last token: colsum(kd (u dS^T)) + e^(G_C) colsum(S dS)
      # the column sums on the tensor cores (module docstring): ones^T (hi + lo), every row the sum, in
      # this warpgroup's staging tiles (its products have read them)
      high = kd_dkd.astype(dtype)
      qr[...] = high
      kr[...] = (kd_dkd - high.astype(F32)).astype(dtype)
      ar[...] = (zero_ck() + 1.0).astype(dtype)
      plgpu.commit_smem()
      (colsum,) = matmuls((ck, [(ar, qr), (ar, kr)]))
      s_ds = plgpu.load(sds_s.at[w], layout=COLS)
      s_decay = plgpu.load(r_s.at[w, 1], layout=COLS)
      term = colsum + lax.broadcast_in_dim(jnp.exp(s_decay) * carry_last * s_ds, ck, [1])
      dG = dG + jnp.where(last_row, term, 0.0)
    with phase("keys2.out"):
      k_w[...] = unnormalised(1, plus + minus, load(k_w)).astype(dtype)
      g_w[...] = dG
      vec_s.at[w][...] = dbeta
      plgpu.commit_smem()
      for i in range(WARPGROUPS):   # static column slices of the outputs: each warpgroup its own half
        @pl.when(w == i)
        def _():
          plgpu.copy_smem_to_gmem(q_s.at[i], dq_r.at[bi, rows_t, h, cols(i)])
          plgpu.copy_smem_to_gmem(k_s.at[i], dk_r.at[bi, rows_t, h, cols(i)])
          plgpu.copy_smem_to_gmem(g_s.at[i], dg_r.at[bi, rows_t, h, cols(i)])

      @pl.when(w == 1)
      def _():
        plgpu.barrier_arrive(handed)   # its dbeta staged

      @pl.when(w == 0)
      def _():
        plgpu.barrier_wait(handed)
        vec_s.at[0][...] = plgpu.load(vec_s.at[0], layout=ROWS) + plgpu.load(vec_s.at[1], layout=ROWS)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(vec_s.at[0], db_r.at[bi, h, rows_t])
    with phase("keys2.exit"):
      plgpu.wait_smem_to_gmem(0)

  args = [q.astype(dtype), k.astype(dtype), G, refs, b, dP, dM, dqg, dkd, dbk, s_ds]
  args += [masks] if has_seg else []
  if chunkwise:
    cotangents = channel.cotangent_bound(dP, dM, C) if unit_bound else None
    args.append(channel.form_tokens(refs, C, dtype, cotangents, width=HALF))
  out_type = (jax.ShapeDtypeStruct((B, T_pad, Hv, K), dtype), jax.ShapeDtypeStruct((B, T_pad, Hv, K), dtype),
              jax.ShapeDtypeStruct((B, T_pad, Hv, K), F32), jax.ShapeDtypeStruct((B, Hv, T_pad), F32))
  outs = plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=(B, Hv, NC), grid_names=("b", "h", "n"),
      num_threads=WARPGROUPS, thread_name="wg", compiler_params=compiler_params(approx_math=True),
      interpret=interpret,
      kernel_name="chunk_grads_channel_delta_k2" + ("" if grams == "one" else "_" + grams))(*args)
  return vary_like(outs, args)
