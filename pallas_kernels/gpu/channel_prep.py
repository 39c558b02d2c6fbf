"""Per-channel decay (gla, kda): the per-chunk tensors in one Mosaic GPU kernel, every chunk in parallel,
packed or not.

One program per (batch, value head, chunk) reads q, k, v, beta and the chunk-local cumulative
log-decay G `[C, K]` (float32) once and writes the walk's inputs (`prep.ChunkTensors`, module docstring
of prep.py) in the operand dtype: `qg = q e^G`, `kd = k e^(G_C - G)`, `P` (the decayed gram of q and k,
j <= i) and, for the delta family (kda), `w = X (beta k e^G)`, `u = X (beta v)` with `X = (I + L)^-1`,
`L = Diag(beta) M`, `M` the strict decayed gram of k.

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
channels, taken in halves of 64, each half's part a product (or the groups' products) of its own.
With `grams="chunk"` each program chooses for each half of its own chunk (a `lax.cond` in the kernel
on the chunk's `channel.form_row`, which holds the form of each channel's half): one reference, the
halves' products (32-token diagonal blocks) or the groups', the first that fits the half's channels.
A chunk whose strong channels lie in one half (`GpuConfig.order_channels` puts them there) pays the
groups' products on that half alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from .. import common, prep
from . import groups
from . import channel
from .channel import HALF, chunk_cumsum
from .masks import SEG_ROWS, segment_masks, segment_vectors
from .tiles import (COLS, F32, ROWS, WGMMA, compiler_params, matmul, matmuls, phase, smem,
                    unit_lower_inverse, vary_like)


GRAMS = ("one", "halves", "groups", "chunk")


def serves(g, beta, segment_ids) -> bool:
  """True for the calls this kernel prepares: per-channel decay `[B, T, H_v, K]`, either family."""
  del beta, segment_ids  # both families; packed rows are served (`masks.segment_vectors`)
  return g is not None and g.ndim == 4


def prepare(q, k, v, g, beta, *, chunk_size: int, dtype, segment_ids=None, interpret=None,
            chunk_multiple: int = 1, cumsum=None, with_inverse: bool = False, grams: str = "one",
            bound: float | None = None):
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
  and two diagonal products, for chunks whose halves each fit that bound) or "chunk" (each half of
  each chunk's key channels the first of one, halves, groups that fits it, `channel.chunk_forms(...,
  width=HALF)`: a call with a few strong chunks pays the extra products only there). bound: the
  one-reference form's bound on `|G - R|` (default `prep.ref_bound(dtype)`; `prep.UNIT_REF_BOUND` only for l2-normalised q and k, whose entries lie in
  [-1, 1]); the caller's test of which chunks fit takes the same."""
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
  if grams == "chunk":
    refs = channel.with_form_row(refs, C, dtype, bound, width=HALF)
  if with_inverse and beta is None:
    raise ValueError("with_inverse is for the delta family (kda): beta must be given")
  return _prepare_kernel(q, k, v, G, refs, beta, chunk_size=C, dtype=dtype, segment_ids=segment_ids,
                         interpret=interpret, with_inverse=with_inverse, grams=grams, bound=bound)


