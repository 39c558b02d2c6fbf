"""`shared_compiles`: with it enabled, the same kernel lowered in two programs hashes (so compiles) once;
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
  # one layer's (preparation, walk) exported in two programs, jit's caches cleared between them so
  # that each lowers its kernels anew (else the second reuses the first's traces and lowerings, as a
  # later layer does within one program: once.lowered_once, test_once.py)
  spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
  B, T, H, D = 1, 128, 1, 64

  def layer(q, k, v, g, beta):
    return gpu.chunked_attention(q, k, v, g, beta)[0]

  args = (spec(B, T, H, D), spec(B, T, H, D), spec(B, T, H, D), spec(B, T, H, dtype=jnp.float32),
          spec(B, T, H, dtype=jnp.float32))
  hashes = []
  for _ in range(2):
    jax.clear_caches()
    with jax.sharding.use_abstract_mesh(H200):
      text = jax.export.export(jax.jit(layer), platforms=["cuda"])(*args).mlir_module()
    hashes += re.findall(r'kernel_hash = "([^"]*)"', text)
  return hashes


def test_identical_kernels_of_two_programs_hash_once_when_enabled():
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
  # two programs of (preparation, walk): four custom calls, two distinct kernels
  assert len(shared) == len(apart) == 4
  assert len(set(shared)) == 2, shared
  # 4 where Pallas stamps a counter in each module it lowers (jax 0.11.2), 2 where it does not (0.12)
  assert len(set(apart)) >= len(set(shared)), apart
