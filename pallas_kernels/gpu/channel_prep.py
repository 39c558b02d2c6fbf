"""Per-channel decay (gla, kda): the per-chunk tensors in one Mosaic GPU kernel, every chunk in parallel,
packed or not.

One program per (batch, value head, chunk) reads q, k (l2-normalising them as they load, with
`qk_l2norm`), v, beta and the chunk-local cumulative log-decay G `[C, K]` (float32) once and writes
the walk's inputs (`prep.ChunkTensors`, module docstring of prep.py) in the operand dtype:
`qg = q e^G`, `kd = k e^(G_C - G)`, `P` (the decayed gram of q and k, j <= i) and, for the delta
family (kda), `w = X (beta k e^G)`, `u = X (beta v)` with `X = (I + L)^-1`, `L = Diag(beta) M`, `M`
the strict decayed gram of k.

The decayed gram `M_ij = sum_c a_ic b_jc e^(G_ic - G_jc)` must not form `e^G` and `e^-G` apart (at
g = -20 a token the second overflows after five tokens). Here it is prep.decayed_gram's one-reference
form: per chunk and channel `R = (max G + min G) / 2`, and one whole-tile product

    M = (a e^(G - R)) (b e^(R - G))^T     masked to j <= i (or j < i)

whose factors all lie within e^(+-bound) when the chunk's decay spans at most twice the bound
(`prep.ref_bound`: 60 nats for bfloat16 operands, 8 for float16; 76 for l2-normalised q, k under
`GpuConfig.unit_ref_bound`). A call where some chunk does not fit
takes the 8-token groups' products instead (`grams="groups"`, groups.py: exact at any decay above
`prep.LOG_DECAY_FLOOR` for bfloat16 operands; float16 operands beyond its bound take prep.py's XLA
preparation with the merge form): the caller's `lax.cond` (`vjp.py`). The grams sum over the key
channels, held in halves of 64. With `grams="chunk"` each program chooses for its own chunk (a
`lax.cond` in the kernel on the chunk's `channel.form_row`): one reference, the halves' products
(32-token diagonal blocks) or the groups', the first that fits; with `half_forms` for each half of
the chunk's key channels apart (the row then holds on each channel its half's form, and each half's
part of the grams is a product, or the groups' products, of its own): a chunk whose strong channels
lie in one half (`GpuConfig.order_channels` puts them there) pays the groups' products on that half
alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from .. import common, prep
from . import channel, channel_prep_split, groups
from .channel import HALF, chunk_cumsum
from .masks import SEG_ROWS, segment_masks, segment_vectors
from .once import lowered_once
from .tiles import (COLS, F32, ROWS, WGMMA, compiler_params, l2_normalize_rows, matmul, matmuls, phase,
                    smem, unit_lower_inverse, vary_like)


GRAMS = ("one", "halves", "groups", "chunk")


def serves(g, beta, segment_ids) -> bool:
  """True for the calls this kernel prepares: per-channel decay `[B, T, H_v, K]`, either family."""
  del beta, segment_ids  # both families; packed rows are served (`masks.segment_vectors`)
  return g is not None and g.ndim == 4


def prepare(q, k, v, g, beta, *, chunk_size: int, dtype, segment_ids=None, interpret=None,
            chunk_multiple: int = 1, cumsum=None, with_inverse: bool = False, grams: str = "one",
            bound: float | None = None, half_forms: bool = False, qk_l2norm: bool = False,
            warpgroups: int = 1):
  """`prep.prepare(q, k, v, g, beta, segment_ids, ...)` for per-channel `g: [B, T, H_v, K]` whose every
  chunk fits the one-reference bound (`channel_grads.fits`; the caller takes XLA's merge form for the
  others), with every matmul operand in `dtype` (16-bit), the tensors in `dtype` and `decay` float32;
  shapes as there (`[B, H_v, NC, C, ...]`); beta None (gla) or `[B, T, H_v]` (kda). chunk_multiple: T is
  padded to whole groups of this many chunks (as in prep.py). cumsum: `chunk_cumsum(g, T_pad, C)` if the
  caller has it. with_inverse (kda): return `(tensors, X, M)`, both `[B, H_v, NC, C, C]` in `dtype`, which
  kda's gradient kernels read (`channel_delta_grads.py`): `X = (I + L)^-1` and the strict decayed gram of
  k `M` (unscaled by beta; one run where rows are packed), from which they take dbeta's `rowsum(dL M)`
  instead of forming M again. grams: "one" (one product about
  the reference R, for chunks within `prep.ref_bound`), "groups" (groups.py's products, exact at any
  decay within `groups.group_bound`), "halves" (the same with diagonal blocks of 32 tokens: one level
  and two diagonal products, for chunks whose halves each fit that bound) or "chunk" (each chunk the
  first of one, halves, groups that fits it, `channel.chunk_forms`: a call with a few strong chunks
  pays the extra products only there; with `half_forms`, each half of a chunk's key channels the
  first that fits the half, `channel.chunk_forms(..., width=HALF)`: for channels ordered strongest
  first, `GpuConfig.order_channels`). bound: the one-reference form's bound on `|G - R|` (default
  `prep.ref_bound(dtype)`; `prep.UNIT_REF_BOUND` only for l2-normalised q and k, whose entries lie in
  [-1, 1]); the caller's test of which chunks fit takes the same. qk_l2norm: q and k are l2-normalised
  in the kernel as they load (over K, float32 sums, rounded to `dtype`, as `common.l2_normalize`)
  before anything reads them. warpgroups: 2 runs kda at K = 128 on two warpgroups
  (`channel_prep_split.py`), the same outputs."""
  if grams not in GRAMS:
    raise ValueError(f"grams must be one of {GRAMS}; got {grams!r}")
  T = q.shape[1]
  C = chunk_size
  T_pad = prep.padded_length(T, C, chunk_multiple)
  G, refs = chunk_cumsum(g, T_pad, C) if cumsum is None else cumsum
  bound = prep.ref_bound(dtype) if bound is None else float(bound)
  if not 0.0 < bound <= prep.ref_bound(dtype, unit=True):
    raise ValueError(f"bound must be in (0, {prep.ref_bound(dtype, unit=True)}] for {jnp.dtype(dtype).name} "
                     f"operands; got {bound}")
  if half_forms and q.shape[-1] % HALF:
    raise ValueError(f"half_forms takes K a multiple of {HALF}; got {q.shape[-1]}")
  if grams == "chunk":
    refs = channel.with_form_row(refs, C, dtype, bound, width=HALF if half_forms else None)
  if with_inverse and beta is None:
    raise ValueError("with_inverse is for the delta family (kda): beta must be given")
  split_served = channel_prep_split.serves(q.shape[-1], beta is not None)
  if warpgroups not in (1, 2) or (warpgroups == 2 and not split_served):
    raise ValueError(f"warpgroups must be 1, or 2 for kda at K = 128; got {warpgroups!r} (K={q.shape[-1]}, "
                     f"beta {'given' if beta is not None else 'None'})")
  return _prepare_kernel(q, k, v, G, refs, beta, chunk_size=C, dtype=dtype, segment_ids=segment_ids,
                         interpret=interpret, with_inverse=with_inverse, grams=grams, bound=bound,
                         half_forms=half_forms, qk_l2norm=qk_l2norm, warpgroups=warpgroups)


@lowered_once(arrays=("segment_ids",))
def _prepare_kernel(q, k, v, G, refs, beta, *, chunk_size: int, dtype, segment_ids, interpret,
                    with_inverse: bool = False, grams: str = "one", bound: float,
                    half_forms: bool = False, qk_l2norm: bool = False, warpgroups: int = 1):
  B, T, H, K = q.shape
  Hv, V = v.shape[2:]
  C = chunk_size
  T_pad = G.shape[1]
  NC = T_pad // C
  group = Hv // H
  delta = beta is not None
  group_bound = groups.group_bound(dtype)
  pad = lambda x: jnp.pad(x.astype(dtype), [(0, 0), (0, T_pad - T), (0, 0), (0, 0)])
  q, k, v = pad(q), pad(k), pad(v)
  b = (jnp.swapaxes(jnp.pad(beta.astype(F32), [(0, 0), (0, T_pad - T), (0, 0)]), 1, 2) if delta
       else None)
  has_seg = segment_ids is not None
  masks = segment_vectors(segment_ids, C, T_pad) if has_seg else None

  # gla reads no v (its u is v itself): 104 KB at K = 128, two programs a multiprocessor
  scratch = dict(
      q_s=smem((C, K), dtype), k_s=smem((C, K), dtype),
      g_s=smem((C, K), F32), r_s=plgpu.SMEM((refs.shape[2], K), F32),
      a_s=smem((C, K), dtype), bk_s=smem((C, K), dtype), p_s=smem((C, C), dtype),
      bar=plgpu.Barrier(num_arrivals=4 + 2 * delta + SEG_ROWS * has_seg))
  if delta:
    scratch.update(v_s=smem((C, V), dtype), out_v=smem((C, V), dtype), ak_s=smem((C, K), dtype),
                   b_s=plgpu.SMEM((C,), F32), x_s=smem((C, C), dtype), e_s=smem((C, C), dtype),
                   y_s=smem((C, C), dtype), l_s=smem((C, C), dtype))
  if has_seg:
    scratch["m_s"] = plgpu.SMEM((SEG_ROWS, C), F32)

  def body(*refs_, q_s, k_s, g_s, r_s, a_s, bk_s, p_s, bar, v_s=None, out_v=None, ak_s=None, b_s=None,
           x_s=None, e_s=None, y_s=None, l_s=None, m_s=None):
    q_r, k_r, g_r, ref_r = refs_[:4]
    rest = list(refs_[4:])
    v_r = rest.pop(0) if delta else None
    b_r = rest.pop(0) if delta else None
    m_r = rest.pop(0) if has_seg else None
    qg_r, kd_r, p_r = rest[:3]
    w_r, u_r = rest[3:5] if delta else (None, None)
    x_r, gram_r = rest[5:7] if with_inverse else (None, None)
    bi, h, n = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
    hk = lax.div(h, group)
    rows_t = pl.ds(n * C, C)
    copies = [(q_r.at[bi, rows_t, hk], q_s), (k_r.at[bi, rows_t, hk], k_s),
              (g_r.at[bi, rows_t, h], g_s), (ref_r.at[bi, n, :, h], r_s)]
    if delta:
      copies += [(v_r.at[bi, rows_t, h], v_s), (b_r.at[bi, h, rows_t], b_s)]
    copies += [(m_r.at[bi, r, rows_t], m_s.at[r]) for r in range(SEG_ROWS if has_seg else 0)]
    for src, dst in copies:
      plgpu.copy_gmem_to_smem(src, dst, bar)
    with phase("cprep.loads"):
      plgpu.barrier_wait(bar)
    if qk_l2norm:
      with phase("cprep.l2"):
        l2_normalize_rows(q_s, C)
        l2_normalize_rows(k_s, C)

    rows = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])
    sq, ck, cv = (C, C), (C, K), (C, V)
    load = lambda ref: plgpu.load(ref, layout=WGMMA).astype(F32)
    fresh = lax.optimization_barrier
    load_G = lambda: fresh(load(g_s))
    col = lambda row: lax.broadcast_in_dim(plgpu.load(r_s.at[row], layout=COLS), ck, [1])
    # the grams' key channels: all of them, or with half_forms (grams="chunk") one half at a time
    # (the tiles' column slices; the grams sum over the channels, so the halves' parts add)
    part_of = lambda ref, cols: ref if cols is None else ref.at[:, cols]
    width = lambda cols: K if cols is None else HALF
    part_col = lambda row, cols: lax.broadcast_in_dim(
        plgpu.load(r_s.at[row] if cols is None else r_s.at[row, cols], layout=COLS), (C, width(cols)), [1])
    clamp = lambda x: jnp.exp(jnp.minimum(x, bound))
    i_sq = plgpu.broadcasted_iota(jnp.int32, sq, 0, layout=WGMMA)
    j_sq = plgpu.broadcasted_iota(jnp.int32, sq, 1, layout=WGMMA)

    def one_grams(cols=None):   # the decayed grams about the reference R (module docstring)
      q_p, k_p, g_p, a_p, bk_p = (part_of(x, cols) for x in (q_s, k_s, g_s, a_s, bk_s))
      G, R = fresh(load(g_p)), part_col(0, cols)
      kt = load(k_p)
      bk_p[...] = (kt * clamp(R - G)).astype(dtype)
      up = clamp(G - R)
      a_p[...] = (load(q_p) * up).astype(dtype)
      if delta:
        part_of(ak_s, cols)[...] = (kt * up).astype(dtype)
      plgpu.commit_smem()
      if delta:
        P, M = matmuls((sq, [(a_p, bk_p.T)]), (sq, [(part_of(ak_s, cols), bk_p.T)]))
        return P, M
      return matmuls((sq, [(a_p, bk_p.T)]))[0], 0.0

    def group_grams(block, cols=None):   # groups.py's products with diagonal blocks of `block` tokens
      q_p, k_p, g_p, a_p, bk_p = (part_of(x, cols) for x in (q_s, k_s, g_s, a_s, bk_s))
      P = M = 0.0
      vec_end = lambda t: part_col(groups.FIRST_ROW + t, cols)
      for s in groups.products(C, block):
        kt = load(k_p)
        if s is None:   # the diagonal blocks: both factors on the same rows
          up, down = groups.factors(fresh(load(g_p)), vec_end, s, group_bound, block)
          bk_p[...] = (kt * down).astype(dtype)
          a_p[...] = (load(q_p) * up).astype(dtype)
          if delta:
            part_of(ak_s, cols)[...] = (kt * up).astype(dtype)
          ak = part_of(ak_s, cols) if delta else None
        else:   # a level: one factor tile (`groups.level_factor`), k's serving both sides of M
          E = groups.level_factor(fresh(load(g_p)), vec_end, s)
          bk_p[...] = (kt * E).astype(dtype)
          a_p[...] = (load(q_p) * E).astype(dtype)
          ak = bk_p
        plgpu.commit_smem()
        if delta:
          Ps, Ms = matmuls((sq, [(a_p, bk_p.T)]), (sq, [(ak, bk_p.T)]))
          M = M + jnp.where(groups.keep_mask(C, s, block), Ms, 0.0)
        else:
          (Ps,) = matmuls((sq, [(a_p, bk_p.T)]))
        P = P + jnp.where(groups.keep_mask(C, s, block), Ps, 0.0)
      return groups.with_diagonal(P, load(q_p), load(k_p)), M

    forms = {"one": one_grams, "halves": lambda cols=None: group_grams(groups.HALVES, cols),
             "groups": lambda cols=None: group_grams(groups.GROUP, cols)}

    def chosen(cols=None):   # "chunk": the form in the refs row `channel.form_row` (on each channel the
      # chunk's form, or with half_forms its half's)
      form = r_s[channel.form_row(C), 0 if cols is None else cols.start]
      return groups.by_form(form, lambda: forms["one"](cols), lambda block: group_grams(block, cols))

    with phase("cprep.grams"):
      if grams in forms:
        P, M = forms[grams]()
      elif not half_forms:
        P, M = chosen()
      else:   # each half's part in its own form; the parts add
        P, M = chosen(pl.ds(0, HALF))
        for i in range(1, K // HALF):
          P_i, M_i = chosen(pl.ds(i * HALF, HALF))
          P, M = P + P_i, M + M_i
      M = M if delta else None

    same = carry = to_last = None
    if has_seg:
      same, carry, to_last, _ = segment_masks(m_s, None, C)
    keep = (i_sq >= j_sq) if same is None else (i_sq >= j_sq) & same
    # above the diagonal the factors do not cancel (they may overflow): the where drops them
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
    # chunk's end)
    with phase("cprep.qg_kd"):
      e_q = jnp.exp(load_G())
      if carry is not None:
        e_q = e_q * rows(carry, ck)
      emit(load(q_s) * e_q, a_s, qg_r.at[bi, h, rows_t])
      e_k = jnp.exp(col(1) - load_G())
      if to_last is not None:
        e_k = e_k * rows(to_last, ck)
      emit(load(k_s) * e_k, bk_s, kd_r.at[bi, h, rows_t])
    if not delta:
      plgpu.wait_smem_to_gmem(0)
      return

    # kda: L = Diag(beta) M (strict, one run), X = (I + L)^-1 by block doubling (delta_prep.py)
    beta_rows = lambda: fresh(plgpu.load(b_s, layout=ROWS))
    keep = (i_sq > j_sq) if same is None else (i_sq > j_sq) & same
    with phase("cprep.inverse"):
      M = jnp.where(keep, M, 0.0)
      if with_inverse:   # M for the gradients (dbeta's rowsum(dL M)), staged in P's tile
        emit(M, p_s, gram_r.at[bi, h, rows_t])
      l_s[...] = (M * rows(beta_rows(), sq)).astype(dtype)
      plgpu.commit_smem()
      unit_lower_inverse(l_s, x_s, e_s, y_s)
      if with_inverse:
        plgpu.copy_smem_to_gmem(x_s, x_r.at[bi, h, rows_t])
    # beta k e^G and beta v replace k and v (their other uses are done); w = X (beta k e^G), u = X (beta v)
    with phase("cprep.w_u"):
      e_q = jnp.exp(load_G())
      if carry is not None:
        e_q = e_q * rows(carry, ck)
      k_s[...] = (load(k_s) * e_q * rows(beta_rows(), ck)).astype(dtype)
      v_s[...] = (load(v_s) * rows(beta_rows(), cv)).astype(dtype)
      plgpu.commit_smem()
      emit(matmul(x_s, k_s, ck), ak_s, w_r.at[bi, h, rows_t])
      emit(matmul(x_s, v_s, cv), out_v, u_r.at[bi, h, rows_t])
    with phase("cprep.exit"):
      plgpu.wait_smem_to_gmem(0)

  args = (q, k, G, refs) + ((v, b) if delta else ()) + ((masks,) if has_seg else ())
  shape = lambda d: jax.ShapeDtypeStruct((B, Hv, T_pad, d), dtype)
  out_type = ((shape(K), shape(K), shape(C)) + ((shape(K), shape(V)) if delta else ())
              + ((shape(C), shape(C)) if with_inverse else ()))
  if warpgroups == 2:
    outs = channel_prep_split.kernel(q, k, v, G, refs, b, masks, chunk_size=C, dtype=dtype,
                                     interpret=interpret, with_inverse=with_inverse, grams=grams,
                                     bound=bound, half_forms=half_forms, qk_l2norm=qk_l2norm)
  else:
    outs = vary_like(plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=(B, Hv, NC), grid_names=("b", "h", "n"),
        compiler_params=compiler_params(approx_math=True), interpret=interpret,
        kernel_name="chunk_prep_channel" + ("" if grams == "one" else "_" + grams)
        + ("_parts" if half_forms and grams == "chunk" else ""))(*args), args)
  outs = [x.reshape(B, Hv, NC, C, x.shape[-1]) for x in outs]
  qg, kd, p = outs[:3]
  decay = jnp.swapaxes(jnp.exp(refs[:, :, 1]), 1, 2)     # e^(G_C), [B, H_v, NC, K]
  if has_seg:
    carry_last = masks[:, 2].reshape(B, NC, C)[..., -1]
    decay = decay * carry_last[:, None, :, None]
  if delta:
    w, u = outs[3:5]
  else:
    w, u = None, prep.to_chunks(v, C, T_pad)
  t = prep.ChunkTensors(qg=qg, kd=kd, w=w, u=u, p=p, decay=decay)
  return (t, outs[5], outs[6]) if with_inverse else t
