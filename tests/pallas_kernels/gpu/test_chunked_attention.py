"""The Mosaic GPU kernels in the Mosaic GPU interpreter against the NumPy float64 loop: o, final state
and every gradient (q, k, v, g, beta, initial state) for both families and every decay kind, with grouped
value heads, packed sequences, T not a multiple of the chunk, strong gates, split value blocks; and the
walk kernels alone against a float32 mirror that rounds where they round (tight).

The kernels take 16-bit operands only (wgmma would run float32 as tf32), so the end-to-end checks use
float16 (tolerance `util.F16_TOL`) and bfloat16 (`util.BF16_TOL`); the mirror checks hold to 1e-5.
Uninitialised memory is NaN and out-of-bounds reads raise in every case.
"""

import dataclasses

import jax
import jax.numpy as jnp
import jax.experimental.pallas.mosaic_gpu as plgpu
import numpy as np
import pytest

from linear_attention_jax.pallas_kernels import common, gpu, prep
from linear_attention_jax.pallas_kernels.gpu import GpuConfig, walk
from tests.ops.conftest import make_inputs, rel_rms
from tests.pallas_kernels.gpu.util import BF16_TOL, KERNEL_FORWARD, KERNELS, PARAMS, XLA, check

KINDS = ("linear_attention", "simple_gla", "gla", "delta_rule", "gated_delta_rule", "kda")


@pytest.mark.parametrize("variant", KINDS)
def test_every_family_and_decay(variant):
  # Given grouped value heads (H=1 serves H_v=2), an initial state and T = 150 (3 chunks, the last partial)
  inp = make_inputs(variant, B=1, T=150, H=1, Hv=2, K=64, V=64, seed=0)
  # Then o, the final state and every gradient match the float64 loop
  check(variant, inp)


@pytest.mark.parametrize("variant", ["simple_gla", "kda"])
def test_segment_ids(variant):
  # Runs of 30, 1 (a length-one segment), 33, 7 and 29 tokens, the last reusing an earlier id; changes
  # fall inside chunks and on the chunk boundary t = 64.
  T = 100
  seg = np.zeros((1, T), np.int32)
  seg[0, 30:31], seg[0, 31:64], seg[0, 64:71], seg[0, 71:] = 5, 1, 2, 0
  check(variant, make_inputs(variant, B=1, T=T, H=1, Hv=1, K=64, V=64, seed=6), seg=seg)


@pytest.mark.parametrize("variant", ["gla", "gated_delta_rule"])
def test_strong_gates_and_no_initial_state(variant):
  # Log-decays down to -20 per token: nothing may overflow inside a 64-token chunk.
  inp = make_inputs(variant, B=1, T=130, H=1, Hv=1, K=64, V=64, gates="strong", seed=3)
  inp["h0"] = None
  check(variant, inp)


def test_two_value_blocks_and_bfloat16():
  # V = 128: two programs of 64 value columns per head; K = 128; bfloat16 operands.
  errors = check("gated_delta_rule", make_inputs("gated_delta_rule", B=1, T=64, H=1, Hv=1, K=128, V=128,
                                                 seed=5), dtype=jnp.bfloat16, tol=BF16_TOL)
  assert errors["o"] > 1e-4  # bfloat16 really was used


def _mirror_forward(t: prep.ChunkTensors, h0):
  """The forward walk in float32, rounding the state and u to the operand dtype where the kernel does."""
  lo = t.qg.dtype
  f = lambda x: x.astype(jnp.float32)
  S = h0
  outs, states = [], []
  for n in range(t.qg.shape[2]):
    S_lo = f(S.astype(lo))
    states.append(S_lo)
    u = f(t.u[:, :, n])
    if t.w is not None:
      u = f((u - jnp.einsum("bhck,bhkv->bhcv", f(t.w[:, :, n]), S_lo)).astype(lo))
    outs.append(jnp.einsum("bhck,bhkv->bhcv", f(t.qg[:, :, n]), S_lo)
                + jnp.einsum("bhij,bhjv->bhiv", f(t.p[:, :, n]), u))
    S = t.decay[:, :, n][..., None] * S + jnp.einsum("bhck,bhcv->bhkv", f(t.kd[:, :, n]), u)
  return jnp.stack(outs, 2), jnp.stack(states, 2), S


