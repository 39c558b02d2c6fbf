"""The kernels lower for a Hopper GPU at realistic shapes: `jax.export(..., platforms=["cuda"])` under an
abstract H200 runs the whole Pallas -> Mosaic GPU lowering on a CPU (layouts, wgmma shapes, TMA
transforms, every op of the kernel bodies) and must produce the Mosaic GPU custom calls, forward and
backward. (ptxas and the driver are not exercised here; the H200 runs are in NOTES.md.)"""

import jax
import jax.numpy as jnp
import pytest
from jax._src.mesh import AbstractDevice
from jax.sharding import AbstractMesh

from linear_attention_jax.pallas_kernels import gpu

B, T, H = 2, 1024, 4
KINDS = {"linear_attention": (None, False), "simple_gla": ("scalar", False), "gla": ("channel", False),
         "delta_rule": (None, True), "gated_delta_rule": ("scalar", True), "kda": ("channel", True)}
H200 = AbstractMesh((), (), abstract_device=AbstractDevice(device_kind="NVIDIA H200", platform="gpu",
                                                           num_cores=132))


def _spec(*shape, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("kind", KINDS)
def test_exports_for_hopper(kind, D):
  gate, delta = KINDS[kind]
  g = {None: None, "scalar": _spec(B, T, H, dtype=jnp.float32),
       "channel": _spec(B, T, H, D, dtype=jnp.float32)}[gate]
  args = (_spec(B, T, H, D), _spec(B, T, H, D), _spec(B, T, H, D), g,
          _spec(B, T, H, dtype=jnp.float32) if delta else None, _spec(B, H, D, D, dtype=jnp.float32),
          _spec(B, T, dtype=jnp.int32))
  # the prepared path (XLA preparation + walks), which every kind can take
  fn = lambda q, k, v, g, beta, h0, seg: gpu.chunked_attention(
      q, k, v, g, beta, initial_state=h0, segment_ids=seg,
      config=gpu.GpuConfig(forward="xla_prep", backward="xla_vjp"))

  def loss(*xs):
    o, final = fn(*xs)
    return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final ** 2)

  argnums = tuple(i for i, a in enumerate(args[:6]) if a is not None)
  with jax.sharding.use_abstract_mesh(H200):
    fwd = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
    bwd = jax.export.export(jax.jit(jax.grad(loss, argnums=argnums)), platforms=["cuda"])(*args)
  # forward: one walk; gradient: the forward walk, the state walk of the backward, the reverse walk
  assert fwd.count("custom_call @mosaic_gpu") == 1 and "chunk_walk_fwd" in fwd
  assert bwd.mlir_module().count("custom_call @mosaic_gpu") == 3


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("D,group,pieces", [(64, 2, 1), (128, 1, 2)])   # group 1: dq, dk, dv in bf16
@pytest.mark.parametrize("kind", ["linear_attention", "simple_gla"])
def test_fused_path_exports_for_hopper(kind, D, group, pieces, packed):
  Hv = group * H
  g = _spec(B, T, Hv, dtype=jnp.float32) if kind == "simple_gla" else None
  args = (_spec(B, T, H, D), _spec(B, T, H, D), _spec(B, T, Hv, D), g,
          _spec(B, Hv, D, D, dtype=jnp.float32))
  seg = jnp.zeros((B, T), jnp.int32).at[:, T // 3:].set(1) if packed else None
  fn = lambda q, k, v, g, h0: gpu.chunked_attention(q, k, v, g, initial_state=h0, segment_ids=seg,
                                                    config=gpu.GpuConfig(sequence_pieces=pieces))

  def loss(*xs):
    o, final = fn(*xs)
    return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final ** 2)

  argnums = tuple(i for i, a in enumerate(args) if a is not None)
  with jax.sharding.use_abstract_mesh(H200):
    fwd = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
    bwd = jax.export.export(jax.jit(jax.grad(loss, argnums=argnums)), platforms=["cuda"])(*args)
  # pieces > 1: a walk of every piece for its end state first (forward and reverse)
  assert fwd.count("custom_call @mosaic_gpu") == 1 + (pieces > 1)
  assert "chunk_walk_fused_fwd" in fwd and "chunk_walk_fwd" not in fwd
  # gradient: the fused forward (keeping the states), the reverse walk, the per-chunk gradients
  bwd = bwd.mlir_module()
  assert bwd.count("custom_call @mosaic_gpu") == 3 + 2 * (pieces > 1)
  for name in ("chunk_walk_fused_fwd", "chunk_walk_fused_bwd", "chunk_grads_fused"):
    assert name in bwd, name
  assert "chunk_walk_fused_states" not in bwd   # no second forward walk


