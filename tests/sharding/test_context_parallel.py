"""Context parallelism: the sequence split over 2, 4 and 8 devices equals the single-device op.

Given a variant and P devices along "seq", when the op runs under `shard_op(op, mesh, "cp")` (each
device walks T / P tokens, the shards exchange affine summaries), then the output, the final state and
the gradients of q, k, v, the gates, beta and the initial state match the unsharded chunked op within
1e-5 (relative RMS, float32). Both families; P = 2, 4, 8 each appear for both; packed rows
(segment_ids) whose boundaries fall on and between shard edges.
"""

import jax
import pytest

from linear_attention_jax.sharding import MeshConfig, make_mesh, shard_op
from tests.sharding import util
from tests.sharding.multidevice import multidevice

T = 48          # 24, 12 or 6 tokens per shard: chunks of 8, some shards end in a partial chunk
CASES = [       # (variant, devices along "seq", packed rows)
    ("linear_attention", 4, False),
    ("retention", 2, True),
    ("simple_gla", 8, False),
    ("gla", 4, True),
    ("delta_rule", 2, False),
    ("gated_delta_rule", 4, True),
    ("kda", 8, True),
]


def _options(variant):
  kwargs = dict(impl="chunk", chunk_size=8)
  if variant in ("gated_delta_rule", "kda"):
    kwargs["use_qk_l2norm"] = True
  return kwargs


@pytest.mark.parametrize("variant,devices,packed", CASES)
@multidevice
def test_context_parallel_equals_single_device(variant, devices, packed):
  # Given
  args, h0 = util.inputs(variant, T=T)
  kwargs = _options(variant)
  if packed:
    kwargs["segment_ids"] = util.segment_ids(2, T)
  mesh = make_mesh(MeshConfig(data=1, seq=devices), devices=jax.devices()[:devices])
  # When
  errors = util.compare(shard_op(util.op(variant), mesh, "cp"), util.op(variant), args, h0, **kwargs)
  # Then
  print(util.table(f"{variant} over {devices} devices{' (packed)' if packed else ''}", errors))
  assert max(errors.values()) <= util.TOL, errors


@multidevice
def test_context_parallel_with_batch_and_heads_split():
  """seq x data x tensor = 2 x 2 x 2: context parallelism with the batch and heads (Gated DeltaNet,
  grouped value heads) or the state's value columns (GLA) split too."""
  mesh = make_mesh(MeshConfig(data=2, seq=2, tensor=2))
  for variant, rules in (("gated_delta_rule", "tp+cp"), ("gla", "state_v+cp")):
    args, h0 = util.inputs(variant, T=T)
    kwargs = dict(_options(variant), segment_ids=util.segment_ids(2, T))
    errors = util.compare(shard_op(util.op(variant), mesh, rules), util.op(variant), args, h0, **kwargs)
    print(util.table(f"{variant} under {rules}", errors))
    assert max(errors.values()) <= util.TOL, (variant, errors)


@multidevice
def test_context_parallel_property():
  """Context parallel == one device as a property (hypothesis, derandomized, 3 examples a variant):
  random values, gate strengths (0.01 ... 30 times the usual gates) and segment boundaries (0 to 3
  changes anywhere, on or off the 4 shards' edges) over one fixed shape, so each variant compiles once;
  o and the final state within util.TOL. Both families, scalar and per-channel gates."""
  import functools

  import numpy as np
  from hypothesis import given, settings
  from hypothesis import strategies as st

  from tests.ops.conftest import FAMILY

  mesh = make_mesh(MeshConfig(data=1, seq=4), devices=jax.devices()[:4])
  for variant in ("gated_delta_rule", "gla", "linear_attention"):
    kwargs = dict(_options(variant), output_final_state=True)
    sharded = util.fast_jit(functools.partial(shard_op(util.op(variant), mesh, "cp"), **kwargs))
    single = util.fast_jit(functools.partial(util.op(variant), **kwargs))

    @settings(max_examples=3, derandomize=True, deadline=None, database=None)
    @given(seed=st.integers(0, 2**31 - 1), strength=st.floats(0.01, 30.0),
           cuts=st.lists(st.integers(1, T - 1), max_size=3))
    def check(seed, strength, cuts):
      args, h0 = util.inputs(variant, T=T, seed=seed % 1000)
      if FAMILY[variant][0] is not None:  # the gate follows q, k, v
        args[3] = args[3] * strength
      ids = np.zeros((2, T), np.int32)
      for c in cuts:
        ids[:, c:] += 1
      seg = jax.numpy.asarray(ids)
      o, final = sharded(*args, initial_state=h0, segment_ids=seg)
      o_ref, final_ref = single(*args, initial_state=h0, segment_ids=seg)
      errors = {"o": util.rel_rms(o, o_ref), "final": util.rel_rms(final, final_ref)}
      assert max(errors.values()) <= util.TOL, (variant, seed, strength, cuts, errors)

    check()
