"""The chunk-local cumulative sums' Mosaic GPU kernels (`pallas_kernels/gpu/cumsum.py`) in the interpreter
against float64 sums: G with the gate's floor (-inf, below -20, bfloat16 input), its reference rows, dG's
reverse sums; `channel.chunk_cumsum` and `channel.key_grads` by the kernels against XLA's products (ragged
T, several channel blocks); the plan's choice; and the lowering for a Hopper GPU. The whole ops with
the kernels in them are checked against the float64 loop by the per-channel tests (the default plan)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.mesh import AbstractDevice
from jax.sharding import AbstractMesh

from linear_attention_jax.pallas_kernels import gpu, prep
from linear_attention_jax.pallas_kernels.gpu import channel, cumsum, plan
from tests.pallas_kernels.gpu.util import PARAMS

C = 64


def _gates(B, T, D, seed):
  """Log-decays of every strength: e^N(0, 2) nats a token, with -inf and a -30 among them."""
  g = -np.exp(np.random.default_rng(seed).normal(0.0, 2.0, (B, T, D)))
  g[0, 3, 5], g[-1, T - 2, D - 1] = -np.inf, -30.0
  return g


def _sums(x, reverse=False):
  """float64 sums along each chunk of `x [B, T_pad, D]` (from the end where `reverse`)."""
  B, T, D = x.shape
  x = np.asarray(x, np.float64).reshape(B, T // C, C, D)
  x = np.flip(x, 2) if reverse else x
  s = np.cumsum(x, axis=2)
  return (np.flip(s, 2) if reverse else s).reshape(B, T, D)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forward_kernel_matches_float64_sums_of_the_floored_gates(dtype):
  B, T, D = 2, 2 * C, 256
  g = jnp.asarray(_gates(B, T, D, 0), dtype)
  G, refs = cumsum.forward(g, C=C, interpret=PARAMS)
  floored = np.maximum(np.asarray(g.astype(jnp.float32), np.float64), prep.LOG_DECAY_FLOOR)
  want = _sums(floored)
  np.testing.assert_allclose(np.asarray(G), want, rtol=1e-6, atol=1e-4)
  chunks = want.reshape(B, T // C, C, D)
  rows = [(chunks.max(2) + chunks.min(2)) / 2, chunks[:, :, -1]]
  rows += [chunks[:, :, 7 + 8 * i] for i in range(C // 8)]
  np.testing.assert_allclose(np.asarray(refs), np.stack(rows, axis=2), rtol=1e-6, atol=1e-4)
  assert refs.shape == (B, T // C, channel.ref_count(C), D)


def test_reverse_kernel_matches_float64_sums():
  dG = np.random.default_rng(1).normal(size=(1, 3 * C, 128)).astype(np.float32)
  dg = cumsum.reverse(jnp.asarray(dG), C=C, interpret=PARAMS)
  np.testing.assert_allclose(np.asarray(dg), _sums(dG, reverse=True), rtol=1e-5, atol=1e-5)


def test_kernels_refuse_what_they_do_not_serve():
  with pytest.raises(ValueError, match="multiple of 128"):
    cumsum.forward(jnp.zeros((1, C, 64)), C=C, interpret=PARAMS)
  with pytest.raises(ValueError, match="float32"):
    cumsum.reverse(jnp.zeros((1, C, 128), jnp.bfloat16), C=C, interpret=PARAMS)
  assert not cumsum.serves(64, C) and not cumsum.serves(128, 12) and cumsum.serves(384, 32)


def test_chunk_cumsum_and_key_grads_by_the_kernels_equal_xlas_products():
  # T = 150 (ragged: padded to 192), H_v = 2 heads of K = 64 (D = 128); and K = 64 alone (D = 64),
  # which the kernels do not serve: XLA's product, the same values
  for Hv in (2, 1):
    B, T, K, T_pad = 1, 150, 64, 3 * C
    g = jnp.asarray(_gates(B, T, Hv * K, Hv).reshape(B, T, Hv, K), jnp.float32)
    by_kernel = channel.chunk_cumsum(g, T_pad, C, kernel=True, interpret=PARAMS)
    by_xla = channel.chunk_cumsum(g, T_pad, C)
    for a, b in zip(by_kernel, by_xla):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-4)
    ks = jax.random.split(jax.random.key(Hv), 3)
    q = jax.random.normal(ks[0], (B, T, Hv, K))
    dq = jax.random.normal(ks[1], (B, T_pad, Hv, K))
    dG = jax.random.normal(ks[2], (B, T_pad, Hv, K))
    grads = lambda **kw: channel.key_grads(dq, dq, dG, q, q, g, C, **kw)
    for a, b in zip(grads(kernel=True, interpret=PARAMS), grads()):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(grads(kernel=True, interpret=PARAMS)[2])[np.asarray(g) < -20] == 0)


def test_the_plan_takes_the_kernels_for_per_channel_decay_by_default():
  select = lambda decay, **kw: plan.select(delta=True, decay=decay, config=gpu.GpuConfig(**kw), K=128)
  assert select("channel").cumsums == "kernel"
  assert select("channel", cumsums="xla").cumsums == "xla"
  assert select("scalar").cumsums == "xla"
  with pytest.raises(ValueError, match="cumsums"):
    gpu.GpuConfig(cumsums="scan")


def test_kernels_export_for_hopper():
  h200 = AbstractMesh((), (), abstract_device=AbstractDevice(device_kind="NVIDIA H200", platform="gpu",
                                                             num_cores=132))
  g = jax.ShapeDtypeStruct((2, 4096, 1024), jnp.float32)
  with jax.sharding.use_abstract_mesh(h200):
    fwd = jax.export.export(jax.jit(lambda x: cumsum.forward(x, C=C)), platforms=["cuda"])(g).mlir_module()
    bwd = jax.export.export(jax.jit(lambda x: cumsum.reverse(x, C=C)), platforms=["cuda"])(g).mlir_module()
    half = jax.export.export(jax.jit(lambda x: cumsum.forward(x, C=C)), platforms=["cuda"])(
        jax.ShapeDtypeStruct((2, 4096, 1024), jnp.bfloat16)).mlir_module()
  assert "chunk_cumsum_fwd" in fwd and "chunk_cumsum_fwd" in half and "chunk_cumsum_bwd" in bwd


def test_the_call_wide_test_from_the_reference_rows_equals_the_one_from_G():
  # vjp._by_bound reads refs' two rows a chunk (channel.fits_refs) where channel.fits read all of G
  for scale, dtype in ((0.01, jnp.bfloat16), (1.5, jnp.bfloat16), (1.5, jnp.float16), (3.0, jnp.float16)):
    g = jnp.asarray(-scale * np.abs(np.random.default_rng(7).normal(size=(2, 150, 2, 64))), jnp.float32)
    G, refs = channel.chunk_cumsum(g, 3 * C, C, kernel=True, interpret=PARAMS)
    for bound in (None, 30.0):
      assert bool(channel.fits_refs(refs, dtype, bound)) == bool(channel.fits(G, C, dtype, bound))