@pytest.mark.parametrize("D,packed", [(64, False), (128, True)])
@pytest.mark.parametrize("gated", [False, True], ids=["delta_rule", "gated_delta_rule"])
def test_delta_preparation_kernel_exports_for_hopper(gated, D, packed):
  g = _spec(B, T, H, dtype=jnp.float32) if gated else None
  args = (_spec(B, T, H, D), _spec(B, T, H, D), _spec(B, T, H, D), g, _spec(B, T, H, dtype=jnp.float32))
  seg = jnp.zeros((B, T), jnp.int32).at[:, T // 3:].set(1) if packed else None
  fn = lambda q, k, v, g, beta: gpu.chunked_attention(q, k, v, g, beta, segment_ids=seg)[0]
  with jax.sharding.use_abstract_mesh(H200):
    fwd = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
  # the preparation kernel, then the walk
  assert fwd.count("custom_call @mosaic_gpu") == 2
  assert "chunk_prep_delta" in fwd and "chunk_walk_fwd" in fwd


@pytest.mark.parametrize("D,packed,l2", [(64, True, False), (128, False, True)])
def test_delta_backward_kernel_exports_for_hopper(D, packed, l2):
  args = (_spec(B, T, H, D), _spec(B, T, H, D), _spec(B, T, H, D), _spec(B, T, H, dtype=jnp.float32),
          _spec(B, T, H, dtype=jnp.float32), _spec(B, H, D, D, dtype=jnp.float32))
  seg = jnp.zeros((B, T), jnp.int32).at[:, T // 3:].set(1) if packed else None

  def loss(q, k, v, g, beta, h0):
    o, final = gpu.chunked_attention(q, k, v, g, beta, initial_state=h0, segment_ids=seg,
                                     qk_l2norm=l2)
    return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final ** 2)

  with jax.sharding.use_abstract_mesh(H200):
    bwd = jax.export.export(jax.jit(jax.grad(loss, argnums=range(6))), platforms=["cuda"])(*args)
  bwd = bwd.mlir_module()
  # forward: preparation (with X) + walk (keeping the states); backward: reverse walk, gradients
  assert bwd.count("custom_call @mosaic_gpu") == 4
  for name in ("chunk_prep_delta", "chunk_walk_fwd", "chunk_walk_bwd", "chunk_grads_delta"):
    assert name in bwd, name
  assert "chunk_walk_states" not in bwd
  if l2:   # the kernels normalise q, k on load: no XLA reduction over them remains
    assert "stablehlo.rsqrt" not in bwd


def test_delta_walks_in_sequence_pieces_export_for_hopper():
  # 2 pieces: per direction one more walk (the pieces' maps: [K, V + K] states; the reverse's starts)
  D = 128
  args = (_spec(B, T, H, D), _spec(B, T, H, D), _spec(B, T, H, D), _spec(B, T, H, dtype=jnp.float32),
          _spec(B, T, H, dtype=jnp.float32))

  def loss(q, k, v, g, beta):
    o, final = gpu.chunked_attention(q, k, v, g, beta, config=gpu.GpuConfig(sequence_pieces=2))
    return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final ** 2)

  with jax.sharding.use_abstract_mesh(H200):
    bwd = jax.export.export(jax.jit(jax.grad(loss, argnums=range(5))), platforms=["cuda"])(*args)
  bwd = bwd.mlir_module()
  # forward: preparation, maps, walk (keeping the states); backward: reverse starts, reverse walk,
  # gradients
  assert bwd.count("custom_call @mosaic_gpu") == 6
  assert "chunk_walk_bwd_starts" in bwd and "chunk_grads_delta" in bwd


@pytest.mark.parametrize("delta", [False, True], ids=["simple_gla", "gated_delta_rule"])
def test_float32_inputs_fit_shared_memory(delta):
  # float32 q, k, v with a bfloat16 compute dtype (the entry casts them before any kernel: staging tiles
  # sized by float32 would double). Lowering checks each kernel against the 227 KB of an H200.
  D = 128
  args = (_spec(B, T, H, D, dtype=jnp.float32), _spec(B, T, H, D, dtype=jnp.float32),
          _spec(B, T, H, D, dtype=jnp.float32), _spec(B, T, H, dtype=jnp.float32),
          _spec(B, T, H, dtype=jnp.float32) if delta else None)

  def loss(q, k, v, g, beta):
    o, final = gpu.chunked_attention(q, k, v, g, beta, compute_dtype=jnp.bfloat16, out_dtype=jnp.bfloat16)
    return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final ** 2)

  argnums = tuple(i for i, a in enumerate(args) if a is not None)
  with jax.sharding.use_abstract_mesh(H200):
    module = jax.export.export(jax.jit(jax.grad(loss, argnums=argnums)), platforms=["cuda"])(*args)
  assert ("chunk_grads_delta" if delta else "chunk_grads_fused") in module.mlir_module()


