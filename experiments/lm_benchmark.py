"""LM training speed over T at a fixed token budget: tokens/s of each pattern next to the softmax
attention LM (`A`) of the same process, the step's model-FLOP utilisation, and with `--breakdown=`
every part of a step timed alone against the step.

    python experiments/lm_benchmark.py --patterns=A,G,GGGA,K --seq_lens=4096,16384,32768,65536 \
        --tokens=32768 --width=1024 --depth=4 --num_heads=8 --dtype=bfloat16 --impl=pallas --steps=10 \
        --set=data.text.valid_fraction=0.2   # T = 65536 needs a validation part of 65,537 bytes
    python experiments/lm_benchmark.py --patterns=A,G --seq_lens=4096 --tokens=32768 --breakdown=A,G ...

Each (T, pattern) trains sharded_throughput.py's one-device run (train.py's own step: AdamW, the
config's data, `--steps` timed steps after a compiling one, `--step_rounds` times over: the median
round is reported, with the rounds' range) with batch `tokens / T`; the model and
data flags are sharded_throughput.py's. MFU counts model FLOPs per token as

    6 N  +  per A layer: 6 H D T  +  per linear layer: 3 H_v (2 C (K + V) + 4 K V)

(N: parameters of the dense products, the tied head included; attention causal, fwd + 2x bwd; the
linear mixers' four chunk products q k^T, A v, q S and k^T v, so the delta rules' extra products are
not counted and their MFU is a lower bound) over the step time and `--peak_tflops`.

`--breakdown=PATTERNS` times, each alone and jitted as fwd+bwd on the step's shapes: the embedding,
final norm, tied head and loss; each distinct block's mixer (with its norm) and MLP (with its norm);
the optimizer update. Their sum (the blocks counted `depth` times) next to the step says what the
step adds beyond its parts. A part alone is not that part inside the step: the optimizer update
jitted alone took 3.35 ms for the G LM at 4K on an H200, 0.24 ms inside the step; for where a step's
time goes, `experiments/profile_step.py` traces the step itself.

Each row also holds every round's host time until its last step was dispatched (`dispatch_ms_rounds`:
a round whose dispatch takes its whole time waited on the host; 62-70% of the step for G and K on an
H100 is a host waiting on the work in flight, NOTES.md v60), `compile_s` (the first step from the
call: trace, lowering, XLA's compile and the step) and `lower_s` (the trace and lowering alone, the
Pallas kernels' lowering among them). `--placed_batches` puts each round's
batches on the device before its clock starts. `--forms_census` counts, at each round's end, the
share of the K layers' chunks in each per-channel form (`forms_rounds`; forms_census.py): a KDA LM's
step grows as training moves its gates into the costlier forms.

Writes `{workdir}/lm.json`, `lm.md` and, over several T, `lm.png`.
"""

from __future__ import annotations

import functools
import json
import os
import sys

if __package__ in (None, ""):  # run as a file: put the repository root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx

from experiments import common, data, forms_census, sharded_throughput, train
from experiments.layer_benchmark import kernel_options, time_it
from linear_attention_jax.pallas_kernels.gpu import shared_compiles

flags.DEFINE_list("patterns", ["A", "G", "GGGA", "K"], "LM patterns; A (the anchor) runs first at each T. "
                  "The suffix ':pN' (e.g. G:p132) runs the delta family's pair gradients in N persistent "
                  "programs (GpuConfig.grads_programs), ':sN' (e.g. G:s4) its walks in N pieces a sequence "
                  "(GpuConfig.sequence_pieces), ':n' (e.g. K:n) the per-channel kernels of "
                  "l2-normalised q, k with the narrower one-reference bound (GpuConfig(unit_ref_bound="
                  "False); ':u' the default's wider one), ':c' (e.g. K:c) the per-chunk kernels without "
                  "the call-wide lax.cond (GpuConfig(call_test=False)), ':o' (e.g. K:o) kda's channels "
                  "strongest first (GpuConfig(order_channels='op')), ':l' (e.g. K:l) the same order "
                  "taken in the KDA layers' projections (order_channels='layer', the default), ':w' (e.g. "
                  "K:w) neither (order_channels='none'), ':r' (e.g. K:r) "
                  "dG's reverse cumsum in the per-channel gradient kernels (GpuConfig(dg_cumsum="
                  "'kernel')), ':k' (e.g. K:k) kda's key side on two warpgroups (GpuConfig("
                  "key_warpgroups=2)), ':f' its preparation on two (GpuConfig(prep_warpgroups=2)); letters "
                  "together set each (e.g. K:kf: the default at K = 128 with bfloat16), and ':1' (e.g. "
                  "K:1) runs both on one warpgroup, ':x' (e.g. K:x) the gates' chunk-local cumsums as XLA's "
                  "products (GpuConfig(cumsums='xla')), ':g' (e.g. K:g) kda's gate by XLA before the kernels "
                  "(GpuConfig(gate='xla')), ':q' (e.g. K:q) kda's l2 norms' gradients in their own "
                  "kernel (GpuConfig(l2_grads='kernel')), ':v' by XLA's vjp (l2_grads='xla'); beside the "
                  "default in the same process.")
