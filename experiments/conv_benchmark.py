"""The short convolution's forms, fwd+bwd, side by side: what a mixer's q, k, v convolutions cost.

    python experiments/conv_benchmark.py --B=8 --T=4096 --D=1024 --dtype=bfloat16

Forms (`--forms`), each `silu(causal depthwise conv(x))` with W taps from a zero history, differentiated
in x and the kernel:
  sum:    the library's `ShortConvolution(impl="xla")` (the taps' shifted sum in float32,
          differentiated by autodiff);
  pallas: the library's `ShortConvolution(impl="pallas")` (the Mosaic GPU kernels,
          `linear_attention_jax.pallas_kernels.gpu.conv`), one row per `--blocks` entry ("auto": the
          kernels' own choice, or "BTxBD": tokens x channels a program);
  vjp:    the same sum with a written-out backward (`causal_conv` below) that keeps x alone and
          recomputes the pre-activation: measured slower than `sum` on an H200 (NOTES.md v46), so
          the library's `ShortConvolution` keeps autodiff's;
  xlaconv: `lax.conv_general_dilated` with one group per channel (cuDNN's depthwise convolution on a
          GPU) in the input dtype with float32 accumulation, differentiated by autodiff.
Each row: one call waited for alone and `--stream` calls back to back (medians over `--iters`
rounds), the ratio to `sum`, and the largest difference of y, dx and dkernel from `sum`'s relative to
its scale. Writes `{workdir}/conv.json` and `conv.md`.
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
from linear_attention_jax.layers import ShortConvolution
from linear_attention_jax.pallas_kernels import gpu
from linear_attention_jax.pallas_kernels.gpu import conv as conv_kernels

FORMS = ("sum", "pallas", "vjp", "xlaconv")
flags.DEFINE_list("forms", list(FORMS), f"Forms to time: {FORMS}.")
flags.DEFINE_list("blocks", ["auto"], "The pallas form's program blocks: 'auto' or 'BTxBD' (e.g. 64x256).")
flags.DEFINE_bool("interpret", False, "Run the pallas form in the Mosaic GPU interpreter (CPU smoke runs).")
flags.DEFINE_integer("B", 8, "Batch.")
flags.DEFINE_integer("T", 4096, "Sequence length.")
flags.DEFINE_integer("D", 1024, "Channels.")
flags.DEFINE_integer("W", 4, "Taps.")
flags.DEFINE_string("dtype", "bfloat16", "Input and output dtype (the kernel is float32).")
flags.DEFINE_integer("iters", 5, "Timed rounds; medians reported.")
flags.DEFINE_integer("stream", 10, "Calls back to back in each round's second timing.")
flags.DEFINE_string("workdir", "runs/conv_benchmark", "Where conv.json and conv.md go.")
FLAGS = flags.FLAGS


def conv_library(x, kernel, impl="xla"):
  """The library's `ShortConvolution` (no cache) with this kernel."""
  conv = ShortConvolution(x.shape[-1], kernel.shape[0], dtype=x.dtype, impl=impl, rngs=nnx.Rngs(0))
  conv.kernel.value = kernel
  return conv(x)[0]


def conv_blocks(block: str):
  """The kernels with the program blocks `block` ("auto" or "BTxBD"), as the library calls them."""
  if block == "auto":
    return lambda x, kernel: conv_library(x, kernel, impl="pallas")
  bt, bd = (int(v) for v in block.split("x"))

  def run(x, kernel):
    B, _, D = x.shape
    head = jnp.zeros((B, kernel.shape[0] - 1, D), jnp.float32)
    return conv_kernels.short_conv(x, kernel, jnp.zeros((D,), jnp.float32), head, block_t=bt,
                                   block_d=bd)
  return run


def _pre(x, kernel):
  W, T = kernel.shape[0], x.shape[1]
  padded = jnp.pad(x.astype(jnp.float32), ((0, 0), (W - 1, 0), (0, 0)))
  return sum(padded[:, w:w + T] * kernel[w] for w in range(W))


@jax.custom_vjp
def causal_conv(x, kernel):
  """The same sum with the backward written out: keeps x (its dtype) and the kernel alone."""
  return jax.nn.silu(_pre(x, kernel)).astype(x.dtype)


def _causal_conv_fwd(x, kernel):
  return causal_conv(x, kernel), (x, kernel)


