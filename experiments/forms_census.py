"""How a KDA LM's chunks split among the per-channel kernels' forms as it trains.

The GPU kernels take each 64-token chunk in the cheapest form its decay allows (`pallas_kernels.gpu.
channel.chunk_forms`): one product about a reference per channel where every channel decays at most
twice the one-reference bound over the chunk (76 nats about it for l2-normalised q, k, the
default `GpuConfig.unit_ref_bound`; 60 for other operands or under `unit_ref_bound=False`), else the
halves' products (32-token blocks), else the 8-token groups'.
The form sets what a chunk costs in the preparation and key-side gradient kernels, and the gates move
as the model trains. This script trains `--pattern` (sharded_throughput.py's model and data flags)
and, at each of `--census_steps`, runs the model's blocks on that step's batch and counts, for every
K layer, the share of (row, chunk, head) in each form at the default bound of l2-normalised q, k
(one, halves, groups), and the share one product serves at the narrower bound (60). One census is a
forward pass of the model (its own `--impl`); the forms are counted in XLA from the gates, so they
read the same on any backend.

    python experiments/forms_census.py --pattern=K --width=1024 --depth=4 --num_heads=8 \
        --seq_len=4096 --batch_size=8 --dtype=bfloat16 --impl=pallas --census_steps=0,10,100

Writes `{workdir}/census.json` (the rows, written after every census) and `census.md`.
"""

from __future__ import annotations

import json
import os
import sys

if __package__ in (None, ""):  # run as a file: put the repository root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx
from tqdm import tqdm

from experiments import common, data, sharded_throughput, train
from linear_attention_jax.pallas_kernels import prep
from linear_attention_jax.pallas_kernels.gpu import channel

flags.DEFINE_list("census_steps", ["0", "10", "100"], "Training steps after which to count the forms "
                  "(0: at initialisation); the run trains up to the largest.")
FLAGS = flags.FLAGS

LETTERS = "K"   # the per-channel delta mixers whose layers the census reads (KimiDeltaAttention)
C = 64          # the GPU kernels' chunk (`plan.CHUNK_SIZES`), whatever the model's --chunk_size


