"""Per-channel decay at any gate strength (`pallas_kernels/gpu/groups.py`): the kernels' 8-token groups'
grams in the Mosaic GPU interpreter, bfloat16 operands.

- The preparation kernel's grams (`grams="groups"`) against float64 sums at g = -20 on every channel,
  uniform in [-20, 0], and -inf on some tokens (floored at prep.LOG_DECAY_FLOOR: finite); the halves'
  form (`grams="halves"`) at g = -4; `grams="chunk"` with each half of K = 128 key channels in a form
  of its own.
- gla and kda end to end (the preparation kernel, the walks, the gradient kernels) against the float64
  loop: o, the final state and every gradient, at strong gates, at the KDA layer's own gates (chunks of
  both forms in one call) and with -inf tokens, grouped heads and packed rows; a spy checks which
  kernels ran, forward and backward (`grams="chunk"`, gla's gradients "groups").
- `grams="chunk"`: each chunk gets exactly the one-reference, the halves' or the groups' tensors, by its
  own form; in kda's key side, each half of a chunk's key channels by its own channels' form.
- A level's one factor tile (`groups.level_factor`, the levels' products in both kernels) equals
  `groups.factors`' up and down exactly on the rows the level reads them, at decays from 0 to -inf.
- The bound: bfloat16 operands always fit the groups (no per-head XLA branch is built); float16 ones
  fit 2.2 nats a token.
"""

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention_jax.pallas_kernels import prep
from linear_attention_jax.pallas_kernels.gpu import channel, channel_delta_grads, channel_grads, channel_prep
from linear_attention_jax.pallas_kernels.gpu import groups
from linear_attention_jax.pallas_kernels.gpu.tiles import COLS, WGMMA
from tests.ops.conftest import make_inputs, rel_rms
from tests.pallas_kernels.gpu.util import KERNELS, PARAMS, check, packed_runs


def _float64_grams(q, k, g):
  """P (j <= i) and the strict M of k with k, per chunk of 64, float64, g floored as the kernels do."""
  g = np.maximum(np.asarray(g, np.float64), prep.LOG_DECAY_FLOOR)
  T = q.shape[0]
  P, M = [], []
  for c in range(0, T, 64):
    G = np.cumsum(g[c:c + 64], axis=0)
    D = np.exp(np.minimum(G[:, None] - G[None], 0.0))
    qc, kc = np.asarray(q[c:c + 64], np.float64), np.asarray(k[c:c + 64], np.float64)
    P.append(np.tril(np.einsum("ic,jc,ijc->ij", qc, kc, D)))
    M.append(np.tril(np.einsum("ic,jc,ijc->ij", kc, kc, D), -1))
  return P, M


@pytest.mark.parametrize("gates,grams", [("minus20", "groups"), ("uniform", "groups"),
                                         ("minus_inf", "groups"), ("minus4", "halves"), ("apart", "chunk")])
