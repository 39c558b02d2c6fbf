"""The forward walk over prepared chunk tensors with specialised warpgroups (`walk_streamed.streamed_walk`,
`chunked_attention(..., walk_warpgroups=3)`) in the Mosaic GPU interpreter: against the one-warpgroup
walk with the race detector on, and end to end against the float64 loop."""

import dataclasses

import jax.numpy as jnp
import jax.experimental.pallas.mosaic_gpu as plgpu
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

from pallas_kernels import gpu, prep
from pallas_kernels.gpu import walk
from pallas_kernels.gpu.walk_streamed import streamed_stages
from tests.ops.conftest import make_inputs
from tests.pallas_kernels.gpu.util import KERNELS, XLA, assert_walk_outputs_close, check

RACES = plgpu.InterpretGPUParams(detect_races=True)


def _tensors(variant, T, K, V, seed):
  inp = make_inputs(variant, B=1, T=T, H=2, Hv=2, K=K, V=V, seed=seed)
  f = lambda n: None if inp.get(n) is None else jnp.asarray(inp[n], jnp.float32)
  t = prep.prepare(f("q"), f("k"), f("v"), f("g"), f("beta"), None, chunk_size=64, dtype=jnp.bfloat16)
  t = t._replace(**{n: None if getattr(t, n) is None else getattr(t, n).astype(jnp.bfloat16)
                    for n in ("qg", "kd", "w", "u", "p")})
  return t, jnp.asarray(inp["h0"])


@pytest.mark.parametrize("variant,K,pieces,with_o,with_states",
                         [("gated_delta_rule", 128, 1, True, True), ("gated_delta_rule", 64, 5, True, False),
                          ("gla", 64, 1, True, False), ("delta_rule", 64, 1, False, True)])
def test_streamed_walk_equals_one_warpgroup_with_no_race(variant, K, pieces, with_o, with_states):
  # A fetching warpgroup streams the chunk tensors into 2-4 input slots, the state's warpgroup hands
  # the state and u_new over through two slots, the output's warpgroup writes o: the same products and
  # roundings as one warpgroup, so the same numbers, and no unsynchronised access. 5 chunks: every
  # slot is reused; 5 pieces of one chunk each also run the pieces' map walk (two warpgroups, no o);
  # K = 128 with o leaves room for 2 input slots only.
  t, h0 = _tensors(variant, 320, K, 128, seed=3)
  stages = streamed_stages(64, K, 64, jnp.bfloat16, jnp.bfloat16, delta=t.w is not None, with_o=with_o)
  assert stages == (2 if (K == 128 and with_o) else 4 if K == 64 else 3)
  run = lambda wg: walk.forward(t, h0, with_o=with_o, with_states=with_states, out_dtype=jnp.bfloat16,
                                interpret=RACES, sequence_pieces=pieces, warpgroups=wg)
  streamed = run(3)
  assert not gpu_callbacks.get_races().races_found
  one = run(1)
  assert_walk_outputs_close(one, streamed, 1e-6)


@pytest.mark.parametrize("variant,gates,packed,pieces", [("gated_delta_rule", "normal", True, None),
                                                         ("delta_rule", "normal", False, 2),
                                                         ("kda", "strong", False, None)])
def test_streamed_walk_matches_the_float64_loop(variant, gates, packed, pieces):
  # Through chunked_attention: the delta family with its preparation and gradient kernels, and
  # per-channel decay (the prepared path), forward and every gradient.
  T = 150
  inp = make_inputs(variant, B=1, T=T, H=1, Hv=2, K=64, V=64, gates=gates, seed=23)
  seg = None
  if packed:
    seg = np.zeros((1, T), np.int32)
    seg[0, 30:70], seg[0, 70:] = 1, 2
  # (kda: the prepared path, XLA's preparation and vjp around the streamed walks)
  config = XLA if variant == "kda" else KERNELS
  check(variant, inp, seg=seg, pieces=pieces, config=dataclasses.replace(config, walk_warpgroups=3))


def test_a_walk_beyond_shared_memory_raises_saying_why():
  # Given float32 operands at K = 128, when not even two input slots fit a block, then the stage count
  # is a ValueError naming the walk and the bytes it needs (as the fused forward's).
  with pytest.raises(ValueError, match=r"streamed walk \(C=64, K=128.*does not fit .*it needs \d+"):
    streamed_stages(64, 128, 64, jnp.float32, jnp.float32, delta=True, with_o=True)


def test_public_option_is_checked():
  x = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="walk_warpgroups"):
    gpu.chunked_attention(x, x, x, beta=jnp.zeros((1, 64, 1)), config=gpu.GpuConfig(walk_warpgroups=2),
                          interpret=plgpu.InterpretGPUParams())
