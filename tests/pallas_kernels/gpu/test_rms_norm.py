"""The block norm's kernels (`pallas_kernels/gpu/rms_norm.py`) in the Mosaic GPU interpreter against the
float64 formula (with and without the residual addition, with and without s's own cotangent, rows that do
not fill a program, odd and even numbers of column blocks, 16-bit dtypes) and against flax's module; the
LM taking them where they serve it (and only there); their checks; the lowering for a Hopper GPU."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import jax.experimental.pallas.mosaic_gpu as plgpu
from flax import nnx
from jax._src.mesh import AbstractDevice
from jax.sharding import AbstractMesh

from linear_attention_jax import models
from linear_attention_jax.models import lm as lm_module
from linear_attention_jax.pallas_kernels.gpu import interpret_kernels, rms_norm
from tests.layers.util import all_eqns
from tests.ops.conftest import rel_rms

EPS = 1e-6


def _float64(x, h, w, dy, ds_out):
  """y, s and the gradients of x (= h's), w in float64 for the cotangents dy, ds_out (None: zero); s is
  rounded to x's dtype first, as the kernels write it."""
  s = x if h is None else (jnp.asarray(x, jnp.float32) + jnp.asarray(h, jnp.float32)).astype(x.dtype)
  s, w, dy = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (s, w, dy))
  r = 1.0 / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + EPS)
  xh, g = s * r, dy * w
  ds = r * (g - xh * np.mean(g * xh, axis=-1, keepdims=True))
  if ds_out is not None:
    ds = ds + np.asarray(jnp.asarray(ds_out, jnp.float32), np.float64)
  return xh * w, s, ds, np.sum((dy * xh).reshape(-1, w.shape[-1]), axis=0)


def _inputs(shape, dtype, seed=0):
  r = np.random.default_rng(seed)
  # rows of very different norms (1e-2 to 30), both signs; a weight away from 1
  x = r.normal(size=shape) * np.exp(r.uniform(np.log(1e-2), np.log(30.0), shape[:-1] + (1,)))
  h = r.normal(size=shape)
  w = 1.0 + 0.5 * r.normal(size=shape[-1:])
  dy, ds_out = r.normal(size=shape), 0.5 * r.normal(size=shape)
  cast = lambda a: jnp.asarray(a, dtype)
  return cast(x), cast(h), jnp.asarray(w, jnp.float32), cast(dy), cast(ds_out)


def _ulps_apart(a, b_exact, dtype):
  """Elements of `a` (in `dtype`) more than one rounding step of `dtype` from the exact `b_exact`."""
  a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  step = np.abs(np.asarray(jnp.asarray(b_exact, jnp.float32), np.float64)) * float(jnp.finfo(dtype).eps)
  return int(np.sum(np.abs(a - b_exact) > step + 1e-30))


@pytest.mark.parametrize("shape,dtype,add,ds_used", [
    ((2, 50, 384), jnp.bfloat16, True, True),     # 2 parts of 192 (blocks of 64); 100 rows: 3 programs + 4
    ((100, 1024), jnp.bfloat16, True, False),     # 4 parts, 16 tokens a program; s unused: no cotangent read
    ((1, 64, 128), jnp.float16, True, True),      # one part: 64 tokens a program
    ((3, 7, 2048), jnp.bfloat16, False, False),   # 8 parts of 256, 8 tokens; the norm alone (the first's)
], ids=["bf16-add-2-parts-ragged", "bf16-add-4-parts-s-unused", "f16-add-1-part", "bf16-norm-8-parts"])
def test_the_kernels_match_the_float64_formula(shape, dtype, add, ds_used):
  x, h, w, dy, ds_out = _inputs(shape, dtype)
  h = h if add else None

  def loss(x, h, w):
    out = rms_norm.add_rms_norm(x, h, w, eps=EPS)
    y, s = out if add else (out, None)
    total = jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))
    return total + (jnp.sum(s.astype(jnp.float32) * ds_out.astype(jnp.float32)) if ds_used else 0.0)

  with interpret_kernels():
    out = jax.jit(lambda x, h, w: rms_norm.add_rms_norm(x, h, w, eps=EPS))(x, h, w)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2) if add else (0, 2)))(x, h, w)
  y, s = out if add else (out, x)
  y_ref, s_ref, ds_ref, dw_ref = _float64(x, h, w, dy, ds_out if ds_used else None)
  assert y.shape == x.shape and y.dtype == x.dtype and s.dtype == x.dtype
  # float32 arithmetic rounded once: y within one rounding step of the exact value, s exactly x + h
  assert _ulps_apart(y, y_ref, dtype) == 0
  np.testing.assert_array_equal(np.asarray(jnp.asarray(s, jnp.float32)), s_ref)
  dx, dw = grads[0], grads[-1]
  assert rel_rms(dx, ds_ref) < (4e-3 if dtype == jnp.bfloat16 else 6e-4), rel_rms(dx, ds_ref)
  if add:
    np.testing.assert_array_equal(np.asarray(grads[1]), np.asarray(dx))   # x's and h's are one
  assert dw.dtype == jnp.float32 and rel_rms(dw, dw_ref) < 1e-5, rel_rms(dw, dw_ref)


