"""`sharded_chunked_attention`: under `jax.shard_map` the kernels give the unsharded result and
gradients (batch x heads, and batch x value columns, on four CPU devices in the TPU interpreter), and
the sharded op exports for a 2 x 2 TPU mesh."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels import tpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def compare_on_four_devices():
  """Run in a fresh process with four CPU devices: prints one max error per sharding."""
  from jax.experimental.pallas import tpu as pltpu

  from tests.ops.conftest import make_inputs, rel_rms
  inp = make_inputs("kda", B=2, T=40, H=2, Hv=4, K=8, V=256, seed=0)
  seg = np.zeros((2, 40), np.int32)
  seg[0, 17:] = 1
  params = pltpu.InterpretParams(random_seed=0)
  args = [jnp.asarray(inp[n]) for n in ("q", "k", "v", "g", "beta", "h0")]
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

  def loss(fn, q, k, v, g, beta, h0):
    o, final = fn(q, k, v, g, beta, initial_state=h0, segment_ids=jnp.asarray(seg))
    return jnp.sum(o * jnp.cos(o)) + jnp.sum(final ** 2), (o, final)

  def value_and_grads(fn):
    return jax.jit(jax.value_and_grad(lambda *a: loss(fn, *a), argnums=range(6), has_aux=True))(*args)

  plain = value_and_grads(lambda *a, **kw: tpu.chunked_attention(*a, **kw, chunk_size=16,
                                                                 interpret=params))
  for label, axes in (("batch+heads", {"batch_axis": "data", "head_axis": "model"}),
                      ("batch+values", {"batch_axis": "data", "value_axis": "model"})):
    sharded = value_and_grads(tpu.sharded_chunked_attention(mesh, **axes, chunk_size=16,
                                                            interpret=params))
    error = max(rel_rms(a, b) for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(plain)))
    print(f"{label} {error:.3e}")


def test_sharded_equals_unsharded():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  code = "from tests.pallas_kernels.tpu.test_sharding import compare_on_four_devices as f; f()"
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  errors = dict(line.split() for line in out.stdout.strip().splitlines())
  print(errors)
  assert set(errors) == {"batch+heads", "batch+values"}, out.stdout
  assert all(float(e) < 1e-5 for e in errors.values()), errors


def test_sharded_exports_for_a_tpu_mesh():
  from jax._src.mesh import AbstractDevice
  mesh = AbstractMesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2,
                      abstract_device=AbstractDevice(device_kind="TPU v5 lite", num_cores=1,
                                                     platform="tpu"))
  B, T, H, D = 8, 1024, 16, 128
  spec = lambda shape, dtype, p: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, p))
  heads = P("data", None, "model")
  args = (spec((B, T, H, D), jnp.bfloat16, heads), spec((B, T, H, D), jnp.bfloat16, heads),
          spec((B, T, H, D), jnp.bfloat16, heads), spec((B, T, H), jnp.float32, heads),
          spec((B, T, H), jnp.float32, heads))
  fn = tpu.sharded_chunked_attention(mesh, batch_axis="data", head_axis="model", interpret=False)

  def loss(*xs):
    o, final = fn(*xs)
    return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final)

  with jax.sharding.use_abstract_mesh(mesh):
    exported = jax.export.export(jax.jit(jax.grad(loss, argnums=range(5))), platforms=["tpu"])(*args)
  assert exported.nr_devices == 4
  assert exported.mlir_module().count("stablehlo.custom_call @tpu_custom_call") == 3
