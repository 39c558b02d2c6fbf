"""The mesh from a config or flags, multi-host arguments, and bad specs raising `ValueError` that
names the field."""

import jax
import pytest
from absl import flags

from linear_attention_jax import ops, sharding
from linear_attention_jax.models import LMConfig
from linear_attention_jax.sharding import MeshConfig
from tests.sharding.multidevice import multidevice


def test_axis_sizes_fill_the_devices():
  assert MeshConfig(tensor=2).axis_sizes(8) == {"data": 4, "fsdp": 1, "seq": 1, "tensor": 2}
  assert MeshConfig(data=2, fsdp=-1, seq=2).axis_sizes(8) == {"data": 2, "fsdp": 2, "seq": 2,
                                                              "tensor": 1}


@pytest.mark.parametrize("config, field", [
    (dict(tensor=3), "tensor=3"),                 # does not divide 8 devices
    (dict(data=2, seq=3), "seq=3"),
    (dict(data=2, tensor=2), "data=2"),           # multiplies to 4, not 8
])
def test_sizes_that_do_not_fit_the_devices_raise(config, field):
  with pytest.raises(ValueError, match=field):
    MeshConfig(**config).axis_sizes(8)


@pytest.mark.parametrize("config, field", [
    (dict(tensor=0), "tensor"), (dict(seq=-1), "at most one"), (dict(fsdp=1.5), "fsdp"),
    (dict(num_processes=2), "coordinator_address"), (dict(num_processes=0), "num_processes"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=2), "process_id"),
    (dict(coordinator_address="h:1"), "num_processes and process_id"),
])
def test_bad_mesh_config_raises_naming_the_field(config, field):
  with pytest.raises(ValueError, match=field):
    MeshConfig(**config)


def test_config_from_flags():
  fv = flags.FlagValues()
  sharding.define_flags(fv)
  fv(["prog", "--mesh_data=2", "--mesh_tensor=4", "--coordinator_address=10.0.0.1:1234",
      "--num_processes=2", "--process_id=1", "--local_device_ids=0,1,2,3"])
  config = sharding.config_from_flags(fv)
  assert config == MeshConfig(data=2, tensor=4, coordinator_address="10.0.0.1:1234", num_processes=2,
                              process_id=1, local_device_ids=(0, 1, 2, 3))
  assert fv.sharding_rules == "dp"
  assert not sharding.initialize_distributed(MeshConfig())  # single process: nothing to start


@pytest.mark.parametrize("argv, given", [
    ([], False), (["--mesh_tensor=2"], True), (["--sharding_rules=fsdp"], True),
    (["--mesh_data=-1"], True),  # the default value, but given: the script asked for a mesh
])
def test_flags_given_tells_a_mesh_request_from_the_defaults(argv, given):
  fv = flags.FlagValues()
  sharding.define_flags(fv)
  fv(["prog", *argv])
  assert sharding.flags_given(fv) == given


@multidevice
def test_mesh_and_model_checks_on_8_devices():
  mesh = sharding.make_mesh(MeshConfig(data=-1, tensor=2))
  assert dict(mesh.shape) == {"data": 4, "fsdp": 1, "seq": 1, "tensor": 2}
  assert mesh.devices.size == 8
  with pytest.raises(ValueError, match="tensor=3"):
    sharding.make_mesh(MeshConfig(tensor=3))
  # Heads not divisible by the tensor-parallel size: the field is named
  config = LMConfig(vocab_size=64, width=48, depth=1, num_heads=3, pattern="G")
  with pytest.raises(ValueError, match="num_heads=3"):
    sharding.check_model_config(config, mesh, "tp")
  sharding.check_model_config(config, mesh, "dp")  # replicated heads: fine
  for changes, field in ((dict(num_heads=2, width=32, vocab_size=63), "vocab_size=63"),
                         (dict(num_heads=2, width=32, pattern="A", num_kv_heads=1), "num_kv_heads=1")):
    with pytest.raises(ValueError, match=field):
      sharding.check_model_config(config.replace(**changes), mesh, "tp")
  with pytest.raises(ValueError, match="head_v_dim=5"):
    sharding.check_model_config(config.replace(num_heads=2, width=32, head_v_dim=5), mesh, "state_v")
  with pytest.raises(ValueError, match="width=36"):
    sharding.check_model_config(config.replace(width=36, num_heads=2),
                                sharding.make_mesh(MeshConfig(fsdp=8)), "fsdp")
  # The sharded op names the size that does not divide
  q = jax.numpy.ones((4, 16, 3, 8))
  with pytest.raises(ValueError, match="H=3"):
    sharding.shard_op(ops.simple_gla, mesh, "tp")(q, q, q, q[..., 0])
  cp_mesh = sharding.make_mesh(MeshConfig(data=2, seq=4))
  x = jax.numpy.ones((2, 18, 2, 8))
  with pytest.raises(ValueError, match="T=18"):
    sharding.shard_op(ops.simple_gla, cp_mesh, "cp")(x, x, x, x[..., 0])
  with pytest.raises(ValueError, match="cu_seqlens"):
    sharding.shard_op(ops.simple_gla, cp_mesh, "cp")(x[:1, :16], x[:1, :16], x[:1, :16], x[:1, :16, :, 0],
                                                     cu_seqlens=jax.numpy.array([0, 5, 16]))
  # A parameter that does not divide is named by its path
  from flax import nnx
  layer = nnx.Linear(8, 6, rngs=nnx.Rngs(0), kernel_metadata=sharding.axes("embed", "mlp"))
  with pytest.raises(ValueError, match=r"kernel.*'mlp'.*size 6"):
    sharding.shard_train_state(nnx.state(layer, nnx.Param), sharding.make_mesh(MeshConfig(tensor=4)),
                               "tp")