flags.DEFINE_list("seq_lens", ["4096", "16384"], "Sequence lengths T.")
flags.DEFINE_integer("tokens", 32768, "Tokens per step: batch = tokens / T (at least 1).")
flags.DEFINE_list("breakdown", [], "Patterns whose steps are also timed part by part.")
flags.DEFINE_list("breakdown_seq_lens", [], "The T at which --breakdown runs (default: every T).")
flags.DEFINE_float("peak_tflops", 989.4, "The device's dense peak in the step's dtype (H200 bf16).")
flags.DEFINE_integer("rounds", 3, "Rounds of the breakdown's timings (medians).")
flags.DEFINE_integer("step_rounds", 3, "Rounds of the --steps timed steps (training on): the median round "
                     "gives tokens/s and step ms, and the table shows the rounds' range (a ratio near 1.0 "
                     "is within noise where the ranges overlap).")
flags.DEFINE_bool("placed_batches", False, "Put each round's batches on the device before its clock starts "
                  "(a prefetching input pipeline), instead of placing each host batch in the loop.")
flags.DEFINE_bool("forms_census", False, "At each round's end (off the clock), the K layers' mean shares of "
                  "chunks in each per-channel form on the last batch (forms_census.py's census; "
                  "`forms_rounds` in the rows): how the forms moved while the rounds' steps were timed.")
flags.DEFINE_bool("share_kernel_compiles", False, "Compile a Mosaic GPU kernel that several layers share "
                  "once (pallas_kernels.gpu.shared_compiles); compile_s says what it saves.")
FLAGS = flags.FLAGS


def model_flops_per_token(model_config, params, T: int) -> float:
  """The step's model FLOPs per token (module docstring)."""
  c = model_config
  dense = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(params)
              if "embed" not in jax.tree_util.keystr(path))
  dense += c.width * c.vocab_size  # the head's product (tied: the embedding's matrix)
  K = c.resolved_head_dim
  V = c.head_v_dim or K
  H_v = c.num_v_heads or c.num_heads
  C = c.chunk_size
  mixer = 0.0
  for letter in c.layer_kinds:
    if letter == "A":
      # q k^T and p v over T / 2 keys a query on average: 2 H D T forward, twice that backward
      mixer += 6 * c.num_heads * (c.head_dim or K) * T
    else:
      mixer += 3 * H_v * (2 * C * (K + V) + 4 * K * V)
  return 6 * dense + mixer


