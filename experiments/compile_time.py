"""Compile time and step time of an LM's training step, at several unrolls of the chunked form's walk.

The XLA chunked form (`impl="chunk"`: what GPUs without the Pallas kernels, and TPUs, run) walks the
chunks with a `lax.scan` unrolled `ops.chunk.ACCELERATOR_UNROLL` chunks a trip on accelerators (8;
`ops.chunk.SCAN_UNROLL` overrides it): fewer loop trips, a larger program to compile, in the forward
pass and again in its transpose. For each `--unrolls` value this times, in one process, tracing + lowering, XLA's compile,
and `--steps` training steps (train.py's own step: AdamW, bfloat16 or float32 activations) of the
LM of `--pattern`:

    python experiments/compile_time.py --pattern=G --impl=chunk --width=1024 --depth=4 --num_heads=8 \\
        --batch_size=8 --seq_len=4096 --dtype=bfloat16 --unrolls=1,8,32,128

Results: `{workdir}/compile_time.json` (rewritten after each unroll) and the printed table. A compile
that never ends is stopped only by the caller's timeout: put the slowest unroll last.
"""

from __future__ import annotations

import os
import sys
import time

if __package__ in (None, ""):  # run as a file: put the repository root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags
import jax

from experiments import common, data, sharded_throughput, train
from linear_attention_jax.ops import chunk

flags.DEFINE_list("unrolls", ["1", "128"], "Values of ops.chunk.SCAN_UNROLL to time, in this order.")
FLAGS = flags.FLAGS


def time_one(config, model_config, batches, unroll: int) -> dict:
  """Trace + lower, compile and `len(batches) - 1` steps of the train step at `unroll`."""
  previous, chunk.SCAN_UNROLL = chunk.SCAN_UNROLL, unroll
  try:
    jax.clear_caches()  # every unroll compiles from scratch
    setup = train.setup_training(config, model_config)
    first = setup.place(batches[0])
    start = time.perf_counter()
    lowered = setup.lower(setup.state, first)
    lower_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    state, metrics = compiled(setup.state, first)
    jax.block_until_ready(state)
    losses = [float(metrics["loss"])]
    start = time.perf_counter()
    pending = []
    for batch in batches[1:]:
      state, metrics = compiled(state, setup.place(batch))
      pending.append(metrics["loss"])
    jax.block_until_ready((state, pending))
    step_s = (time.perf_counter() - start) / max(1, len(batches) - 1)
  finally:
    chunk.SCAN_UNROLL = previous
  tokens = batches[0]["tokens"].size
  return {"unroll": unroll, "lower_s": lower_s, "compile_s": compile_s, "step_ms": 1e3 * step_s,
          "tokens_per_s": tokens / step_s, "first_loss": losses[0],
          "final_loss": float(pending[-1]) if pending else losses[0]}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  unrolls = [int(u) for u in FLAGS.unrolls]
  if any(u < 1 for u in unrolls):
    raise ValueError(f"unrolls must be positive integers; got {FLAGS.unrolls}")
  train.quiet_logs()
  config = sharded_throughput.train_config()
  source = data.make_source(config.data)
  model_config = config.lm_config(source.vocab_size)
  batches = [source.batch("train", config.data.seed, i) for i in range(config.steps)]
  results = []
  print("| unroll | lower s | compile s | step ms | tokens/s | first loss | final loss |", flush=True)
  print("|---|---|---|---|---|---|---|", flush=True)
  for unroll in unrolls:
    r = time_one(config, model_config, batches, unroll)
    results.append(r)
    print(f"| {unroll} | {r['lower_s']:.1f} | {r['compile_s']:.1f} | {r['step_ms']:.1f} | "
          f"{r['tokens_per_s']:,.0f} | {r['first_loss']:.4f} | {r['final_loss']:.4f} |", flush=True)
    path = common.write_json(FLAGS.workdir, "compile_time.json", {
        "pattern": FLAGS.pattern, "impl": FLAGS.impl, "width": FLAGS.width, "depth": FLAGS.depth,
        "num_heads": FLAGS.num_heads, "batch_size": FLAGS.batch_size, "seq_len": FLAGS.seq_len,
        "dtype": FLAGS.dtype, "backend": jax.default_backend(), "results": results})
  print(f"wrote {path}")


if __name__ == "__main__":
  FLAGS.set_default("workdir", "runs/compile_time")
  app.run(main)
