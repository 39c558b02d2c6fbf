"""The kernels lower for TPU at realistic shapes: `jax.export(..., platforms=["tpu"])` runs the whole
Pallas -> Mosaic lowering on a CPU (block-shape rules, every op of the kernel bodies) and must produce
the Mosaic custom calls, forward and backward. (Mosaic's own compilation in libtpu is not exercised.)"""

import jax
import jax.numpy as jnp
import pytest

from linear_attention_jax.pallas_kernels import tpu

# (8, 4096, 16, 128): B, T, heads, head dim, in bfloat16; chunk 64, default block sizes.
B, T, H, D = 8, 4096, 16, 128
KINDS = {  # name -> (gate shape or None, delta family)
    "linear_attention": (None, False), "simple_gla": ((B, T, H), False), "gla": ((B, T, H, D), False),
    "delta_rule": (None, True), "gated_delta_rule": ((B, T, H), True), "kda": ((B, T, H, D), True)}


def _spec(*shape, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct(shape, dtype)


def _export(fn, args, argnums):
  """Exports the forward and the gradient of a scalar loss; returns the two MLIR texts."""
  def loss(*xs):
    o, final = fn(*xs)
    return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final ** 2)

  fwd = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)
  bwd = jax.export.export(jax.jit(jax.grad(loss, argnums=argnums)), platforms=["tpu"])(*args)
  return fwd.mlir_module(), bwd.mlir_module()


@pytest.mark.parametrize("segments", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("kind", KINDS)
def test_exports_for_tpu(kind, segments):
  gate, delta = KINDS[kind]
  args = (_spec(B, T, H, D), _spec(B, T, H, D), _spec(B, T, H, D),
          None if gate is None else _spec(*gate, dtype=jnp.float32),
          _spec(B, T, H, dtype=jnp.float32) if delta else None,
          _spec(B, H, D, D, dtype=jnp.float32), _spec(B, T, dtype=jnp.int32) if segments else None)

  def fn(q, k, v, g, beta, h0, seg):
    return tpu.chunked_attention(q, k, v, g, beta, initial_state=h0, segment_ids=seg, chunk_size=64,
                                 interpret=False)

  fwd, bwd = _export(fn, args, tuple(i for i in range(6) if args[i] is not None))
  assert fwd.count("stablehlo.custom_call @tpu_custom_call") == 1  # the forward walk
  # the gradient: forward walk (the loss reads o), state recomputation, reverse walk
  assert bwd.count("stablehlo.custom_call @tpu_custom_call") == 3


def test_exports_split_values_grouped_heads_float32():
  # float32 operands (Precision.HIGHEST), 4 q/k heads serving 16 value heads, V = 256 split into two
  # 128-lane blocks, chunk 128.
  Bs, Ts, Hq, Hv, K, V = 2, 1024, 4, 16, 128, 256
  f32 = jnp.float32
  args = (_spec(Bs, Ts, Hq, K, dtype=f32), _spec(Bs, Ts, Hq, K, dtype=f32), _spec(Bs, Ts, Hv, V, dtype=f32),
          _spec(Bs, Ts, Hv, K, dtype=f32), _spec(Bs, Ts, Hv, dtype=f32), _spec(Bs, Hv, K, V, dtype=f32))

  def fn(q, k, v, g, beta, h0):
    return tpu.chunked_attention(q, k, v, g, beta, initial_state=h0, chunk_size=128, interpret=False,
                                 block_sizes=tpu.BlockSizes(block_v=128))

  fwd, bwd = _export(fn, args, tuple(range(6)))
  assert "tpu_custom_call" in fwd and bwd.count("stablehlo.custom_call @tpu_custom_call") == 3


def test_default_blocks_fit_the_smallest_scoped_vmem():
  # v5e grants 16 MiB of scoped VMEM by default; the defaults stay well inside it at K = V = 128.
  bs = tpu.BlockSizes()
  for backward, nb in ((False, bs.chunks_per_step), (True, bs.chunks_per_step_bwd)):
    need = tpu.walk.vmem_bytes(C=64, K=128, V=128, nb=nb, bv=128, itemsize=2, delta=True,
                               backward=backward)
    assert need < 16 * 2 ** 20, (backward, need)
