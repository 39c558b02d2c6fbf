"""Sharded training throughput: a short run on one device, then the same run on flag-selected meshes.

    python experiments/sharded_throughput.py --layouts=dp:data=2,tp:tensor=2 --workdir=OUT   # 2 GPUs
    python experiments/sharded_throughput.py --mesh_data=2 --sharding_rules=dp
    python experiments/sharded_throughput.py --layouts=fsdp+tp:fsdp=4:tensor=2 --pattern=GGGA

A layout is `RULES[:AXIS=SIZE...]` (rule sets of `linear_attention_jax.sharding.rules`, '+'-joined;
unnamed mesh axes are 1 except "data", which takes the devices left). Without `--layouts` the one
layout is `--sharding_rules` on the `--mesh_*` axes. Multi-host: pass `--coordinator_address`,
`--num_processes`, `--process_id` to every process.

Each layout runs train.py's own training path (`train.setup_training`: the same initialisation,
AdamW step, batch placement and jitted step with in/out shardings as `experiments/train.py --mesh_*`)
on a config of experiments/configs/ (default `text_small`: bytes of the embedded corpus, no download),
whose model and batch the flags below override. Every layout starts from the same initialisation and
sees the same batches: one compiling step, then `--steps` timed steps. Reported per layout: tokens/s
and the speed-up over one device, the loss of the first and last step (equal across layouts up to
float rounding: the layouts compute the same function), the compiled step's memory per device (XLA's
`memory_analysis`: arguments + outputs + temporaries - donated) and, where the backend reports it,
the device's `peak_bytes_in_use` (a high-water mark of the whole process, so a layout run after a
larger one reports the larger peak; the one-device baseline runs last for that reason).
Results: `{workdir}/sharded_throughput.json` and the printed table (also `sharded_throughput.txt`).
"""

from __future__ import annotations

import os
import sys
import time

if __package__ in (None, ""):  # run as a file: put the repository root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
from absl import app, flags

from experiments import common, configs, data, train
from linear_attention_jax import sharding

FLAGS = flags.FLAGS
sharding.define_flags()
flags.DEFINE_list("layouts", None, "layouts RULES[:AXIS=SIZE...]; default: --sharding_rules on --mesh_*")
flags.DEFINE_string("config", "text_small", "train config (experiments/configs/) giving data, model "
                    "and optimizer; the flags below override it")
flags.DEFINE_multi_string("set", [], "Override KEY=VALUE of the config (after the flags below).")
flags.DEFINE_string("pattern", "GA", "mixer letters of the LM")
flags.DEFINE_integer("width", 256, "model width")
flags.DEFINE_integer("depth", 4, "blocks")
flags.DEFINE_integer("num_heads", 4, "heads (divisible by the tensor-parallel size)")
flags.DEFINE_integer("batch_size", 16, "rows per step (divisible by data x fsdp)")
flags.DEFINE_integer("seq_len", 512, "tokens per row (text data; divisible by the seq axis)")
flags.DEFINE_integer("steps", 20, "timed steps after the compiling one")
flags.DEFINE_integer("chunk_size", 64, "chunk length of the chunked form")
flags.DEFINE_enum("impl", "auto", ["auto", "chunk", "recurrent", "pallas"], "the ops' implementation")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "activation dtype")
flags.DEFINE_integer("seed", 0, "initialisation seed")
flags.DEFINE_string("workdir", "runs/sharded_throughput", "Where sharded_throughput.json (and .txt) go.")


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