@pytest.mark.parametrize("delta", [False, True], ids=["additive", "delta"])
def test_forward_walk_matches_its_float32_mirror(delta):
  variant = "kda" if delta else "gla"
  inp = make_inputs(variant, B=1, T=192, H=1, Hv=1, K=64, V=128, seed=11)
  x = {n: None if inp.get(n) is None else jnp.asarray(inp[n]) for n in ("q", "k", "v", "g", "beta")}
  t = prep.prepare(x["q"], x["k"], x["v"], x["g"], x["beta"], None, chunk_size=64,
                   dtype=jnp.bfloat16)
  t = t._replace(**{n: getattr(t, n).astype(jnp.bfloat16) for n in ("qg", "kd", "w", "u", "p")
                    if getattr(t, n) is not None})
  h0 = jnp.asarray(inp["h0"])
  o, states, final = walk.forward(t, h0, with_o=True, with_states=True, out_dtype=jnp.float32,
                                  interpret=PARAMS)
  ro, rstates, rfinal = _mirror_forward(t, h0)
  assert rel_rms(o, ro) < 1e-5 and rel_rms(final, rfinal) < 1e-5
  assert rel_rms(jnp.swapaxes(states, -1, -2).astype(jnp.float32), rstates) < 1e-5
  # o in the token layout [B, T, H, V], scaled in the kernel
  o_tok, _, _ = walk.forward(t, h0, with_o=True, out_dtype=jnp.float32, interpret=PARAMS,
                             token_o=True, scale=0.125)
  assert o_tok.shape == (1, 192, 1, 128)
  assert rel_rms(o_tok, prep.from_chunks(ro, 192) * 0.125) < 1e-5


def test_public_api_reaches_the_kernel_in_the_interpreter():
  from linear_attention_jax import ops
  inp = make_inputs("kda", B=1, T=70, H=1, Hv=1, K=64, V=64, seed=2)
  q, k, v = (jnp.asarray(inp[n], jnp.bfloat16) for n in ("q", "k", "v"))
  with gpu.interpret_kernels():
    assert ops.select_impl("auto", "kda", K=64, V=64, chunk_size=64, dtype=jnp.bfloat16) == "pallas"
    o, _ = ops.kda(q, k, v, jnp.asarray(inp["g"]), jnp.asarray(inp["beta"]), impl="pallas")
  ref, _ = ops.kda(q, k, v, jnp.asarray(inp["g"]), jnp.asarray(inp["beta"]), impl="recurrent")
  assert o.dtype == jnp.bfloat16 and rel_rms(o, ref) < BF16_TOL


def test_rejects_what_it_cannot_serve():
  inp = make_inputs("kda", T=20, K=64, V=64)
  q, k, v = (jnp.asarray(inp[n], jnp.bfloat16) for n in ("q", "k", "v"))
  with pytest.raises(ValueError, match=r"chunks of \(64,\) tokens; got chunk_size=32"):
    gpu.chunked_attention(q, k, v, inp["g"], inp["beta"], chunk_size=32, interpret=PARAMS)
  with pytest.raises(ValueError, match=r"^initial_state must be one of .*got \(2, 4, 64, 13\)"):
    gpu.chunked_attention(q, k, v, inp["g"], inp["beta"], initial_state=np.zeros((2, 4, 64, 13)))
  with pytest.raises(ValueError, match=r"bfloat16 or float16 operands .* not float32"):
    gpu.chunked_attention(q.astype(jnp.float32), k, v, interpret=PARAMS)
  with pytest.raises(ValueError, match=r"out_dtype must be bfloat16 or float16 .* got float32"):
    gpu.chunked_attention(q, k, v, out_dtype=jnp.float32, interpret=PARAMS)
  # float32 inputs with a 16-bit compute dtype: o comes back in the compute dtype by default
  o, _ = gpu.chunked_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                               compute_dtype=jnp.bfloat16, interpret=PARAMS)
  assert o.dtype == jnp.bfloat16
  assert "cu_seqlens" in gpu.supports(K=64, V=64, chunk_size=64, packing="cu_seqlens", backend="hopper")
  assert "K and V in (64, 128, 256)" in gpu.supports(K=32, V=64, chunk_size=64, backend="hopper")
  assert "backend is 'cpu'" in gpu.supports(K=64, V=64, chunk_size=64)
  assert "shard_map" in gpu.supports(K=64, V=64, chunk_size=64, backend="hopper", sharded=True)
  assert gpu.supports(K=128, V=128, chunk_size=64, dtype=jnp.bfloat16, backend="hopper") is None


