"""The LM trained under each rule set equals the single-device run, with parameters sharded as the
rules say.

Given a small hybrid LM, a rule set and a mesh of 8 devices, when one AdamW step runs under
`make_sharded_train_step` (jit with in/out shardings; every mixer's op under `shard_map`), then the
loss, every gradient and every updated parameter match the unsharded step within 1e-5 (relative RMS),
and each parameter's `.sharding` splits exactly the dimensions its logical axes map to.
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from linear_attention_jax import sharding
from linear_attention_jax.models import LM, LMConfig
from linear_attention_jax.sharding import MeshConfig, make_mesh
from tests.sharding import util
from tests.sharding.multidevice import multidevice

VOCAB, B, T = 64, 8, 16
CASES = {  # rules: (mesh, pattern, tied embeddings, {parameter path: shard shape})
    "dp": (MeshConfig(data=8), "LA", True,
           {"embed.embedding": (64, 32), "blocks.0.mixer.q_proj.kernel": (32, 32)}),
    "fsdp": (MeshConfig(data=2, fsdp=4), "RF", True,
             {"embed.embedding": (64, 8), "blocks.0.mlp.down.kernel": (96, 8),
              "blocks.1.mixer.q_proj.kernel": (8, 32)}),
    "tp": (MeshConfig(data=4, tensor=2), "GA", False,
           {"embed.embedding": (32, 32), "lm_head.kernel": (32, 32), "blocks.0.mixer.A_log": (2,),
            "blocks.0.mixer.q_proj.kernel": (32, 16), "blocks.1.mixer.k_proj.kernel": (32, 16),
            "blocks.0.mlp.gate.kernel": (32, 48)}),
    "state_v": (MeshConfig(data=4, tensor=2), "DK", True,
                {"blocks.0.mixer.o_norm.weight": (8,), "blocks.1.mixer.q_proj.kernel": (32, 32)}),
    "cp": (MeshConfig(data=2, seq=4), "GA", True, {"blocks.0.mixer.q_proj.kernel": (32, 32)}),
    "fsdp+tp+cp": (MeshConfig(data=1, fsdp=2, seq=2, tensor=2), "KA", True,
                   {"blocks.0.mixer.q_proj.kernel": (16, 16), "blocks.0.mixer.dt_bias": (32,),
                    "embed.embedding": (32, 16)}),
}


def make_state(pattern, tie, impl="chunk"):
  config = LMConfig(vocab_size=VOCAB, width=32, depth=2, num_heads=2, num_v_heads=4, num_kv_heads=2,
                    pattern=pattern, chunk_size=8, impl=impl, tie_embeddings=tie)
  graphdef, params = nnx.split(LM(config, rngs=nnx.Rngs(0)), nnx.Param)
  tx = optax.adamw(1e-3, eps=1e-3)  # a large eps keeps the first update a smooth function of the
  #                                    gradient (with eps -> 0 it is lr * sign(g), which flips on noise)

  def loss_fn(params, batch):
    logits, _ = nnx.merge(graphdef, params)(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  def step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    new = {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
           "opt_state": opt_state}
    return new, {"loss": loss, "grads": grads}

  state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}
  return config, state, step


def batch():
  tokens = jax.random.randint(jax.random.key(1), (B, T + 1), 0, VOCAB)
  return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


def _path(key_path) -> str:
  part = lambda k: getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
  return ".".join(str(part(k)) for k in key_path)


def _params(state):
  return {_path(p): v for p, v in jax.tree_util.tree_leaves_with_path(
      state, is_leaf=lambda x: isinstance(x, nnx.Variable)) if isinstance(v, nnx.Variable)}


@pytest.mark.parametrize("rules", list(CASES))
@multidevice
def test_sharded_step_equals_single_device(rules):
  # Given
  mesh_config, pattern, tie, expected_shards = CASES[rules]
  config, state, step = make_state(pattern, tie)
  mesh = make_mesh(mesh_config)
  sharding.check_model_config(config, mesh, rules)
  data = batch()
  ref_state, ref = util.fast_jit(step)(state, data)
  # When
  sharded_state = sharding.shard_train_state(state, mesh, rules)
  sharded_step = sharding.make_sharded_train_step(step, mesh, rules, sharded_state,
                                                  compiler_options=util.FAST_OPTIONS)
  new_state, out = sharded_step(sharded_state, data)
  # Then: equal to the single-device step
  errors = {"loss": util.rel_rms(out["loss"], ref["loss"])}
  errors["grads"] = max(jax.tree.leaves(jax.tree.map(util.rel_rms, out["grads"], ref["grads"])))
  errors["params"] = max(jax.tree.leaves(jax.tree.map(util.rel_rms, new_state["params"],
                                                      ref_state["params"])))
  print(util.table(f"LM {pattern} under {rules} on {dict(mesh.shape)}", errors))
  assert max(errors.values()) <= util.TOL, errors
  # Then: every parameter (and its Adam moments) is split as its logical axes say
  params = _params(new_state["params"])
  for path, shard in expected_shards.items():
    x = params[path].get_value()
    assert x.sharding.shard_shape(x.shape) == shard, (path, x.sharding)
  moments = _params(new_state["opt_state"])
  for path, var in _params(new_state["params"]).items():
    x = var.get_value()
    spec = sharding.to_spec(sharding.rules.logical_axes_of(var), rules, mesh)
    assert x.sharding.spec == spec, (path, x.sharding.spec, spec)
    for moment in ("0.mu", "0.nu"):
      m = moments[f"{moment}.{path}"].get_value()
      assert m.sharding.is_equivalent_to(x.sharding, x.ndim), (path, moment)


@multidevice
def test_the_kda_layers_channel_order_under_sharding_equals_the_single_device_step(monkeypatch):
  # GpuConfig(order_channels="layer"), the default, impl "auto": each KDA layer orders its projections'
  # columns by the decay of the whole batch, which is split over the data axis (and its heads over
  # tensor); the step equals the unsharded step without the order (this CPU's: the order is taken
  # where the GPU's kernels can run, here as if they could, the op taking XLA's form all the same)
  from linear_attention_jax.layers import KimiDeltaAttention
  from linear_attention_jax.layers import kda as kda_module
  calls = []
  columns = KimiDeltaAttention.channel_columns
  monkeypatch.setattr(KimiDeltaAttention, "channel_columns",
                      lambda self, x: calls.append(x.shape) or columns(self, x))
  config, state, step = make_state("KA", True, impl="auto")
  mesh = make_mesh(MeshConfig(data=4, tensor=2))
  data = batch()
  ref_state, ref = util.fast_jit(step)(state, data)
  assert not calls
  monkeypatch.setattr(kda_module, "_gpu_kernels", lambda: True)
  sharded_state = sharding.shard_train_state(state, mesh, "tp")
  new_state, out = sharding.make_sharded_train_step(step, mesh, "tp", sharded_state,
                                                    compiler_options=util.FAST_OPTIONS)(sharded_state, data)
  assert calls, "the KDA layer did not order its channels"
  errors = {"loss": util.rel_rms(out["loss"], ref["loss"])}
  errors["grads"] = max(jax.tree.leaves(jax.tree.map(util.rel_rms, out["grads"], ref["grads"])))
  errors["params"] = max(jax.tree.leaves(jax.tree.map(util.rel_rms, new_state["params"],
                                                      ref_state["params"])))
  print(util.table("LM KA, the layer order, under tp", errors))
  assert max(errors.values()) <= util.TOL, errors