def breakdown(config, model_config, batch, rounds: int) -> list[dict]:
  """Each part of the train step alone, fwd+bwd on the step's shapes (module docstring)."""
  setup = train.setup_training(config, model_config)
  graphdef, params = setup.graphdef, setup.state["params"]
  tokens, targets = jnp.asarray(batch["tokens"]), jnp.asarray(batch["targets"])
  B, T = tokens.shape
  h = jax.random.normal(jax.random.key(1), (B, T, model_config.width), jnp.float32)
  h = h.astype(model_config.dtype)
  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))

  def ends(params, dummy):  # embedding, final norm, tied head, loss
    model = nnx.merge(graphdef, params)
    x = model.embed(tokens) + dummy
    x = model.final_norm(x)
    logits = (model.embed.attend(x) if model.lm_head is None else model.lm_head(x)).astype(jnp.float32)
    return train.masked_sums(logits, targets)[0] / targets.size

  def part(i, which, params, x):
    block = nnx.merge(graphdef, params).blocks[i]
    if which == "mixer":
      y = block.mixer(block.mixer_norm(x))[0]
    else:
      y = block.mlp(block.mlp_norm(x))
    return jnp.mean(jnp.square(y.astype(jnp.float32)))

  rows = []
  timed = lambda fn, args: time_it(fn, args, iters=rounds, stream=10)
  single, stream = timed(grad(ends), (params, jnp.zeros((), model_config.dtype)))
  rows.append(dict(part="embedding + final norm + head + loss", count=1, single_ms=single,
                   stream_ms=stream))
  firsts = {}
  for i, letter in enumerate(model_config.layer_kinds):
    firsts.setdefault(letter, i)
  for letter, i in firsts.items():
    n = model_config.layer_kinds.count(letter)
    for which in ("mixer", "mlp"):
      single, stream = timed(grad(functools.partial(part, i, which)), (params, h))
      rows.append(dict(part=f"{which} of a {letter} block (norm included)", count=n, single_ms=single,
                       stream_ms=stream))
  tx = train.make_optimizer(config.optimizer, config.steps)
  f32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)

  @jax.jit
  def update(grads, opt_state, params):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  single, stream = timed(update, (f32, setup.state["opt_state"], f32))
  rows.append(dict(part="optimizer (clip + AdamW, float32)", count=1, single_ms=single, stream_ms=stream))
  return rows


def run(pattern: str, T: int, batch: int) -> dict:
  """One (pattern, T) training run through sharded_throughput's one-device path."""
  base, _, suffix = pattern.partition(":")
  options = kernel_options(pattern)
  if suffix and not options:
    raise ValueError(f"patterns: the suffix must be ':pN' or ':sN' (N > 0), ':u', ':n', ':c', ':o', ':l', "
                     f"':w', ':r', ':k', ':f', ':x', ':g', ':q', ':v' (letters together: each), ':1' or "
                     f"none; got {pattern!r}")
  with common.kernel_config(**options):
    return _run(pattern, base, T, batch)


def _run(pattern: str, base: str, T: int, batch: int) -> dict:
  FLAGS.pattern, FLAGS.seq_len, FLAGS.batch_size = base, T, batch
  config = sharded_throughput.train_config()
  source = data.make_source(config.data)
  model_config = config.lm_config(source.vocab_size)
  batches = [source.batch("train", config.data.seed, i) for i in range(config.steps)]
  jax.clear_caches()
  row = dict(pattern=pattern, T=T, batch=batch)
  after_round = None
  if FLAGS.forms_census and any(x in forms_census.LETTERS for x in model_config.layer_kinds):
    census = forms_census.census_fn(train.init_state(config, model_config, optax.identity())[0],
                                    forms_census.C)
    tokens = jnp.asarray(batches[-1]["tokens"])
    # each of the census's numbers, the mean over the K layers
    after_round = lambda state: jax.tree.map(lambda *x: float(np.mean(x)), *census(state["params"], tokens))
  try:
    r = sharded_throughput.run_layout(config, model_config, batches, rounds=FLAGS.step_rounds,
                                      placed=FLAGS.placed_batches, after_round=after_round)
  except Exception as e:  # a run that cannot run here (memory, a kernel's limits) says why
    return dict(row, error=f"{type(e).__name__}: {str(e)[:300]}")
  setup_params = train.init_state(config, model_config, optax.identity())[1]["params"]
  flops = model_flops_per_token(model_config, setup_params, T)
  row.update(tokens_per_s=r["tokens_per_s"], step_ms=r["step_ms"], step_ms_rounds=r["step_ms_rounds"],
             dispatch_ms_rounds=r["dispatch_ms_rounds"],
             compile_s=r["compile_and_first_step_s"], lower_s=r["lower_s"], first_loss=r["first_loss"],
             final_loss=r["final_loss"], step_mib=(r["step_bytes_per_device"] or 0) / 2**20,
             flops_per_token=flops, mfu=flops * r["tokens_per_s"] / (FLAGS.peak_tflops * 1e12))
  if after_round is not None:
    row["forms_rounds"] = r["after_rounds"]
  at_T = not FLAGS.breakdown_seq_lens or str(T) in FLAGS.breakdown_seq_lens
  if pattern in FLAGS.breakdown and at_T:
    parts = breakdown(config, model_config, batches[0], FLAGS.rounds)
    row["parts"] = parts
    row["parts_sum_ms"] = sum(p["count"] * p["stream_ms"] for p in parts)
  return row


