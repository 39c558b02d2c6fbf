"""The chunk-local cumulative sum of per-channel gates, forward and reverse, by form: what the kda and
gla kernels' XLA glue pays for G = cumsum(g) within each chunk and for dg = the reverse cumsum of dG.

    python experiments/cumsum_benchmark.py --B=8 --T=4096 --H=8 --K=128

Forms (`--forms`), each over the tokens of chunks of `--C` of a float32 `[B, T / C, C, H, K]` tensor:
  cumsum:  `lax.cumsum` over the chunk's C tokens (what the library ran before NOTES.md v49);
  blocks:  `prep.local_cumsum(..., method="blocks")`: a scan within blocks of 8 tokens plus the sums
           of the blocks before;
  matmul:  `prep.local_cumsum(..., method="matmul")`: the triangle of ones times the chunk, float32 at
           HIGHEST precision (what kda's and gla's kernel glue takes, NOTES.md v49).
Each row: one call waited for alone and `--stream` calls back to back (medians over `--iters` rounds),
the ratio to `cumsum`, and the largest difference from `cumsum` relative to its scale. Writes
`{workdir}/cumsum.json` and `cumsum.md`.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a file: put the repository root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
from absl import app, flags
from jax import lax

from experiments import common
from experiments.layer_benchmark import time_it
from linear_attention_jax.pallas_kernels import prep

FORMS = ("cumsum", "blocks", "matmul")
FLAGS = flags.FLAGS
flags.DEFINE_list("forms", list(FORMS), f"Forms to time: {FORMS}.")
flags.DEFINE_integer("B", 8, "Batch.")
flags.DEFINE_integer("T", 4096, "Sequence length.")
flags.DEFINE_integer("H", 8, "Heads.")
flags.DEFINE_integer("K", 128, "Key channels.")
flags.DEFINE_integer("C", 64, "Chunk size.")
flags.DEFINE_integer("iters", 5, "Timed rounds; medians reported.")
flags.DEFINE_integer("stream", 10, "Calls back to back in each round's second timing.")
flags.DEFINE_string("workdir", "runs/cumsum_benchmark", "Where cumsum.json and cumsum.md go.")


def form(name: str, reverse: bool):
  """`x [B, NC, C, H, K] -> cumsum over axis 2` by the named form."""
  if name == "cumsum":
    return lambda x: lax.cumsum(x, 2, reverse=reverse)
  if name == "blocks":
    return lambda x: prep.local_cumsum(x, 2, reverse=reverse)
  if name == "matmul":
    return lambda x: prep.local_cumsum(x, 2, reverse=reverse, method="matmul")
  raise ValueError(f"form must be one of {FORMS}; got {name!r}")


def main(argv):
  del argv
  f = FLAGS
  # gates as kda's layer draws them: -A softplus(.), A in [1, 16], floored at -20
  key_a, key_b = jax.random.split(jax.random.key(0))
  A = jax.random.uniform(key_a, (f.H, f.K), minval=1.0, maxval=16.0)
  g = -A * jax.nn.softplus(jax.random.normal(key_b, (f.B, f.T, f.H, f.K)) - 3.0)
  x = jnp.maximum(g, -20.0).reshape(f.B, f.T // f.C, f.C, f.H, f.K)
  rows = []
  for reverse in (False, True):
    ref = jax.jit(form("cumsum", reverse))(x)
    scale = float(jnp.max(jnp.abs(ref)))
    base = None
    for name in f.forms:
      fn = jax.jit(form(name, reverse))
      y = fn(x)
      single, stream = time_it(fn, (x,), iters=f.iters, stream=f.stream)
      base = stream if name == "cumsum" else base
      rows.append(dict(form=name, reverse=reverse, single_ms=single, stream_ms=stream,
                       ratio=None if base is None else stream / base,
                       rel_err=float(jnp.max(jnp.abs(y - ref))) / scale))
      print(rows[-1], flush=True)
  lines = [f"chunk-local cumsum, float32 [{f.B}, {f.T // f.C}, {f.C}, {f.H}, {f.K}], "
           f"{jax.devices()[0].device_kind}, jax {jax.__version__}", "",
           "| form | reverse | single ms | stream ms | / cumsum | max rel err |",
           "| --- | --- | --- | --- | --- | --- |"]
  for r in rows:
    ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
    lines.append(f"| {r['form']} | {r['reverse']} | {r['single_ms']:.3f} | {r['stream_ms']:.3f} | {ratio} | "
                 f"{r['rel_err']:.1e} |")
  path = common.write_json(f.workdir, "cumsum.json", rows)
  with open(os.path.join(f.workdir, "cumsum.md"), "w") as fh:
    fh.write("\n".join(lines) + "\n")
  print("\n".join(lines))
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
