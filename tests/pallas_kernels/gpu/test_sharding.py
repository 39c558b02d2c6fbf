"""`sharded_chunked_attention` for the GPU kernels: the op under `jax.shard_map` (batch x heads, and batch
x value columns, with `check_vma=True`) exports with its gradient for a 2 x 2 mesh of H200s.

The numerics of the shard_map wrapper (`pallas_kernels.sharding`, shared with the TPU kernels) are checked
on four CPU devices in tests/pallas_kernels/tpu/test_sharding.py; the Mosaic GPU interpreter simulates a
single device, so the GPU kernels cannot run sharded on a CPU."""

import jax
import jax.numpy as jnp
import pytest
from jax._src.mesh import AbstractDevice
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels import gpu


AXES = pytest.mark.parametrize("axes", [{"batch_axis": "data", "head_axis": "model"},
                                         {"batch_axis": "data", "value_axis": "model"}],
                                ids=["batch+heads", "batch+values"])


def _export_grad(axes, T, delta, per_channel=False):
  """`jax.export` of the gradient of the sharded op (B=4, H=8, K=V=128, bf16; scalar or per-channel
  decay) for a 2 x 2 H200 mesh."""
  mesh = AbstractMesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2,
                      abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                                     platform="gpu"))
  B, H, D = 4, 8, 128
  spec = lambda shape, dtype, p: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, p))
  rows = P("data", None, "model") if "head_axis" in axes else P("data")
  values = P("data", None, "model") if "head_axis" in axes else P("data", None, None, "model")
  args = (spec((B, T, H, D), jnp.bfloat16, rows), spec((B, T, H, D), jnp.bfloat16, rows),
          spec((B, T, H, D), jnp.bfloat16, values),
          spec((B, T, H, D) if per_channel else (B, T, H), jnp.float32, rows))
  if delta:
    args += (spec((B, T, H), jnp.float32, rows),)
  fn = gpu.sharded_chunked_attention(mesh, **axes)

  def loss(*xs):
    o, final = fn(*xs)
    return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final)

  with jax.sharding.use_abstract_mesh(mesh):
    return jax.export.export(jax.jit(jax.grad(loss, argnums=range(len(args)))), platforms=["cuda"])(*args)


@AXES
def test_sharded_exports_for_two_by_two_h200s(axes):
  exported = _export_grad(axes, T=1024, delta=True)
  assert exported.nr_devices == 4
  # the forward's preparation kernel and walk (which keeps the states for the backward); the backward's
  # reverse walk and per-chunk gradient kernel
  module = exported.mlir_module()
  assert module.count("custom_call @mosaic_gpu") == 4
  assert "chunk_prep_delta" in module and "chunk_grads_delta" in module


@pytest.mark.parametrize("delta", [False, True], ids=["simple_gla", "gated_delta_rule"])
@AXES
def test_sharded_walks_in_sequence_pieces_export(axes, delta):
  # T = 4096 per shard with 16 programs: the walks split into 4 pieces inside each shard (the pieces'
  # maps and starts are per shard; their constants must vary over the mesh axes like the data).
  module = _export_grad(axes, T=4096, delta=delta).mlir_module()
  # each direction's walk gains a first pass for the pieces: forward (preparation,) maps, walk; backward
  # starts, reverse walk, per-chunk gradients
  assert module.count("custom_call @mosaic_gpu") == (6 if delta else 5)
  assert ("chunk_walk_bwd_starts" if delta else "chunk_walk_fused_bwd_starts") in module


@pytest.mark.parametrize("delta", [False, True], ids=["gla", "kda"])
@AXES
def test_sharded_per_channel_gradients_export(axes, delta):
  # per-channel decay: the preparation kernel and walk forward; the reverse walk and the per-chunk
  # gradient kernels (gla's one, kda's value side and key side) inside each shard
  module = _export_grad(axes, T=1024, delta=delta, per_channel=True).mlir_module()
  names = ["chunk_grads_channel_delta_v", "chunk_grads_channel_delta_k"] if delta else ["chunk_grads_channel"]
  assert all(name in module for name in ["chunk_prep_channel", "chunk_walk_fwd", "chunk_walk_bwd"] + names)