def table(rows) -> list[str]:
  lines = ["| pattern | T | batch | tokens/s | step ms (rounds' range) | / A tokens/s | MFU | "
           "compile s (of it tracing and lowering) | step MiB |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['pattern']} | {r['T']} | {r['batch']} | {r['error']} | | | | | |")
      continue
    a = next((x for x in rows if x["pattern"] == "A" and x["T"] == r["T"] and "error" not in x), None)
    ratio = f"{r['tokens_per_s'] / a['tokens_per_s']:.2f}" if a else "-"
    spread = r.get("step_ms_rounds") or [r["step_ms"]]
    step = f"{r['step_ms']:.1f}" + (f" ({min(spread):.1f}-{max(spread):.1f})" if len(spread) > 1 else "")
    lowering = f" ({r['lower_s']:.1f})" if "lower_s" in r else ""
    lines.append(f"| {r['pattern']} | {r['T']} | {r['batch']} | {r['tokens_per_s']:,.0f} | "
                 f"{step} | {ratio} | {100 * r['mfu']:.1f}% | {r['compile_s']:.1f}{lowering} | "
                 f"{r['step_mib']:,.0f} |")
  for r in rows:
    if "parts" not in r:
      continue
    lines += ["", f"Step of {r['pattern']} at T = {r['T']}, batch {r['batch']}: {r['step_ms']:.1f} ms; "
              f"its parts alone (stream ms, times their count) sum to {r['parts_sum_ms']:.1f} ms", "",
              "| part | count | single ms | stream ms | count x stream ms |",
              "| --- | --- | --- | --- | --- |"]
    lines += [f"| {p['part']} | {p['count']} | {p['single_ms']:.2f} | {p['stream_ms']:.2f} | "
              f"{p['count'] * p['stream_ms']:.2f} |" for p in r["parts"]]
  return lines


def plot(rows, path: str):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  for pattern in dict.fromkeys(r["pattern"] for r in rows):
    pts = sorted((r["T"], r["tokens_per_s"]) for r in rows if r["pattern"] == pattern and "error" not in r)
    if pts:
      ax.plot(*zip(*pts), marker="o", label=pattern, lw=2.5 if pattern == "A" else 1.5)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("T (tokens per sequence; batch = token budget / T)")
  ax.set_ylabel("training tokens/s")
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  train.quiet_logs()
  if FLAGS.share_kernel_compiles and not shared_compiles.enable():
    raise ValueError("--share_kernel_compiles: this jax has no Mosaic GPU lowering rule to wrap")
  Ts = [int(t) for t in FLAGS.seq_lens]
  patterns = sorted(FLAGS.patterns, key=lambda p: p != "A")  # the anchor first
  rows = []
  os.makedirs(FLAGS.workdir, exist_ok=True)
  title = (f"LM width {FLAGS.width} depth {FLAGS.depth} heads {FLAGS.num_heads} impl {FLAGS.impl} "
           f"{FLAGS.dtype}, {FLAGS.tokens} tokens a step, {FLAGS.steps} timed steps, "
           f"{'shared' if FLAGS.share_kernel_compiles else 'per-layer'} kernel compiles, "
           f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
  for T in Ts:
    for pattern in patterns:
      rows.append(run(pattern, T, max(1, FLAGS.tokens // T)))
      print(json.dumps({k: v for k, v in rows[-1].items() if k != "parts"}), flush=True)
      with open(os.path.join(FLAGS.workdir, "lm.json"), "w") as f:
        json.dump(dict(title=title, peak_tflops=FLAGS.peak_tflops, rows=rows), f, indent=1)
      with open(os.path.join(FLAGS.workdir, "lm.md"), "w") as f:
        f.write("\n".join([title, ""] + table(rows)) + "\n")
  if len(Ts) > 1:
    plot(rows, os.path.join(FLAGS.workdir, "lm.png"))
  print("\n".join([title, ""] + table(rows)))
  print(f"wrote {os.path.join(FLAGS.workdir, 'lm.json')}")


if __name__ == "__main__":
  FLAGS.set_default("workdir", "runs/lm_benchmark")
  FLAGS.set_default("steps", 10)
  app.run(main)