def _causal_conv_bwd(residuals, dy):
  x, kernel = residuals
  W, T = kernel.shape[0], x.shape[1]
  pre = _pre(x, kernel)
  s = jax.nn.sigmoid(pre)
  dpre = dy.astype(jnp.float32) * s * (1.0 + pre * (1.0 - s))
  ahead = jnp.pad(dpre, ((0, 0), (0, W - 1), (0, 0)))   # x[s] reaches pre[s + W - 1 - w] via tap w
  dx = sum(ahead[:, W - 1 - w:W - 1 - w + T] * kernel[w] for w in range(W))
  padded = jnp.pad(x.astype(jnp.float32), ((0, 0), (W - 1, 0), (0, 0)))
  dkernel = jnp.stack([jnp.sum(padded[:, w:w + T] * dpre, axis=(0, 1)) for w in range(W)])
  return dx.astype(x.dtype), dkernel.astype(kernel.dtype)


causal_conv.defvjp(_causal_conv_fwd, _causal_conv_bwd)


def conv_xla(x, kernel):
  W, D = kernel.shape
  y = jax.lax.conv_general_dilated(
      x, kernel.astype(x.dtype)[:, None, :], window_strides=(1,), padding=[(W - 1, 0)],
      dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=D,
      preferred_element_type=jnp.float32)
  return jax.nn.silu(y).astype(x.dtype)


def form_fn(form: str):
  if form.startswith("pallas"):
    return conv_blocks(form.partition(":")[2] or "auto")
  return {"sum": conv_library, "vjp": causal_conv, "xlaconv": conv_xla}[form]


def step(form: str):
  """A jitted `(x, kernel, dy) -> (y, dx, dkernel)`; form "pallas:BLOCK" for a block of the kernels."""
  f = form_fn(form)

  def run(x, kernel, dy):
    y, pull = jax.vjp(f, x, kernel)
    return (y, *pull(dy))

  return jax.jit(run)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = FLAGS
  dtype = jnp.dtype(f.dtype)
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (f.B, f.T, f.D), jnp.float32).astype(dtype)
  kernel = jax.random.uniform(keys[1], (f.W, f.D), jnp.float32, -0.5, 0.5)
  dy = jax.random.normal(keys[2], (f.B, f.T, f.D), jnp.float32).astype(dtype)
  rows, ref = [], None
  bad = [form for form in f.forms if form not in FORMS]
  if bad:
    raise app.UsageError(f"--forms: unknown {bad}; known {FORMS}")
  forms = [x for form in f.forms
           for x in ([f"pallas:{b}" for b in f.blocks] if form == "pallas" else [form])]
  for form in forms:
    with (gpu.interpret_kernels() if f.interpret else contextlib.nullcontext()):
      fn = step(form)
      outs = jax.block_until_ready(fn(x, kernel, dy))
      single, stream = time_it(fn, (x, kernel, dy), iters=f.iters, stream=f.stream)
    outs = [np.asarray(o, np.float32) for o in outs]
    if ref is None:
      ref = outs
    err = {name: float(np.max(np.abs(o - r)) / max(float(np.max(np.abs(r))), 1e-30))
           for name, o, r in zip(("y", "dx", "dkernel"), outs, ref)}
    rows.append(dict(form=form, single_ms=single, stream_ms=stream, max_rel_diff=err))
    print(json.dumps(rows[-1]), flush=True)
  base = rows[0]
  lines = [f"Short convolution fwd+bwd, x [{f.B}, {f.T}, {f.D}] {dtype.name}, W = {f.W}, "
           f"{jax.devices()[0].device_kind}, jax {jax.__version__}", "",
           f"| form | single ms | stream ms | / {base['form']} (stream) | max diff y, dx, dkernel |",
           "| --- | --- | --- | --- | --- |"]
  for r in rows:
    e = r["max_rel_diff"]
    lines.append(f"| {r['form']} | {r['single_ms']:.3f} | {r['stream_ms']:.3f} | "
                 f"{r['stream_ms'] / base['stream_ms']:.2f} | {e['y']:.1e}, {e['dx']:.1e}, {e['dkernel']:.1e} |")
  os.makedirs(f.workdir, exist_ok=True)
  with open(os.path.join(f.workdir, "conv.json"), "w") as fh:
    json.dump(dict(B=f.B, T=f.T, D=f.D, W=f.W, dtype=dtype.name, rows=rows), fh, indent=1)
  with open(os.path.join(f.workdir, "conv.md"), "w") as fh:
    fh.write("\n".join(lines) + "\n")
  print("\n".join(lines))
  print(f"wrote {os.path.join(f.workdir, 'conv.json')}")


if __name__ == "__main__":
  app.run(main)
