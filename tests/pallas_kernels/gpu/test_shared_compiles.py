"""`shared_compiles`: with it enabled, the same kernel lowered for two layers hashes (so compiles) once;
the export runs the Hopper lowering on a CPU, as test_lowering.py does."""

import re

import jax
import jax.numpy as jnp
from jax._src.mesh import AbstractDevice
from jax.sharding import AbstractMesh

from linear_attention_jax.pallas_kernels import gpu
from linear_attention_jax.pallas_kernels.gpu import shared_compiles

H200 = AbstractMesh((), (), abstract_device=AbstractDevice(device_kind="NVIDIA H200", platform="gpu",
                                                           num_cores=132))


def _kernel_hashes():
  spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
  B, T, H, D = 1, 128, 1, 64

  def two_layers(q, k, v, g, beta):
    o, _ = gpu.chunked_attention(q, k, v, g, beta)
    return gpu.chunked_attention(o, k, v, g, beta)[0]

  args = (spec(B, T, H, D), spec(B, T, H, D), spec(B, T, H, D), spec(B, T, H, dtype=jnp.float32),
          spec(B, T, H, dtype=jnp.float32))
  with jax.sharding.use_abstract_mesh(H200):
    text = jax.export.export(jax.jit(two_layers), platforms=["cuda"])(*args).mlir_module()
  return re.findall(r'kernel_hash = "([^"]*)"', text)


def test_identical_kernels_of_two_layers_hash_once_when_enabled():
  was = shared_compiles.enabled()
  try:
    shared_compiles.disable()
    apart = _kernel_hashes()
    assert shared_compiles.enable() and shared_compiles.enable() and shared_compiles.enabled()
    shared = _kernel_hashes()
  finally:
    shared_compiles.disable()
    if was:
      shared_compiles.enable()
  # two layers of (preparation, walk): four custom calls, two distinct kernels
  assert len(shared) == len(apart) == 4
  assert len(set(shared)) == 2, shared
  assert len(set(apart)) >= len(set(shared))   # 4 while Pallas stamps a counter in each module