def _mirror_backward(t: prep.ChunkTensors, do, dfinal):
  """The reverse walk in float32, rounding dS and du to the operand dtype where the kernel does."""
  lo = t.qg.dtype
  f = lambda x: x.astype(jnp.float32)
  dS, stored = dfinal, []
  for n in reversed(range(t.qg.shape[2])):
    dS_lo = f(dS.astype(lo))
    stored.append(dS_lo)
    do_n = f(do[:, :, n].astype(lo))
    nxt = t.decay[:, :, n][..., None] * dS + jnp.einsum("bhck,bhcv->bhkv", f(t.qg[:, :, n]), do_n)
    if t.w is not None:
      du = jnp.einsum("bhij,bhiv->bhjv", f(t.p[:, :, n]), do_n) + jnp.einsum(
          "bhck,bhkv->bhcv", f(t.kd[:, :, n]), dS_lo)
      nxt = nxt - jnp.einsum("bhck,bhcv->bhkv", f(t.w[:, :, n]), f(du.astype(lo)))
    dS = nxt
  return jnp.stack(stored[::-1], 2), dS


@pytest.mark.parametrize("delta", [False, True], ids=["additive", "delta"])
def test_reverse_walk_matches_its_float32_mirror(delta):
  variant = "kda" if delta else "gla"
  inp = make_inputs(variant, B=1, T=192, H=1, Hv=1, K=64, V=128, seed=12)
  x = {n: None if inp.get(n) is None else jnp.asarray(inp[n]) for n in ("q", "k", "v", "g", "beta")}
  t = prep.prepare(x["q"], x["k"], x["v"], x["g"], x["beta"], None, chunk_size=64, dtype=jnp.bfloat16)
  t = t._replace(**{n: getattr(t, n).astype(jnp.bfloat16) for n in ("qg", "kd", "w", "u", "p")
                    if getattr(t, n) is not None})
  rng = np.random.default_rng(0)
  do = jnp.asarray(rng.normal(size=t.u.shape), jnp.float32)
  dfinal = jnp.asarray(rng.normal(size=(1, 1, 64, 128)), jnp.float32)
  dstates, dh0 = walk.backward_states(t, do, dfinal, interpret=PARAMS)
  rstates, rdh0 = _mirror_backward(t, do, dfinal)
  assert rel_rms(dh0, rdh0) < 1e-5
  assert rel_rms(jnp.swapaxes(dstates, -1, -2).astype(jnp.float32), rstates) < 1e-5


def test_linear_attention_normaliser_splits_off_to_the_chunk_form():
  # normalize=True carries z as a V+1-th state column: the kernel walks the V value columns and the
  # chunked form the normaliser column (each value column walks alone), so auto still takes the kernel.
  from linear_attention_jax import ops
  inp = make_inputs("linear_attention", B=1, T=100, H=2, Hv=2, K=64, V=64, seed=13)
  q, k, v = (jnp.asarray(inp[n], jnp.float16) for n in ("q", "k", "v"))
  h0 = np.abs(np.random.default_rng(0).normal(size=(1, 2, 64, 65))).astype(np.float32)
  run = lambda impl: jax.vjp(lambda q, k, v, h0: ops.linear_attention(
      q, k, v, initial_state=h0, output_final_state=True, impl=impl), q, k, v, jnp.asarray(h0))
  with gpu.interpret_kernels():
    assert ops.select_impl("auto", "linear_attention", K=64, V=65, chunk_size=64, dtype=jnp.float16,
                           v_extra=1) == "pallas"
    (o, final), pull = run("pallas")
    cot = (jnp.ones_like(o), jnp.ones_like(final))
    grads = pull(cot)
  (ro, rfinal), rpull = run("recurrent")
  rgrads = rpull(cot)
  assert final.shape == (1, 2, 64, 65)
  assert rel_rms(o, ro) < 4e-3 and rel_rms(final, rfinal) < 4e-3
  for a, b in zip(grads, rgrads):
    assert rel_rms(a, b) < 4e-3


