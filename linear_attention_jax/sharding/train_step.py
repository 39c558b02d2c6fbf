"""Sharded training: place a train state as the rules say, and jit a step with in/out shardings.

    mesh = make_mesh(MeshConfig(data=-1, tensor=2))
    state = shard_train_state(state, mesh, "tp")          # {"step", "params", "opt_state"} or any pytree
    step = make_sharded_train_step(train_step, mesh, "tp", state)
    batch = shard_batch(host_batch, mesh, "tp")           # leaves [B, T]: rows over the batch axes
    state, metrics = step(state, batch)
    evaluate = make_sharded_eval_step(eval_fn, mesh, "tp", state["params"])   # (params, batch) -> ...

A parameter's sharding comes from its logical axes (the `out_sharding` metadata the layers set), and
the optimizer's moments inherit them (optax maps over the same `nnx.Variable`s); anything without
axes (step counters, scalars) is replicated. While the step is traced the rules are in force
(`rules.use_rules`), so every mixer runs its op under `shard_map` (`kernels.py`).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from linear_attention_jax.sharding.rules import (axis_size, logical_axes_of, named_sharding, rule_set,
                                                 to_spec, use_rules)


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def state_shardings(state, mesh, rules):
  """A pytree shaped like `state` (arrays, `jax.ShapeDtypeStruct`s or `nnx.Variable`s) whose leaves
  are `NamedSharding`s on `mesh`.

  Raises `ValueError` naming the parameter (its path), its logical axis and the sizes when a dimension
  does not divide the mesh axes the rules give it.
  """
  table = rule_set(rules)

  def one(path, x):
    if not _is_variable(x):
      return NamedSharding(mesh, P())
    names = logical_axes_of(x)
    spec = P() if names is None else to_spec(names, table, mesh)
    shape = x.get_value().shape
    for dim, (size, entry) in enumerate(zip(shape, spec)):
      n = axis_size(mesh, entry)
      if size % n:
        raise ValueError(f"parameter {jax.tree_util.keystr(path)} of shape {shape}: dimension {dim} "
                         f"({names[dim]!r}, size {size}) is not divisible by {n}, the size of mesh "
                         f"axes {entry!r}")
    return x.replace(NamedSharding(mesh, spec))

  return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_variable)


def shard_train_state(state, mesh, rules):
  """`state` placed on `mesh` with `state_shardings(state, mesh, rules)`."""
  return jax.device_put(state, state_shardings(state, mesh, rules))


def check_batch(batch, mesh, rules, axes=("batch", "seq")) -> None:
  """Raises `ValueError` naming the batch size or sequence length that the mesh axes do not divide."""
  spec = to_spec(axes, rules, mesh)
  for key, x in jax.tree_util.tree_leaves_with_path(batch):
    for name, size, entry in zip(("batch size", "sequence length"), x.shape, spec):
      n = axis_size(mesh, entry)
      if size % n:
        raise ValueError(f"batch{jax.tree_util.keystr(key)}: {name} {size} is not divisible by {n}, "
                         f"the size of mesh axes {entry!r}")


def _unjitted(fn):
  """The Python function under `jax.jit` (and under a `functools.partial` of a jitted function): its
  own trace cache would not know the rules in force, so the step is traced afresh here."""
  if isinstance(fn, functools.partial):
    return functools.partial(_unjitted(fn.func), *fn.args, **fn.keywords)
  return fn.__wrapped__ if hasattr(fn, "lower") and hasattr(fn, "__wrapped__") else fn


def batch_sharding(mesh, rules, axes=("batch", "seq")) -> NamedSharding:
  """The sharding of a batch leaf whose leading dimensions have the logical axes `axes` (by default
  a `[B, T, ...]` leaf: rows over the batch axes, T over the sequence axes)."""
  return named_sharding(mesh, axes, rule_set(rules))


def shard_batch(batch, mesh, rules, axes=("batch", "seq")):
  """`batch` (host arrays `[B, T, ...]`: the same global batch in every process) placed with
  `batch_sharding`.

  Each device receives only its block (`jax.make_array_from_callback`), so this also serves a
  multi-host job whose processes each build the global batch. Checks the shapes first (`check_batch`).
  """
  table = rule_set(rules)
  check_batch(batch, mesh, table, axes)

  def one(x):
    x = np.asarray(x)
    sharding = named_sharding(mesh, axes[:x.ndim], table)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

  return jax.tree.map(one, batch)


def _jit_under_rules(fn, mesh, table, in_shardings, out_shardings, donate, compiler_options):
  fn = _unjitted(fn)

  def traced(*args):
    with use_rules(mesh, table):
      return fn(*args)

  return fn, jax.jit(traced, in_shardings=in_shardings, out_shardings=out_shardings,
                     donate_argnums=(0,) if donate else (), compiler_options=compiler_options)


def make_sharded_train_step(step, mesh, rules, state, *, batch_axes=("batch", "seq"),
                            donate: bool = True, compiler_options: dict | None = None):
  """`step(state, batch) -> (state, metrics)` jitted with shardings from `rules` on `mesh`.

  Args:
    step: the training step; a jitted function (or a partial of one) is unwrapped and re-traced.
    mesh, rules: where and how (`rules.rule_set` names or pairs).
    state: the train state, or its abstract shape (`jax.eval_shape`), giving the shardings.
    batch_axes: logical axes of every batch leaf's leading dimensions.
    donate: donate the input state's buffers.
    compiler_options: passed to `jax.jit` (XLA options).

  Returns:
    `sharded_step(state, batch)`: inputs resharded to `(state shardings, batch sharding)`, outputs
    `(state with the same shardings, metrics replicated)`; checks the batch shapes first. Its
    `.jitted` is the `jax.jit` object (for `.lower(...)`), `.shardings` the state's shardings.
  """
  table = rule_set(rules)
  shardings = state_shardings(state, mesh, table)
  fn, jitted = _jit_under_rules(step, mesh, table, (shardings, batch_sharding(mesh, table, batch_axes)),
                                (shardings, NamedSharding(mesh, P())), donate, compiler_options)
  return _checking_batches(fn, jitted, shardings, mesh, table, batch_axes)


def make_sharded_eval_step(step, mesh, rules, params, *, batch_axes=("batch", "seq"),
                           compiler_options: dict | None = None):
  """`step(params, batch) -> metrics` jitted with `params` laid out by `rules` (as
  `make_sharded_train_step` lays out a state's parameters), the batch split over the batch axes and
  the metrics replicated; nothing donated. `params` may be abstract. Same attributes as the train step.
  """
  table = rule_set(rules)
  shardings = state_shardings(params, mesh, table)
  fn, jitted = _jit_under_rules(step, mesh, table, (shardings, batch_sharding(mesh, table, batch_axes)),
                                NamedSharding(mesh, P()), False, compiler_options)
  return _checking_batches(fn, jitted, shardings, mesh, table, batch_axes)


def _checking_batches(fn, jitted, shardings, mesh, table, batch_axes):
  """`jitted(state_or_params, batch)` after `check_batch`, with `.jitted` and `.shardings` attached."""

  @functools.wraps(fn)
  def sharded_step(state, batch):
    check_batch(batch, mesh, table, batch_axes)
    return jitted(state, batch)

  sharded_step.jitted = jitted
  sharded_step.shardings = shardings
  return sharded_step
