"""Ops under `shard_map` with the batch, the heads or the state's value columns split.

Given every variant and a data x tensor = 4 x 2 mesh, when the op runs under `shard_op` with the
"tp" rules (heads over "tensor": grouped value heads, retention's per-head gamma) or the "state_v"
rules (value columns over "tensor": no communication), then output, final state and all gradients
equal the single-device op within 1e-5. The backends' kernel entries themselves under `shard_op`
(`util.kernel_op`): the TPU kernels equal their unsharded selves on four CPU devices, and the TPU and
GPU kernels' sharded gradients export for 2 x 2 meshes of TPUs and H200s.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

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
  from linear_attention_jax.pallas_kernels import tpu as tpu_kernels

  mesh = make_mesh(MeshConfig(data=1, seq=2, tensor=2), devices=jax.devices()[:4])
  args, h0 = util.inputs("gated_delta_rule", T=64, K=16, V=16)
  with tpu_kernels.interpret_kernels():  # trace inside: impl="pallas" then reaches the kernel
    sharded = shard_op(util.op("gated_delta_rule"), mesh, "tp+cp")
    errors = util.compare(sharded, util.op("gated_delta_rule"), args, h0, impl="pallas", chunk_size=16)
  print(util.table("gated_delta_rule, Pallas TPU kernel (interpreted) under tp+cp", errors))
  assert max(errors.values()) <= util.TOL, errors


# The backends' kernel entries under `shard_op` (`util.kernel_op`), with `check_vma=True`: the kernels
# declare the mesh axes their results vary over. "tp" splits batch x heads, "state_v" batch x value
# columns (K and T whole).
KERNEL_RULES = pytest.mark.parametrize("rules", ["tp", "state_v"], ids=["batch+heads", "batch+values"])


@multidevice
def test_tpu_kernel_sharded_equals_unsharded():
  """The TPU kernels (in the TPU interpreter, four CPU devices) give the unsharded result and gradients
  under both splits."""
  from jax.experimental.pallas import tpu as pltpu

  from linear_attention_jax.pallas_kernels import tpu
  from tests.ops.conftest import make_inputs, rel_rms
  inp = make_inputs("kda", B=2, T=40, H=2, Hv=4, K=8, V=256, seed=0)
  seg = np.zeros((2, 40), np.int32)
  seg[0, 17:] = 1
  params = pltpu.InterpretParams(random_seed=0)
  args = [jnp.asarray(inp[n]) for n in ("q", "k", "v", "g", "beta", "h0")]
  mesh = make_mesh(MeshConfig(data=2, tensor=2), devices=jax.devices()[:4])
  op = util.kernel_op(tpu.chunked_attention, chunk_size=16, interpret=params)

  def loss(fn, q, k, v, g, beta, h0):
    o, final = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                  segment_ids=jnp.asarray(seg))
    return jnp.sum(o * jnp.cos(o)) + jnp.sum(final ** 2), (o, final)

  def value_and_grads(fn):
    return jax.jit(jax.value_and_grad(lambda *a: loss(fn, *a), argnums=range(6), has_aux=True))(*args)

  plain = value_and_grads(op)
  errors = {}
  for label, rules in (("batch+heads", "tp"), ("batch+values", "state_v")):
    sharded = value_and_grads(shard_op(op, mesh, rules, check_vma=True))
    errors[label] = max(rel_rms(a, b) for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(plain)))
  print(errors)
  assert set(errors) == {"batch+heads", "batch+values"}, errors
  assert all(float(e) < 1e-5 for e in errors.values()), errors


def _abstract_mesh(device_kind, num_cores, platform):
  from jax._src.mesh import AbstractDevice
  return AbstractMesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2,
                      abstract_device=AbstractDevice(device_kind=device_kind, num_cores=num_cores,
                                                     platform=platform))


def _export_grad(chunked_attention, mesh, rules, platform, arrays, gate=(), **options):
  """`jax.export` for `platform` of the gradient of a loss of the sharded kernel's output and final
  state; `arrays`: `(shape, dtype, PartitionSpec)` of each positional argument, then of `gate`'s
  keywords (kda's A_log and dt_bias)."""
  args = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, p)) for shape, dtype, p in arrays]
  fn = shard_op(util.kernel_op(chunked_attention, **options), mesh, rules, check_vma=True)

  def loss(*xs):
    n = len(xs) - len(gate)
    o, final = fn(*xs[:n], output_final_state=True, **dict(zip(gate, xs[n:])))
    return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final)

  with jax.sharding.use_abstract_mesh(mesh):
    return jax.export.export(jax.jit(jax.grad(loss, argnums=range(len(args)))), platforms=[platform])(*args)