@pytest.mark.parametrize("variant", ["linear_attention", "simple_gla"])
def test_fused_forward_equals_the_prepared_path(variant):
  # The fused forward in one warpgroup forms P, q e^G and k e^(G_C - G) in shared memory with the
  # roundings of prep.py, so it computes the same numbers as the prepared path (grouped heads: H=1
  # serves H_v=2). The default, three warpgroups, rounds v e^(G_C - G) instead and q e^G not at all:
  # the same numbers to the operands' rounding.
  inp = make_inputs(variant, B=1, T=150, H=1, Hv=2, K=64, V=128, seed=14)
  q, k, v = (jnp.asarray(inp[n], jnp.bfloat16) for n in ("q", "k", "v"))
  g = None if inp.get("g") is None else jnp.asarray(inp["g"])
  run = lambda config, wg=1: gpu.chunked_attention(q, k, v, g, initial_state=jnp.asarray(inp["h0"]),
                                                   config=dataclasses.replace(config, forward_warpgroups=wg),
                                                   interpret=PARAMS)
  (o, final), (ro, rfinal) = run(KERNELS), run(XLA)
  assert rel_rms(final, rfinal) < 1e-6
  # o leaves in bfloat16: a float32 sum that lands next to a rounding boundary may round either way
  # when the interpreter's matmuls add in another order (with numpy 2.5.5, 3 of 38400 elements do);
  # no more than 0.1% of the elements may differ, by at most one bfloat16 step
  o, ro = np.asarray(o, np.float32), np.asarray(ro, np.float32)
  assert np.mean(o != ro) < 1e-3
  np.testing.assert_allclose(o, ro, rtol=2.0 ** -7, atol=0)
  o3, final3 = run(KERNELS, 3)
  assert rel_rms(o3, ro) < 4e-3 and rel_rms(final3, rfinal) < 4e-3


@pytest.mark.parametrize("variant,gates,h0,H,V", [("linear_attention", "normal", True, 1, 64),
                                                  ("simple_gla", "normal", True, 1, 64),
                                                  ("simple_gla", "strong", False, 1, 64),
                                                  ("simple_gla", "normal", True, 2, 64),
                                                  ("simple_gla", "normal", True, 2, 128)])
def test_fused_path_matches_the_float64_loop(variant, gates, h0, H, V):
  # Forward and backward without the XLA preparation: o, final state and every gradient (dq, dk of
  # grouped heads summed over their value heads, dg through the per-chunk cumulative sum, dh0). With
  # H = H_v the kernel writes dq, dk, dv in the inputs' dtype itself.
  inp = make_inputs(variant, B=1, T=150, H=H, Hv=2, K=64, V=V, gates=gates, seed=15)
  if not h0:
    inp["h0"] = None
  check(variant, inp, config=KERNELS)


def test_fused_path_serves_only_the_additive_family_with_scalar_or_no_decay():
  from linear_attention_jax.pallas_kernels.gpu import fused
  g_scalar, g_channel, seg = jnp.zeros((1, 8, 2)), jnp.zeros((1, 8, 2, 4)), jnp.zeros((1, 8), jnp.int32)
  assert fused.serves(None, None, None) and fused.serves(g_scalar, None, None)
  assert fused.serves(g_scalar, None, seg)
  assert not fused.serves(g_channel, None, None)
  assert not fused.serves(g_scalar, jnp.zeros((1, 8, 2)), None)


def test_fused_path_with_segment_ids():
  # Runs of 30, 1, 33, 7 and 29 tokens (changes inside chunks and on the boundary t = 64), the last
  # reusing an earlier id: forward equal to the prepared path, gradients against the float64 loop.
  T = 100
  seg = np.zeros((1, T), np.int32)
  seg[0, 30:31], seg[0, 31:64], seg[0, 64:71], seg[0, 71:] = 5, 1, 2, 0
  inp = make_inputs("simple_gla", B=1, T=T, H=1, Hv=2, K=64, V=64, seed=16)
  q, k, v = (jnp.asarray(inp[n], jnp.bfloat16) for n in ("q", "k", "v"))
  run = lambda config, wg=1: gpu.chunked_attention(q, k, v, jnp.asarray(inp["g"]),
                                                   segment_ids=jnp.asarray(seg),
                                                   initial_state=jnp.asarray(inp["h0"]),
                                                   config=dataclasses.replace(config, forward_warpgroups=wg),
                                                   interpret=PARAMS)
  (o, final), (ro, rfinal) = run(KERNELS), run(XLA)   # one warpgroup: prep.py's roundings
  assert rel_rms(o, ro) < 1e-6 and rel_rms(final, rfinal) < 1e-6
  o3, final3 = run(KERNELS, 3)
  assert rel_rms(o3, ro) < 4e-3 and rel_rms(final3, rfinal) < 4e-3
  check("simple_gla", inp, seg=seg, config=KERNELS)