def _prepare_kernel(q, k, v, G, refs, beta, *, chunk_size: int, dtype, segment_ids, interpret,
                    with_inverse: bool = False, grams: str = "one", bound: float):
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

  if K % HALF:
    raise ValueError(f"K must be a multiple of {HALF}; got {K}")
  KH = K // HALF
  halves = lambda dt: smem((KH, C, HALF), dt)   # the key channels in halves of 64, each its own grams
  # gla reads no v (its u is v itself): 104 KB at K = 128, two programs a multiprocessor
  scratch = dict(
      q_s=halves(dtype), k_s=halves(dtype), g_s=halves(F32), r_s=plgpu.SMEM((refs.shape[2], K), F32),
      a_s=halves(dtype), bk_s=halves(dtype), p_s=smem((C, C), dtype),
      bar=plgpu.Barrier(num_arrivals=3 * KH + 1 + 2 * delta + SEG_ROWS * has_seg))
  if delta:
    scratch.update(v_s=smem((C, V), dtype), out_v=smem((C, V), dtype), ak_s=halves(dtype),
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
    cols = lambda i: pl.ds(i * HALF, HALF)
    copies = [(ref_r.at[bi, n, :, h], r_s)]
    for i in range(KH):
      copies += [(q_r.at[bi, rows_t, hk, cols(i)], q_s.at[i]), (k_r.at[bi, rows_t, hk, cols(i)], k_s.at[i]),
                 (g_r.at[bi, rows_t, h, cols(i)], g_s.at[i])]
    if delta:
      copies += [(v_r.at[bi, rows_t, h], v_s), (b_r.at[bi, h, rows_t], b_s)]
    copies += [(m_r.at[bi, r, rows_t], m_s.at[r]) for r in range(SEG_ROWS if has_seg else 0)]
    for src, dst in copies:
      plgpu.copy_gmem_to_smem(src, dst, bar)
    with phase("cprep.loads"):
      plgpu.barrier_wait(bar)

    rows = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])
    sq, ch, cv = (C, C), (C, HALF), (C, V)
    load = lambda ref: plgpu.load(ref, layout=WGMMA).astype(F32)
    fresh = lax.optimization_barrier
    load_G = lambda i: fresh(load(g_s.at[i]))
    col = lambda row, i: lax.broadcast_in_dim(plgpu.load(r_s.at[row, cols(i)], layout=COLS), ch, [1])
    clamp = lambda x: jnp.exp(jnp.minimum(x, bound))
    i_sq = plgpu.broadcasted_iota(jnp.int32, sq, 0, layout=WGMMA)
    j_sq = plgpu.broadcasted_iota(jnp.int32, sq, 1, layout=WGMMA)

    # each gram's part over the halves `parts` of the key channels in one form: their products chain in
    # one accumulator (a fixed form takes every half at once; "chunk" each half apart)
    def one_grams(parts):   # the decayed grams about the reference R (module docstring)
      for i in parts:
        G, R = load_G(i), col(0, i)
        kt = load(k_s.at[i])
        bk_s.at[i][...] = (kt * clamp(R - G)).astype(dtype)
        up = clamp(G - R)
        a_s.at[i][...] = (load(q_s.at[i]) * up).astype(dtype)
        if delta:
          ak_s.at[i][...] = (kt * up).astype(dtype)
      plgpu.commit_smem()
      P_pairs = [(a_s.at[i], bk_s.at[i].T) for i in parts]
      if delta:
        return matmuls((sq, P_pairs), (sq, [(ak_s.at[i], bk_s.at[i].T) for i in parts]))
      return matmuls((sq, P_pairs))[0], 0.0

    def group_grams(parts, block):   # groups.py's products with diagonal blocks of `block` tokens
      P = M = 0.0
      for s in groups.products(C, block):
        for i in parts:
          kt = load(k_s.at[i])
          vec_end = lambda t, i=i: col(groups.FIRST_ROW + t, i)
          if s is None:   # the diagonal blocks: both factors on the same rows
            up, down = groups.factors(load_G(i), vec_end, s, group_bound, block)
            bk_s.at[i][...] = (kt * down).astype(dtype)
            a_s.at[i][...] = (load(q_s.at[i]) * up).astype(dtype)
            if delta:
              ak_s.at[i][...] = (kt * up).astype(dtype)
          else:   # a level: one factor tile (`groups.level_factor`), k's serving both sides of M
            E = groups.level_factor(load_G(i), vec_end, s)
            bk_s.at[i][...] = (kt * E).astype(dtype)
            a_s.at[i][...] = (load(q_s.at[i]) * E).astype(dtype)
        plgpu.commit_smem()
        ak = ak_s if s is None else bk_s
        P_pairs = [(a_s.at[i], bk_s.at[i].T) for i in parts]
        if delta:
          Ps, Ms = matmuls((sq, P_pairs), (sq, [(ak.at[i], bk_s.at[i].T) for i in parts]))
          M = M + jnp.where(groups.keep_mask(C, s, block), Ms, 0.0)
        else:
          (Ps,) = matmuls((sq, P_pairs))
        P = P + jnp.where(groups.keep_mask(C, s, block), Ps, 0.0)
      for i in parts:
        P = groups.with_diagonal(P, load(q_s.at[i]), load(k_s.at[i]))
      return P, M

    forms = {"one": one_grams, "halves": lambda parts: group_grams(parts, groups.HALVES),
             "groups": lambda parts: group_grams(parts, groups.GROUP)}

    def half_grams(i):   # "chunk": half i's own form (`channel.chunk_forms(..., width=HALF)`), its refs
      # row `channel.form_row` holding on each channel the form of the channel's half
      form = r_s[channel.form_row(C), i * HALF]
      return lax.cond(form < 0.5, lambda: forms["one"]([i]),
                      lambda: lax.cond(form < 1.5, lambda: forms["halves"]([i]), lambda: forms["groups"]([i])))

    with phase("cprep.grams"):   # P and M sum over the key channels: the halves' parts add
      if grams in forms:
        P, M = forms[grams](range(KH))
      else:
        P, M = half_grams(0)
        for i in range(1, KH):
          P_i, M_i = half_grams(i)
          P, M = P + P_i, M + M_i

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

    def e_q(i):   # e^G, and zero on rows reading no carried state
      e = jnp.exp(load_G(i))
      return e if carry is None else e * rows(carry, ch)

    # qg = q e^G (rows reading the carried state); kd = k e^(G_C - G) (rows whose write reaches the
    # chunk's end)
    with phase("cprep.qg_kd"):
      for i in range(KH):
        emit(load(q_s.at[i]) * e_q(i), a_s.at[i], qg_r.at[bi, h, rows_t, cols(i)])
        e_k = jnp.exp(col(1, i) - load_G(i))
        if to_last is not None:
          e_k = e_k * rows(to_last, ch)
        emit(load(k_s.at[i]) * e_k, bk_s.at[i], kd_r.at[bi, h, rows_t, cols(i)])
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
      for i in range(KH):
        k_s.at[i][...] = (load(k_s.at[i]) * e_q(i) * rows(beta_rows(), ch)).astype(dtype)
      v_s[...] = (load(v_s) * rows(beta_rows(), cv)).astype(dtype)
      plgpu.commit_smem()
      for i in range(KH):
        emit(matmul(x_s, k_s.at[i], ch), ak_s.at[i], w_r.at[bi, h, rows_t, cols(i)])
      emit(matmul(x_s, v_s, cv), out_v, u_r.at[bi, h, rows_t])
    with phase("cprep.exit"):
      plgpu.wait_smem_to_gmem(0)

  args = (q, k, G, refs) + ((v, b) if delta else ()) + ((masks,) if has_seg else ())
  shape = lambda d: jax.ShapeDtypeStruct((B, Hv, T_pad, d), dtype)
  out_type = ((shape(K), shape(K), shape(C)) + ((shape(K), shape(V)) if delta else ())
              + ((shape(C), shape(C)) if with_inverse else ()))
  outs = plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=(B, Hv, NC), grid_names=("b", "h", "n"),
      compiler_params=compiler_params(approx_math=True), interpret=interpret,
      kernel_name="chunk_prep_channel" + ("" if grams == "one" else "_" + grams))(*args)
  outs = [x.reshape(B, Hv, NC, C, x.shape[-1]) for x in vary_like(outs, args)]
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
