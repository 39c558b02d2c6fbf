"""The fused additive forward in three warpgroups per program (`fused_streamed.streamed_walk`,
`chunked_attention(..., forward_warpgroups=3)`, the default) in the Mosaic GPU interpreter: against the
one-warpgroup walk with the race detector on, and end to end against the float64 loop."""

import dataclasses

import jax.numpy as jnp
import jax.experimental.pallas.mosaic_gpu as plgpu
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

from linear_attention_jax.pallas_kernels import gpu
from linear_attention_jax.pallas_kernels.gpu import fused
from linear_attention_jax.pallas_kernels.gpu.fused_streamed import streamed_stages
from tests.ops.conftest import make_inputs
from tests.pallas_kernels.gpu.util import KERNELS, assert_walk_outputs_close, check

RACES = plgpu.InterpretGPUParams(detect_races=True)


@pytest.mark.parametrize("K,pieces,packed,h0,with_states", [(64, 1, False, True, False), (64, 2, True, True, True),
                                                            (64, 1, True, False, True), (128, 1, False, True, True)])
def test_streamed_walk_equals_one_warpgroup_with_no_race(K, pieces, packed, h0, with_states):
  # A fetching warpgroup fills 3-4 input slots, the state's warpgroup hands the state entering each
  # chunk to the output's warpgroup through two shared-memory slots: the same o, states and final state
  # as one warpgroup to bfloat16 rounding (it rounds v e^(G_C - G) instead of k e^(G_C - G) and never
  # rounds q e^G; its accuracy: the float64-loop test below), and the race detector finds no
  # unsynchronised access. 5 chunks per sequence: every slot of every buffer is reused; grouped heads
  # (H = 1 serves H_v = 2); packed runs that end inside a chunk and on a piece boundary; K = 128 leaves
  # room for 3 input slots, K = 64 for 4.
  T = 300
  inp = make_inputs("simple_gla", B=1, T=T, H=1, Hv=2, K=K, V=128, seed=21)
  q, k, v = (jnp.asarray(inp[n], jnp.bfloat16) for n in ("q", "k", "v"))
  seg = None
  if packed:
    seg = np.zeros((1, T), np.int32)
    seg[0, 40:128], seg[0, 128:] = 1, 2
    seg = jnp.asarray(seg)
  assert streamed_stages(64, K, 64, jnp.bfloat16, jnp.bfloat16, packed) == (4 if K == 64 else 3)
  run = lambda wg: fused.forward(q, k, v, jnp.asarray(inp["g"]), jnp.asarray(inp["h0"]) if h0 else None,
                                 chunk_size=64, dtype=jnp.bfloat16, out_dtype=jnp.bfloat16,
                                 segment_ids=seg, interpret=RACES, with_states=with_states,
                                 sequence_pieces=pieces, scale=0.5, warpgroups=wg)
  streamed = run(3)
  assert not gpu_callbacks.get_races().races_found
  one = run(1)
  assert_walk_outputs_close(one, streamed, 4e-3)


@pytest.mark.parametrize("variant,packed,pieces", [("simple_gla", True, None), ("retention", False, 2),
                                                   ("linear_attention", True, 2)])
def test_streamed_forward_matches_the_float64_loop(variant, packed, pieces):
  # Through chunked_attention, forward and every gradient (the differentiated forward keeps its states
  # from the pair's walk).
  T = 150
  inp = make_inputs(variant, B=1, T=T, H=1, Hv=2, K=64, V=128, seed=22)
  seg = None
  if packed:
    seg = np.zeros((1, T), np.int32)
    seg[0, 30:70], seg[0, 70:] = 1, 2
  check(variant, inp, seg=seg, pieces=pieces, config=dataclasses.replace(KERNELS, forward_warpgroups=3))


def test_a_forward_beyond_shared_memory_raises_saying_why():
  # Given float32 operands at K = 128, when not even two input slots fit a block, then the stage count
  # is a ValueError naming the forward and the bytes it needs (as the prepared walk's).
  with pytest.raises(ValueError, match=r"streamed forward \(C=64, K=128.*does not fit .*it needs \d+"):
    streamed_stages(64, 128, 64, jnp.float32, jnp.float32, False)


def test_public_option_is_checked():
  x = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="forward_warpgroups"):
    gpu.chunked_attention(x, x, x, config=gpu.GpuConfig(forward_warpgroups=0),
                          interpret=plgpu.InterpretGPUParams())
  with pytest.raises(ValueError, match="warpgroups"):
    fused.forward(x, x, x, None, None, chunk_size=64, dtype=jnp.bfloat16, out_dtype=jnp.bfloat16,
                  warpgroups=2)


def test_interpreter_without_threads_for_every_warpgroup_raises_instead_of_hanging(monkeypatch):
  # The interpreter runs each warpgroup on XLA's CPU pool; with fewer threads than warpgroups plus the
  # launcher one would wait forever. The call says so, naming the option, before any kernel runs.
  x = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
  params = plgpu.InterpretGPUParams()
  monkeypatch.setenv("NPROC", "2")
  assert gpu.interpreter_threads() == 2
  with pytest.raises(ValueError, match="forward_warpgroups=3 needs 4.*NPROC"):
    gpu.chunked_attention(x, x, x, interpret=params)
  v128 = jnp.zeros((1, 64, 1, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="delta_warpgroups=2 needs 3"):
    gpu.chunked_attention(x, x, v128, beta=jnp.zeros((1, 64, 1)), interpret=params)
  # one warpgroup everywhere runs (and the pair does not serve V = 64)
  o, _ = gpu.chunked_attention(x, x, x, config=gpu.GpuConfig(forward_warpgroups=1), interpret=params)
  o2, _ = gpu.chunked_attention(x, x, x, beta=jnp.zeros((1, 64, 1)), interpret=params)
  assert o.shape == o2.shape == x.shape