def forms(g, C: int, strength=None) -> dict:
  """The shares of `g [B, T, H_v, K]`'s (row, chunk, head) in each form for bfloat16 operands: `one`,
  `halves`, `groups` at the bound of l2-normalised q, k (`prep.UNIT_REF_BOUND`, kda's default),
  `one_narrow` at `prep.REF_BOUND`; the mean gate; and, over the (row, chunk, head) beyond one
  reference, how many of the head's K channels are beyond it (`beyond_channels`, their mean; 0 where
  none is beyond) and the share with at most 16 such channels (`beyond_within_16`; 1 where none is
  beyond): what a form that treats only those channels apart would have to take. `groups_in_16`: the
  share of all (row, chunk, head) in the groups' form whose 16-token blocks each fit the diagonal
  bound (`channel.blocks_fit`), which a form with 16-token diagonal blocks (two levels and a
  diagonal: three products where the groups take four) would serve.

  A form that keeps one reference for most channels and the groups' products for a slice of n
  (`beyond_within_32`, `beyond_within_64`: the share of beyond chunks with at most n channels beyond)
  needs those channels in one place: `mean_top_n`, the share of beyond chunks whose every channel
  beyond lies among the n that decay most over the row's whole sequence (one channel order a row and
  head: `channel.channel_order`'s, which `GpuConfig.order_channels` applies); `batch_top_n`, among
  the n that decay most over the whole batch (one order a head, which a layer could apply to its
  projections' columns instead of gathering activations); with `strength
  [H_v, K]` (a layer's per-channel gate bias: larger decays more), `strength_top_n`, among the n
  strongest by it (one order a head, from the parameters)."""
  B, T = g.shape[:2]
  T_pad = -(-T // C) * C
  refs = channel.chunk_cumsum(g, T_pad, C)[1]
  bound = prep.ref_bound(jnp.bfloat16, unit=True)
  at = channel.chunk_forms(refs, C, jnp.bfloat16, bound)
  narrow = channel.chunk_forms(refs, C, jnp.bfloat16)
  share = lambda x: jnp.mean(x.astype(jnp.float32))
  channels = jnp.sum(channel.channels_beyond(refs, jnp.bfloat16, bound), axis=-1)   # [B, NC, H_v]
  beyond = at != channel.ONE
  count = jnp.maximum(jnp.sum(beyond), 1)
  which = channel.channels_beyond(refs, jnp.bfloat16, bound)   # [B, NC, H_v, K]
  within = lambda top: 1.0 - jnp.sum(beyond & jnp.any(which & ~top[:, None], axis=-1)) / count
  out = dict(one=share(at == channel.ONE), halves=share(at == channel.HALVES),
             groups=share(at == channel.GROUPS), one_narrow=share(narrow == channel.ONE),
             mean_g=jnp.mean(g), beyond_channels=jnp.sum(jnp.where(beyond, channels, 0)) / count,
             groups_in_16=share((at == channel.GROUPS) & channel.blocks_fit(refs, C, jnp.bfloat16, 16)))
  for n in (16, 32, 64):
    out[f"beyond_within_{n}"] = 1.0 - jnp.sum(beyond & (channels > n)) / count
  decay = -jnp.mean(g.astype(jnp.float32), axis=1)   # [B, H_v, K]
  row_rank = channel.channel_order(g, g.shape[2])[1]   # the order GpuConfig.order_channels applies
  for n in (32, 64):
    out[f"mean_top_{n}"] = within(row_rank < n)
    out[f"batch_top_{n}"] = within(jnp.broadcast_to(strongest(jnp.mean(decay, axis=0), n), decay.shape))
    if strength is not None:
      out[f"strength_top_{n}"] = within(jnp.broadcast_to(strongest(strength, n), which[:, 0].shape))
  return out


def strongest(key, n: int):
  """`key`'s shape, bool: the n largest of `key` along its last axis."""
  rank = jnp.argsort(jnp.argsort(-key, axis=-1), axis=-1)
  return rank < n


def census_fn(graphdef, C: int):
  """`(params, tokens) -> [forms(g) of each K layer]`, jitted: the blocks run in order on the
  embedded tokens, each K layer's gates read from its own input."""

  @jax.jit
  def census(params, tokens):
    model = nnx.merge(graphdef, params)
    h = model.embed(tokens)
    out = []
    for block in model.blocks:
      if block.letter in LETTERS:
        g, _ = block.mixer.gates(block.mixer_norm(h))
        strength = block.mixer.dt_bias[...].astype(jnp.float32).reshape(g.shape[2:])
        out.append(forms(g, C, strength))
      h, _ = block(h)
    return out

  return census


def run() -> list[dict]:
  steps = sorted({int(s) for s in FLAGS.census_steps})
  if not steps or steps[0] < 0:
    raise ValueError(f"census_steps must be integers >= 0; got {FLAGS.census_steps}")
  FLAGS.steps = max(steps[-1], 1)
  config = sharded_throughput.train_config()
  source = data.make_source(config.data)
  model_config = config.lm_config(source.vocab_size)
  letters = list(model_config.layer_kinds)
  if not any(x in LETTERS for x in letters):
    raise ValueError(f"pattern {FLAGS.pattern!r} has no layer the census reads ({LETTERS})")
  setup = train.setup_training(config, model_config)
  census = census_fn(setup.graphdef, C)
  state, rows = setup.state, []
  layers = [i for i, x in enumerate(letters) if x in LETTERS]
  for step in tqdm(range(steps[-1] + 1), desc="train + census", disable=None):
    batch = source.batch("train", config.data.seed, step)
    if step in steps:
      counts = jax.device_get(census(state["params"], jnp.asarray(batch["tokens"])))
      for layer, c in zip(layers, counts):
        rows.append(dict(step=step, layer=layer, **{k: float(v) for k, v in c.items()}))
      common.write_json(FLAGS.workdir, "census.json", dict(pattern=FLAGS.pattern, rows=rows))
    if step < steps[-1]:
      state, _ = setup.train_step(state, setup.place(batch))
  return rows


def table(rows) -> list[str]:
  lines = ["| step | layer | one (76) | halves | groups | groups in 16-token blocks | one (60) | mean g "
           "| channels beyond | within 16 / 32 / 64 | in the 32 / 64 decaying most (row) "
           "| (batch) | in the 32 / 64 strongest (bias) |", "| --- " * 13 + "|"]
  pct = lambda r, keys: " / ".join(f"{r[k]:.0%}" if k in r else "-" for k in keys)
  for r in rows:
    lines.append(f"| {r['step']} | {r['layer']} | {r['one']:.1%} | {r['halves']:.1%} | {r['groups']:.1%} "
                 f"| {r['groups_in_16']:.1%} | {r['one_narrow']:.1%} | {r['mean_g']:.3f} "
                 f"| {r['beyond_channels']:.1f} "
                 f"| {pct(r, ['beyond_within_16', 'beyond_within_32', 'beyond_within_64'])} "
                 f"| {pct(r, ['mean_top_32', 'mean_top_64'])} | {pct(r, ['batch_top_32', 'batch_top_64'])} "
                 f"| {pct(r, ['strength_top_32', 'strength_top_64'])} |")
  return lines


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  train.quiet_logs()
  rows = run()
  title = (f"Chunk forms, pattern {FLAGS.pattern}, width {FLAGS.width}, depth {FLAGS.depth}, T "
           f"{FLAGS.seq_len}, batch {FLAGS.batch_size}, {FLAGS.dtype}")
  lines = [title, ""] + table(rows)
  os.makedirs(FLAGS.workdir, exist_ok=True)
  with open(os.path.join(FLAGS.workdir, "census.md"), "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))
  print(f"wrote {os.path.join(FLAGS.workdir, 'census.json')}")


if __name__ == "__main__":
  FLAGS.set_default("workdir", "runs/forms_census")
  FLAGS.set_default("pattern", "K")
  app.run(main)
