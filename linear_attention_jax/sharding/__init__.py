"""Sharding: logical axis rules, the device mesh, ops under `shard_map`, context parallelism, sharded
training steps and checkpoints.

    mesh = make_mesh(MeshConfig(data=-1, tensor=2))
    state = shard_train_state(state, mesh, "tp")                # parameters placed as the rules say
    step = make_sharded_train_step(step_fn, mesh, "tp", state)  # jit with in/out shardings
    state, metrics = step(state, shard_batch(batch, mesh, "tp"))  # rows over the batch axes

`rules`: the logical axes and rule sets; `mesh`: MeshConfig, flags, multi-host start-up, model checks;
`kernels`: `shard_op`; `context_parallel`: the sequence split; `train_step`; `checkpoint` (orbax:
save on one mesh, restore on another; imported on its own).
"""

from linear_attention_jax.sharding.kernels import for_current_rules, shard_op
from linear_attention_jax.sharding.mesh import (MeshConfig, check_model_config, config_from_flags,
                                                define_flags, flags_given, initialize_distributed,
                                                make_mesh)
from linear_attention_jax.sharding.rules import (LOGICAL_AXES, MESH_AXES, RULE_SETS, axes, constrain,
                                                 current_rules, named_sharding, rule_set, to_spec,
                                                 use_rules)
from linear_attention_jax.sharding.train_step import (batch_sharding, make_sharded_eval_step,
                                                      make_sharded_train_step, shard_batch,
                                                      shard_train_state, state_shardings)

__all__ = [
    "LOGICAL_AXES", "MESH_AXES", "MeshConfig", "RULE_SETS", "axes", "batch_sharding",
    "check_model_config", "constrain", "config_from_flags", "current_rules", "define_flags",
    "flags_given", "for_current_rules", "initialize_distributed", "make_mesh",
    "make_sharded_eval_step", "make_sharded_train_step", "named_sharding", "rule_set", "shard_batch",
    "shard_op", "shard_train_state", "state_shardings", "to_spec", "use_rules",
]
