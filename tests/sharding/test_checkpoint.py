"""A sharded train state saved from one mesh restores onto another (orbax).

Given parameters and Adam moments laid out by the "fsdp" rules on fsdp = 8, when they are saved and
restored with the "tp" rules on data x tensor = 2 x 4 (and onto one device), then every array comes
back equal, laid out as the target rules say.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from linear_attention_jax import sharding
from linear_attention_jax.models import LM, LMConfig
from linear_attention_jax.sharding import MeshConfig, checkpoint, make_mesh
from linear_attention_jax.sharding.rules import logical_axes_of
from tests.sharding.multidevice import multidevice


def _state():
  config = LMConfig(vocab_size=64, width=32, depth=2, num_heads=4, pattern="GA", chunk_size=8)
  _, params = nnx.split(LM(config, rngs=nnx.Rngs(0)), nnx.Param)
  tx = optax.adam(1e-3)
  opt_state = tx.init(params)
  opt_state = jax.tree.map(lambda x: x + 0.5, opt_state)  # moments that are not all zeros
  return {"step": jnp.array(7, jnp.int32), "params": params, "opt_state": opt_state}


def _variables(tree):
  return [v for v in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
          if isinstance(v, nnx.Variable)]


@multidevice
def test_checkpoint_saved_on_one_mesh_restores_on_another(tmp_path):
  # Given a state sharded for FSDP over 8 devices
  state = _state()
  mesh_a = make_mesh(MeshConfig(data=1, fsdp=8))
  saved = sharding.shard_train_state(state, mesh_a, "fsdp")
  embedding = saved["params"]["embed"]["embedding"].get_value()
  assert embedding.sharding.shard_shape(embedding.shape) == (64, 4)
  # When it is saved, then restored for tensor parallelism on a 2 x 4 mesh
  checkpoint.save(tmp_path / "ckpt", saved)
  mesh_b = make_mesh(MeshConfig(data=2, tensor=4))
  like = jax.eval_shape(_state)
  restored = checkpoint.restore(tmp_path / "ckpt", checkpoint.abstract_state(like, mesh_b, "tp"))
  # Then every array is equal and laid out by the "tp" rules on mesh B
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  for var in _variables(restored):
    x = var.get_value()
    assert x.sharding.mesh.shape == mesh_b.shape
    names = logical_axes_of(var)
    want = sharding.to_spec(names, "tp", mesh_b) if names else jax.sharding.PartitionSpec()
    assert x.sharding.spec == want, (names, x.sharding.spec)
  q = restored["params"]["blocks"][0]["mixer"]["q_proj"]["kernel"].get_value()
  assert q.sharding.shard_shape(q.shape) == (32, 8)
  # And onto a single device
  one = make_mesh(MeshConfig(data=1), devices=jax.devices()[:1])
  single = checkpoint.restore(tmp_path / "ckpt", checkpoint.abstract_state(like, one, "dp"))
  for got, want in zip(jax.tree.leaves(single), jax.tree.leaves(state)):
    assert len(got.sharding.device_set) == 1
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
