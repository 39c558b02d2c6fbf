"""Logical axis names, the rule sets that map them onto a device mesh, and the rules in force.

Every parameter of the layers and the LM names its dimensions with logical axes (its `out_sharding`
metadata, set through `axes(...)`); activations are named the same way where they cross a `shard_map`
(`kernels.py`). A rule set maps logical axes to mesh axes; nothing else in the library names a mesh axis.

Logical axes (`LOGICAL_AXES`):

  batch     rows of a batch                      seq       tokens, T
  embed     model width d                        mlp       SwiGLU hidden width
  heads     q/k heads H and value heads H_v, and projection columns that are (heads x head dim)
  kv_heads  Attention's key/value heads          vocab     vocabulary
  head_k    K, a head's key width (state rows)   head_v    V, a head's value width (state columns)

Mesh axes (`MESH_AXES`, built by `mesh.make_mesh`): "data", "fsdp", "seq", "tensor".

Rule sets (`RULE_SETS`; join names with "+" to combine, e.g. "fsdp+tp+cp"):

  dp       batch over ("data", "fsdp"); parameters replicated
  fsdp     dp, and parameters' embed dimension over "fsdp" (ZeRO-3 style: gathered for use)
  tp       dp, and heads, kv_heads, mlp, vocab over "tensor" (Megatron: column-parallel projections in,
           row-parallel out; every head's recurrence stays on one device)
  state_v  dp, and head_v over "tensor": each device keeps V / n columns of every state. The recurrence
           is independent per value column (delta family included: column j of S only ever meets
           column j of v), so the op needs no communication; q, k and the gates are replicated.
  cp       dp, and seq over "seq": context parallelism (`context_parallel.py`)

head_k has no rule and must not get one: the read-out `S^T q` and the delta rule's prediction `S^T k`
sum over K.

A rule set is a tuple of `(logical axis, mesh axes)` pairs, mesh axes a name, a tuple of names or None:
the format of `flax.nnx.logical_axis_rules`. Resolving a list of logical axes (`to_spec`) gives each
dimension its mesh axes minus any an earlier dimension already took, so `[batch, seq, embed]` under
"fsdp" shards the batch over ("data", "fsdp") and leaves embed whole, while a `[embed, mlp]` kernel
shards its embed over "fsdp".
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

LOGICAL_AXES = ("batch", "seq", "embed", "heads", "kv_heads", "head_k", "head_v", "mlp", "vocab")
MESH_AXES = ("data", "fsdp", "seq", "tensor")

Rules = tuple[tuple[str, "str | tuple[str, ...] | None"], ...]

_BATCH = (("batch", ("data", "fsdp")),)
RULE_SETS: dict[str, Rules] = {
    "dp": _BATCH,
    "fsdp": _BATCH + (("embed", "fsdp"),),
    "tp": _BATCH + (("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"),
                    ("vocab", "tensor")),
    "state_v": _BATCH + (("head_v", "tensor"),),
    "cp": _BATCH + (("seq", "seq"),),
}


def axes(*names: str | None) -> dict:
  """Variable metadata naming a parameter's dimensions, e.g. `nnx.Param(x, **axes("embed", "mlp"))`
  or `nnx.Linear(..., kernel_metadata=axes("embed", "heads"))`.

  The names ride in flax's `out_sharding` metadata (so `nnx.get_partition_spec` sees them too);
  `eager_sharding=False` keeps creating a model free of any mesh: placement happens in
  `train_step.shard_train_state`.
  """
  for name in names:
    if name is not None and name not in LOGICAL_AXES:
      raise ValueError(f"unknown logical axis {name!r}; known: {LOGICAL_AXES}")
  return {"out_sharding": tuple(names), "eager_sharding": False}


def rule_set(rules: str | Rules) -> Rules:
  """The rules named by `rules` ("tp", "fsdp+tp", ...), or `rules` itself when it is already pairs.

  Raises `ValueError` naming `rules` for an unknown name, a logical axis outside `LOGICAL_AXES`, a rule
  for head_k, or two sets that map one logical axis differently.
  """
  if isinstance(rules, str):
    merged: dict[str, object] = {}
    for name in rules.split("+"):
      name = name.strip()
      if name not in RULE_SETS:
        raise ValueError(f"rules={rules!r}: unknown rule set {name!r}; known: {sorted(RULE_SETS)} "
                         f"(join with '+')")
      for logical, mesh_axes in RULE_SETS[name]:
        if merged.get(logical, mesh_axes) != mesh_axes:
          raise ValueError(f"rules={rules!r}: rule sets disagree on {logical!r}: "
                           f"{merged[logical]!r} vs {mesh_axes!r}")
        merged[logical] = mesh_axes
    return tuple(merged.items())
  pairs = tuple((str(a), b) for a, b in rules)
  for logical, _ in pairs:
    if logical not in LOGICAL_AXES:
      raise ValueError(f"rules: unknown logical axis {logical!r}; known: {LOGICAL_AXES}")
    if logical == "head_k":
      raise ValueError("rules: head_k (K) cannot be sharded: the read-out S^T q sums over K")
  return pairs


def _as_tuple(mesh_axes) -> tuple[str, ...]:
  if mesh_axes is None:
    return ()
  return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)


def to_spec(names: Sequence[str | None], rules: str | Rules, mesh=None) -> PartitionSpec:
  """The `PartitionSpec` of an array whose dimensions have the logical axes `names`.

  A dimension gets its rule's mesh axes minus those an earlier dimension took (and, with `mesh`,
  minus axes the mesh lacks); no rule or nothing left means replicated (None).
  """
  table = dict(rule_set(rules))
  used: set[str] = set()
  spec = []
  for name in names:
    picked = tuple(a for a in _as_tuple(table.get(name)) if a not in used
                   and (mesh is None or a in mesh.axis_names))
    used.update(picked)
    spec.append(None if not picked else (picked[0] if len(picked) == 1 else picked))
  return PartitionSpec(*spec)


def named_sharding(mesh, names: Sequence[str | None], rules: str | Rules) -> NamedSharding:
  """`NamedSharding(mesh, to_spec(names, rules, mesh))`."""
  return NamedSharding(mesh, to_spec(names, rules, mesh))


def axis_size(mesh, entry) -> int:
  """Devices along one `PartitionSpec` entry (None: 1)."""
  return math.prod(mesh.shape[a] for a in _as_tuple(entry))


def logical_axes_of(variable) -> tuple | None:
  """The logical axes of an `nnx.Variable` (its `out_sharding` metadata), or None."""
  get = getattr(variable, "get_metadata", None)
  if get is None:
    return None
  names = get().get("out_sharding")
  return tuple(names) if names else None


# The mesh and rules in force while a step is traced (`use_rules`); layers read it through
# `kernels.for_current_rules` to run their ops under `shard_map`.
_CURRENT: contextvars.ContextVar = contextvars.ContextVar("linear_attention_jax_rules", default=None)


@contextlib.contextmanager
def use_rules(mesh, rules: str | Rules):
  """Within the block (while tracing), layers run their ops under `shard_map` on `mesh` per `rules`."""
  token = _CURRENT.set((mesh, rule_set(rules)))
  try:
    yield
  finally:
    _CURRENT.reset(token)


def current_rules():
  """`(mesh, rules)` set by the innermost `use_rules`, or None."""
  return _CURRENT.get()


def constrain(x, names: Sequence[str | None]):
  """`x` with its layout pinned to the logical axes `names` under `use_rules` (a sharding constraint
  that guides XLA's partitioning of everything outside the `shard_map`s); `x` itself otherwise.
  One name per dimension, e.g. `x: [B, T, width]` with `names=("batch", "seq", "embed")`."""
  current = _CURRENT.get()
  if current is None:
    return x
  mesh, rules = current
  return jax.lax.with_sharding_constraint(x, named_sharding(mesh, names, rules))


