"""Why Gated DeltaNet trails DeltaNet on the CPU MQAR default: steps, learning rate, or the decay's init.

Trains the two-layer Gated DeltaNet ("GG") of `mqar_sweep` (T = 32, vocabulary 64, 2 heads, 500 steps)
in a few variants, and DeltaNet ("DD") as the control, and prints one line each (mean recall over the
test settings); experiments/RECALL.md records the numbers.

- `default_*`: the layer as it is (A ~ U(1, 16), dt ~ logU(1e-3, 0.1): Mamba-2's initialisation), at
  three rates, for 3x the steps and with another seed;
- `weak_decay_*`: A = 1 and dt = 1e-3 at init (log-decay about -1e-3 per token before the input term);
- `no_decay_*`: A = 1e-9 at init (the decay off: DeltaNet plus Gated DeltaNet's output gate).

If only the decay's initial values change the outcome, the layer computes what it should and the gap
is the initialisation (and how fast a rate lets the decay grow), which the task (every key is needed
up to 30 tokens later) punishes.

    python experiments/gdn_gate_probe.py --workdir=runs/gdn_probe     # about 15 minutes on 2 cores

`--base=zoology512` and `--base=zoology_d128` train their own variants (below) in zoology's setting,
the second at its full size (one GPU run of a few minutes each).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

if __package__ in (None, ""):  # run as a file: put the repository root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
from absl import app, flags

from experiments import mqar, train

# name -> (pattern, learning rate, steps, seed, (A, dt) at init or None for the layer's own); in the
# order run, the most telling first
VARIANTS = {
    "no_decay_lr1e-2": ("GG", 1e-2, 500, 0, (1e-9, 1e-3)),
    "deltanet_lr1e-2": ("DD", 1e-2, 500, 0, None),
    "default_lr1e-2": ("GG", 1e-2, 500, 0, None),
    "default_lr3e-3": ("GG", 3e-3, 500, 0, None),
    "weak_decay_lr1e-2": ("GG", 1e-2, 500, 0, (1.0, 1e-3)),
    "weak_decay_lr3e-3": ("GG", 3e-3, 500, 0, (1.0, 1e-3)),
    "default_lr1e-3": ("GG", 1e-3, 500, 0, None),
    "default_lr3e-3_1500steps": ("GG", 3e-3, 1500, 0, None),
    "default_lr3e-3_seed1": ("GG", 3e-3, 500, 1, None),
}


def _with_decay_init(A: float, dt: float):
  """`train.init_state` with every `A_log` and `dt_bias` set so that A and softplus(dt_bias) = dt."""
  original = train.init_state
  a_log, dt_bias = math.log(A), dt + math.log(-math.expm1(-dt))

  def init_state(config, model_config, tx):
    graphdef, state = original(config, model_config, tx)

    def fix(path, x):
      names = {getattr(p, "key", None) for p in path}
      if "A_log" in names:
        return jnp.full_like(x, a_log)
      if "dt_bias" in names:
        return jnp.full_like(x, dt_bias)
      return x
    state["params"] = jax.tree_util.tree_map_with_path(fix, state["params"])
    state["opt_state"] = tx.init(train._float32(state["params"]))
    return graphdef, state
  return original, init_state


OUTPUT_GATE = "output_gate"  # an `init` that gives DeltaNet the output gate instead of a decay init


def _deltanet_with_output_gate():
  """`(original, patched)` `DeltaNet.__init__`: the patched one defaults `use_output_gate=True`."""
  from linear_attention_jax.layers import delta_net
  original = delta_net.DeltaNet.__init__

  def init(self, *args, **kwargs):
    kwargs.setdefault("use_output_gate", True)
    original(self, *args, **kwargs)
  return original, init


# `--base=zoology512`: mqar_zoology's model and optimiser (width 64, 2 heads, K = V = 32, rates and
# schedule as there) at a vocabulary of 512 and its three T = 64 training settings, batch 64: the
# smallest case in which DeltaNet starts to recall within a few hundred steps on a CPU
# (experiments/RECALL.md), so the decay-off control runs in minutes.
BASES = {
    "mqar_sweep": ("mqar_sweep", []),
    "zoology512": ("mqar_zoology", [
        "train.data.mqar.vocab_size=512", "train.data.batch_size=64", "train.eval_batches=1",
        "train.data.mqar.train_settings=[[64, 4], [64, 8], [64, 16]]",
        "train.data.mqar.test_settings=[[64, 4], [64, 8], [64, 16]]", "widths=[64]",
        "train.log_every=25"]),
    # `--base=zoology_d128`: mqar_zoology itself (vocabulary 8192, its training mix and test sets) at
    # width 128, the GPU sweep's setting, in which Gated DeltaNet never left the loss plateau in 2,000
    # steps (experiments/RECALL.md, "GPU results: phase 1")
    "zoology_d128": ("mqar_zoology", ["widths=[128]"]),
}

# the zoology512 variants: DeltaNet, Gated DeltaNet as it is, and with the decay off at init; and
# DeltaNet with Gated DeltaNet's output gate (`o_norm(o) * swish(x W_g)`), which tells whether the
# gate alone delays the start of recall (the decay-off Gated DeltaNet still starts after DeltaNet)
ZOOLOGY_VARIANTS = {
    "zoo512_deltanet_lr1e-2": ("DD", 1e-2, 400, 0, None),
    "zoo512_no_decay_lr1e-2": ("GG", 1e-2, 400, 0, (1e-9, 1e-3)),
    "zoo512_default_lr1e-2": ("GG", 1e-2, 400, 0, None),
    "zoo512_deltanet_output_gate_lr1e-2": ("DD", 1e-2, 400, 0, OUTPUT_GATE),
    "zoo512_deltanet_lr1e-2_seed1": ("DD", 1e-2, 400, 1, None),
    "zoo512_deltanet_output_gate_lr1e-2_seed1": ("DD", 1e-2, 400, 1, OUTPUT_GATE),
}
VARIANTS.update(ZOOLOGY_VARIANTS)

# the zoology_d128 variants (one GPU run each, 2,000 steps as in the sweep, at the rate where the
# sweep's DeltaNet and KDA learned): the decay off and weak at init, DeltaNet with the output gate,
# the sweep's one missing phase-1 run (KDA at rate 1e-2), which is the same config as the sweep's, and
# the layer as it is for 1.5x the steps
GPU_VARIANTS = {
    "d128_no_decay_lr3e-3": ("GG", 3.1623e-3, 2000, 0, (1e-9, 1e-3)),
    "d128_weak_decay_lr3e-3": ("GG", 3.1623e-3, 2000, 0, (1.0, 1e-3)),
    "d128_deltanet_output_gate_lr3e-3": ("DD", 3.1623e-3, 2000, 0, OUTPUT_GATE),
    "d128_kda_lr1e-2": ("KK", 1e-2, 2000, 0, None),
    "d128_default_lr3e-3_3000steps": ("GG", 3.1623e-3, 3000, 0, None),  # does it leave the plateau?
}
VARIANTS.update(GPU_VARIANTS)
DEFAULTS = {"zoology512": ZOOLOGY_VARIANTS, "zoology_d128": GPU_VARIANTS}


def run(workdir: str, names, base: str = "mqar_sweep") -> dict:
  config_name, overrides = BASES[base]
  sweep = mqar.load_config(config_name, overrides)
  results = {}
  path = os.path.join(workdir, "gdn_probe.json")
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      results = json.load(f)
  for name in names:
    if name in results:
      continue
    pattern, lr, steps, seed, init = VARIANTS[name]
    base = sweep.run_config(pattern, lr, sweep.widths[0] if sweep.widths else None)
    config = train.configs.build(train.TrainConfig, {
        **train.configs.to_dict(base), "steps": steps, "seed": seed,
        "optimizer": {**train.configs.to_dict(base.optimizer), "learning_rate": lr}})
    from linear_attention_jax.layers import delta_net
    original, original_deltanet = train.init_state, delta_net.DeltaNet.__init__
    if init == OUTPUT_GATE:
      _, delta_net.DeltaNet.__init__ = _deltanet_with_output_gate()
    elif init is not None:
      original, train.init_state = _with_decay_init(*init)
    try:
      start = time.perf_counter()
      summary = train.train_and_evaluate(config, os.path.join(workdir, name), progress=False)
    finally:
      train.init_state, delta_net.DeltaNet.__init__ = original, original_deltanet
    results[name] = {"pattern": pattern, "learning_rate": lr, "steps": steps, "seed": seed, "init": init,
                     "mean_accuracy": summary["eval/accuracy"],
                     "accuracy": {k.split("/")[1]: v for k, v in summary.items()
                                  if k.startswith("eval/T") and k.endswith("/accuracy")},
                     "seconds": time.perf_counter() - start}
    print(f"{name}: mean recall {summary['eval/accuracy']:.3f} "
          f"({results[name]['seconds']:.0f} s)", flush=True)
    os.makedirs(workdir, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
      json.dump(results, f, indent=1)
  return results


def main(argv):
  del argv
  train.quiet_logs()
  default = DEFAULTS.get(flags.FLAGS.base) or [
      n for n in VARIANTS if not any(n in d for d in DEFAULTS.values())]
  names = flags.FLAGS.variants or list(default)
  for name, r in run(flags.FLAGS.workdir, names, flags.FLAGS.base).items():
    print(f"| {name} | {r['mean_accuracy']:.3f} | "
          + " | ".join(f"{k} {v:.3f}" for k, v in r["accuracy"].items()) + " |")


if __name__ == "__main__":
  flags.DEFINE_string("workdir", "runs/gdn_probe", "Where the runs and gdn_probe.json are written.")
  flags.DEFINE_list("variants", [], f"Which variants (default: the base's): {list(VARIANTS)}")
  flags.DEFINE_enum("base", "mqar_sweep", list(BASES), "The MQAR setting the variants train in.")
  app.run(main)
