"""Sharded checkpoints with orbax: save from one mesh, restore onto another.

Orbax writes each array's shards from the devices that hold them (every host its own, in a multi-host
job) and reads back whatever shards the target sharding asks of each device, so the mesh and rules of
the restore need not be those of the save:

    save(path, state)                                            # state sharded on mesh A
    state = restore(path, abstract_state(like, mesh_b, "tp"))    # laid out for mesh B

`like` is the state or its shape (`jax.eval_shape` of the initialisation): it gives the pytree, the
shapes, dtypes and logical axes. Works with `experiments/checkpoint.py`'s `Checkpointer.restore` too:
pass it `abstract_state(...)` as the abstract state.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp

from linear_attention_jax.sharding.train_step import state_shardings


def abstract_state(like, mesh, rules):
  """`like` as `jax.ShapeDtypeStruct`s carrying the shardings `rules` give on `mesh`."""
  shardings = state_shardings(like, mesh, rules)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), like, shardings)


def save(directory: str, state) -> None:
  """Writes `state` (a pytree of arrays, sharded or not) to `directory` (which must not exist) and
  waits until it is complete."""
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(os.path.abspath(directory), state)
    checkpointer.wait_until_finished()


def restore(directory: str, abstract):
  """The state saved in `directory`, laid out as `abstract` (from `abstract_state`) says."""
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(os.path.abspath(directory), abstract)