def test_group_grams_equal_float64_sums_at_any_gate_strength(gates, grams):
  # "apart": K = 128, each half of the key channels its own form (the grams sum the halves' parts):
  # chunk 0 the groups' in its first half and one reference in its second, chunk 1 the halves' in
  # its first and the groups' in its second
  B, T, H, K = 1, 128, 1, 128 if gates == "apart" else 64
  r = np.random.default_rng(5)
  q, k, v = (r.normal(size=(B, T, H, K)).astype(np.float32) for _ in range(3))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  g = {"minus20": np.full((B, T, H, K), -20.0), "uniform": r.uniform(-20, 0, (B, T, H, K)),
       "minus4": np.full((B, T, H, K), -4.0)}.get(gates, r.uniform(-3, 0, (B, T, H, K))).astype(np.float32)
  if gates == "minus_inf":
    g[0, 5, 0, :16] = -np.inf
    g[0, 70] = -np.inf
  if gates == "apart":
    g = r.uniform(-0.5, 0.0, (B, T, H, K)).astype(np.float32)
    g[0, :64, 0, :64] = r.uniform(-20.0, 0.0, (64, 64))
    g[0, 64:, 0, :64] = -2.5
    g[0, 64:, 0, 64:] = r.uniform(-20.0, 0.0, (64, 64))
    parts = np.asarray(channel.chunk_forms(channel.chunk_cumsum(jnp.asarray(g), T, 64)[1], 64, jnp.bfloat16,
                                           width=64))[0, :, 0]
    np.testing.assert_array_equal(parts, [[channel.GROUPS, channel.ONE], [channel.HALVES, channel.GROUPS]])
  beta = r.uniform(0.1, 1.0, (B, T, H)).astype(np.float32)
  cumsum = channel.chunk_cumsum(jnp.asarray(g), T, 64)
  assert not bool(channel.fits(cumsum[0], 64, jnp.bfloat16))   # beyond one reference
  assert bool(groups.fits(cumsum[0], 64, jnp.bfloat16))
  if grams == "halves":   # -4 a token: 256 nats over a chunk, 128 over each half
    assert (np.asarray(channel.chunk_forms(cumsum[1], 64, jnp.bfloat16)) == channel.HALVES).all()
  cast = lambda x: jnp.asarray(x, jnp.bfloat16)
  t, _, M_got = channel_prep.prepare(cast(q), cast(k), cast(v), jnp.asarray(g), jnp.asarray(beta),
                                     chunk_size=64, dtype=jnp.bfloat16, interpret=PARAMS, with_inverse=True,
                                     grams=grams, half_forms=gates == "apart")
  qb, kb = (np.asarray(cast(x).astype(jnp.float32))[0, :, 0] for x in (q, k))
  P, M = _float64_grams(qb, kb, g[0, :, 0])
  for c in range(2):
    # P, and the strict M that the gradient kernels read (zero on and above the diagonal)
    for got, want in ((t.p[0, 0, c], P[c]), (M_got[0, 0, c], M[c])):
      got = np.asarray(got, np.float64)
      assert np.all(np.isfinite(got))
      assert rel_rms(got, want) < 1e-2, (c, rel_rms(got, want))
    assert not np.asarray(M_got[0, 0, c], np.float64)[np.triu_indices(64)].any()
  # w and u (through M and the inverse) against XLA's float32 preparation with the merge-form gram
  ref = prep.prepare(jnp.asarray(qb)[None, :, None], jnp.asarray(kb)[None, :, None],
                     cast(v).astype(jnp.float32), prep.floor_log_decay(jnp.asarray(g)), jnp.asarray(beta),
                     None, chunk_size=64, dtype=jnp.float32, inverse_dtype=jnp.float32, gram_method="merge")
  for name in ("w", "u", "qg", "kd"):
    a, b = np.asarray(getattr(t, name), np.float64), np.asarray(getattr(ref, name), np.float64)
    assert np.all(np.isfinite(a)) and rel_rms(a, b) < 1e-2, (name, rel_rms(a, b))


def _spy(monkeypatch):
  seen = []
  for module, name in ((channel_prep, "prepare"), (channel_grads, "chunk_grads"),
                       (channel_delta_grads, "key_side")):
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **k: seen.append(
        (_n, k.get("grams", "one"))) or _f(*a, **k))
  return seen


def _kda_layer_gates(r, shape):
  """KimiDeltaAttention's gates at initialisation: -A softplus(a + dt_bias), A ~ U(1, 16) per head (the
  first head at the range's top, where a 64-token chunk decays past one reference's bound)."""
  A = r.uniform(1.0, 16.0, (shape[2], 1))
  A[0] = 16.0
  dt = np.exp(r.uniform(np.log(1e-3), np.log(0.1), shape[2:]))
  return (-A * np.logaddexp(0.0, r.normal(size=shape) + dt + np.log(-np.expm1(-dt)))).astype(np.float32)


@pytest.mark.parametrize("variant,gates,packed", [("gla", "strong", True), ("kda", "strong", False),
                                                  ("kda", "layer", True), ("gla", "minus_inf", False),
                                                  ("kda", "minus_inf", False)])
