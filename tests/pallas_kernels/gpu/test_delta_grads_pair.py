"""The delta family's gradients with both value blocks in one program of two warpgroups
(`delta_grads_pair.chunk_grads_pair`, `chunked_attention(..., delta_warpgroups=2)`) in the Mosaic GPU
interpreter: against one warpgroup per block (`delta_grads.chunk_grads`, partial sums added outside) with
the race detector on (end to end against the float64 loop: test_chunked_attention.py's delta backward
test)."""

import jax.numpy as jnp
import jax.experimental.pallas.mosaic_gpu as plgpu
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

from linear_attention_jax.pallas_kernels.gpu import delta_grads
from linear_attention_jax.pallas_kernels.gpu.delta_grads_pair import chunk_grads_pair
from tests.ops.conftest import rel_rms

RACES = plgpu.InterpretGPUParams(detect_races=True)


def _grads_args(r, *, B=1, T=128, H=1, Hv=2, K=64, C=64, blocks=2):
  """chunk_grads' inputs (float16 operands): T a multiple of C, V = `blocks` value blocks of C."""
  f16 = lambda *shape, s=0.5: jnp.asarray(r.normal(size=shape) * s, jnp.float16)
  NC, V = T // C, blocks * C
  G = jnp.cumsum(jnp.asarray(-r.uniform(0, 0.3, (B, Hv, NC, C)), jnp.float32), -1).reshape(B, Hv, T)
  return (f16(B, T, H, K, s=1.0), f16(B, T, H, K, s=1.0), f16(B, T, Hv, V), G,
          jnp.asarray(r.uniform(0, 1, (B, Hv, T)), jnp.float32), f16(B, Hv, T, C, s=0.2),
          f16(B, Hv, NC, V, K), f16(B, Hv, NC, V, K), f16(B, T, Hv, V))


@pytest.mark.parametrize("l2,packed,blocks", [(False, False, 2), (True, True, 2), (True, False, 4)])
def test_pair_equals_one_warpgroup_per_block_with_no_race(l2, packed, blocks):
  # The two warpgroups share q, k, X (and normalise q, k once, for both) and hand their partial dq, dk,
  # dG, dbeta, kdv over in shared memory: the same gradients as one warpgroup per value block with the
  # partials added outside, and the race detector finds no unsynchronised access to shared memory.
  # V = 256 (four blocks): one program per pair of blocks, each pair's partial sums apart.
  r = np.random.default_rng(5)
  args = _grads_args(r, blocks=blocks)
  masks = None
  if packed:
    from linear_attention_jax.pallas_kernels.gpu.masks import segment_vectors
    seg = np.zeros((1, 128), np.int32)
    seg[0, 30:70], seg[0, 70:] = 1, 2
    masks = segment_vectors(jnp.asarray(seg), 64, 128)
  one = delta_grads.chunk_grads(*args, dtype=jnp.float16, masks=masks, interpret=RACES,
                                dv_dtype=jnp.float16, partial_dtype=jnp.float32, qk_l2norm=l2)
  pair = chunk_grads_pair(*args, dtype=jnp.float16, masks=masks, interpret=RACES, qk_l2norm=l2)
  assert not gpu_callbacks.get_races().races_found
  names = ("dq", "dk", "dv", "dG", "dbeta", "kdv")
  for name, a, b in zip(names, one, pair):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if name != "dv":
      assert b.shape[0] == blocks // 2
      a = a.reshape((blocks // 2, 2) + a.shape[1:]).sum(1)
    assert a.shape == b.shape and np.isfinite(b).all(), name
    # dq, dk: float16 once (the second block's partial rounded before the sum); dG: its column sums
    # from transposed products with a float16 operand, against cross-warp reductions; dbeta (and dG):
    # dB_k's row sums from dB_v in float32 through k S^T, against dB_k from dB_v's float16 tile
    assert rel_rms(b, a) < {"dq": 1.5e-3, "dk": 1.5e-3, "dG": 2e-3, "dbeta": 2e-4}.get(name, 1e-6), name


def test_pair_rejects_what_it_cannot_serve():
  r = np.random.default_rng(0)
  args = list(_grads_args(r))
  with pytest.raises(ValueError, match="V = 128 or 256"):
    chunk_grads_pair(*args[:2], args[2][..., :64], *args[3:6], args[6][..., :64, :],
                     args[7][..., :64, :], args[8][..., :64], dtype=jnp.float16)
  with pytest.raises(ValueError, match="16-bit"):
    chunk_grads_pair(*args[:2], args[2].astype(jnp.float32), *args[3:], dtype=jnp.float16)
  assert delta_grads.pair_serves(128, 64, jnp.bfloat16, jnp.bfloat16)
  assert delta_grads.pair_serves(256, 64, jnp.bfloat16, jnp.bfloat16)
  assert not delta_grads.pair_serves(64, 64, jnp.bfloat16, jnp.bfloat16)
  assert not delta_grads.pair_serves(128, 64, jnp.float32, jnp.bfloat16)


def test_public_option_is_checked():
  from linear_attention_jax.pallas_kernels import gpu
  x = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="delta_warpgroups"):
    gpu.chunked_attention(x, x, x, beta=jnp.zeros((1, 64, 1)), config=gpu.GpuConfig(delta_warpgroups=3),
                          interpret=plgpu.InterpretGPUParams())


def test_persistent_programs_equal_the_grid_with_no_race():
  # Given 8 items (V = 256: 2 heads x 2 chunks x 2 pairs of value blocks) and 3 persistent programs, so
  # that each program takes two or three items in turn and the last turn of one has none
  r = np.random.default_rng(7)
  args = _grads_args(r, blocks=4)
  programs = 3
  grid = chunk_grads_pair(*args, dtype=jnp.float16, interpret=RACES, qk_l2norm=True)
  # When the same call runs in persistent programs
  turns = chunk_grads_pair(*args, dtype=jnp.float16, interpret=RACES, qk_l2norm=True, programs=programs)
  # Then every output is the grid's, bit for bit, and no tile was reused before it was free
  assert not gpu_callbacks.get_races().races_found
  for name, a, b in zip(("dq", "dk", "dv", "dG", "dbeta", "kdv"), grid, turns):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)
  with pytest.raises(ValueError, match="programs"):
    chunk_grads_pair(*args, dtype=jnp.float16, programs=0)
