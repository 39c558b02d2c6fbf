"""kda's preparation (channel_prep.py) on two warpgroups at K = 128: `GpuConfig.prep_warpgroups=2`.

The one-warpgroup program (~195 KB, one an SM) runs its phases in sequence on 128 threads: the grams,
qg and kd, the inverse, w and u. Here two warpgroups share the program's tiles and its work:
- the grams: each half of the key channels takes its own form (or the chunk's), and the products of
  both halves' forms are dealt out between the warpgroups (product i of half h to warpgroup (i + h) mod
  2: one reference on both halves is a product each; one half's groups' products split two and two).
  Each warpgroup stages its products in its own half's column slices of the staging tiles, whichever
  half the product belongs to, so the two never share a staging tile;
- warpgroup 1 hands its partial grams P and M to warpgroup 0 as two 16-bit tiles each (the value and
  the rounding's rest: float32's sum to ~16 significant bits, `hi + lo`) in the inverse's scratch
  tiles, which are free until then; warpgroup 0 adds them, writes P (and M), forms the inverse and w;
- qg and kd: where shared memory holds two more `[C, 64]` staging tiles (V <= 128), warpgroup 1 writes
  both halves' columns right after its hand-over, while warpgroup 0 sums the grams and inverts, so that
  they are off warpgroup 0's path (the program's longest: grams, sum, inverse, w; NOTES.md v83); else
  (V = 256) each warpgroup its own half's, before the hand-over, staged in a free `[C, C]` tile (a copy
  reads a contiguous tile, not a column slice);
- warpgroup 1 forms u once the inverse is in shared memory.
With `qk_l2norm` both read the full rows for the norms, meet at a barrier, and each scales its own
half. The hand-over reuses the inverse's scratch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from . import channel, groups
from .channel import HALF
from .masks import SEG_ROWS, segment_masks
from .tiles import (COLS, F32, L2_EPS, ROWS, SMEM_BYTES, WGMMA, chunk_program, compiler_params, matmul,
                    matmuls, phase, phase_bytes, scratch_bytes, smem, unit_lower_inverse, vary_like)

WARPGROUPS = 2


def serves(K: int, delta: bool) -> bool:
  """True for the calls this kernel prepares: kda (the delta family) with K = 2 x 64."""
  return delta and K == WARPGROUPS * HALF


def kernel(q, k, v, G, refs, b, masks, *, chunk_size: int, dtype, interpret, with_inverse: bool, grams: str,
           bound: float, half_forms: bool, qk_l2norm: bool):
  """`channel_prep._prepare_kernel`'s Mosaic GPU call for kda on two warpgroups: the same padded inputs
  (q, k `[B, T_pad, H, K]`, v `[B, T_pad, H_v, V]`, G and refs as `chunk_cumsum` returns them, with the
  form row for `grams="chunk"`, b `[B, H_v, T_pad]` float32, masks None or `segment_vectors(...)`) and
  the same outputs (qg, kd, p, w, u, and with `with_inverse` X and M, `[B, H_v, T_pad, ...]`)."""
  B, T_pad, H, K = q.shape
  Hv, V = v.shape[2:]
  C = chunk_size
  NC = T_pad // C
  group = Hv // H
  if C != HALF:
    raise ValueError(f"the two-warpgroup preparation stages a half's qg and kd in [C, C] tiles: C must be "
                     f"{HALF}; got {C}")
  if not serves(K, b is not None):
    raise ValueError(f"the two-warpgroup preparation takes kda at K = {WARPGROUPS * HALF}; got K={K}, "
                     f"beta {'given' if b is not None else 'None'}")
  gb = groups.group_bound(dtype)
  has_seg = masks is not None
  scratch = dict(
      q_s=smem((C, K), dtype), k_s=smem((C, K), dtype), g_s=smem((C, K), F32),
      r_s=plgpu.SMEM((refs.shape[2], K), F32), a_s=smem((C, K), dtype), bk_s=smem((C, K), dtype),
      ak_s=smem((C, K), dtype), p_s=smem((C, C), dtype), v_s=smem((C, V), dtype), out_v=smem((C, V), dtype),
      b_s=plgpu.SMEM((C,), F32), x_s=smem((C, C), dtype), e_s=smem((C, C), dtype), y_s=smem((C, C), dtype),
      l_s=smem((C, C), dtype), bar=plgpu.Barrier(num_arrivals=6 + SEG_ROWS * has_seg),
      normed=plgpu.Barrier(num_arrivals=WARPGROUPS, num_barriers=2), handed=plgpu.Barrier(),
      inverted=plgpu.Barrier())
  if has_seg:
    scratch["m_s"] = plgpu.SMEM((SEG_ROWS, C), F32)
  # warpgroup 1's staging tiles for both halves of qg and kd (module docstring), where they fit
  late_stage = smem((WARPGROUPS, C, HALF), dtype)
  late = scratch_bytes(dict(scratch, late_s=late_stage)) + phase_bytes(WARPGROUPS) <= SMEM_BYTES
  if late:
    scratch["late_s"] = late_stage
  need = scratch_bytes(scratch) + phase_bytes(WARPGROUPS)
  if need > SMEM_BYTES:
    raise ValueError(f"the two-warpgroup preparation needs {need} bytes of shared memory (at most "
                     f"{SMEM_BYTES})")

  def body(*refs_, q_s, k_s, g_s, r_s, a_s, bk_s, ak_s, p_s, v_s, out_v, b_s, x_s, e_s, y_s, l_s, bar,
           normed, handed, inverted, m_s=None, late_s=None):
    q_r, k_r, g_r, ref_r, v_r, b_r = refs_[:6]
    m_r = refs_[6] if has_seg else None
    qg_r, kd_r, p_r, w_r, u_r = refs_[6 + has_seg:11 + has_seg]
    x_r, gram_r = refs_[11 + has_seg:] if with_inverse else (None, None)
    bi, h, n, hk, rows_t = chunk_program(C, group)
    w = lax.axis_index("wg")
    cols = lambda i: pl.ds(i * HALF, HALF)

    @pl.when(w == 0)
    def _copies():
      copies = [(q_r.at[bi, rows_t, hk], q_s), (k_r.at[bi, rows_t, hk], k_s), (g_r.at[bi, rows_t, h], g_s),
                (ref_r.at[bi, n, :, h], r_s), (v_r.at[bi, rows_t, h], v_s), (b_r.at[bi, h, rows_t], b_s)]
      copies += [(m_r.at[bi, r, rows_t], m_s.at[r]) for r in range(SEG_ROWS if has_seg else 0)]
      for src, dst in copies:
        plgpu.copy_gmem_to_smem(src, dst, bar)

    with phase("cprep2.loads"):
      plgpu.barrier_wait(bar)
    rows = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])
    sq, ch, ck, cv = (C, C), (C, HALF), (C, K), (C, V)
    load = lambda ref: plgpu.load(ref, layout=WGMMA).astype(F32)
    fresh = lax.optimization_barrier
    i_sq = plgpu.broadcasted_iota(jnp.int32, sq, 0, layout=WGMMA)
    j_sq = plgpu.broadcasted_iota(jnp.int32, sq, 1, layout=WGMMA)
    half_col = lambda row, i: lax.broadcast_in_dim(plgpu.load(r_s.at[row, cols(i)], layout=COLS), ch, [1])
    clamp = lambda x: jnp.exp(jnp.minimum(x, bound))

    if qk_l2norm:   # `tiles.l2_normalize_rows`'s sums over the full rows; each warpgroup scales its half
      with phase("cprep2.l2"):
        norms = [lax.rsqrt(jnp.sum(load(t) * load(t), axis=1) + L2_EPS) for t in (q_s, k_s)]
        plgpu.barrier_arrive(normed.at[0])   # both have read the raw rows
        plgpu.barrier_wait(normed.at[0])
        for wi in range(WARPGROUPS):
          @pl.when(w == wi)
          def _():
            for tile, r in zip((q_s, k_s), norms):
              part = tile.at[:, cols(wi)]
              part[...] = (load(part) * rows(r, ch)).astype(dtype)
            plgpu.commit_smem()
        plgpu.barrier_arrive(normed.at[1])   # both halves scaled: the grams read either
        plgpu.barrier_wait(normed.at[1])

    def product(half, form, s, stage):
      """(P, M) `[C, C]` float32: product `s` of half `half`'s `form` ("one", or a block size and the
      level / None for the groups' forms), staged in `stage`, masked to the entries it keeps."""
      q_p, k_p, g_p = (t.at[:, cols(half)] for t in (q_s, k_s, g_s))
      a_p, bk_p, ak_p = stage
      kt = load(k_p)
      if form == "one":
        Gt, R = fresh(load(g_p)), half_col(0, half)
        bk_p[...] = (kt * clamp(R - Gt)).astype(dtype)
        up = clamp(Gt - R)
        a_p[...] = (load(q_p) * up).astype(dtype)
        ak_p[...] = (kt * up).astype(dtype)
        ak = ak_p
      elif s is None:   # the diagonal blocks
        up, down = groups.factors(fresh(load(g_p)), lambda t: half_col(groups.FIRST_ROW + t, half), s, gb,
                                  form)
        bk_p[...] = (kt * down).astype(dtype)
        a_p[...] = (load(q_p) * up).astype(dtype)
        ak_p[...] = (kt * up).astype(dtype)
        ak = ak_p
      else:   # a level: one factor tile, k's serving both sides of M
        E = groups.level_factor(fresh(load(g_p)), lambda t: half_col(groups.FIRST_ROW + t, half), s)
        bk_p[...] = (kt * E).astype(dtype)
        a_p[...] = (load(q_p) * E).astype(dtype)
        ak = bk_p
      plgpu.commit_smem()
      P, M = matmuls((sq, [(a_p, bk_p.T)]), (sq, [(ak, bk_p.T)]))
      if form == "one":
        return P, M
      keep = groups.keep_mask(C, s, form)
      return jnp.where(keep, P, 0.0), jnp.where(keep, M, 0.0)

    zero = lambda: i_sq.astype(F32) * 0.0   # a [C, C] float32 tile of zeros in the products' layout

    def share(half, form, wi, stage):
      """Warpgroup wi's part of half `half`'s grams in `form` ("one", or the diagonal blocks' tokens:
      the halves' or the groups' products)."""
      items = [None] if form == "one" else list(groups.products(C, form))
      P, M = zero(), zero()
      for i, s in enumerate(items):
        if (i + half) % WARPGROUPS == wi:
          Ps, Ms = product(half, form, s, stage)
          P, M = P + Ps, M + Ms
      if form != "one" and half == wi:   # the tile's own diagonal, undecayed (groups.with_diagonal)
        P = groups.with_diagonal(P, load(q_s.at[:, cols(half)]), load(k_s.at[:, cols(half)]))
      return P, M

    def grams_of(wi):
      stage = tuple(t.at[:, cols(wi)] for t in (a_s, bk_s, ak_s))
      P, M = zero(), zero()
      for half in range(WARPGROUPS):
        if grams != "chunk":
          Ph, Mh = share(half, {"halves": groups.HALVES, "groups": groups.GROUP}.get(grams, grams), wi, stage)
        else:   # the chunk's form, or with half_forms the half's (`channel.form_row`)
          form = r_s[channel.form_row(C), half * HALF if half_forms else 0]
          Ph, Mh = groups.by_form(form, lambda: share(half, "one", wi, stage),
                                  lambda block: share(half, block, wi, stage))
        P, M = P + Ph, M + Mh
      return P, M

    with phase("cprep2.grams"):
      P, M = lax.cond(w == 0, lambda: grams_of(0), lambda: grams_of(1))

    same = carry = to_last = None
    if has_seg:
      same, carry, to_last, _ = segment_masks(m_s, None, C)

    def emit(x, tile, dst):
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      tile[...] = x.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(tile, dst)

    beta_rows = lambda: fresh(plgpu.load(b_s, layout=ROWS))

    def e_q(shape, cols_=None):   # e^G (rows reading the carried state)
      Gt = load(g_s if cols_ is None else g_s.at[:, cols_])
      return jnp.exp(Gt) if carry is None else jnp.exp(Gt) * rows(carry, shape)

    def qg_of(i):   # half i's columns of qg = q e^G (float32)
      c = cols(i)
      return load(q_s.at[:, c]) * e_q(ch, c)

    def kd_of(i):   # half i's columns of kd = k e^(G_C - G)
      c = cols(i)
      e_k = jnp.exp(half_col(1, i) - load(g_s.at[:, c]))
      if to_last is not None:
        e_k = e_k * rows(to_last, ch)
      return load(k_s.at[:, c]) * e_k

    def qg_kd(i, tile):   # half i's columns of qg and kd, staged in the [C, 64] tile `tile`
      emit(qg_of(i), tile, qg_r.at[bi, h, rows_t, cols(i)])
      emit(kd_of(i), tile, kd_r.at[bi, h, rows_t, cols(i)])

    def both_halves(out_r, of):   # both halves' columns at once through late_s (one wait for its reads)
      xs = [of(i) for i in range(WARPGROUPS)]
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      for i, x in enumerate(xs):
        late_s.at[i][...] = x.astype(dtype)
      plgpu.commit_smem()
      for i in range(WARPGROUPS):
        plgpu.copy_smem_to_gmem(late_s.at[i], out_r.at[bi, h, rows_t, cols(i)])

    if not late:
      with phase("cprep2.qg_kd"):   # each warpgroup its own half's columns, staged in a [C, 64] tile of
        # its own: P's for warpgroup 0, the inverse's e for warpgroup 1
        for wi, tile in enumerate((p_s, e_s)):
          pl.when(w == wi)(lambda wi=wi, tile=tile: qg_kd(wi, tile))

    @pl.when(w == 1)
    def _second():
      with phase("cprep2.hand_over"):   # P and M as value and rest in the inverse's scratch tiles
        if not late:
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # kd's copy has read e
        for x, (hi, lo) in ((P, (e_s, y_s)), (M, (l_s, x_s))):
          head = x.astype(dtype)
          hi[...] = head
          lo[...] = (x - head.astype(F32)).astype(dtype)
        plgpu.commit_smem()
        plgpu.barrier_arrive(handed)
      if late:
        with phase("cprep2.qg_kd"):   # both halves, while warpgroup 0 sums and inverts
          both_halves(qg_r, qg_of)
          both_halves(kd_r, kd_of)
      with phase("cprep2.u"):
        v_s[...] = (load(v_s) * rows(beta_rows(), cv)).astype(dtype)
        plgpu.commit_smem()
        plgpu.barrier_wait(inverted)
        emit(matmul(x_s, v_s, cv), out_v, u_r.at[bi, h, rows_t])

    @pl.when(w == 0)
    def _first():
      with phase("cprep2.sum"):
        plgpu.barrier_wait(handed)
        P_all = P + (load(e_s) + load(y_s))
        M_all = M + (load(l_s) + load(x_s))
      keep = (i_sq >= j_sq) if same is None else (i_sq >= j_sq) & same
      # above the diagonal the factors do not cancel (they may overflow): the where drops them
      emit(jnp.where(keep, P_all, 0.0), p_s, p_r.at[bi, h, rows_t])
      strict = (i_sq > j_sq) if same is None else (i_sq > j_sq) & same
      with phase("cprep2.inverse"):
        M_all = jnp.where(strict, M_all, 0.0)
        if with_inverse:   # M for the gradients, staged in P's tile
          emit(M_all, p_s, gram_r.at[bi, h, rows_t])
        l_s[...] = (M_all * rows(beta_rows(), sq)).astype(dtype)
        plgpu.commit_smem()
        unit_lower_inverse(l_s, x_s, e_s, y_s)
        plgpu.barrier_arrive(inverted)
        if with_inverse:
          plgpu.copy_smem_to_gmem(x_s, x_r.at[bi, h, rows_t])
      with phase("cprep2.w"):   # beta k e^G in a_s, the grams' staging tile (both warpgroups' products
        # are done: warpgroup 1's before its hand-over); k_s stays for warpgroup 1's kd
        a_s[...] = (load(k_s) * e_q(ck) * rows(beta_rows(), ck)).astype(dtype)
        plgpu.commit_smem()
        emit(matmul(x_s, a_s, ck), ak_s, w_r.at[bi, h, rows_t])

    with phase("cprep2.exit"):
      plgpu.wait_smem_to_gmem(0)

  args = (q, k, G, refs, v, b) + ((masks,) if has_seg else ())
  shape = lambda d: jax.ShapeDtypeStruct((B, Hv, T_pad, d), dtype)
  out_type = (shape(K), shape(K), shape(C), shape(K), shape(V))
  out_type += (shape(C), shape(C)) if with_inverse else ()
  outs = plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=(B, Hv, NC), grid_names=("b", "h", "n"),
      num_threads=WARPGROUPS, thread_name="wg", compiler_params=compiler_params(approx_math=True),
      interpret=interpret,
      kernel_name="chunk_prep_channel2" + ("" if grams == "one" else "_" + grams)
      + ("_parts" if half_forms and grams == "chunk" else ""))(*args)
  return vary_like(outs, args)