def test_per_channel_kernels_at_any_gate_strength_match_the_float64_loop(monkeypatch, variant, gates,
                                                                          packed):
  seen = _spy(monkeypatch)
  T = 130 + len(variant) + len(gates) + packed   # a fresh trace per case (the spy sees traces)
  inp = make_inputs(variant, B=1, T=T, H=1, Hv=2, K=64, V=64, gates="strong" if gates == "strong" else "normal",
                    seed=61)
  r = np.random.default_rng(62)
  if gates == "layer":
    inp["g"] = _kda_layer_gates(r, inp["g"].shape)
  if gates == "minus_inf":   # forget everything at one token on some channels, and on all at another
    g = np.asarray(inp["g"]).copy() * 8.0
    g[0, 3, :, :20] = -np.inf
    g[0, 100] = -np.inf
    inp["g"] = g
  G, refs = channel.chunk_cumsum(jnp.asarray(inp["g"]), 192, 64)
  assert not bool(channel.fits(G, 64, jnp.bfloat16))
  if gates == "layer":   # chunks of several forms in one call: each kernel program takes its own
    forms = np.asarray(channel.chunk_forms(refs, 64, jnp.bfloat16))
    assert (forms == channel.ONE).any() and (forms == channel.HALVES).any(), forms
  check(variant, inp, seg=packed_runs(T) if packed else None, dtype=jnp.bfloat16, tol=1e-2, config=KERNELS)
  ran = {(name, grams) for name, grams in seen if grams != "one"}
  assert ran == ({("prepare", "chunk"), ("key_side", "chunk")} if variant == "kda" else
                 {("prepare", "chunk"), ("chunk_grads", "groups")}), seen


@pytest.mark.parametrize("delta", [False, True], ids=["gla", "kda"])
def test_each_chunk_takes_its_own_form(delta):
  # grams="chunk": each chunk gets exactly the tensors of the first form that fits it: one reference
  # (mild gates), the halves' products (2.5 nats a token: 160 over the chunk, 80 over each half) or the
  # groups' (up to 20 nats a token), in one call over two value heads
  B, T, H, K = 1, 256, 1, 64
  r = np.random.default_rng(7)
  q, k, v = (jnp.asarray(r.normal(size=(B, T, H, K)), jnp.bfloat16) for _ in range(3))
  v = jnp.concatenate([v, v[..., ::-1]], axis=2)
  g = r.uniform(-0.5, 0.0, (B, T, 2, K)).astype(np.float32)
  g[:, 64:128, 0] = -2.5
  g[:, 192:, 0] = r.uniform(-20.0, 0.0, (B, 64, K))
  g[:, 128:192, 1] = -2.5
  g[:, :64, 1] = r.uniform(-20.0, 0.0, (B, 64, K))
  beta = jnp.asarray(r.uniform(0.1, 1.0, (B, T, 2)), jnp.float32) if delta else None
  forms = np.asarray(channel.chunk_forms(channel.chunk_cumsum(jnp.asarray(g), T, 64)[1], 64, jnp.bfloat16))
  one, halves, grouped = channel.ONE, channel.HALVES, channel.GROUPS
  np.testing.assert_array_equal(forms[0], [[one, grouped], [halves, one], [one, halves], [grouped, one]])
  run = lambda grams: channel_prep.prepare(q, k, v, jnp.asarray(g), beta, chunk_size=64, dtype=jnp.bfloat16,
                                           interpret=PARAMS, with_inverse=delta, grams=grams)
  by = {grams: jax.tree.leaves(run(grams)) for grams in ("one", "halves", "groups", "chunk")}
  name = {one: "one", halves: "halves", grouped: "groups"}
  for i, got in enumerate(by["chunk"]):
    if got.ndim < 4:   # the chunks' decay vector (no form)
      continue
    for h in range(2):
      for n in range(4):
        want = by[name[forms[0, n, h]]][i]
        np.testing.assert_array_equal(np.asarray(got[0, h, n]), np.asarray(want[0, h, n]))


