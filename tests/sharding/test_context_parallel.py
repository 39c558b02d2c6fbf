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
