"""Logical axes and rule sets (no devices needed): how names resolve, and that every parameter of
every layer names its axes."""

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from linear_attention_jax import sharding
from linear_attention_jax.models import LM, LMConfig
from linear_attention_jax.sharding.rules import logical_axes_of


def test_rule_sets_map_the_logical_axes():
  assert sharding.to_spec(("batch", "seq", "embed"), "dp") == P(("data", "fsdp"), None, None)
  assert sharding.to_spec(("embed", "mlp"), "fsdp") == P("fsdp", None)
  assert sharding.to_spec(("embed", "heads"), "tp") == P(None, "tensor")
  assert sharding.to_spec(("vocab", "embed"), "fsdp+tp") == P("tensor", "fsdp")
  assert sharding.to_spec(("batch", "heads", "head_k", "head_v"), "state_v") == \
      P(("data", "fsdp"), None, None, "tensor")
  assert sharding.to_spec(("batch", "seq", "heads", "head_v"), "tp+cp") == \
      P(("data", "fsdp"), "seq", "tensor", None)


def test_a_mesh_axis_serves_one_dimension_per_array():
  # Given fsdp rules, which put both the batch and the embedding width on "fsdp"
  # When an activation [batch, seq, embed] resolves, Then the batch takes "fsdp" and embed stays whole
  assert sharding.to_spec(("batch", "seq", "embed"), "fsdp") == P(("data", "fsdp"), None, None)
  # and "tp+state_v" gives "tensor" to heads, not also to head_v
  assert sharding.to_spec(("heads", "head_v"), "tp+state_v") == P("tensor", None)


def test_rules_given_as_pairs_are_flax_logical_axis_rules():
  rules = sharding.rule_set("fsdp+tp")
  with nnx.logical_axis_rules(rules):
    layer = nnx.Linear(4, 8, rngs=nnx.Rngs(0), kernel_metadata=sharding.axes("embed", "mlp"))
    spec = nnx.get_partition_spec(nnx.state(layer, nnx.Param))["kernel"].get_value()
  assert spec == P("fsdp", "tensor")


@pytest.mark.parametrize("bad, field", [
    ("zz", "unknown rule set"), ((("head_k", "tensor"),), "head_k"), ((("heads_", "tensor"),), "heads_"),
])
def test_bad_rules_raise(bad, field):
  with pytest.raises(ValueError, match=field):
    sharding.rule_set(bad)
  with pytest.raises(ValueError, match="unknown logical axis"):
    sharding.axes("embedding")


def test_every_parameter_names_its_axes():
  # Given an LM with every mixer (and an untied output head)
  config = LMConfig(vocab_size=64, width=32, depth=7, num_heads=2, num_v_heads=4, num_kv_heads=1,
                    pattern="LRFDGKA", conv_letters="LRFDGKA", chunk_size=8, tie_embeddings=False)
  _, params = nnx.split(nnx.eval_shape(lambda: LM(config, rngs=nnx.Rngs(0))), nnx.Param)
  # Then every parameter has one known logical axis (or None) per dimension
  leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
  assert len(leaves) > 60
  for path, var in leaves:
    names = logical_axes_of(var)
    assert names is not None, jax.tree_util.keystr(path)
    assert len(names) == var.get_value().ndim, (jax.tree_util.keystr(path), names)
    assert set(names) <= set(sharding.LOGICAL_AXES) | {None}, names
    assert "head_k" not in names