@pytest.mark.parametrize("pieces,packed", [(2, False), (3, True), (4, True)])
def test_fused_path_split_into_sequence_pieces(pieces, packed):
  # Each sequence's walks split into pieces that run in parallel, joined by the pieces' end states:
  # 2 pieces pad 3 chunks to 4, 3 pieces take one chunk each, 4 pieces of 5 chunks. Packed rows put
  # boundaries inside a piece and on the piece boundary t = 64 * 2 (the carried state must not cross).
  T = 150 if pieces < 4 else 300
  inp = make_inputs("simple_gla", B=1, T=T, H=1, Hv=2, K=64, V=64, seed=17)
  seg = None
  if packed:
    seg = np.zeros((1, T), np.int32)
    seg[0, 40:128], seg[0, 128:] = 1, 2
  check("simple_gla", inp, seg=seg, config=KERNELS, pieces=pieces)
  q, k, v = (jnp.asarray(inp[n], jnp.bfloat16) for n in ("q", "k", "v"))
  # (one warpgroup: the main walk rounds as the pieces' end-state walk does)
  run = lambda p: gpu.chunked_attention(q, k, v, jnp.asarray(inp["g"]), initial_state=jnp.asarray(inp["h0"]),
                                        segment_ids=None if seg is None else jnp.asarray(seg),
                                        config=GpuConfig(sequence_pieces=p, forward_warpgroups=1),
                                        interpret=PARAMS)
  (o, final), (ro, rfinal) = run(pieces), run(1)
  assert rel_rms(o, ro) < 2e-3 and rel_rms(final, rfinal) < 1e-5


def test_sequence_pieces_fill_one_wave_of_programs():
  assert walk.pieces(programs=32, NC=512) == 4       # (1, 32768, 16, 128): 32 programs -> 128
  assert walk.pieces(programs=128, NC=128) == 1      # (4, 8192, 16, 128): already one wave
  assert walk.pieces(programs=2, NC=20) == 1         # too few chunks to split
  assert walk.pieces(programs=2, NC=33) == 1         # the pieces must divide the chunks
  assert walk.pieces(programs=2, NC=66) == 2
  assert walk.pieces(programs=2, NC=3, pieces_=3) == 3
  with pytest.raises(ValueError, match="sequence_pieces"):
    walk.pieces(programs=2, NC=3, pieces_=0)


@pytest.mark.parametrize("variant,gates,K,V,packed", [("delta_rule", "normal", 64, 128, False),
                                                      ("gated_delta_rule", "normal", 128, 64, False),
                                                      ("gated_delta_rule", "strong", 64, 64, False),
                                                      ("gated_delta_rule", "normal", 64, 64, True)])
def test_delta_preparation_kernel_equals_xla(variant, gates, K, V, packed):
  # The delta family's per-chunk tensors from one kernel (block-doubling inverse on whole tiles) against
  # prep.py with the same float16 operands (its inverse in float32), rounded as the kernel's outputs are
  # (grouped heads, T = 150). At strong gates k e^G itself loses digits as a float16 operand (w is then
  # 7e-3 from the float32 preparation, in XLA as in the kernel).
  from linear_attention_jax.pallas_kernels.gpu import delta_prep
  inp = make_inputs(variant, B=1, T=150, H=1, Hv=2, K=K, V=V, gates=gates, seed=18)
  q, k, v = (jnp.asarray(inp[n], jnp.float16) for n in ("q", "k", "v"))
  g = None if inp.get("g") is None else jnp.asarray(inp["g"])
  beta = jnp.asarray(inp["beta"])
  seg = None
  if packed:  # runs change inside a chunk, on the boundary t = 64 and again inside the last chunk
    seg = np.zeros((1, 150), np.int32)
    seg[0, 20:64], seg[0, 64:130], seg[0, 130:] = 1, 2, 3
    seg = jnp.asarray(seg)
  ref = prep.prepare(q, k, v, g, beta, seg, chunk_size=64, dtype=jnp.float16, inverse_dtype=jnp.float32)
  out = delta_prep.prepare(q, k, v, g, beta, chunk_size=64, dtype=jnp.float16, segment_ids=seg,
                           interpret=PARAMS)
  for name in ("qg", "kd", "w", "u", "p", "decay"):
    a, r = getattr(out, name), getattr(ref, name).astype(getattr(out, name).dtype)
    assert a.shape == r.shape, name
    assert rel_rms(a, r) < 1e-3, (name, rel_rms(a, r))