def test_the_forward_equals_flaxs_module():
  x, h, w, _, _ = _inputs((4, 64, 256), jnp.bfloat16, seed=1)
  norm = nnx.RMSNorm(256, epsilon=EPS, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  norm.scale[...] = w
  with interpret_kernels():   # flax rounds its scale to the module's dtype: so does the LM's call
    y, s = jax.jit(lambda x, h, w: rms_norm.add_rms_norm(x, h, w, eps=EPS))(x, h, w.astype(jnp.bfloat16))
  flax_y = norm(x + h)
  np.testing.assert_array_equal(np.asarray(s), np.asarray(x + h))
  # the same float32 products in the same order; the mean's sum may round differently
  apart = np.abs(np.asarray(y, np.float32) - np.asarray(flax_y, np.float32))
  assert np.mean(apart > 0) < 0.01 and (apart <= np.abs(np.asarray(flax_y, np.float32)) / 64).all()


def _lm(impl):
  config = models.LMConfig(vocab_size=64, width=128, depth=2, num_heads=2, pattern="A",
                           dtype=jnp.bfloat16, impl=impl)
  return models.LM(config, rngs=nnx.Rngs(0))


def test_the_lm_takes_the_kernels_where_they_serve_it():
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 40)), jnp.int32)

  def loss_and_grads(impl):
    """A fresh function each call: jit's caches (make_jaxpr's too) do not see the interpreter."""
    graph, params = nnx.split(_lm(impl))
    def loss(p):
      logits, _ = nnx.merge(graph, p)(tokens)
      return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - logits[..., 0])
    return jax.value_and_grad(loss), params

  def kernel_calls(impl):
    fn, params = loss_and_grads(impl)
    names = [str(e.params.get("name", "")) for e in all_eqns(jax.make_jaxpr(fn)(params).jaxpr)]
    return names.count("rms_norm_fwd"), names.count("rms_norm_bwd")

  with interpret_kernels():
    # two norms a block and the final one: each a forward kernel, and a backward one in the gradient
    assert kernel_calls("auto") == (5, 5) and kernel_calls("pallas") == (5, 5)
    assert kernel_calls("chunk") == (0, 0)                    # not the kernels' impls: flax's module
    fn, params = loss_and_grads("auto")
    got, grads = jax.jit(fn)(params)
  assert kernel_calls("auto") == (0, 0)                        # no Hopper, no interpreter: flax's
  ref_fn, ref_params = loss_and_grads("chunk")
  want, want_grads = jax.jit(ref_fn)(ref_params)
  assert abs(float(got) - float(want)) < 1e-2 * abs(float(want))
  flat, flat_want = jax.tree.leaves(grads), jax.tree.leaves(want_grads)
  assert len(flat) == len(flat_want)
  for a, b in zip(flat, flat_want):
    assert rel_rms(a, b) < 2e-2, rel_rms(a, b)


def test_the_kernels_check_their_arguments():
  x = jnp.zeros((64, 256), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"h must have x's shape \(64, 256\)"):
    rms_norm.add_rms_norm(x, x[:, :128], jnp.ones((256,)), eps=EPS)
  with pytest.raises(ValueError, match=r"w must be \[256\]"):
    rms_norm.add_rms_norm(x, None, jnp.ones((128,)), eps=EPS)
  assert "parts of a multiple of 64" in rms_norm.reason((64, 200), jnp.bfloat16, backend="hopper")
  assert "parts of a multiple of 64" in rms_norm.reason((64, 8192), jnp.bfloat16, backend="hopper")
  assert [rms_norm.parts(D) for D in (128, 256, 384, 1024, 2048, 4096)] == [1, 1, 2, 4, 8, None]
  assert "bfloat16 and float16" in rms_norm.reason((64, 256), jnp.float32, backend="hopper")
  assert "Hopper" in rms_norm.reason((64, 256), jnp.bfloat16, backend="cpu")
  assert rms_norm.reason((8, 1024, 1024), jnp.bfloat16, backend="hopper") is None


H200 = AbstractMesh((), (), abstract_device=AbstractDevice(device_kind="NVIDIA H200", platform="gpu",
                                                           num_cores=132))


@pytest.mark.parametrize("add", [True, False])
def test_the_kernels_lower_for_hopper(add):
  spec = jax.ShapeDtypeStruct((8, 4096, 1024), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((1024,), jnp.float32)

  def loss(x, h, w):
    out = rms_norm.add_rms_norm(x, h if add else None, w, eps=EPS)
    y, s = out if add else (out, x)
    return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(s.astype(jnp.float32))

  with jax.sharding.use_abstract_mesh(H200):
    module = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda"])(
        spec, spec, w).mlir_module()
  assert module.count("mosaic_gpu") >= 2 and "rms_norm_fwd" in module and "rms_norm_bwd" in module


@pytest.mark.parametrize("D,add", [(1024, True), (384, False)], ids=["4-parts-add", "2-parts-norm"])
def test_the_race_detector_finds_no_race(capfd, D, add):
  # the row sums' hand-over through shared memory between the tile's rows, and each tile's copies after
  # the writes that fill it (jax 0.11's detector prints what it finds)
  x, h, w, dy, ds_out = _inputs((40, D), jnp.bfloat16, seed=4)
  with interpret_kernels(plgpu.InterpretGPUParams(detect_races=True)):
    if add:
      out, pull = jax.vjp(lambda x, h, w: rms_norm.add_rms_norm(x, h, w, eps=EPS), x, h, w)
      grads = pull((dy, ds_out))
    else:
      out, pull = jax.vjp(lambda x, w: rms_norm.add_rms_norm(x, None, w, eps=EPS), x, w)
      grads = pull(dy)
    jax.block_until_ready((out, grads))
  printed = "".join(capfd.readouterr())
  assert "RACE DETECTED" not in printed, printed[:3000]
