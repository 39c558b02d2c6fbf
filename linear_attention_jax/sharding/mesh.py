"""The device mesh from a `MeshConfig` (or absl flags), multi-host start-up, and the model checks.

    config = MeshConfig(data=-1, tensor=2)            # -1: whatever the other axes leave
    initialize_distributed(config)                    # multi-host: before anything touches a device
    mesh = make_mesh(config)                          # axes ("data", "fsdp", "seq", "tensor")
    check_model_config(model_config, mesh, "tp")      # heads, widths, vocab divide the axes they use

Every bad field raises a `ValueError` that names it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from linear_attention_jax.sharding import rules as rules_lib
from linear_attention_jax.sharding.rules import MESH_AXES


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh axis sizes and how this process joins a multi-host job.

  Attributes:
    data: devices along "data" (batch split); -1: every device the other axes leave.
    fsdp: devices along "fsdp" (batch split, and parameters too under the "fsdp" rules).
    seq: devices along "seq" (context parallelism under the "cp" rules).
    tensor: devices along "tensor" (heads under "tp", state columns under "state_v").
    coordinator_address: "host:port" of process 0 for `jax.distributed.initialize`; "auto" lets JAX
      detect the cluster (TPU pods, SLURM, ...); None: a single process.
    num_processes: processes in the job (with a coordinator address).
    process_id: this process's index in [0, num_processes).
    local_device_ids: the local devices this process drives (None: all of them).
  """
  data: int = -1
  fsdp: int = 1
  seq: int = 1
  tensor: int = 1
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  local_device_ids: tuple[int, ...] | None = None

  def __post_init__(self):
    fill = [name for name in MESH_AXES if getattr(self, name) == -1]
    for name in MESH_AXES:
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or (value < 1 and value != -1):
        raise ValueError(f"{name} must be a positive integer or -1 (fill); got {name}={value!r}")
    if len(fill) > 1:
      raise ValueError(f"at most one mesh axis may be -1 (fill); got {', '.join(f'{n}=-1' for n in fill)}")
    if self.num_processes is not None and (not isinstance(self.num_processes, int)
                                           or self.num_processes < 1):
      raise ValueError(f"num_processes must be a positive integer; got num_processes={self.num_processes!r}")
    if self.process_id is not None:
      if not isinstance(self.process_id, int) or self.process_id < 0:
        raise ValueError(f"process_id must be an integer >= 0; got process_id={self.process_id!r}")
      if self.num_processes is not None and self.process_id >= self.num_processes:
        raise ValueError(f"process_id={self.process_id} must be < num_processes={self.num_processes}")
    multi = (self.num_processes or 1) > 1 or self.process_id is not None
    if multi and not self.coordinator_address:
      raise ValueError("coordinator_address is required with num_processes > 1 or a process_id "
                       "(use 'auto' to let JAX detect the cluster)")
    if self.coordinator_address not in (None, "auto"):
      if self.num_processes is None or self.process_id is None:
        raise ValueError(f"coordinator_address={self.coordinator_address!r} needs num_processes and "
                         f"process_id (or coordinator_address='auto')")

  def axis_sizes(self, num_devices: int) -> dict[str, int]:
    """`{axis: size}` for `num_devices` devices, the -1 axis filled in.

    Raises `ValueError` naming the fields when the sizes do not divide (or, with no -1, do not
    multiply to) the device count.
    """
    sizes = {name: getattr(self, name) for name in MESH_AXES}
    fixed = math.prod(s for s in sizes.values() if s != -1)
    fill = [n for n, s in sizes.items() if s == -1]
    if (num_devices % fixed) if fill else (fixed != num_devices):
      bad = [n for n, s in sizes.items() if s > 1 and num_devices % s]
      bad = bad or [n for n, s in sizes.items() if s > 1] or list(MESH_AXES)
      named = ", ".join(f"{n}={sizes[n]}" for n in bad)
      need = "divide" if fill else "multiply to"
      raise ValueError(f"mesh axis sizes {named} do not fit the device count {num_devices}: the fixed "
                       f"sizes (product {fixed}) must {need} it" + ("" if fill else
                       "; set one axis to -1 to take the rest"))
    if fill:
      sizes[fill[0]] = num_devices // fixed
    return sizes


def initialize_distributed(config: MeshConfig) -> bool:
  """Starts JAX's multi-host runtime when `config` names a coordinator; returns whether it did.

  Call it first, before anything queries a device: every process of the job runs the same program,
  and `jax.devices()` then lists the devices of all hosts.
  """
  if config.coordinator_address is None:
    return False
  if config.coordinator_address == "auto":
    jax.distributed.initialize()
  else:
    jax.distributed.initialize(coordinator_address=config.coordinator_address,
                               num_processes=config.num_processes, process_id=config.process_id,
                               local_device_ids=(None if config.local_device_ids is None
                                                 else list(config.local_device_ids)))
  return True


