"""Decode: per-token latency and cache bytes against the context length, linear vs attention vs hybrid.

For every model (a layer pattern) and context L, builds the model's cache for one batch of sequences
with room for L tokens, places its position at the end of the context (`pos = L - warmup - iters - 1`,
so the timed steps are the last tokens of a full context) and times single-token decode steps under
`jax.jit`, the cache donated and fed back as in generation. Attention reads its whole `[B, L, H_kv, D]`
buffer each step; the linear mixers read a state of fixed size. Reports the median milliseconds per
token (and the fastest step, the better estimate on a shared machine), the cache's bytes
(`layers.nbytes`) and elements per sequence (`LM.state_size(L)`); writes
`{workdir}/decode.json`, `{workdir}/decode.md` and `{workdir}/decode.png`.

    python experiments/decode.py --workdir=runs/decode
    python experiments/decode.py --set=contexts=[1024,4096] --set=model.width=1024 ...
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a file: put the repository root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from experiments import common, configs, train
from linear_attention_jax.layers import nbytes
from linear_attention_jax.models import LM, LMCache, LMConfig


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  models: tuple[tuple[str, str], ...] = (("linear", "G"), ("attention", "A"), ("hybrid", "GA"))
  # (name, pattern); the pattern repeats over model.depth
  contexts: tuple[int, ...] = (1024, 4096)  # context lengths L (the cache holds L tokens)
  model: dict = dataclasses.field(default_factory=lambda: dict(
      width=64, depth=2, num_heads=2))  # LMConfig fields shared by every model but pattern, vocab_size
  vocab_size: int = 256  # vocabulary (only the embedding and output head depend on it)
  batch: int = 1  # sequences decoded together
  warmup: int = 2  # untimed steps after compilation
  iters: int = 5  # timed steps; the median is reported
  seed: int = 0  # parameters and the decoded tokens

  def __post_init__(self):
    if not self.models or any(len(m) != 2 for m in self.models):
      raise ValueError(f"models must be a non-empty list of (name, pattern); got {self.models}")
    if not self.contexts or min(self.contexts) < self.warmup + self.iters + 2:
      raise ValueError(f"contexts must be a non-empty list of lengths >= warmup + iters + 2 = "
                       f"{self.warmup + self.iters + 2}; got {self.contexts}")
    if self.batch < 1 or self.iters < 1 or self.warmup < 0:
      raise ValueError(f"need batch >= 1, iters >= 1, warmup >= 0; got {self.batch=} {self.iters=} "
                       f"{self.warmup=}")
    train.check_model_section(self.model)
    if "pattern" in self.model:
      raise ValueError("model.pattern is set per model (the models field), not in model")
    for _, pattern in self.models:
      self.lm_config(pattern)

  def lm_config(self, pattern: str) -> LMConfig:
    return train.lm_config(dict(self.model, pattern=pattern), self.vocab_size)


def load_config(name_or_path: str, overrides=()) -> DecodeConfig:
  return configs.build(DecodeConfig, configs.load(name_or_path, "decode", overrides))


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def decode_step(params, token, cache, *, graphdef):
  """One token `[B]` through the model from `cache`: the next greedy token and the advanced cache."""
  logits, cache = nnx.merge(graphdef, params)(token[:, None], cache)
  return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache


def at_position(cache: LMCache, pos: int) -> LMCache:
  """The cache with every layer's position set to `pos` (the buffers as they are; one position array
  per layer, since the step donates the cache and a buffer may be donated only once)."""
  return LMCache(layers=tuple(dataclasses.replace(c, pos=jnp.full((), pos, jnp.int32))
                              for c in cache.layers), max_len=cache.max_len)


def measure(config: DecodeConfig, pattern: str, context: int) -> dict:
  """Median ms per decoded token at `context`, and the cache's bytes and elements per sequence."""
  model = LM(config.lm_config(pattern), rngs=nnx.Rngs(config.seed))
  graphdef, params = nnx.split(model, nnx.Param)
  cache = model.init_cache(config.batch, context)
  cache_bytes = nbytes(cache)
  cache = at_position(cache, context - config.warmup - config.iters - 1)
  rng = np.random.default_rng(config.seed)
  token = jnp.asarray(rng.integers(0, config.vocab_size, config.batch), jnp.int32)
  start = time.perf_counter()
  token, cache = decode_step(params, token, cache, graphdef=graphdef)
  jax.block_until_ready(token)
  compile_s = time.perf_counter() - start
  times = []
  for i in range(config.warmup + config.iters):
    start = time.perf_counter()
    token, cache = decode_step(params, token, cache, graphdef=graphdef)
    jax.block_until_ready(token)
    if i >= config.warmup:
      times.append((time.perf_counter() - start) * 1e3)
  assert int(cache.pos) == context, (int(cache.pos), context)
  return {"pattern": pattern, "context": context, "ms_per_token": statistics.median(times),
          "min_ms_per_token": min(times), "times_ms": times, "first_call_s": compile_s, "cache_bytes": cache_bytes,
          "state_elements": model.state_size(context) * config.batch}


