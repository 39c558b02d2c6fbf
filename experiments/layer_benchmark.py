"""Whole mixer layers, fwd+bwd, as a model trains them: the layer's own projections, short convolutions,
gates (from its own initialisation) and output norm, on `x [B, T, width]`, with the gradient of every
parameter and of x. One row per mixer: one call waited for alone and `--stream` calls issued back to
back (per call), both medians over `--iters` rounds, and the ratio to softmax attention (`A`) of the
same run.

    python experiments/layer_benchmark.py --B=8 --T=4096 --width=1024 --heads=8 --impl=pallas

Mixers (`--mixers`): A softmax attention; L linear attention; R retention; F GLA; D DeltaNet;
G Gated DeltaNet (V = K); G2 Gated DeltaNet with V = 2K (the paper's); K KimiDeltaAttention; Kb KDA
with the bounded gate (`gate_lower_bound=-5`). Writes `{workdir}/layers.json` and `layers.md`.
"""

from __future__ import annotations

import json
import os
import sys
import time

if __package__ in (None, ""):  # run as a file: put the repository root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_attention_jax import layers

MIXERS = ("A", "L", "R", "F", "D", "G", "G2", "K", "Kb")


def build(mixer: str, *, width: int, heads: int, impl: str, dtype):
  """The layer of `mixer` (module docstring), bfloat16 compute over float32 parameters."""
  kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  K = width // heads
  match mixer:
    case "A":
      return layers.Attention(width, heads, **kw)
    case "L":
      return layers.LinearAttention(width, heads, impl=impl, **kw)
    case "R":
      return layers.MultiScaleRetention(width, heads, impl=impl, **kw)
    case "F":
      return layers.GatedLinearAttention(width, heads, impl=impl, **kw)
    case "D":
      return layers.DeltaNet(width, heads, impl=impl, **kw)
    case "G":
      return layers.GatedDeltaNet(width, heads, head_v_dim=K, impl=impl, **kw)
    case "G2":
      return layers.GatedDeltaNet(width, heads, head_v_dim=2 * K, impl=impl, **kw)
    case "K":
      return layers.KimiDeltaAttention(width, heads, impl=impl, **kw)
    case "Kb":
      return layers.KimiDeltaAttention(width, heads, gate_lower_bound=-5.0, impl=impl, **kw)
  raise ValueError(f"mixer must be one of {MIXERS}; got {mixer!r}")


def step_fn(layer):
  """A jitted `(params, x) -> (loss, grads)`: fwd+bwd of the layer, every parameter and x."""
  graphdef, params = nnx.split(layer)

  def loss(params, x):
    y = nnx.merge(graphdef, params)(x)
    y = y[0] if isinstance(y, tuple) else y
    return jnp.mean(jnp.square(y.astype(jnp.float32)))

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), params


def time_it(fn, args, *, iters: int, stream: int):
  """(single ms, stream ms per call): medians over `iters` rounds."""
  jax.block_until_ready(fn(*args))
  single, streamed = [], []
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    single.append(time.perf_counter() - t)
    t = time.perf_counter()
    outs = [fn(*args) for _ in range(stream)]
    jax.block_until_ready(outs)
    streamed.append((time.perf_counter() - t) / stream)
  return 1e3 * float(np.median(single)), 1e3 * float(np.median(streamed))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  dtype = jnp.dtype(f.dtype)
  x = jax.random.normal(jax.random.key(0), (f.B, f.T, f.width), jnp.float32).astype(dtype)
  rows = []
  for mixer in f.mixers:
    t0 = time.perf_counter()
    try:
      fn, params = step_fn(build(mixer, width=f.width, heads=f.heads, impl=f.impl, dtype=dtype))
      jax.block_until_ready(fn(params, x))
      compile_s = time.perf_counter() - t0
      single, streamed = time_it(fn, (params, x), iters=f.iters, stream=f.stream)
      rows.append(dict(mixer=mixer, single_ms=single, stream_ms=streamed, compile_s=compile_s))
    except Exception as e:  # a mixer that cannot run here is reported, not silently dropped
      rows.append(dict(mixer=mixer, error=f"{type(e).__name__}: {str(e)[:300]}"))
    print(json.dumps(rows[-1]), flush=True)
  anchor = next((r for r in rows if r["mixer"] == "A" and "error" not in r), None)
  lines = [f"Layer fwd+bwd, x [{f.B}, {f.T}, {f.width}] {dtype.name}, {f.heads} heads, impl={f.impl}, "
           f"{jax.devices()[0].device_kind}", "",
           "| mixer | single ms | stream ms | / A (single, stream) | compile s |", "| --- | --- | --- | --- | --- |"]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['mixer']} | {r['error']} | | | |")
      continue
    ratio = (f"{r['single_ms'] / anchor['single_ms']:.2f}, {r['stream_ms'] / anchor['stream_ms']:.2f}"
             if anchor else "-")
    lines.append(f"| {r['mixer']} | {r['single_ms']:.3f} | {r['stream_ms']:.3f} | {ratio} | "
                 f"{r['compile_s']:.1f} |")
  os.makedirs(f.workdir, exist_ok=True)
  with open(os.path.join(f.workdir, "layers.json"), "w") as fh:
    json.dump(dict(B=f.B, T=f.T, width=f.width, heads=f.heads, impl=f.impl, dtype=dtype.name,
                   device=jax.devices()[0].device_kind, rows=rows), fh, indent=1)
  with open(os.path.join(f.workdir, "layers.md"), "w") as fh:
    fh.write("\n".join(lines) + "\n")
  print("\n".join(lines))
  print(f"wrote {os.path.join(f.workdir, 'layers.json')}")


if __name__ == "__main__":
  flags.DEFINE_list("mixers", ["A", "G", "K", "Kb"], f"Mixers to time: {MIXERS}.")
  flags.DEFINE_integer("B", 8, "Batch.")
  flags.DEFINE_integer("T", 4096, "Sequence length.")
  flags.DEFINE_integer("width", 1024, "Model width.")
  flags.DEFINE_integer("heads", 8, "Heads (K = width / heads).")
  flags.DEFINE_string("impl", "auto", "impl= of the linear mixers.")
  flags.DEFINE_string("dtype", "bfloat16", "Compute dtype (parameters float32).")
  flags.DEFINE_integer("iters", 5, "Timed rounds; medians reported.")
  flags.DEFINE_integer("stream", 10, "Calls issued back to back in each round's second timing.")
  flags.DEFINE_string("workdir", "runs/layer_benchmark", "Where layers.json and layers.md go.")
  app.run(main)
