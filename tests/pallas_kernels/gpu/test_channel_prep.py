"""Per-channel decay (gla, kda) in the Mosaic GPU interpreter: the forward's preparation kernel
(`channel_prep.py`, one-reference grams) against prep.py's XLA preparation, its merge-form fallback at
decay that overflows a naive split (against a float64 sum), and the float64 loop end to end; the
prepared path with the merge-form gram (`gram_method="merge"`)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention_jax.pallas_kernels import gpu, prep
from tests.ops.conftest import make_inputs, rel_rms
from tests.pallas_kernels.gpu.util import KERNEL_FORWARD, KERNELS, PARAMS, check


@pytest.mark.parametrize("variant,gates,K,V,packed", [("gla", "normal", 64, 64, False),
                                                      ("kda", "normal", 64, 128, False),
                                                      ("kda", "strong", 128, 64, False),
                                                      ("gla", "strong", 64, 64, True),
                                                      ("kda", "normal", 64, 64, True)])
def test_per_channel_preparation_kernel_equals_xla(variant, gates, K, V, packed):
  # Per-channel decay: the chunk tensors from one kernel (the decayed grams as one whole-tile product
  # about each channel's mid-range reference) against prep.py's XLA preparation with the same float16
  # operands, grouped heads, T = 150, runs changing inside a chunk and on its boundary. "normal" gates
  # are halved so that every chunk fits float16's bound (8 nats each side) and the kernel runs; "strong"
  # ones (g down to -20 a token) do not, and the call returns the merge form's tensors.
  from linear_attention_jax.pallas_kernels import vjp
  from linear_attention_jax.pallas_kernels.gpu import channel
  inp = make_inputs(variant, B=1, T=150, H=1, Hv=2, K=K, V=V, gates=gates, seed=18)
  q, k, v = (jnp.asarray(inp[n], jnp.float16) for n in ("q", "k", "v"))
  g = jnp.asarray(inp["g"]) * (0.5 if gates == "normal" else 1.0)
  G, _ = channel.chunk_cumsum(g, 192, 64)
  assert bool(channel.fits(G, 64, jnp.float16)) == (gates == "normal")
  beta = None if inp.get("beta") is None else jnp.asarray(inp["beta"])
  seg = None
  if packed:
    seg = np.zeros((1, 150), np.int32)
    seg[0, 20:64], seg[0, 64:130], seg[0, 130:] = 1, 2, 3
    seg = jnp.asarray(seg)
  ref = prep.prepare(q, k, v, g, beta, seg, chunk_size=64, dtype=jnp.float16, inverse_dtype=jnp.float32)
  out = vjp.channel_tensors(q, k, v, g, beta, chunk_size=64, dtype=jnp.float16, segment_ids=seg,
                             interpret=PARAMS)
  for name in ("qg", "kd", "w", "u", "p", "decay"):
    a, r = getattr(out, name), getattr(ref, name)
    if r is None:
      assert a is None, name
      continue
    assert a.shape == r.shape, name
    assert bool(jnp.all(jnp.isfinite(a))) and rel_rms(a, r.astype(a.dtype)) < 1e-3, (name, rel_rms(a, r))


def test_per_channel_gram_survives_decay_that_overflows_a_naive_split():
  # g = -20 on half the channels: e^(-G) reaches e^1260 inside a chunk, far beyond the one-reference
  # bound, so the call takes the merge form (exponents <= 0 only): P equals the float64 sum wherever it
  # is representable.
  from linear_attention_jax.pallas_kernels import vjp
  B, T, H, K = 1, 64, 1, 64
  r = np.random.default_rng(9)
  q, k, v = (jnp.asarray(r.normal(size=(B, T, H, K)), jnp.float16) for _ in range(3))
  g = np.full((B, T, H, K), -20.0, np.float32)
  g[..., : K // 2] = -0.01   # half the channels barely decay
  out = vjp.channel_tensors(q, k, v, jnp.asarray(g), None, chunk_size=64, dtype=jnp.float16,
                             interpret=PARAMS)
  G = np.cumsum(g[0, :, 0].astype(np.float64), axis=0)
  qn, kn = np.asarray(q[0, :, 0], np.float64), np.asarray(k[0, :, 0], np.float64)
  P = np.einsum("ic,jc,ijc->ij", qn, kn, np.exp(np.minimum(G[:, None] - G[None], 0.0)))
  P = np.tril(P)
  got = np.asarray(out.p[0, 0, 0], np.float64)
  assert np.all(np.isfinite(got))
  assert np.sqrt(np.mean((got - P) ** 2) / np.mean(P ** 2)) < 2e-3


@pytest.mark.parametrize("variant,gates,packed", [("gla", "normal", False), ("kda", "strong", False),
                                                  ("kda", "normal", True)])
def test_per_channel_family_with_the_preparation_kernel_matches_the_float64_loop(variant, gates, packed):
  # the default forward: the forward's tensors come from the per-channel kernel, the backward recomputes
  # them in XLA; o, final state and every gradient against the float64 loop.
  inp = make_inputs(variant, B=1, T=150, H=1, Hv=2, K=64, V=64, gates=gates, seed=27)
  seg = None
  if packed:
    seg = np.zeros((1, 150), np.int32)
    seg[0, 33:64], seg[0, 64:100], seg[0, 100:] = 4, 1, 7
  # (gla's backward in its gradient kernel, kda's through XLA's vjp)
  check(variant, inp, seg=seg, config=KERNELS if variant == "gla" else KERNEL_FORWARD)


def test_per_channel_preparation_kernel_serves_per_channel_gates_only():
  from linear_attention_jax.pallas_kernels.gpu import channel_prep
  assert channel_prep.serves(jnp.zeros((1, 8, 2, 4)), None, None)
  assert channel_prep.serves(jnp.zeros((1, 8, 2, 4)), jnp.zeros((1, 8, 2)), jnp.zeros((1, 8), jnp.int32))
  assert not channel_prep.serves(jnp.zeros((1, 8, 2)), None, None)
  assert not channel_prep.serves(None, jnp.zeros((1, 8, 2)), None)


@pytest.mark.parametrize("variant,gates,packed", [("gla", "strong", True), ("kda", "normal", False)])
def test_per_channel_prepared_path_with_the_merge_gram_matches_the_float64_loop(variant, gates, packed):
  # gram_method="merge": XLA's decayed grams in the merge form wherever XLA prepares (kda's backward
  # through XLA's vjp; gla's beyond the bound, one head at a time), with the per-channel preparation
  # kernel in the forward
  inp = make_inputs(variant, B=1, T=150, H=1, Hv=2, K=64, V=64, gates=gates, seed=28)
  seg = None
  if packed:
    seg = np.zeros((1, 150), np.int32)
    seg[0, 50:64], seg[0, 64:120], seg[0, 120:] = 2, 5, 1
  config = KERNELS if variant == "gla" else KERNEL_FORWARD
  check(variant, inp, seg=seg, config=dataclasses.replace(config, gram_method="merge"))
  with pytest.raises(ValueError, match="gram_method"):
    gpu.chunked_attention(*(jnp.zeros((1, 64, 1, 64), jnp.bfloat16),) * 3,
                          config=gpu.GpuConfig(gram_method="direct"), interpret=PARAMS)