def make_mesh(config: MeshConfig | None = None, devices=None) -> jax.sharding.Mesh:
  """A mesh with axes `MESH_AXES` over `devices` (default: all of them), sizes from `config`.

  Axis types are `Auto`: XLA partitions everything outside the `shard_map`s from the in/out shardings.
  """
  config = MeshConfig() if config is None else config
  devices = jax.devices() if devices is None else list(devices)
  sizes = config.axis_sizes(len(devices))
  shape = tuple(sizes[name] for name in MESH_AXES)
  auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  if len(devices) == len(jax.devices()):
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)
  return jax.sharding.Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=auto)


def check_model_config(config, mesh, rules) -> None:
  """Raises `ValueError` naming the `LMConfig` field whose size does not divide the mesh axes the
  rules put its logical axis on (heads not divisible by the tensor-parallel size, and so on).

  `config` is an `LMConfig` (read by attribute: num_heads, num_v_heads, num_kv_heads, head_dim,
  head_v_dim, width, mlp_dim, vocab_size, pattern).
  """
  table = rules_lib.rule_set(rules)
  K = config.head_dim or config.width // config.num_heads
  fields = [
      ("num_heads", config.num_heads, "heads"),
      ("num_v_heads", config.num_v_heads or config.num_heads, "heads"),
      ("head_v_dim", config.head_v_dim or K, "head_v"),
      ("width", config.width, "embed"),
      ("mlp_dim", config.mlp_dim, "mlp"),
      ("vocab_size", config.vocab_size, "vocab"),
  ]
  if "A" in config.pattern:
    fields.append(("num_kv_heads", config.num_kv_heads or config.num_heads, "kv_heads"))
  for field, size, logical in fields:
    spec = rules_lib.to_spec((logical,), table, mesh)
    n = rules_lib.axis_size(mesh, spec[0])
    if size % n:
      extra = " (from mlp_ratio)" if field == "mlp_dim" else ""
      raise ValueError(f"{field}={size}{extra} is not divisible by {n}, the size of mesh axes "
                       f"{spec[0]!r} that the rules give {logical!r}")


def define_flags(flag_values=None) -> None:
  """Defines the mesh flags on `flag_values` (absl's global FLAGS by default):

  --mesh_data, --mesh_fsdp, --mesh_seq, --mesh_tensor (sizes; one may be -1), --sharding_rules,
  --coordinator_address, --num_processes, --process_id, --local_device_ids.
  """
  from absl import flags
  fv = flags.FLAGS if flag_values is None else flag_values
  defaults = MeshConfig()
  for name in MESH_AXES:
    flags.DEFINE_integer(f"mesh_{name}", getattr(defaults, name),
                         f"devices along mesh axis {name!r} (-1: the rest)", flag_values=fv)
  flags.DEFINE_string("sharding_rules", "dp", "rule set(s), '+'-joined: " + ", ".join(rules_lib.RULE_SETS),
                      flag_values=fv)
  flags.DEFINE_string("coordinator_address", None, "multi-host: host:port of process 0, or 'auto'",
                      flag_values=fv)
  flags.DEFINE_integer("num_processes", None, "multi-host: processes in the job", flag_values=fv)
  flags.DEFINE_integer("process_id", None, "multi-host: this process's index", flag_values=fv)
  flags.DEFINE_list("local_device_ids", None, "multi-host: local device ids this process uses",
                    flag_values=fv)


_FLAG_NAMES = tuple(f"mesh_{name}" for name in MESH_AXES) + (
    "sharding_rules", "coordinator_address", "num_processes", "process_id", "local_device_ids")


def flags_given(flag_values=None) -> bool:
  """Whether any flag `define_flags` defined was set on the command line (scripts that run on one
  device unless told otherwise ask this before building a mesh)."""
  from absl import flags
  fv = flags.FLAGS if flag_values is None else flag_values
  return any(fv[name].present for name in _FLAG_NAMES)


def config_from_flags(flag_values=None) -> MeshConfig:
  """The `MeshConfig` of the flags `define_flags` defined (checked: a bad value raises `ValueError`)."""
  from absl import flags
  fv = flags.FLAGS if flag_values is None else flag_values
  ids = fv.local_device_ids
  return MeshConfig(**{name: fv[f"mesh_{name}"].value for name in MESH_AXES},
                    coordinator_address=fv.coordinator_address, num_processes=fv.num_processes,
                    process_id=fv.process_id,
                    local_device_ids=None if ids is None else tuple(int(i) for i in ids))