def train_config() -> train.TrainConfig:
  """`--config` with the model, batch and step flags applied, then `--set`."""
  steps = FLAGS.steps + 1
  overrides = {"seed": FLAGS.seed, "steps": steps, "model.pattern": FLAGS.pattern,
               "model.width": FLAGS.width, "model.depth": FLAGS.depth,
               "model.num_heads": FLAGS.num_heads, "model.chunk_size": FLAGS.chunk_size,
               "model.impl": FLAGS.impl, "model.dtype": FLAGS.dtype,
               "data.batch_size": FLAGS.batch_size, "data.text.seq_len": FLAGS.seq_len,
               "optimizer.warmup_steps": max(1, steps // 5)}
  raw = configs.load(FLAGS.config, "train", overrides)
  return configs.build(train.TrainConfig, configs.apply_overrides(raw, FLAGS.set))


def device_peak_bytes(devices) -> int | None:
  """The largest `peak_bytes_in_use` of `devices`, or None where the backend keeps no statistics."""
  peaks = []
  for device in devices:
    try:
      stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None  # noqa: BLE001
      stats = None
    if stats and "peak_bytes_in_use" in stats:
      peaks.append(int(stats["peak_bytes_in_use"]))
  return max(peaks) if peaks else None


def _on_devices(batch, devices, mesh):
  """A placed batch's host arrays put on the one device (a mesh's are already placed)."""
  return batch if mesh is not None else jax.device_put(batch, devices[0])


def run_layout(config: train.TrainConfig, model_config, batches, *, mesh=None, rules="dp",
               rounds: int = 1, placed: bool = False, after_round=None) -> dict:
  """Trains `config` on `batches` (host batches) through train.py's path: the first step compiles,
  the rest are timed, `rounds` times over (training on): the median round gives `tokens_per_s` and
  `step_ms`, and `step_ms_rounds` holds every round's; `dispatch_ms_rounds` is each round's host time
  a step until the last step was dispatched (a round whose dispatch takes its whole time waited on
  the host). `placed`: each round's batches are on the devices before its clock starts (what an
  input pipeline that prefetches gives the step), else the loop places each host batch as train.py's
  does. `after_round(state)`, if given, runs after each round's clock stops; its results are
  `after_rounds`."""
  if rounds < 1:
    raise ValueError(f"rounds must be >= 1; got {rounds}")
  setup = train.setup_training(config, model_config, mesh=mesh, rules=rules)
  devices = [jax.devices()[0]] if mesh is None else list(mesh.devices.flat)
  state = setup.state
  start = time.perf_counter()
  first = setup.place(batches[0])
  if placed:   # the compiling step sees the timed steps' placement (a committed array is another key)
    first = _on_devices(first, devices, mesh)
  lowered = setup.lower(state, first)   # trace and lowering (the Pallas kernels' among them) ...
  lower_s = time.perf_counter() - start
  compiled = lowered.compile()          # ... then XLA's compile; the first step takes both from jit's caches
  state, metrics = setup.train_step(state, first)
  losses = [float(metrics["loss"])]
  compile_s = time.perf_counter() - start
  analysis = compiled.memory_analysis()
  step_bytes = None if analysis is None else int(
      analysis.argument_size_in_bytes + analysis.output_size_in_bytes
      + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes)
  times, dispatched, after = [], [], []
  for _ in range(rounds):
    pending = []
    timed = batches[1:]
    if placed:
      timed = jax.block_until_ready([_on_devices(setup.place(b), devices, mesh) for b in timed])
    start = time.perf_counter()
    for batch in timed:  # as train.py's loop: place the host batch, step (dispatch runs ahead)
      state, metrics = setup.train_step(state, batch if placed else setup.place(batch))
      pending.append(metrics["loss"])
    dispatched.append(time.perf_counter() - start)
    jax.block_until_ready((state, pending))
    times.append(time.perf_counter() - start)
    losses += [float(x) for x in pending]
    if after_round is not None:
      after.append(after_round(state))
  elapsed = sorted(times)[(len(times) - 1) // 2]   # the median round (the lower of two middles)
  tokens = sum(b["tokens"].size for b in batches[1:])
  params = jax.tree.leaves(state["params"])
  shards = {str(x.sharding.spec) if hasattr(x.sharding, "spec") else "single device" for x in params}
  return {"layout": setup.describe(), "rules": rules if mesh is not None else None,
          "mesh": None if mesh is None else dict(mesh.shape), "devices": len(devices),
          "tokens_per_s": tokens / elapsed, "step_ms": 1e3 * elapsed / (len(batches) - 1),
          "step_ms_rounds": [1e3 * t / (len(batches) - 1) for t in times],
          "dispatch_ms_rounds": [1e3 * t / (len(batches) - 1) for t in dispatched],
          "after_rounds": after,
          "compile_and_first_step_s": compile_s, "lower_s": lower_s, "first_loss": losses[0],
          "final_loss": losses[-1], "losses": losses, "step_bytes_per_device": step_bytes,
          "peak_bytes_in_use": device_peak_bytes(devices), "param_specs": sorted(shards)}


def _mib(x) -> str:
  return "-" if x is None else f"{x / 2**20:,.1f}"


def table(results: list[dict]) -> str:
  base = next(r for r in results if r["mesh"] is None)["tokens_per_s"]
  header = ["layout", "devices", "tokens/s", "vs 1 device", "step ms", "first loss", "final loss",
            "step MiB/device", "peak MiB"]
  rows = [[r["layout"], r["devices"], f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s'] / base:.2f}x",
           f"{r['step_ms']:.2f}", f"{r['first_loss']:.6f}", f"{r['final_loss']:.6f}",
           _mib(r["step_bytes_per_device"]), _mib(r["peak_bytes_in_use"])] for r in results]
  return common.format_table(header, rows)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  train.quiet_logs()
  sharding.initialize_distributed(sharding.config_from_flags())
  layouts = ([parse_layout(t) for t in FLAGS.layouts] if FLAGS.layouts else
             [(FLAGS.sharding_rules, sharding.config_from_flags())])
  config = train_config()
  source = data.make_source(config.data)
  model_config = config.lm_config(source.vocab_size)
  batches = [source.batch("train", config.data.seed, i) for i in range(config.steps)]  # train.py's
  meshes = [(rules, sharding.make_mesh(mesh_config)) for rules, mesh_config in layouts]  # check first
  results = [run_layout(config, model_config, batches, mesh=mesh, rules=rules) for rules, mesh in meshes]
  results.append(run_layout(config, model_config, batches))  # the one-device baseline, last (peaks)
  results.insert(0, results.pop())
  B, T = batches[0]["tokens"].shape
  title = (f"LM {model_config.pattern} width {model_config.width} depth {model_config.depth} "
           f"heads {model_config.num_heads} impl {model_config.impl} {FLAGS.dtype}, "
           f"{config.data.source} data, batch {B} x {T} tokens, {FLAGS.steps} timed steps, "
           f"{jax.device_count()} {jax.devices()[0].platform} devices ({jax.devices()[0].device_kind})")
  text = f"{title}\n{table(results)}"
  print(text)
  out = {"title": title, "config": configs.to_dict(config), "device_count": jax.device_count(),
         "platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind,
         "jax_version": jax.__version__, "results": results}
  path = common.write_json(FLAGS.workdir, "sharded_throughput.json", out)
  with open(os.path.join(FLAGS.workdir, "sharded_throughput.txt"), "w", encoding="utf-8") as f:
    f.write(text + "\n")
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
