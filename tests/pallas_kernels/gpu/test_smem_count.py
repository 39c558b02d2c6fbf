"""`tiles.scratch_bytes`, the kernels' own shared-memory check, against Mosaic GPU's count at export:
Mosaic GPU starts each scratch buffer on a 1 KB boundary, so small buffers take more than their bytes,
and a plain sum of the buffers passes layouts that the lowering then refuses."""

import jax
import jax.numpy as jnp
import pytest
from jax._src.mesh import AbstractDevice
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import AbstractMesh

from linear_attention_jax.pallas_kernels.gpu import tiles

H200 = AbstractMesh((), (), abstract_device=AbstractDevice(device_kind="NVIDIA H200", platform="gpu",
                                                           num_cores=132))


def _export(scratch):
  """Exports for Hopper a copy kernel that holds `scratch` (it reads none of it)."""
  def body(x_ref, o_ref, **_):
    o_ref[...] = x_ref[...]
  kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128, 128), jnp.float32),
                        scratch_types=scratch)
  with jax.sharding.use_abstract_mesh(H200):
    jax.export.export(jax.jit(kernel), platforms=["cuda"])(jax.ShapeDtypeStruct((128, 128), jnp.float32))


def _scratch(rows, small):
  """A `[rows, 128]` bfloat16 tile, `small` 4-byte buffers and one barrier."""
  return dict(tile=tiles.smem((rows, 128), jnp.bfloat16), bar=plgpu.Barrier(),
              **{f"s{i}": plgpu.SMEM((1,), jnp.float32) for i in range(small)})


def test_a_layout_that_mosaic_refuses_does_not_fit_by_the_count():
  scratch = _scratch(888, 5)   # 227,328 bytes of tile and 5 x 4 bytes, each buffer on its own 1 KB
  plain = 888 * 256 + 5 * 4 + 2048
  assert plain <= tiles.SMEM_BYTES < tiles.scratch_bytes(scratch)
  with pytest.raises(ValueError, match="exceeds available shared memory"):
    _export(scratch)


def test_the_count_is_mosaics_plus_the_reduction_scratch_where_mosaic_accepts():
  scratch = _scratch(872, 4)   # 223,232 + 4 x 1 KB + 8: Mosaic's 227,336 fits
  _export(scratch)
  assert tiles.scratch_bytes(scratch) == 872 * 256 + 4 * 1024 + 8 + 2048   # + the reduction scratch
