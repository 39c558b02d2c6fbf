"""Ops under `shard_map` with the batch, the heads or the state's value columns split.

Given every variant and a data x tensor = 4 x 2 mesh, when the op runs under `shard_op` with the
"tp" rules (heads over "tensor": grouped value heads, retention's per-head gamma) or the "state_v"
rules (value columns over "tensor": no communication), then output, final state and all gradients
equal the single-device op within 1e-5.
"""

import jax
import pytest

from linear_attention_jax.sharding import MeshConfig, make_mesh, shard_op
from tests.sharding import util
from tests.sharding.multidevice import multidevice

SPLITS = {
    "tp": ("retention", "gla", "gated_delta_rule"),
    "state_v": ("linear_attention", "simple_gla", "delta_rule", "kda"),
}


@pytest.mark.parametrize("rules", sorted(SPLITS))
@multidevice
def test_sharded_op_equals_single_device(rules):
  mesh = make_mesh(MeshConfig(data=4, tensor=2))
  for variant in SPLITS[rules]:
    # Given
    args, h0 = util.inputs(variant, B=4, T=20)
    kwargs = dict(impl="chunk", chunk_size=8)
    if variant == "linear_attention":  # its normaliser column cannot be split: no states here
      h0 = None
    # When
    errors = util.compare(shard_op(util.op(variant), mesh, rules), util.op(variant), args, h0, **kwargs)
    # Then
    print(util.table(f"{variant} under {rules}", errors))
    assert max(errors.values()) <= util.TOL, (variant, errors)


@multidevice
def test_pallas_kernel_runs_per_shard():
  """The TPU kernel (in the TPU interpreter) under `shard_map`: heads over "tensor" and the sequence
  over "seq" (context parallel: the kernel walks each shard from the identity basis too)."""
  from pallas_kernels import tpu as tpu_kernels

  mesh = make_mesh(MeshConfig(data=1, seq=2, tensor=2), devices=jax.devices()[:4])
  args, h0 = util.inputs("gated_delta_rule", T=64, K=16, V=16)
  with tpu_kernels.interpret_kernels():  # trace inside: impl="pallas" then reaches the kernel
    sharded = shard_op(util.op("gated_delta_rule"), mesh, "tp+cp")
    errors = util.compare(sharded, util.op("gated_delta_rule"), args, h0, impl="pallas", chunk_size=16)
  print(util.table("gated_delta_rule, Pallas TPU kernel (interpreted) under tp+cp", errors))
  assert max(errors.values()) <= util.TOL, errors
