"""A mixer's q, k and v from one product and one convolution call (`LinearMixer._project_joined`,
`layers.conv.joined_kernel_call`) against three of each, in the Mosaic GPU interpreter: the same
outputs and every gradient in float32, KDA's channel order included; and where the joined call
declines (channels split over devices), saying so by returning None."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.mesh import AbstractDevice
from jax.sharding import AbstractMesh, AxisType

from linear_attention_jax.layers import GatedDeltaNet, KimiDeltaAttention, base
from linear_attention_jax.layers.conv import joined_kernel_call
from linear_attention_jax.pallas_kernels import gpu
from linear_attention_jax.sharding import use_rules
from tests.layers.util import all_eqns


def _convs_on_kernels(layer):
  # the op in XLA's chunked form (quick in the interpreter), the convolutions on their kernels
  for conv in layer.convs:
    conv.impl = "auto"
  return layer


def _relative(a, b):
  return float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))


@pytest.mark.parametrize("mixer", ["G", "K"])
def test_layer_joined_equals_separate_projections(monkeypatch, mixer):
  # Given a layer whose convolutions run on the kernels: Gated DeltaNet with V = 2K (splits 256, 256,
  # 512), KDA
  if mixer == "G":
    layer = GatedDeltaNet(256, 2, head_v_dim=256, impl="chunk", chunk_size=16, rngs=nnx.Rngs(0))
  else:
    layer = KimiDeltaAttention(256, 2, impl="chunk", chunk_size=16, rngs=nnx.Rngs(0))
  layer = _convs_on_kernels(layer)
  served = []
  monkeypatch.setattr(base, "joined_kernel_call", lambda *a: served.append(joined_kernel_call(*a))
                      or served[-1])
  x = jax.random.normal(jax.random.key(1), (2, 32, 256))

  def loss(model, x):
    return jnp.sum(jnp.sin(model(x)[0]))

  # When it runs joined and then, switched off, projection by projection
  with gpu.interpret_kernels():
    joined = nnx.value_and_grad(loss, argnums=(0, 1))(layer, x)
    layer.join_projections = False
    apart = nnx.value_and_grad(loss, argnums=(0, 1))(layer, x)
  # Then the joined call served it, and the loss and every gradient agree to float32 rounding
  assert len(served) == 1 and served[0] is not None
  np.testing.assert_allclose(joined[0], apart[0], rtol=1e-5)   # a sum of 16,384 sines, reordered
  paths = jax.tree_util.tree_leaves_with_path(joined[1])
  assert len(paths) == len(jax.tree.leaves(apart[1]))
  for (path, a), b in zip(paths, jax.tree.leaves(apart[1])):
    assert _relative(a, b) < 1e-5, (jax.tree_util.keystr(path), _relative(a, b))


def test_kda_joined_projection_takes_the_channel_order():
  # Given a KDA layer and a permutation of each key head's channels (the layer's channel order)
  layer = _convs_on_kernels(KimiDeltaAttention(256, 2, impl="chunk", rngs=nnx.Rngs(0)))
  perm = np.concatenate([np.random.default_rng(h).permutation(128) + 128 * h for h in range(2)])
  perm = jnp.asarray(perm, jnp.int32)
  x = jax.random.normal(jax.random.key(1), (2, 32, 256))

  def loss(model, x):
    q, k, v, _ = model._project(x, None, perm)
    return jnp.sum(jnp.sin(q)) + jnp.sum(2 * jnp.cos(k)) + jnp.sum(v ** 2)

  # When q, k, v are projected joined and apart
  with gpu.interpret_kernels():
    assert layer._project_joined(x, perm) is not None
    joined = nnx.value_and_grad(loss, argnums=(0, 1))(layer, x)
    layer.join_projections = False
    apart = nnx.value_and_grad(loss, argnums=(0, 1))(layer, x)
  # Then they agree, the projections' and convolutions' gradients in the modules' own channel order
  np.testing.assert_allclose(joined[0], apart[0], rtol=1e-6)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(joined[1]), jax.tree.leaves(apart[1])):
    assert _relative(a, b) < 1e-5, (jax.tree_util.keystr(path), _relative(a, b))


def test_joined_call_declines_split_channels_and_unlike_convolutions():
  layer = _convs_on_kernels(GatedDeltaNet(256, 2, impl="chunk", rngs=nnx.Rngs(0)))
  shape = (4, 64, 768)
  device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  with gpu.interpret_kernels():
    assert joined_kernel_call(layer.convs, shape, jnp.bfloat16) is not None
    # rows over "data" keep one call per device; channels over "tensor" would mix q's, k's and v's
    for sizes, joined in (((2, 1), True), ((1, 2), False)):
      mesh = AbstractMesh(sizes, ("data", "tensor"), axis_types=(AxisType.Auto,) * 2,
                          abstract_device=device)
      with use_rules(mesh, "tp"):
        assert (joined_kernel_call(layer.convs, shape, jnp.bfloat16) is not None) == joined, sizes
    layer.v_conv.impl = "xla"
    assert joined_kernel_call(layer.convs, shape, jnp.bfloat16) is None


def _apart(layers, x):
  return tuple(layer(x) for layer in layers)


def test_shared_input_products_equal_each_layer_apart():
  # Given three projections of one input, one with a bias, in float32 and bfloat16
  rngs = nnx.Rngs(3)
  for dtype, rtol in ((jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)):
    layers = (nnx.Linear(16, 8, use_bias=False, dtype=dtype, rngs=rngs),
              nnx.Linear(16, 3, use_bias=True, dtype=dtype, rngs=rngs),
              nnx.Linear(16, 8, use_bias=False, dtype=dtype, rngs=rngs))
    layers[1].bias[...] = jnp.arange(3.0)
    x = jax.random.normal(jax.random.key(1), (2, 5, 16))

    def loss(layers, x, project):
      y1, y2, y3 = project(layers, x)
      return (jnp.sum(jnp.sin(y1).astype(jnp.float32)) + jnp.sum(y2.astype(jnp.float32) ** 2)
              + jnp.sum(jnp.cos(y3).astype(jnp.float32)))

    # When they run joined and apart
    ys = base.dense_shared_input(layers, x)
    joined = nnx.value_and_grad(loss, argnums=(0, 1))(layers, x, base.dense_shared_input)
    apart = nnx.value_and_grad(loss, argnums=(0, 1))(layers, x, _apart)
    # Then the outputs are the same products bit for bit, and the loss and gradients agree
    for y, ref in zip(ys, _apart(layers, x)):
      assert y.dtype == ref.dtype and bool(jnp.all(y == ref))
    np.testing.assert_allclose(joined[0], apart[0], rtol=1e-6)
    paths = jax.tree_util.tree_leaves_with_path(joined[1])
    assert len(paths) == len(jax.tree.leaves(apart[1])) == 5   # x, three kernels, one bias
    for (path, a), b in zip(paths, jax.tree.leaves(apart[1])):
      assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(path)
      error = _relative(a.astype(jnp.float32), b.astype(jnp.float32))
      assert error < rtol, (jax.tree_util.keystr(path), dtype, error)


def test_shared_input_gradient_is_one_product_onto_the_input():
  layers = tuple(nnx.Linear(16, n, rngs=nnx.Rngs(n)) for n in (8, 3, 8))
  x = jnp.ones((2, 5, 16))

  loss = lambda project: lambda x: sum(jnp.sum(jnp.sin(y)) for y in project(layers, x))
  # x's cotangent: one product where apart it is three (then added)
  assert _products_onto(loss(_apart), x) == 3
  assert _products_onto(loss(base.dense_shared_input), x) == 1


def _products_onto(f, x):
  """How many products in `grad(f)(x)`'s jaxpr have x's shape: x's cotangent's products."""
  jaxpr = jax.make_jaxpr(jax.grad(f))(x).jaxpr
  return sum(1 for e in all_eqns(jaxpr)
             if e.primitive.name == "dot_general" and e.outvars[0].aval.shape == x.shape)


def test_gated_delta_net_with_shared_input_products_equals_them_apart(monkeypatch):
  from linear_attention_jax.layers import gated_delta_net
  # Given a layer that takes narrow products of one input (its gates' projections a and b)
  layer = GatedDeltaNet(64, 2, impl="chunk", chunk_size=16, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 32, 64))

  def loss(model, x):
    return jnp.sum(jnp.sin(model(x)[0]))

  # When it runs as it does and with each product apart
  products = lambda: _products_onto(lambda x: loss(layer, x), x)
  joined, joined_products = nnx.value_and_grad(loss, argnums=(0, 1))(layer, x), products()
  monkeypatch.setattr(gated_delta_net, "dense_shared_input", _apart)
  apart, apart_products = nnx.value_and_grad(loss, argnums=(0, 1))(layer, x), products()
  # Then x's cotangent takes one product for a and b, and the loss and every gradient agree to float32
  # rounding
  assert apart_products - joined_products == 1
  np.testing.assert_allclose(joined[0], apart[0], rtol=1e-5)
  paths = jax.tree_util.tree_leaves_with_path(joined[1])
  assert len(paths) == len(jax.tree.leaves(apart[1]))
  for (path, a), b in zip(paths, jax.tree.leaves(apart[1])):
    assert _relative(a, b) < 1e-5, (jax.tree_util.keystr(path), _relative(a, b))


def test_shared_input_kernel_gradient_reads_x_through_a_barrier():
  # XLA's dot merger joins products that share an operand: the kernels' gradient x^T dy, reading the same
  # x as a wide projection's x^T dqkv, was taken into it at the price of copying dqkv (NOTES.md v76)
  layers = tuple(nnx.Linear(16, n, rngs=nnx.Rngs(n)) for n in (8, 3))
  x = jnp.ones((2, 5, 16))

  def loss(layers):
    return sum(jnp.sum(jnp.sin(y)) for y in base.dense_shared_input(layers, x))

  jaxpr = jax.make_jaxpr(nnx.grad(loss))(layers).jaxpr
  eqns = list(all_eqns(jaxpr))
  barriers = {v for e in eqns if e.primitive.name == "optimization_barrier" for v in e.outvars}
  kernel_grads = [e for e in eqns
                  if e.primitive.name == "dot_general" and e.outvars[0].aval.shape == (16, 11)]
  assert len(kernel_grads) == 1 and kernel_grads[0].invars[0] in barriers