def _key_side_inputs():
  """kda's key side at K = 128 (two halves of 64 channels) over four chunks whose halves take the forms
  `parts` (one | one, groups | one, one | halves, halves | groups): `(args, parts)`."""
  B, T, Hv, K, V, C = 1, 256, 1, 128, 64, 64
  NC = T // C
  r = np.random.default_rng(9)
  g = r.uniform(-0.5, 0.0, (B, T, Hv, K)).astype(np.float32)
  g[:, 64:128, :, :64] = r.uniform(-20.0, 0.0, (B, 64, Hv, 64))   # chunk 1: groups | one
  g[:, 128:192, :, 64:] = -2.5                                     # chunk 2: one | halves
  g[:, 192:, :, :64] = -2.5                                        # chunk 3: halves | groups
  g[:, 192:, :, 64:] = r.uniform(-20.0, 0.0, (B, 64, Hv, 64))
  G, refs = channel.chunk_cumsum(jnp.asarray(g), T, C)
  one, halves, grouped = channel.ONE, channel.HALVES, channel.GROUPS
  parts = np.asarray(channel.chunk_forms(refs, C, jnp.bfloat16, width=64))[0, :, 0]
  np.testing.assert_array_equal(parts, [[one, one], [grouped, one], [one, halves], [halves, grouped]])
  np.testing.assert_array_equal(np.asarray(channel.chunk_forms(refs, C, jnp.bfloat16))[0, :, 0],
                                parts.max(axis=-1))
  bf = lambda *shape: jnp.asarray(r.normal(size=shape) * 0.3, jnp.bfloat16)
  q, k = bf(B, T, Hv, K), bf(B, T, Hv, K)
  b = jnp.asarray(r.uniform(0.1, 1.0, (B, Hv, T)), jnp.float32)
  do, u, dr = bf(B, T, Hv, V), bf(B, Hv, T, V), bf(B, Hv, T, V)
  lower = np.tril(np.ones((C, C), bool))
  dP = jnp.asarray(np.asarray(bf(B, Hv, T, C), np.float32) * np.tile(lower, (NC, 1)), jnp.bfloat16)
  dM = jnp.asarray(np.asarray(bf(B, Hv, T, C), np.float32) * np.tile(np.tril(lower, -1), (NC, 1)),
                   jnp.bfloat16)
  states, dstates = bf(B, Hv, NC, V, K), bf(B, Hv, NC, V, K)
  return (q, k, G, refs, b, do, u, dr, dP, dM, states, dstates), parts


def test_each_half_of_the_key_channels_takes_its_own_form():
  # kda's key side, grams="chunk", K = 128 (two halves of 64 channels): each half of each chunk gets
  # exactly the dq, dk, dG columns of the form its own channels need, so a chunk whose strong channels
  # lie in one half takes one reference in the other
  args, parts = _key_side_inputs()
  C, NC = 64, 4
  one, halves, grouped = channel.ONE, channel.HALVES, channel.GROUPS
  run = lambda grams: channel_delta_grads.key_side(*args, dtype=jnp.bfloat16, interpret=PARAMS,
                                                   grams=grams)[:3]
  by = {grams: [np.asarray(x) for x in run(grams)] for grams in ("one", "halves", "groups", "chunk")}
  name = {one: "one", halves: "halves", grouped: "groups"}
  for i in range(3):   # dq, dk, dG [B, T, H_v, K]
    for n in range(NC):
      for half in range(2):
        at = (0, slice(n * C, (n + 1) * C), 0, slice(half * 64, (half + 1) * 64))
        np.testing.assert_array_equal(by["chunk"][i][at], by[name[parts[n, half]]][i][at])
  assert all(np.isfinite(x).all() for x in by["chunk"])


def test_the_key_side_takes_the_reverse_cumsum_of_dG_to_float32_precision():
  # reverse_cumsum=True: dg = U dG at the end of each program, dG as three bfloat16 tiles on the tensor
  # cores; against dG's reverse cumsum in float64 (every chunk form), the other outputs bit for bit
  args, _ = _key_side_inputs()
  run = lambda summed: [np.asarray(x, np.float64) for x in channel_delta_grads.key_side(
      *args, dtype=jnp.bfloat16, interpret=PARAMS, grams="chunk", reverse_cumsum=summed)]
  plain, summed = run(False), run(True)
  dG = plain[2].reshape(1, 4, 64, 1, 128)
  want = np.flip(np.cumsum(np.flip(dG, 2), 2), 2).reshape(plain[2].shape)
  err = np.abs(summed[2] - want)
  assert err.max() <= 1e-6 * np.abs(want).max(), err.max() / np.abs(want).max()
  assert np.median(err / np.maximum(np.abs(want), 1e-30)) < 1e-6
  assert np.abs(want - plain[2]).max() > 0.1 * np.abs(want).max()   # the sum is not dG
  for a, b in zip(plain[:2] + plain[3:], summed[:2] + summed[3:]):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="bfloat16"):
    channel_delta_grads.key_side(*args, dtype=jnp.float16, interpret=PARAMS, reverse_cumsum=True)


