"""The short convolution's Mosaic GPU kernels (pallas_kernels/gpu/conv.py) in the interpreter against a
float64 loop: y and the gradients of x, the taps, the bias and the window before the sequence, across
blocks (halos before and after), channel blocks, widths 1 to 9 and both activations; the layer's
`impl` choice; and the lowering for a Hopper GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.mesh import AbstractDevice
from jax.sharding import AbstractMesh

from linear_attention_jax.layers import ShortConvolution
from linear_attention_jax.pallas_kernels import gpu
from linear_attention_jax.pallas_kernels.gpu import conv


def loop(x, kernel, bias, head, dy, activation):
  """float64 `(y, dx, dkernel, dbias, dhead)` by the definition, token by token."""
  x, kernel, bias, head, dy = (np.asarray(a, np.float64) for a in (x, kernel, bias, head, dy))
  W = kernel.shape[0]
  T = x.shape[1]
  xp = np.concatenate([head, x], axis=1)            # token t is row t + W - 1
  pre = np.zeros_like(x) + bias
  for t in range(T):
    for w in range(W):
      pre[:, t] += kernel[w] * xp[:, t + w]
  if activation == "silu":
    s = 1 / (1 + np.exp(-pre))
    y, slope = pre * s, s * (1 + pre * (1 - s))
  else:
    y, slope = pre, np.ones_like(pre)
  dpre = dy * slope
  dxp = np.zeros_like(xp)
  dkernel = np.zeros_like(kernel)
  for t in range(T):
    for w in range(W):
      dxp[:, t + w] += kernel[w] * dpre[:, t]
      dkernel[w] += np.sum(dpre[:, t] * xp[:, t + w], axis=0)
  return y, dxp[:, W - 1:], dkernel, dpre.sum(axis=(0, 1)), dxp[:, :W - 1]


CASES = {   # B, T, D, W, activation, blocks (bt, bd) or None
    "three_blocks": (2, 24, 256, 4, "silu", None),
    "channel_blocks_identity": (1, 40, 256, 2, "identity", (8, 128)),
    "width_one": (1, 16, 128, 1, "silu", None),
    "width_nine": (1, 32, 128, 9, "silu", (16, 128)),
}


# bfloat16 on one case (the interpreter's time goes to the float32 cases); "mixed": float32 x, bfloat16
# y and dy (no buffer is shared in place then)
@pytest.mark.parametrize("case,dtype", [(c, "float32") for c in CASES] + [("three_blocks", "bfloat16"),
                                                                          ("width_one", "mixed")])
def test_kernels_match_the_float64_loop(case, dtype):
  B, T, D, W, activation, blocks = CASES[case]
  ks = jax.random.split(jax.random.key(W), 5)
  dt = jnp.dtype("float32" if dtype == "mixed" else dtype)
  out = jnp.dtype("bfloat16" if dtype == "mixed" else dtype)
  x = jax.random.normal(ks[0], (B, T, D)).astype(dt)
  kernel = jax.random.uniform(ks[1], (W, D), minval=-1, maxval=1)
  bias = 0.3 * jax.random.normal(ks[2], (D,))
  head = jax.random.normal(ks[3], (B, W - 1, D))
  dy = jax.random.normal(ks[4], (B, T, D)).astype(out)
  bt, bd = blocks or (None, None)
  with gpu.interpret_kernels():
    y, pull = jax.vjp(lambda *a: conv.short_conv(*a, activation=activation, out_dtype=out, block_t=bt,
                                                 block_d=bd), x, kernel, bias, head)
    grads = pull(dy)
  want = loop(x, kernel, bias, head, dy, activation)
  # float32: each value within float32 rounding of the loop's; bfloat16: y and dx are rounded once
  # to bfloat16 (relative 2^-8), the float32 sums (taps, bias, head) only differ by the rounded inputs
  tol = dict(float32=(2e-5, 2e-5), bfloat16=(1e-2, 1e-2), mixed=(1e-2, 1e-2))[dtype]
  assert y.dtype == out and grads[0].dtype == dt
  for name, got, ref in zip(("y", "dx", "dkernel", "dbias", "dhead"), (y, *grads), want):
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape, name
    if not ref.size:   # d(head) of width 1: no window
      continue
    scale = max(np.max(np.abs(ref)), 1e-30)
    assert np.max(np.abs(got - ref)) / scale < tol[0], (name, np.max(np.abs(got - ref)) / scale)
    assert np.sqrt(np.mean((got - ref) ** 2)) / np.sqrt(np.mean(ref ** 2) + 1e-30) < tol[1], name


def test_layer_takes_the_kernels_and_keeps_its_window():
  # Given a conv with bias whose impl is "pallas", and a nonzero window from an earlier call
  layer = ShortConvolution(128, 4, use_bias=True, impl="pallas", rngs=nnx.Rngs(0))
  layer.bias[...] = jnp.full((128,), 0.1)
  xla = ShortConvolution(128, 4, use_bias=True, impl="xla", rngs=nnx.Rngs(0))
  xla.bias[...] = layer.bias[...]
  x = jax.random.normal(jax.random.key(3), (2, 16, 128))
  cache = jax.random.normal(jax.random.key(4), (2, 3, 128))

  def loss(model, x, cache):
    y, window = model(x, cache)
    return jnp.sum(jnp.sin(y)) + jnp.sum(window ** 2)

  # When both run, with the cache, and are differentiated in the params, x and the cache
  with gpu.interpret_kernels():
    got = nnx.grad(loss, argnums=(0, 1, 2))(layer, x, cache)
    y, window = layer(x, cache)
  want = nnx.grad(loss, argnums=(0, 1, 2))(xla, x, cache)
  y_xla, window_xla = xla(x, cache)
  # Then outputs, windows and every gradient agree
  np.testing.assert_allclose(y, y_xla, rtol=2e-5, atol=2e-6)
  np.testing.assert_array_equal(window, window_xla)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def test_pallas_says_why_it_cannot_serve_a_call():
  with gpu.interpret_kernels():
    with pytest.raises(ValueError, match="T a multiple of 8 and D a multiple of 128"):
      ShortConvolution(96, 4, impl="pallas", rngs=nnx.Rngs(0))(jnp.ones((1, 16, 96)))
    # "auto" takes the shifted sum for the same call, and the kernels where they serve it
    auto = ShortConvolution(96, 4, rngs=nnx.Rngs(0))
    assert auto.kernel_reason((1, 16, 96), jnp.float32) is not None
    assert auto.kernel_reason((1, 16, 128), jnp.float32) is None
  with pytest.raises(ValueError, match="impl must be one of"):
    ShortConvolution(8, 4, impl="chunk", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="block_t=12 must divide T=16"):
    conv.blocks(16, 128, 12, None)


H200 = AbstractMesh((), (), abstract_device=AbstractDevice(device_kind="NVIDIA H200", platform="gpu",
                                                           num_cores=132))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kernels_export_for_hopper(dtype):
  # the layer's shapes: x [8, 4096, 1024], four taps, a window before the sequence
  spec = jax.ShapeDtypeStruct
  args = (spec((8, 4096, 1024), jnp.dtype(dtype)), spec((4, 1024), jnp.float32),
          spec((1024,), jnp.float32), spec((8, 3, 1024), jnp.float32))
  loss = lambda *a: jnp.sum(conv.short_conv(*a).astype(jnp.float32) ** 2)
  with jax.sharding.use_abstract_mesh(H200):
    fwd = jax.export.export(jax.jit(conv.short_conv), platforms=["cuda"])(*args).mlir_module()
    bwd = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))),
                            platforms=["cuda"])(*args).mlir_module()
  assert fwd.count("custom_call @mosaic_gpu") == 1 and "short_conv_fwd" in fwd
  assert bwd.count("custom_call @mosaic_gpu") == 2 and "short_conv_bwd" in bwd


def test_layer_runs_the_kernels_per_shard_under_sharding_rules(monkeypatch):
  """Under `use_rules` the layer's kernels run under `shard_map` (rows over "data", channels over
  "tensor"), exported for a 2 x 2 H200 mesh; a sequence split says why it keeps the shifted sum. (The
  Mosaic GPU interpreter simulates one device, so the split's numerics are not run here: per device the
  kernels see an ordinary call of a depthwise convolution.)"""
  from jax._src.mesh import AbstractDevice as Device
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  from linear_attention_jax.sharding import use_rules
  # the export targets a Hopper GPU from this CPU: the kernels' backend check is asserted, as
  # `hopper_reason(backend="hopper")` does for the ops' export tests
  monkeypatch.setattr(conv, "hopper_reason", lambda backend=None: None)
  mesh = AbstractMesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2,   # as make_mesh
                      abstract_device=Device(device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
  layer = ShortConvolution(1024, 4, impl="pallas", axis="heads", dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(layer)

  def loss(params, x):
    with use_rules(mesh, "tp"):
      y, _ = nnx.merge(graphdef, params)(x)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  rows = NamedSharding(mesh, P("data", None, "tensor"))
  x = jax.ShapeDtypeStruct((4, 1024, 1024), jnp.bfloat16, sharding=rows)
  with jax.sharding.use_abstract_mesh(mesh):
    exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1))), platforms=["cuda"])(params, x)
  module = exported.mlir_module()
  assert exported.nr_devices == 4
  assert module.count("custom_call @mosaic_gpu") == 2 and "short_conv_bwd" in module
  # per device under shard_map, the taps' and bias' per-row-shard sums added over "data"
  assert "sdy.manual_computation" in module and "all_reduce" in module
  seq_mesh = AbstractMesh((2, 2), ("data", "seq"), axis_types=(AxisType.Auto,) * 2)
  with use_rules(seq_mesh, "cp"):
    assert "sequence is split" in layer.kernel_reason((4, 1024, 1024), jnp.bfloat16)


@pytest.mark.parametrize("splits", [(128, 256), (128, 128, 128)])
def test_one_call_over_joined_channels_matches_the_float64_loop(splits):
  # Given q, k, v's channels side by side in one x (a joined projection), three token blocks
  B, T, W = 2, 24, 4
  D = sum(splits)
  ks = jax.random.split(jax.random.key(len(splits)), 5)
  x = jax.random.normal(ks[0], (B, T, D))
  kernel = jax.random.uniform(ks[1], (W, D), minval=-1, maxval=1)
  bias = 0.3 * jax.random.normal(ks[2], (D,))
  head = jax.random.normal(ks[3], (B, W - 1, D))
  dy = jax.random.normal(ks[4], (B, T, D))
  edges = np.cumsum((0,) + splits)
  dys = tuple(dy[..., a:b] for a, b in zip(edges[:-1], edges[1:]))
  # When one call convolves them and returns one array a split
  with gpu.interpret_kernels():
    ys, pull = jax.vjp(lambda *a: conv.short_conv(*a, splits=splits, block_t=8), x, kernel, bias, head)
    grads = pull(dys)
  # Then each split is its channels of the joined convolution, and x's gradient comes back joined
  want = loop(x, kernel, bias, head, dy, "silu")
  assert isinstance(ys, tuple) and [y.shape[-1] for y in ys] == list(splits)
  for name, got, ref in zip(("y", "dx", "dkernel", "dbias", "dhead"),
                            (jnp.concatenate(ys, axis=-1), *grads), want):
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape, name
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5 * np.max(np.abs(ref)), err_msg=name)


def test_a_split_call_says_why_it_cannot_serve():
  assert "each split of D a multiple of 128" in conv.reason((1, 16, 384), 4, "silu", jnp.float32,
                                                            backend="hopper", splits=(64, 320))
  assert "summing to D=384" in conv.reason((1, 16, 384), 4, "silu", jnp.float32, backend="hopper",
                                           splits=(128, 128))
  assert conv.reason((1, 16, 384), 4, "silu", jnp.float32, backend="hopper", splits=(128, 256)) is None
