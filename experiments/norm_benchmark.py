"""The LM's block norm, fwd+bwd, side by side: the residual addition and the RMSNorm after it.

    python experiments/norm_benchmark.py --B=8 --T=4096 --D=1024 --dtype=bfloat16

Forms (`--forms`), each `(y, s) = (RMSNorm(x + h), x + h)` with flax's `nnx.RMSNorm` in the LM's dtype,
differentiated in x, h and the scale with cotangents for both y and s (what a block's norm receives):
  flax:   the addition and flax's module, differentiated by autodiff (what XLA runs without the kernels);
  pallas: the Mosaic GPU kernels (`linear_attention_jax.pallas_kernels.gpu.rms_norm`) as the LM calls
          them (`models.lm.block_norm`).
Each row: one call waited for alone and `--stream` calls back to back (medians over `--iters`
rounds), the ratio to the first form, the bytes a call must move at least (x, h, s, y forward; s, dy,
ds_out, ds backward) over the stream time, and the largest difference of y, s and each gradient from
the first form's relative to its scale. Writes `{workdir}/norm.json` and `norm.md`.
"""

from __future__ import annotations

import contextlib
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
from linear_attention_jax.models.lm import block_norm
from linear_attention_jax.pallas_kernels import gpu
from linear_attention_jax.pallas_kernels.gpu import rms_norm

FORMS = ("flax", "pallas")
flags.DEFINE_list("forms", list(FORMS), f"Forms to time: {FORMS}.")
flags.DEFINE_bool("interpret", False, "Run the pallas form in the Mosaic GPU interpreter (CPU smoke runs).")
flags.DEFINE_bool("add", True, "The addition in the kernels (else XLA adds x + h and the kernels normalise).")
flags.DEFINE_integer("B", 8, "Batch.")
flags.DEFINE_integer("T", 4096, "Sequence length.")
flags.DEFINE_integer("D", 1024, "Width.")
flags.DEFINE_string("dtype", "bfloat16", "The stream's dtype (the norm computes in float32).")
flags.DEFINE_integer("iters", 5, "Timed rounds; medians reported.")
flags.DEFINE_integer("stream", 10, "Calls back to back in each round's second timing.")
flags.DEFINE_string("workdir", "runs/norm_benchmark", "Where norm.json and norm.md go.")
FLAGS = flags.FLAGS


def step(form: str, norm: nnx.RMSNorm, add: bool = True):
  """A jitted `(x, h, scale, dy, ds) -> (y, s, dx, dh, dscale)` of the form."""
  graph, _ = nnx.split(norm)
  if form == "flax":
    call = lambda n, x, h: block_norm(n, x, h, kernels=False)
  else:
    out_dtype = norm.dtype

    def call(n, x, h):
      w = n.scale[...].astype(out_dtype)
      if not add:   # XLA's addition, the kernels' norm
        s = x + h
        return rms_norm.add_rms_norm(s, None, w, eps=n.epsilon, out_dtype=out_dtype), s
      return rms_norm.add_rms_norm(x, h, w, eps=n.epsilon, out_dtype=out_dtype)

  def run(x, h, state, dy, ds):
    f = lambda x, h, state: call(nnx.merge(graph, state), x, h)
    out, pull = jax.vjp(f, x, h, state)
    return (*out, *pull((dy, ds)))

  return jax.jit(run)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = FLAGS
  dtype = jnp.dtype(f.dtype)
  bad = [form for form in f.forms if form not in FORMS]
  if bad:
    raise app.UsageError(f"--forms: unknown {bad}; known {FORMS}")
  keys = jax.random.split(jax.random.key(0), 5)
  shape = (f.B, f.T, f.D)
  x, h, dy, ds = (jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in keys[:4])
  norm = nnx.RMSNorm(f.D, epsilon=1e-5, dtype=dtype, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  norm.scale[...] = 1.0 + 0.1 * jax.random.normal(keys[4], (f.D,), jnp.float32)
  state = nnx.state(norm)
  forms = list(f.forms)
  floor = 8 * x.size * dtype.itemsize   # x, h, s, y forward; s, dy, ds_out, ds backward
  rows, ref = [], None
  for form in forms:
    with (gpu.interpret_kernels() if f.interpret else contextlib.nullcontext()):
      fn = step(form, norm, f.add)
      outs = jax.block_until_ready(fn(x, h, state, dy, ds))
      single, stream = time_it(fn, (x, h, state, dy, ds), iters=f.iters, stream=f.stream)
    outs = [np.asarray(o, np.float32) for o in jax.tree.leaves(outs)]
    ref = outs if ref is None else ref
    err = [float(np.max(np.abs(o - r)) / max(float(np.max(np.abs(r))), 1e-30)) for o, r in zip(outs, ref)]
    rows.append(dict(form=form, single_ms=single, stream_ms=stream, tb_s=floor / stream / 1e9,
                     max_rel_diff=err))
    print(json.dumps(rows[-1]), flush=True)
  base = rows[0]
  lines = [f"Block norm (x + h, then RMSNorm; addition in the kernels: {f.add}) fwd+bwd, x [{f.B}, {f.T}, {f.D}] {dtype.name}, "
           f"{jax.devices()[0].device_kind}, jax {jax.__version__}", "",
           f"| form | single ms | stream ms | / {base['form']} (stream) | TB/s of the floor's bytes | "
           "max diff y, s, dx, dh, dscale |", "| --- | --- | --- | --- | --- | --- |"]
  for r in rows:
    lines.append(f"| {r['form']} | {r['single_ms']:.3f} | {r['stream_ms']:.3f} | "
                 f"{r['stream_ms'] / base['stream_ms']:.2f} | {r['tb_s']:.2f} | "
                 + ", ".join(f"{e:.1e}" for e in r["max_rel_diff"]) + " |")
  os.makedirs(f.workdir, exist_ok=True)
  with open(os.path.join(f.workdir, "norm.json"), "w") as fh:
    json.dump(dict(B=f.B, T=f.T, D=f.D, dtype=dtype.name, rows=rows), fh, indent=1)
  with open(os.path.join(f.workdir, "norm.md"), "w") as fh:
    fh.write("\n".join(lines) + "\n")
  print("\n".join(lines))
  print(f"wrote {os.path.join(f.workdir, 'norm.json')}")


if __name__ == "__main__":
  app.run(main)