def run_decode(config: DecodeConfig, workdir: str) -> dict:
  """Measures every (model, context); prints the table; writes JSON, Markdown and a plot."""
  rows = []
  for name, pattern in config.models:
    for context in config.contexts:
      row = {"model": name, **measure(config, pattern, context)}
      print(f"{name:>10} {pattern:>6} L={context:>7,}: {row['ms_per_token']:8.3f} ms/token, "
            f"cache {row['cache_bytes'] / 2**20:10.2f} MiB")
      rows.append(row)
      jax.clear_caches()  # one compiled step per (model, context): free them as we go
  device = jax.devices()[0]
  results = {"config": configs.to_dict(config), "device": f"{device.platform} ({device.device_kind})",
             "jax": jax.__version__, "rows": rows}
  table = markdown_table(rows)
  print(f"{results['device']}, batch {config.batch}, median of {config.iters} steps")
  print(table)
  os.makedirs(workdir, exist_ok=True)
  results["table"] = os.path.join(workdir, "decode.md")
  with open(results["table"], "w", encoding="utf-8") as f:
    f.write(table + "\n")
  results["plot"] = plot(rows, os.path.join(workdir, "decode.png"))
  results["path"] = os.path.join(workdir, "decode.json")
  with open(results["path"], "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1)
  print(f"wrote {results['table']}, {results['path']}" + (f", {results['plot']}" if results["plot"] else ""))
  return results


def markdown_table(rows: list[dict]) -> str:
  """Rows: model and quantity (median and fastest ms per token, cache MiB); columns: contexts."""
  contexts = sorted({r["context"] for r in rows})
  models = list(dict.fromkeys((r["model"], r["pattern"]) for r in rows))
  by = {(r["model"], r["context"]): r for r in rows}
  label = lambda L: f"{L // 1024}K" if L % 1024 == 0 else str(L)
  header = ["model", "pattern", "quantity", *(label(L) for L in contexts)]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for name, pattern in models:
    for quantity, cell in (("ms / token (median)", lambda r: f"{r['ms_per_token']:.3f}"),
                           ("ms / token (min)", lambda r: f"{r['min_ms_per_token']:.3f}"),
                           ("cache MiB", lambda r: f"{r['cache_bytes'] / 2**20:.3f}")):
      lines.append("| " + " | ".join([name, f"`{pattern}`", quantity,
                                      *(cell(by[(name, L)]) for L in contexts)]) + " |")
  return "\n".join(lines)


def plot(rows: list[dict], path: str) -> str | None:
  """Cache MiB (left) and ms per token (right) against the context, log-log, a line per model."""
  drawn = common.new_figure(1, 2, figsize=(11, 4))
  if drawn is None:
    return None
  fig, axes = drawn
  for name in dict.fromkeys(r["model"] for r in rows):
    mine = [r for r in rows if r["model"] == name]
    contexts = [r["context"] for r in mine]
    axes[0].plot(contexts, [r["cache_bytes"] / 2**20 for r in mine], "o-", label=name)
    axes[1].plot(contexts, [r["ms_per_token"] for r in mine], "o-", label=name)
  for ax, ylabel in zip(axes, ("cache MiB per batch", "ms per decoded token (median)")):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length L")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return path


def _define_flags():
  flags.DEFINE_string("config", "decode_latency", "Config name in experiments/configs/ or a path.")
  flags.DEFINE_multi_string("set", [], "Override KEY=VALUE (dotted keys, e.g. model.width=512).")
  flags.DEFINE_string("workdir", "runs/decode", "Where decode.json, decode.md and decode.png go.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  train.quiet_logs()
  run_decode(load_config(f.config, f.set), f.workdir)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
