"""The l2 norms' backward kernel (`pallas_kernels/gpu/l2_grads.py`) in the Mosaic GPU interpreter against
the float64 formula and XLA's vjp (ragged rows, 16-bit dtypes, large and tiny norms); its checks; kda's
backward through it (`GpuConfig.l2_grads="kernel"`, the two-warpgroup key side without its epilogue)
against the float64 loop; the plan's choice; and the lowering for a Hopper GPU."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.mesh import AbstractDevice
from jax.sharding import AbstractMesh

from linear_attention_jax.pallas_kernels import common, gpu
from linear_attention_jax.pallas_kernels.gpu import call_plan, channel_delta_keys, l2_grads
from tests.ops.conftest import make_inputs, rel_rms
from tests.pallas_kernels.gpu.util import KERNELS, PARAMS, normalised_kda_reference, packed_runs


def _float64_grad(x, dy):
  x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
  norm = np.linalg.norm(x, axis=-1, keepdims=True)
  y = x / norm
  return (dy - y * np.sum(y * dy, axis=-1, keepdims=True)) / norm


@pytest.mark.parametrize("shape,dtype", [((1, 70, 3, 128), jnp.bfloat16), ((2, 64, 1, 64), jnp.float16)],
                         ids=["bf16-ragged-rows", "f16"])
def test_the_kernel_matches_the_float64_formula_and_xlas_vjp(shape, dtype):
  r = np.random.default_rng(3)
  # norms from ~0.03 (k's rows scaled by 1e-2 on some) to ~60, cotangents of both signs
  q = r.normal(size=shape) * r.uniform(0.5, 5.0, shape[:-1] + (1,))
  k = r.normal(size=shape) * np.where(r.uniform(size=shape[:-1] + (1,)) < 0.2, 1e-2, 0.3)
  q, dq, k, dk = (jnp.asarray(x, dtype) for x in (q, r.normal(size=shape), k, 2.0 * r.normal(size=shape)))
  out = jax.jit(lambda *a: l2_grads.backward(*a, interpret=PARAMS))(q, dq, k, dk)
  for x, dx, got in ((q, dq, out[0]), (k, dk, out[1])):
    assert got.shape == x.shape and got.dtype == x.dtype
    ref = _float64_grad(x, dx)
    xla = jax.vjp(common.l2_normalize, x)[1](dx)[0]
    assert rel_rms(got, ref) < (4e-3 if dtype == jnp.bfloat16 else 6e-4), rel_rms(got, ref)
    # XLA's vjp computes the same float32 sums: they differ by the final rounding at most
    assert rel_rms(got, xla) < (4e-3 if dtype == jnp.bfloat16 else 6e-4) / 4
    assert np.isfinite(np.asarray(got, np.float32)).all()


def test_the_kernel_checks_its_arguments():
  x = jnp.zeros((1, 64, 1, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="K in"):
    l2_grads.backward(*(jnp.zeros((1, 64, 1, 256), jnp.bfloat16),) * 4, interpret=PARAMS)
  with pytest.raises(ValueError, match="16-bit"):
    l2_grads.backward(*(jnp.zeros((1, 64, 1, 128), jnp.float32),) * 4, interpret=PARAMS)
  with pytest.raises(ValueError, match="dk must have q's shape"):
    l2_grads.backward(x, x, x, x[:, :32], interpret=PARAMS)
  assert l2_grads.serves(64, jnp.float16) and not l2_grads.serves(128, jnp.float32)


def test_the_plan_says_where_the_norms_gradients_run():
  x = jnp.zeros((1, 64, 1, 128), jnp.bfloat16)
  g, beta = jnp.zeros((1, 64, 1, 128)), jnp.zeros((1, 64, 1))
  plan = lambda **kw: call_plan(x, x, x, g, beta, qk_l2norm=True, config=gpu.GpuConfig(**kw)).l2_grads
  assert plan() == "key_side" and plan(key_warpgroups=1) == "xla"
  assert plan(l2_grads="kernel") == "kernel" and plan(l2_grads="kernel", key_warpgroups=1) == "kernel"
  assert plan(l2_grads="xla") == "xla"
  assert call_plan(x, x, x, g, beta, qk_l2norm=False).l2_grads == "none"
  assert call_plan(x, x, x, g[..., 0], beta, qk_l2norm=True).l2_grads == "none"   # gated delta: in-kernel
  with pytest.raises(ValueError, match="l2_grads"):
    gpu.GpuConfig(l2_grads="epilogue")


def test_kda_with_the_norms_gradients_in_the_kernel_matches_the_float64_loop(monkeypatch):
  # K = 128, bfloat16: the two-warpgroup key side without its epilogue, then l2_grads.py; against the
  # float64 loop on the normalised q, k through the norm's float64 backward (as
  # test_channel_delta_grads' test of the epilogue and of XLA's vjp): packed rows, grouped heads, raw
  # norms 5-64, gates to -20 a token on some channels
  seen = []
  for module, name in ((l2_grads, "backward"), (channel_delta_keys, "key_side")):
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **kw: seen.append(
        (_n, kw.get("norm_grads"))) or _f(*a, **kw))
  T, Hv = 70, 2
  inp = make_inputs("kda", B=1, T=T, H=1, Hv=Hv, K=128, V=64, gates="normal", seed=5)
  r = np.random.default_rng(6)
  q, k = (np.asarray(jnp.asarray(x * r.uniform(1.0, 8.0, x.shape[:-1] + (1,)), jnp.bfloat16), np.float64)
          for x in (inp["q"], inp["k"] * 5.0))
  v = np.asarray(jnp.asarray(inp["v"], jnp.bfloat16), np.float64)
  g = np.asarray(inp["g"], np.float32).copy()
  g[:, 20:60, :, :16] = -r.uniform(3.0, 20.0, (1, 40, Hv, 16))
  beta, h0, seg = inp["beta"], inp["h0"], packed_runs(T)
  do = r.normal(size=v.shape).astype(np.float32)
  dhT = r.normal(size=h0.shape).astype(np.float32)
  config = dataclasses.replace(KERNELS, key_warpgroups=2, l2_grads="kernel")

  def f(q, k, v, g, beta, h0):
    return gpu.chunked_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), g,
                                 beta, initial_state=h0, segment_ids=jnp.asarray(seg), qk_l2norm=True,
                                 config=config, interpret=PARAMS)

  @jax.jit
  def run(*a):
    (o, hT), pull = jax.vjp(f, *a)
    return o, hT, pull((jnp.asarray(do, o.dtype), jnp.asarray(dhT)))

  o, hT, grads = run(*(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, h0)))
  assert ("backward", None) in seen and ("key_side", False) in seen, seen
  ro, rhT, rgrads = normalised_kda_reference(q, k, v, g, beta, h0, do, dhT, seg)
  errors = {"o": rel_rms(o, ro), "state": rel_rms(hT, rhT)}
  errors.update({f"d{n}": rel_rms(a, rgrads[n]) for n, a in zip("q k v g beta h0".split(), grads)})
  print(errors)
  assert all(bool(jnp.isfinite(x).all()) for x in grads)
  for name, e in errors.items():
    assert e <= 1e-2, (name, errors)


def test_the_kernel_exports_for_hopper():
  h200 = AbstractMesh((), (), abstract_device=AbstractDevice(device_kind="NVIDIA H200", platform="gpu",
                                                             num_cores=132))
  with jax.sharding.use_abstract_mesh(h200):
    for shape, dtype in (((8, 4096, 8, 128), jnp.bfloat16), ((2, 100, 3, 64), jnp.float16)):
      spec = jax.ShapeDtypeStruct(shape, dtype)
      module = jax.export.export(jax.jit(l2_grads.backward), platforms=["cuda"])(*(spec,) * 4).mlir_module()
      assert module.count("custom_call @mosaic_gpu") == 1 and "l2_grads" in module
