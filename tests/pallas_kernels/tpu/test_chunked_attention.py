"""The TPU kernels in the TPU interpreter against the NumPy float64 loop: o, final state and every
gradient (q, k, v, g, beta, initial state) for both families and every decay kind, with grouped value
heads, packed sequences, T not a multiple of the chunk, walks of many grid steps, split value blocks,
bfloat16 matmuls, race detection and a two-core (megacore) schedule.

Every case runs with NaN-filled uninitialised memory, out-of-bounds reads raising and the parallel grid
axes shuffled (`util.PARAMS`), and stays at a few dozen grid steps.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call
from jax.experimental.pallas import tpu as pltpu

from linear_attention_jax.pallas_kernels import tpu
from tests.ops.conftest import make_inputs
from tests.pallas_kernels.tpu.util import check

# One variant per (family, decay kind): linear_attention's inputs here are raw (no feature map), so it
# is the additive family with no decay; retention's constant decay is a scalar gate (tests/ops covers it).
KINDS = ("linear_attention", "simple_gla", "gla", "delta_rule", "gated_delta_rule", "kda")
# Two chunks per forward step, three per backward step: the chunk axis spans several grid steps, so the
# VMEM state is carried across steps both ways (T = 65, C = 16: forward 3 steps, backward 2 steps).
MANY_STEPS = tpu.BlockSizes(chunks_per_step=2, chunks_per_step_bwd=3)
BF16_TOL = 1e-2


@pytest.mark.parametrize("variant", KINDS)
def test_every_family_and_decay(variant):
  # Given grouped value heads (H=2 serves H_v=4), an initial state and T = 65 (not a multiple of C = 16)
  inp = make_inputs(variant, B=2, T=65, H=2, Hv=4, K=8, V=12, seed=0)
  # Then o, the final state and every gradient match the float64 loop
  check(variant, inp, chunk_size=16, block_sizes=MANY_STEPS)


@pytest.mark.parametrize("variant", KINDS)
def test_segment_ids(variant):
  # Row 0: runs of 30, 1 (a length-one segment), 40 and 29 tokens, the last reusing an earlier id;
  # row 1: a single segment. Segment changes fall inside chunks and on a chunk boundary (t = 64).
  T = 100
  seg = np.zeros((2, T), np.int32)
  seg[0, 30:31], seg[0, 31:64], seg[0, 64:71], seg[0, 71:] = 5, 1, 2, 0
  inp = make_inputs(variant, B=2, T=T, H=1, Hv=1, K=8, V=12, seed=6)
  check(variant, inp, seg=seg, chunk_size=16, block_sizes=tpu.BlockSizes(chunks_per_step=4))


@pytest.mark.parametrize("variant,gates", [("simple_gla", "strong"), ("gla", "strong"),
                                           ("gated_delta_rule", "strong"), ("kda", "strong"),
                                           ("kda", "zero")])
def test_strong_and_zero_gates(variant, gates):
  # Log-decays down to -20 per token: nothing may overflow inside a 32-token chunk. (Same inputs as
  # tests/ops' strong-gate case: the errors equal the XLA chunked form's, ~1e-6 on o, ~5e-6 on dg.)
  check(variant, make_inputs(variant, T=130, gates=gates, seed=3), chunk_size=32)


@pytest.mark.parametrize("variant", ["gla", "gated_delta_rule"])
def test_without_initial_state(variant):
  inp = make_inputs(variant, B=1, T=40, H=1, Hv=2, seed=4)
  inp["h0"] = None
  check(variant, inp, chunk_size=16)


@pytest.mark.parametrize("variant", ["simple_gla", "kda"])
def test_split_value_blocks(variant):
  # V = 256 in two lane-aligned blocks of 128: each program walks half the state's columns and the
  # backward adds the K-side partial sums.
  inp = make_inputs(variant, B=1, T=48, H=1, Hv=2, K=8, V=256, seed=5)
  check(variant, inp, chunk_size=16, block_sizes=tpu.BlockSizes(block_v=128, chunks_per_step=2))


@pytest.mark.parametrize("T", [1, 32])
def test_short_and_exact_lengths(T):
  check("kda", make_inputs("kda", B=1, T=T, H=1, Hv=2, seed=7), chunk_size=16)


@pytest.mark.parametrize("variant", ["gla", "delta_rule"])
def test_bfloat16_matmuls(variant):
  # bfloat16 inputs: the kernels feed the MXU bfloat16 and accumulate in float32.
  inp = make_inputs(variant, B=1, T=100, H=1, Hv=2, seed=8)
  inp = {n: None if x is None else jnp.asarray(x, jnp.bfloat16) for n, x in inp.items()}
  errors = check(variant, inp, chunk_size=16, tol=BF16_TOL)
  assert errors["o"] > 1e-5  # bfloat16 really was used


def test_no_races():
  # The race detector follows every read and write of the interpreted TPU memory (happens-before).
  params = pltpu.InterpretParams(detect_races=True, random_seed=1)
  seg = np.zeros((1, 40), np.int32)
  seg[0, 20:] = 1
  inp = make_inputs("kda", B=1, T=40, H=1, Hv=2, K=8, V=12, seed=9)
  check("kda", inp, seg=seg, chunk_size=16, params=params,
        block_sizes=tpu.BlockSizes(chunks_per_step=1, chunks_per_step_bwd=1))
  assert interpret_pallas_call.races is not None and not interpret_pallas_call.races.races_found


def test_two_core_schedule():
  # Megacore: the interpreter splits the parallel axes over two cores, each with its own scratch.
  params = pltpu.InterpretParams(num_cores_or_threads=2, random_seed=2)
  check("gated_delta_rule", make_inputs("gated_delta_rule", B=2, T=50, H=1, Hv=2, seed=10), chunk_size=16,
        params=params, block_sizes=MANY_STEPS)


def test_rejects_what_it_cannot_serve():
  inp = make_inputs("kda", T=20)
  with pytest.raises(ValueError, match=r"chunk_size >= 16"):
    tpu.chunked_attention(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], chunk_size=8,
                          interpret=pltpu.InterpretParams())
  with pytest.raises(ValueError, match=r"^initial_state must be one of .*got \(2, 4, 8, 13\)"):
    tpu.chunked_attention(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                          initial_state=np.zeros((2, 4, 8, 13), np.float32))
  assert "cu_seqlens" in tpu.supports(K=8, V=8, chunk_size=64, packing="cu_seqlens", backend="tpu")
  assert "float16" in tpu.supports(K=8, V=8, chunk_size=64, dtype=jnp.float16, backend="tpu")
  assert "backend is 'cpu'" in tpu.supports(K=8, V=8, chunk_size=64, backend="cpu")
  assert "VMEM" in tpu.supports(K=1024, V=1024, chunk_size=64, backend="tpu")
  assert tpu.supports(K=128, V=128, chunk_size=64, dtype=jnp.bfloat16, backend="tpu") is None