@pytest.mark.parametrize("variant,gates,packed", [("delta_rule", "normal", False),
                                                  ("gated_delta_rule", "strong", False),
                                                  ("gated_delta_rule", "normal", True)])
def test_delta_family_with_the_preparation_kernel_matches_the_float64_loop(variant, gates, packed):
  # backward="xla_vjp": the forward's tensors come from the kernel, the backward recomputes them in XLA.
  inp = make_inputs(variant, B=1, T=150, H=1, Hv=2, K=64, V=64, gates=gates, seed=19)
  seg = None
  if packed:
    seg = np.zeros((1, 150), np.int32)
    seg[0, 33:64], seg[0, 64:100], seg[0, 100:] = 4, 1, 7
  check(variant, inp, seg=seg, config=KERNEL_FORWARD)


def test_delta_preparation_kernel_serves_scalar_or_no_decay_only():
  from linear_attention_jax.pallas_kernels.gpu import delta_prep
  beta, seg = jnp.zeros((1, 8, 2)), jnp.zeros((1, 8), jnp.int32)
  assert delta_prep.serves(None, beta, None) and delta_prep.serves(jnp.zeros((1, 8, 2)), beta, seg)
  assert not delta_prep.serves(jnp.zeros((1, 8, 2, 4)), beta, None)
  assert not delta_prep.serves(None, None, None)


@pytest.mark.parametrize("variant,gates,H,K,V,packed,h0,warpgroups", [
    ("delta_rule", "normal", 1, 64, 64, False, True, 1),
    ("gated_delta_rule", "normal", 1, 64, 128, False, True, 1),    # two value blocks: partial sums
    ("gated_delta_rule", "strong", 2, 64, 64, False, False, 1),
    ("gated_delta_rule", "normal", 1, 128, 64, True, True, 1),
    # both value blocks in one program of two warpgroups (delta_grads.chunk_grads_pair)
    ("gated_delta_rule", "normal", 1, 64, 128, False, True, 2),    # grouped value heads (H_v = 2)
    ("delta_rule", "normal", 2, 128, 128, True, True, 2),
    ("gated_delta_rule", "strong", 2, 64, 128, True, False, 2)])
def test_delta_backward_kernel_matches_the_float64_loop(variant, gates, H, K, V, packed, h0, warpgroups):
  # the default backward: every chunk's gradients in one kernel (dq, dk, dv, dbeta, dg, dh0), from the
  # preparation kernel's X and the two walks, with no XLA vjp of the preparation.
  inp = make_inputs(variant, B=1, T=150, H=H, Hv=2, K=K, V=V, gates=gates, seed=22)
  if not h0:
    inp["h0"] = None
  seg = None
  if packed:
    seg = np.zeros((1, 150), np.int32)
    seg[0, 10:64], seg[0, 64:90], seg[0, 90:] = 3, 1, 2
  # errors are ~5e-4 here: a tolerance of 1.5e-3 (not float16's 4e-3) fails a 1% error in one term of dg
  check(variant, inp, seg=seg, tol=1.5e-3, config=dataclasses.replace(KERNELS, delta_warpgroups=warpgroups))


@pytest.mark.parametrize("variant,pieces,packed,kernel_forward", [
    ("delta_rule", 2, False, False),           # 3 chunks padded to 4
    ("gated_delta_rule", 3, True, True),       # preparation kernel; a run ends on a piece boundary
    ("gla", 3, False, False),                  # per-channel decay: diagonal transitions
    ("simple_gla", 2, True, False)])