@pytest.mark.parametrize("kind,D,packed", [("gla", 128, False), ("kda", 128, True), ("kda", 64, False)])
def test_per_channel_preparation_kernel_exports_for_hopper(kind, D, packed):
  # the default: the forward's chunk tensors from chunk_prep_channel (one-reference grams, in a
  # lax.cond with the same kernel choosing per chunk between those and the 8-token groups' products:
  # chunk_prep_channel_chunk), then the walk; kda's q, k l2-normalised in the kernels as they load; kda
  # at K = 128 on two warpgroups (chunk_prep_channel2); before them, g's chunk-local cumsums by
  # chunk_cumsum_fwd (GpuConfig.cumsums)
  delta = kind == "kda"
  args = (_spec(B, T, H, D), _spec(B, T, H, D), _spec(B, T, H, D), _spec(B, T, H, D, dtype=jnp.float32),
          _spec(B, T, H, dtype=jnp.float32) if delta else None)
  seg = jnp.zeros((B, T), jnp.int32).at[:, T // 3:].set(1) if packed else None
  fn = lambda q, k, v, g, beta: gpu.chunked_attention(q, k, v, g, beta, segment_ids=seg, qk_l2norm=delta)
  with jax.sharding.use_abstract_mesh(H200):
    fwd = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
  assert fwd.count("custom_call @mosaic_gpu") == 4 and "chunk_cumsum_fwd" in fwd
  prep = "chunk_prep_channel2" if delta and D == 128 else "chunk_prep_channel"
  assert prep in fwd and f"{prep}_chunk" in fwd and "chunk_walk_fwd" in fwd
  assert fwd.count("chunk_prep_channel") == fwd.count(prep)
  assert "stablehlo.rsqrt" not in fwd   # no XLA norm (kda's in the kernels)


@pytest.mark.parametrize("kind,D,group,packed,pieces,order", [
    ("gla", 128, 1, True, 2, False), ("gla", 64, 2, False, 1, False), ("kda", 128, 1, True, 2, False),
    ("kda", 64, 2, False, 1, True)])
def test_per_channel_gradient_kernels_export_for_hopper(kind, D, group, packed, pieces, order):
  # the backward: the reverse walk over the saved tensors, then gla's chunk_grads_channel (halves of 64
  # key channels, ~209 KB of shared memory at K = V = 128) or kda's value-side and key-side kernels
  # (~192 / ~218 KB), inside the lax.cond whose other branch is the same kernels on the 8-token groups'
  # products (chunk_grads_channel_groups) or, for kda, choosing per chunk between the two forms
  # (chunk_grads_channel_delta_k_chunk; at K = 128 the two-warpgroup key side, chunk_grads_channel_delta_k2);
  # `order`: kda's channels strongest first (GpuConfig.order_channels)
  Hv = group * H
  delta = kind == "kda"
  args = (_spec(B, T, H, D), _spec(B, T, H, D), _spec(B, T, Hv, D), _spec(B, T, Hv, D, dtype=jnp.float32),
          _spec(B, T, Hv, dtype=jnp.float32) if delta else None, _spec(B, Hv, D, D, dtype=jnp.float32))
  seg = jnp.zeros((B, T), jnp.int32).at[:, T // 3:].set(1) if packed else None

  def loss(q, k, v, g, beta, h0):   # kda's q, k l2-normalised on load in its kernels
    o, final = gpu.chunked_attention(q, k, v, g, beta, initial_state=h0, segment_ids=seg, qk_l2norm=delta,
                                     config=gpu.GpuConfig(sequence_pieces=pieces,
                                                          order_channels="op" if order else "none"))
    return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final ** 2)

  argnums = tuple(i for i, a in enumerate(args) if a is not None)
  with jax.sharding.use_abstract_mesh(H200):
    bwd = jax.export.export(jax.jit(jax.grad(loss, argnums=argnums)), platforms=["cuda"])(*args).mlir_module()
  assert ("stablehlo.gather" in bwd) == order   # the order's gathers, forward and back
  # with the order, the per-chunk preparation chooses each half's form (delta and order go together)
  assert ("chunk_prep_channel_chunk_parts" in bwd) == order
  keys = "chunk_grads_channel_delta_k2" if D == 128 else "chunk_grads_channel_delta_k"
  names = ["chunk_grads_channel_delta_v", keys] if delta else ["chunk_grads_channel"]
  names += [f"{keys}_chunk"] if delta else ["chunk_grads_channel_groups"]
  assert all(name in bwd for name in names)
  assert not delta or bwd.count("chunk_grads_channel_delta_k") == bwd.count(keys)
  assert "chunk_walk_bwd" in bwd
  assert "chunk_cumsum_fwd" in bwd and "chunk_cumsum_bwd" in bwd   # g's cumsums, and dG's after the kernels


def test_kdas_key_side_and_preparation_in_two_warpgroups_export_for_hopper():
  # GpuConfig.key_warpgroups=2 and prep_warpgroups=2 at K = 128: the value side with the key side's
  # products, then the two-warpgroup key side in both branches of the call-wide test (one reference;
  # each chunk its form, each half its own under "ordered"), and the two-warpgroup preparation in both
  # of the forward's, q, k normalised on load; no one-warpgroup key side or preparation left
  # (packed rows; V = 64 lowers the same tiles' shapes as V = K, the interpreter tests take it)
  D, V, Hv = 128, 128, H
  args = (_spec(B, T, H, D), _spec(B, T, H, D), _spec(B, T, Hv, V), _spec(B, T, Hv, D, dtype=jnp.float32),
          _spec(B, T, Hv, dtype=jnp.float32), _spec(B, Hv, D, V, dtype=jnp.float32))
  seg = jnp.zeros((B, T), jnp.int32).at[:, T // 3:].set(1)
  config = gpu.GpuConfig(key_warpgroups=2, prep_warpgroups=2, order_channels="ordered")

  def loss(q, k, v, g, beta, h0):
    o, final = gpu.chunked_attention(q, k, v, g, beta, initial_state=h0, segment_ids=seg, qk_l2norm=True,
                                     config=config)
    return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final ** 2)

  with jax.sharding.use_abstract_mesh(H200):
    bwd = jax.export.export(jax.jit(jax.grad(loss, argnums=range(6))), platforms=["cuda"])(*args)
  bwd = bwd.mlir_module()
  assert "chunk_grads_channel_delta_k2" in bwd and "chunk_grads_channel_delta_k2_chunk" in bwd
  assert bwd.count("chunk_grads_channel_delta_k") == bwd.count("chunk_grads_channel_delta_k2")
  assert "chunk_prep_channel2" in bwd and "chunk_prep_channel2_chunk_parts" in bwd
  assert bwd.count("chunk_prep_channel") == bwd.count("chunk_prep_channel2")


@pytest.mark.parametrize("l2,packed,V", [(True, False, 128), (False, True, 128), (True, False, 256)])
def test_delta_gradients_in_two_warpgroups_export_for_hopper(l2, packed, V):
  # delta_warpgroups=2 (V = 128): the gradients come from the two-warpgroup kernel, not chunk_grads_delta;
  # V = 256 (Gated DeltaNet's V = 2K) in one call: u in two blocks, one pair program per two blocks
  D = 128
  args = (_spec(B, T, H, D), _spec(B, T, H, D), _spec(B, T, H, V), _spec(B, T, H, dtype=jnp.float32),
          _spec(B, T, H, dtype=jnp.float32), _spec(B, H, D, V, dtype=jnp.float32))
  seg = jnp.zeros((B, T), jnp.int32).at[:, T // 3:].set(1) if packed else None

  def loss(q, k, v, g, beta, h0):
    o, final = gpu.chunked_attention(q, k, v, g, beta, initial_state=h0, segment_ids=seg,
                                     qk_l2norm=l2, config=gpu.GpuConfig(delta_warpgroups=2))
    return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final ** 2)

  with jax.sharding.use_abstract_mesh(H200):
    bwd = jax.export.export(jax.jit(jax.grad(loss, argnums=range(6))), platforms=["cuda"])(*args)
  bwd = bwd.mlir_module()
  assert bwd.count("custom_call @mosaic_gpu") == 4
  # every mention of the gradient kernel is the pair's
  assert "chunk_grads_delta_pair" in bwd
  assert bwd.count("chunk_grads_delta") == bwd.count("chunk_grads_delta_pair")


@pytest.mark.parametrize("D,pieces,packed", [(128, 1, False), (64, 2, True)])
def test_fused_forward_in_three_warpgroups_exports_for_hopper(D, pieces, packed):
  # forward_warpgroups=3 (the default): the forward (and the differentiated forward, which keeps the
  # states) is the streamed walk; the backward kernels are unchanged
  warpgroups, name = 3, "chunk_walk_fused_fwd_streamed"
  args = (_spec(B, T, H, D), _spec(B, T, H, D), _spec(B, T, H, D), _spec(B, T, H, dtype=jnp.float32),
          _spec(B, H, D, D, dtype=jnp.float32))
  seg = jnp.zeros((B, T), jnp.int32).at[:, T // 3:].set(1) if packed else None
  fn = lambda q, k, v, g, h0: gpu.chunked_attention(q, k, v, g, initial_state=h0, segment_ids=seg,
                                                    config=gpu.GpuConfig(sequence_pieces=pieces,
                                                                         forward_warpgroups=warpgroups))

  def loss(*xs):
    o, final = fn(*xs)
    return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final ** 2)

  with jax.sharding.use_abstract_mesh(H200):
    fwd = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
    bwd = jax.export.export(jax.jit(jax.grad(loss, argnums=range(5))), platforms=["cuda"])(*args)
  assert fwd.count("custom_call @mosaic_gpu") == 1 + (pieces > 1)
  assert name in fwd
  bwd = bwd.mlir_module()
  assert bwd.count("custom_call @mosaic_gpu") == 3 + 2 * (pieces > 1)
  for kernel in (name, "chunk_walk_fused_bwd", "chunk_grads_fused"):
    assert kernel in bwd, kernel


def test_persistent_pair_gradients_export_for_hopper():
  # GpuConfig(grads_programs=132): the pair gradients as 132 programs, each looping over its chunks
  D = 128
  args = (_spec(B, T, H, D), _spec(B, T, H, D), _spec(B, T, H, D), _spec(B, T, H, dtype=jnp.float32),
          _spec(B, T, H, dtype=jnp.float32))

  def loss(q, k, v, g, beta):
    o, _ = gpu.chunked_attention(q, k, v, g, beta, qk_l2norm=True,
                                 config=gpu.GpuConfig(grads_programs=132))
    return jnp.sum(o.astype(jnp.float32) ** 2)

  with jax.sharding.use_abstract_mesh(H200):
    bwd = jax.export.export(jax.jit(jax.grad(loss, argnums=range(5))), platforms=["cuda"])(*args)
  bwd = bwd.mlir_module()
  assert bwd.count("custom_call @mosaic_gpu") == 4 and "chunk_grads_delta_pair" in bwd


def test_the_kda_layer_with_the_layer_order_gathers_only_weights_for_hopper(monkeypatch):
  # GpuConfig(order_channels="layer"): the KDA layer's fwd+bwd (impl "pallas", bfloat16) exported for
  # Hopper holds the per-half preparation kernel (two warpgroups at K = 128) and gathers only its
  # weights' columns (q, k, f_up
  # kernels, dt_bias, the convolutions' taps), no [B, T, ...] activation, where "op" gathers q, k, g
  import re

  from flax import nnx

  from linear_attention_jax import layers
  from linear_attention_jax.ops import dispatch
  from linear_attention_jax.pallas_kernels.gpu import conv, plan
  hopper = plan.hopper_reason
  monkeypatch.setattr(dispatch, "kernel_backend", lambda: "gpu")   # this CPU exports for a Hopper GPU
  monkeypatch.setattr(plan, "hopper_reason", lambda backend=None: hopper("hopper"))
  monkeypatch.setattr(conv, "hopper_reason", lambda backend=None: None)
  width, T_ = 256, 256
  layer = layers.KimiDeltaAttention(width, 2, head_dim=128, impl="pallas", dtype=jnp.bfloat16,
                                    rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(layer)

  def loss(params, x):
    y, _ = nnx.merge(graphdef, params)(x)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  with gpu.default_config(gpu.GpuConfig(order_channels="layer")), jax.sharding.use_abstract_mesh(H200):
    text = jax.export.export(jax.jit(jax.grad(loss)), platforms=["cuda"])(
        params, _spec(B, T_, width)).mlir_module()
  assert "chunk_prep_channel2_chunk_parts" in text and "short_conv" in text
  gathered = re.findall(r'stablehlo\.gather"?\(.*?\).*?:\s*\(tensor<([0-9x]+)x[a-z0-9]+>', text)
  assert gathered and all(f"{B}x{T_}x" not in s and not s.startswith(f"{B}x") for s in gathered), gathered