def test_tpu_kernel_sharded_exports_for_a_tpu_mesh():
  from linear_attention_jax.pallas_kernels import tpu
  B, T, H, D = 8, 1024, 16, 128
  heads = P("data", None, "tensor")
  arrays = [((B, T, H, D), jnp.bfloat16, heads)] * 3 + [((B, T, H), jnp.float32, heads)] * 2
  exported = _export_grad(tpu.chunked_attention, _abstract_mesh("TPU v5 lite", 1, "tpu"), "tp", "tpu",
                          arrays, interpret=False)
  assert exported.nr_devices == 4
  assert exported.mlir_module().count("stablehlo.custom_call @tpu_custom_call") == 3


def _export_gpu_grad(rules, T, delta, per_channel=False, gate=False):
  """The GPU kernels' sharded gradient exported for a 2 x 2 H200 mesh (B=4, H=8, K=V=128, bf16; scalar
  or per-channel decay; `gate`: kda given its gate's pre-activation, A_log and dt_bias split as the
  heads). The Mosaic GPU interpreter simulates a single device, so the GPU kernels cannot run sharded
  on a CPU: the numerics of the split are the TPU kernels' test's."""
  from linear_attention_jax.pallas_kernels import gpu
  B, H, D = 4, 8, 128
  rows = P("data", None, "tensor") if rules == "tp" else P("data")
  values = P("data", None, "tensor") if rules == "tp" else P("data", None, None, "tensor")
  arrays = [((B, T, H, D), jnp.bfloat16, rows), ((B, T, H, D), jnp.bfloat16, rows),
            ((B, T, H, D), jnp.bfloat16, values),
            ((B, T, H, D) if per_channel else (B, T, H), jnp.float32, rows)]
  if delta:
    arrays.append(((B, T, H), jnp.float32, rows))
  if gate:
    arrays[3] = ((B, T, H, D), jnp.bfloat16, rows)
    arrays += [((H,), jnp.float32, P("tensor")), ((H * D,), jnp.float32, P("tensor"))]
  return _export_grad(gpu.chunked_attention, _abstract_mesh("NVIDIA H200", 132, "gpu"), rules, "cuda",
                      arrays, gate=("A_log", "dt_bias") if gate else ())


@KERNEL_RULES
def test_gpu_kernel_sharded_exports_for_two_by_two_h200s(rules):
  exported = _export_gpu_grad(rules, T=1024, delta=True)
  assert exported.nr_devices == 4
  # the forward's preparation kernel and walk (which keeps the states for the backward); the backward's
  # reverse walk and per-chunk gradient kernel
  module = exported.mlir_module()
  assert module.count("custom_call @mosaic_gpu") == 4
  assert "chunk_prep_delta" in module and "chunk_grads_delta" in module


@pytest.mark.parametrize("delta", [False, True], ids=["simple_gla", "gated_delta_rule"])
@KERNEL_RULES
def test_gpu_kernel_sharded_walks_in_sequence_pieces_export(rules, delta):
  # T = 4096 per shard with 16 programs: the walks split into 4 pieces inside each shard (the pieces'
  # maps and starts are per shard; their constants must vary over the mesh axes like the data).
  module = _export_gpu_grad(rules, T=4096, delta=delta).mlir_module()
  # each direction's walk gains a first pass for the pieces: forward (preparation,) maps, walk; backward
  # starts, reverse walk, per-chunk gradients
  assert module.count("custom_call @mosaic_gpu") == (6 if delta else 5)
  assert ("chunk_walk_bwd_starts" if delta else "chunk_walk_fused_bwd_starts") in module


@pytest.mark.parametrize("rules,delta", [("tp", True), ("state_v", False)],
                         ids=["batch+heads-kda", "batch+values-gla"])
def test_gpu_kernel_sharded_per_channel_gradients_export(rules, delta):
  # per-channel decay: the preparation kernel and walk forward; the reverse walk and the per-chunk
  # gradient kernels (gla's one, kda's value side and key side) inside each shard. Each layout and
  # each variant once (40-50 s of Mosaic lowering a case): what the layout changes is the shard_map
  # around the kernels, the same for both variants, and both variants' kernels lower unsharded at
  # every size in tests/pallas_kernels/gpu/test_lowering.py.
  # kda given its gate's pre-activation: the gate's walks, and A_log's and dt_bias's cotangents split
  module = _export_gpu_grad(rules, T=1024, delta=delta, per_channel=True, gate=delta).mlir_module()
  names = ["chunk_grads_channel_delta_v", "chunk_grads_channel_delta_k"] if delta else ["chunk_grads_channel"]
  names += ["chunk_cumsum_gate_fwd", "chunk_cumsum_gate_bwd"] if delta else []
  assert all(name in module for name in ["chunk_prep_channel", "chunk_walk_fwd", "chunk_walk_bwd"] + names)
