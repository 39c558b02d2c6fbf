"""Sharded training throughput: one short run on one device, then the same run on flag-selected meshes.

    python experiments/sharded_throughput.py --mesh_data=2 --sharding_rules=dp
    python experiments/sharded_throughput.py --layouts=dp:data=2,tp:tensor=2      # two GPUs, one call
    python experiments/sharded_throughput.py --layouts=fsdp+tp:fsdp=4:tensor=2 --pattern=GGGA

A layout is `RULES[:AXIS=SIZE...]` (rule sets of `linear_attention_jax.sharding.rules`, '+'-joined;
unnamed mesh axes are 1 except "data", which takes the devices left). Without `--layouts` the one
layout is `--sharding_rules` on the `--mesh_*` axes. Multi-host: pass `--coordinator_address`,
`--num_processes`, `--process_id` to every process.

Every run trains the same LM from the same initialisation on the same random tokens (a throughput
measure: the data is noise) with AdamW: one compiling step, then `--steps` timed steps. It prints
tokens/s per layout, the speed-up over one device, and the final loss (equal across layouts up to
float rounding: the layouts compute the same function).
"""

from __future__ import annotations

import os
import sys
import time

if __package__ in (None, ""):  # run as a file: put the repository root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import optax
from absl import app, flags
from flax import nnx

from linear_attention_jax import sharding
from linear_attention_jax.models import LM, LMConfig

FLAGS = flags.FLAGS
sharding.define_flags()
flags.DEFINE_list("layouts", None, "layouts RULES[:AXIS=SIZE...]; default: --sharding_rules on --mesh_*")
flags.DEFINE_string("pattern", "GA", "mixer letters of the LM")
flags.DEFINE_integer("width", 256, "model width")
flags.DEFINE_integer("depth", 4, "blocks")
flags.DEFINE_integer("num_heads", 4, "heads (divisible by the tensor-parallel size)")
flags.DEFINE_integer("vocab_size", 1024, "vocabulary (divisible by the tensor-parallel size)")
flags.DEFINE_integer("batch_size", 16, "rows per step (divisible by data x fsdp)")
flags.DEFINE_integer("seq_len", 512, "tokens per row (divisible by the seq axis)")
flags.DEFINE_integer("steps", 10, "timed steps after the compiling one")
flags.DEFINE_integer("chunk_size", 64, "chunk length of the chunked form")
flags.DEFINE_enum("impl", "auto", ["auto", "chunk", "recurrent", "pallas"], "the ops' implementation")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "activation dtype")
flags.DEFINE_integer("seed", 0, "initialisation and data seed")


def parse_layout(text: str) -> tuple[str, sharding.MeshConfig]:
  """`"tp:tensor=2"` -> `("tp", MeshConfig(data=-1, tensor=2))`; raises `ValueError` naming the part."""
  rules, *parts = text.split(":")
  sizes = {}
  for part in parts:
    name, _, value = part.partition("=")
    if name not in sharding.MESH_AXES or not value.lstrip("-").isdigit():
      raise ValueError(f"layout {text!r}: {part!r} is not AXIS=SIZE with AXIS in {sharding.MESH_AXES}")
    sizes[name] = int(value)
  sharding.rule_set(rules)  # raises on an unknown rule set
  return rules, sharding.MeshConfig(**{"data": -1, **sizes})


def model_config() -> LMConfig:
  return LMConfig(vocab_size=FLAGS.vocab_size, width=FLAGS.width, depth=FLAGS.depth,
                  num_heads=FLAGS.num_heads, pattern=FLAGS.pattern, chunk_size=FLAGS.chunk_size,
                  impl=FLAGS.impl, dtype=jnp.dtype(FLAGS.dtype))


def make_step(graphdef, tx):
  def loss_fn(params, batch):
    logits, _ = nnx.merge(graphdef, params)(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  def step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, {"loss": loss}

  return step


def run(label, step, state, batches) -> dict:
  """Compiles with the first batch, times the rest; returns tokens/s and the last loss."""
  state, metrics = step(state, batches[0])
  jax.block_until_ready(metrics)
  start = time.perf_counter()
  for batch in batches[1:]:
    state, metrics = step(state, batch)
  jax.block_until_ready((state, metrics))
  elapsed = time.perf_counter() - start
  tokens = sum(b["tokens"].size for b in batches[1:])
  return {"layout": label, "tokens_per_s": tokens / elapsed, "loss": float(metrics["loss"])}


def main(argv):
  del argv
  sharding.initialize_distributed(sharding.config_from_flags())
  layouts = ([parse_layout(t) for t in FLAGS.layouts] if FLAGS.layouts else
             [(FLAGS.sharding_rules, sharding.config_from_flags())])
  config = model_config()
  tx = optax.adamw(1e-3)
  graphdef, params = nnx.split(LM(config, rngs=nnx.Rngs(FLAGS.seed)), nnx.Param)
  init = {"params": params, "opt_state": tx.init(params)}
  step = make_step(graphdef, tx)
  key = jax.random.key(FLAGS.seed + 1)
  shape = (FLAGS.batch_size, FLAGS.seq_len + 1)
  batches = []
  for i in range(FLAGS.steps + 1):
    t = jax.random.randint(jax.random.fold_in(key, i), shape, 0, FLAGS.vocab_size)
    batches.append({"tokens": t[:, :-1], "targets": t[:, 1:]})

  results = [run("1 device", jax.jit(step), jax.device_put(init, jax.devices()[0]), batches)]
  for rules, mesh_config in layouts:
    mesh = sharding.make_mesh(mesh_config)
    sharding.check_model_config(config, mesh, rules)
    state = sharding.shard_train_state(jax.tree.map(jnp.copy, init), mesh, rules)  # steps donate it
    sharded = sharding.make_sharded_train_step(step, mesh, rules, state)
    sizes = ", ".join(f"{a}={s}" for a, s in mesh.shape.items() if s > 1) or "1 device"
    results.append(run(f"{rules} ({sizes})", sharded, state, batches))

  base = results[0]["tokens_per_s"]
  print(f"LM {config.pattern} width {config.width} depth {config.depth}, batch {FLAGS.batch_size} x "
        f"{FLAGS.seq_len} tokens, {FLAGS.steps} timed steps on {jax.device_count()} "
        f"{jax.devices()[0].platform} devices")
  print(f"{'layout':<32} {'tokens/s':>12} {'vs 1 device':>12} {'final loss':>12}")
  for r in results:
    print(f"{r['layout']:<32} {r['tokens_per_s']:>12,.0f} {r['tokens_per_s'] / base:>11.2f}x "
          f"{r['loss']:>12.6f}")


if __name__ == "__main__":
  app.run(main)
