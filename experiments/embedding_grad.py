"""The token embedding's fwd+bwd alone: `nnx.Embed` (its gradient a scatter-add into the table) against
`layers.Embed` (a one-hot product for small vocabularies, a float32 scatter above), same process.

    python experiments/embedding_grad.py --vocabs=256,32768 --tokens=8,4096 --width=1024 --dtype=bfloat16

One row per (vocabulary, layer): one call waited for alone and `--stream` calls back to back (per call),
medians over `--iters` rounds, and the table gradient's largest difference from the float64 row sums.
Writes `{workdir}/embedding_grad.json`.
"""

from __future__ import annotations

import json
import os
import sys

if __package__ in (None, ""):  # run as a file: put the repository root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from experiments.layer_benchmark import time_it
from linear_attention_jax import layers

flags.DEFINE_list("vocabs", ["256", "32768"], "Vocabulary sizes.")
flags.DEFINE_list("tokens", ["8", "4096"], "Token ids per call: B, T.")
flags.DEFINE_integer("width", 1024, "Embedding width.")
flags.DEFINE_string("dtype", "bfloat16", "The layers' compute dtype (parameters float32).")
flags.DEFINE_integer("iters", 5, "Timed rounds; medians reported.")
flags.DEFINE_integer("stream", 10, "Calls back to back in each round's second timing.")
flags.DEFINE_string("workdir", "runs/embedding_grad", "Where embedding_grad.json goes.")
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  B, T = (int(x) for x in FLAGS.tokens)
  dtype = jnp.dtype(FLAGS.dtype)
  rows = []
  for V in (int(v) for v in FLAGS.vocabs):
    tokens = jax.random.randint(jax.random.key(0), (B, T), 0, V)
    w = jax.random.normal(jax.random.key(1), (B, T, FLAGS.width), jnp.float32)
    want = np.zeros((V, FLAGS.width))
    np.add.at(want, np.asarray(tokens).reshape(-1), np.asarray(w, np.float64).reshape(-1, FLAGS.width))
    for name, cls in (("nnx.Embed", nnx.Embed), ("layers.Embed", layers.Embed)):
      graphdef, params = nnx.split(cls(V, FLAGS.width, dtype=dtype, rngs=nnx.Rngs(0)))
      loss = lambda p, tok: jnp.sum(nnx.merge(graphdef, p)(tok).astype(jnp.float32) * w)
      fn = jax.jit(jax.grad(loss))
      grad = np.asarray(fn(params, tokens)["embedding"][...], np.float64)
      single, streamed = time_it(fn, (params, tokens), iters=FLAGS.iters, stream=FLAGS.stream)
      rows.append(dict(vocab=V, layer=name, single_ms=single, stream_ms=streamed,
                       max_abs_error=float(np.abs(grad - want).max()), max_abs=float(np.abs(want).max())))
      print(json.dumps(rows[-1]), flush=True)
  os.makedirs(FLAGS.workdir, exist_ok=True)
  path = os.path.join(FLAGS.workdir, "embedding_grad.json")
  with open(path, "w") as f:
    json.dump(dict(B=B, T=T, width=FLAGS.width, dtype=dtype.name, device=jax.devices()[0].device_kind,
                   jax_version=jax.__version__, rows=rows), f, indent=1)
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