def test_prepared_walks_split_into_sequence_pieces(variant, pieces, packed, kernel_forward):
  # The walks of walk.py in pieces: a first walk gives every piece's affine map S_end = A S_start + F
  # (A from the identity with u = 0), XLA chains them; the reverse walk chains A^T backwards.
  inp = make_inputs(variant, B=1, T=150, H=1, Hv=2, K=64, V=64, seed=23)
  seg = None
  if packed:
    seg = np.zeros((1, 150), np.int32)
    seg[0, 30:64], seg[0, 64:] = 1, 2
  check(variant, inp, seg=seg, config=KERNEL_FORWARD if kernel_forward else XLA, pieces=pieces)


def test_delta_backward_kernel_with_sequence_pieces():
  inp = make_inputs("gated_delta_rule", B=1, T=150, H=1, Hv=2, K=64, V=64, seed=24)
  check("gated_delta_rule", inp, config=KERNELS, pieces=3)


@pytest.mark.parametrize("variant,l2", [("linear_attention", False), ("simple_gla", False),
                                        ("gated_delta_rule", False), ("gla", False),
                                        ("gated_delta_rule", True), ("delta_rule", True), ("kda", True)])
def test_public_api_gradients_through_the_kernels(variant, l2):
  # linear_attention_jax.ops with impl="pallas" in the interpreter against impl="recurrent", float16 in
  # and out, grouped value heads: o and every gradient (the kernels receive q, k, v in the matmul dtype
  # for no or scalar gates, float32 for per-channel ones). use_qk_l2norm: the delta kernels normalise
  # q, k on load (no or scalar decay), XLA before the kernels otherwise (kda).
  from linear_attention_jax import ops
  inp = make_inputs(variant, B=1, T=100, H=1, Hv=2, K=64, V=64, seed=25)
  names = [n for n in ("q", "k", "v", "g", "beta") if inp.get(n) is not None]
  args = [jnp.asarray(inp[n], jnp.float16 if n in ("q", "k", "v") else jnp.float32) for n in names]
  fn = getattr(ops, variant)
  kw = dict(use_qk_l2norm=True) if l2 else {}
  do = jnp.asarray(np.random.default_rng(3).normal(size=inp["v"].shape), jnp.float16)

  def run(impl):
    o, vjp = jax.vjp(lambda *a: fn(*a, impl=impl, **kw)[0], *args)
    return o, vjp(do)

  with gpu.interpret_kernels():
    o, grads = run("pallas")
  ro, rgrads = run("recurrent")
  assert o.dtype == jnp.float16 and rel_rms(o, ro) < 4e-3
  for name, a, b in zip(names, grads, rgrads):
    assert a.dtype == b.dtype and rel_rms(a, b) < 6e-3, (name, rel_rms(a, b))


@pytest.mark.parametrize("variant", ["simple_gla", "gated_delta_rule"])
def test_backward_recomputes_what_the_forward_did_not_keep(variant):
  # Under differentiation the op's forward keeps the states (and, for the delta family, the prepared
  # tensors and (I + L)^-1) for its backward; called without them, the backward recomputes them and
  # gives the same gradients.
  from linear_attention_jax.pallas_kernels.gpu import delta_grads, fused
  inp = make_inputs(variant, B=1, T=100, H=1, Hv=2, K=64, V=64, seed=31)
  q, k, v = (jnp.asarray(inp[n], jnp.float16) for n in ("q", "k", "v"))
  g, beta = jnp.asarray(inp["g"]), (None if inp.get("beta") is None else jnp.asarray(inp["beta"]))
  h0 = jnp.asarray(inp["h0"])
  do = jnp.asarray(np.random.default_rng(4).normal(size=v.shape), jnp.float16)
  dfinal = jnp.asarray(np.random.default_rng(5).normal(size=h0.shape), jnp.float32)
  args = (q, k, v, g) if beta is None else (q, k, v, g, beta)
  # (the additive forward in one warpgroup: the states it keeps round as the backward's recomputation)
  _, pull = jax.vjp(lambda *a: gpu.chunked_attention(*a[:-1], initial_state=a[-1],
                                                     config=GpuConfig(forward_warpgroups=1),
                                                     interpret=PARAMS), *args, h0)
  kept = pull((do, dfinal))
  kw = dict(chunk_size=64, dtype=jnp.float16, interpret=PARAMS, scale=64 ** -0.5)
  if beta is None:
    recomputed = fused.backward(q, k, v, g, h0, do, dfinal, **kw)
    recomputed = recomputed[:4] + recomputed[5:]
  else:
    recomputed = delta_grads.backward(q, k, v, g, beta, h0, do, dfinal, **kw)
  assert len(kept) == len(recomputed)
  for a, b in zip(kept, recomputed):
    assert a.shape == b.shape and rel_rms(a, b) < 1e-6, rel_rms(a, b)