def test_bfloat16_always_fits_the_groups_and_float16_does_not():
  assert groups.always_fits(jnp.bfloat16) and not groups.always_fits(jnp.float16)
  G, _ = channel.chunk_cumsum(jnp.full((1, 64, 1, 64), -1e9), 64, 64)   # floored to -20 a token
  assert bool(groups.fits(G, 64, jnp.bfloat16)) and not bool(groups.fits(G, 64, jnp.float16))
  G, _ = channel.chunk_cumsum(jnp.full((1, 64, 1, 64), -2.0), 64, 64)   # 16 nats a group: f16's edge
  assert bool(groups.fits(G, 64, jnp.float16))
  with pytest.raises(ValueError, match="power of two"):
    groups.groups(24)


def test_a_levels_one_factor_tile_equals_its_two_factors_where_the_level_reads_them():
  # groups.level_factor against groups.factors, in a kernel in the interpreter, at every level of a
  # 64-token chunk whose channels decay from 0 to 20 nats a token (-inf floored): exactly `up` on each
  # level's later rows, exactly `down` on its earlier rows, finite and within [0, 1] everywhere
  C, W = 64, 64
  r = np.random.default_rng(11)
  g = r.uniform(-20.0, 0.0, (1, C, 1, W)).astype(np.float32) * r.uniform(0.0, 1.0, (1, 1, 1, W))
  g[0, 9, 0, :8] = -np.inf
  G, refs = channel.chunk_cumsum(jnp.asarray(g), C, C)
  G, refs = G[0, :, 0], refs[0, 0, :, 0]   # [C, W], [2 + NG, W]
  levels = groups.levels(C)
  out_shape = jax.ShapeDtypeStruct((len(levels), 3, C, W), jnp.float32)

  def body(g_r, ref_r, out_r, g_s, r_s, o_s, bar):
    plgpu.copy_gmem_to_smem(g_r, g_s, bar)
    plgpu.copy_gmem_to_smem(ref_r, r_s, bar)
    plgpu.barrier_wait(bar)
    col = lambda row: jax.lax.broadcast_in_dim(plgpu.load(r_s.at[row], layout=COLS), (C, W), [1])
    vec_end = lambda t: col(groups.FIRST_ROW + t)
    for n, s in enumerate(levels):
      Gt = plgpu.load(g_s, layout=WGMMA)
      up, down = groups.factors(Gt, vec_end, s, groups.GROUP_BOUND)
      for j, x in enumerate((groups.level_factor(Gt, vec_end, s), up, down)):
        o_s.at[n, j][...] = x
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, out_r)
    plgpu.wait_smem_to_gmem(0)

  scratch = dict(g_s=plgpu.SMEM((C, W), jnp.float32), r_s=plgpu.SMEM(refs.shape, jnp.float32),
                 o_s=plgpu.SMEM(out_shape.shape, jnp.float32), bar=plgpu.Barrier(num_arrivals=2))
  out = np.asarray(plgpu.kernel(body, out_type=out_shape, scratch_types=scratch, grid=(1,), grid_names=("x",),
                                interpret=PARAMS)(G, refs))
  i = np.arange(C)[:, None]
  for n, s in enumerate(levels):
    E, up, down = out[n]
    later = np.broadcast_to((i // s) % 2 == 1, E.shape)
    assert np.isfinite(E).all() and (E >= 0).all() and (E <= 1).all()
    np.testing.assert_array_equal(E[later], up[later])
    np.testing.assert_array_equal(E[~later], down[~later])
    assert (E < 1e-30).any() and (E > 0.5).any()   # the test's decays reach both ends