def test_delta_gradient_programs_over_several_value_blocks_change_no_bit():
  # chunk_grads can take several value blocks of a chunk in one program (the next block's tiles fetched
  # while the current one computes); the bits must equal one block per program's.
  from linear_attention_jax.pallas_kernels.gpu import delta_grads
  B, T, H, Hv, K, V, C = 1, 128, 1, 2, 128, 256, 64
  r = np.random.default_rng(33)
  f16 = lambda *shape: jnp.asarray(r.normal(size=shape) * 0.5, jnp.float16)
  NC = T // C
  G = jnp.cumsum(jnp.asarray(-r.uniform(0, 0.3, (B, Hv, NC, C)), jnp.float32), -1).reshape(B, Hv, T)
  args = (f16(B, T, H, K), f16(B, T, H, K), f16(B, T, Hv, V), G,
          jnp.asarray(r.uniform(0, 1, (B, Hv, T)), jnp.float32), f16(B, Hv, T, C),
          f16(B, Hv, NC, V, K), f16(B, Hv, NC, V, K), f16(B, T, Hv, V))
  run = lambda n, out=jnp.float16: delta_grads.chunk_grads(*args, dtype=jnp.float16, interpret=PARAMS,
                                                           blocks_per_program=n, dv_dtype=out,
                                                           partial_dtype=out)
  ref = run(1)
  for n in (2, 4):
    for a, b in zip(run(n), ref):
      assert a.shape == b.shape and bool(jnp.all(jnp.isfinite(a)))
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="blocks_per_program"):
    run(3)
  # float32 staging tiles leave no room for a second slot: an error naming the shared memory
  with pytest.raises(ValueError, match="shared memory"):
    run(2, jnp.float32)


@pytest.mark.parametrize("packed", [True])   # packed rows: the masks and the norms together (27 s each)
def test_l2_norm_on_load_in_the_delta_kernels_equals_xla_before_them(packed):
  # qk_l2norm=True: the preparation and gradient kernels normalise q, k as they load them and return the
  # gradients of the raw q, k; against the same kernels fed XLA-normalised q, k (o, final state and
  # every gradient, initial state and final-state cotangent included).
  inp = make_inputs("gated_delta_rule", B=1, T=150, H=1, Hv=2, K=64, V=128, seed=41)
  q, k, v = (jnp.asarray(inp[n] * 3.0, jnp.float16) for n in ("q", "k", "v"))
  g, beta, h0 = (jnp.asarray(inp[n]) for n in ("g", "beta", "h0"))
  seg = None
  if packed:
    seg = np.zeros((1, 150), np.int32)
    seg[0, 40:100], seg[0, 100:] = 1, 2
    seg = jnp.asarray(seg)
  r = np.random.default_rng(6)
  do = jnp.asarray(r.normal(size=v.shape), jnp.float16)
  dfinal = jnp.asarray(r.normal(size=h0.shape), jnp.float32)

  def run(fused_norm, *a):
    q, k = a[:2]
    if not fused_norm:
      q, k = common.l2_normalize(q), common.l2_normalize(k)
    o, final = gpu.chunked_attention(q, k, *a[2:5], initial_state=a[5], segment_ids=seg,
                                     qk_l2norm=fused_norm, interpret=PARAMS)
    return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(final * dfinal), (o, final)

  outs = [jax.value_and_grad(lambda *a: run(fn, *a), argnums=range(6), has_aux=True)(q, k, v, g, beta, h0)
          for fn in (True, False)]
  (_, (o, final)), grads = outs[0]
  (_, (ro, rfinal)), rgrads = outs[1]
  assert rel_rms(o, ro) < 2e-3 and rel_rms(final, rfinal) < 2e-3
  for name, a, b in zip("q k v g beta h0".split(), grads, rgrads):
    assert a.dtype == b.dtype and bool(jnp.all(jnp.isfinite(a))), name
    assert rel_rms(a, b) < 3e-3, (name, rel_rms(a, b))
