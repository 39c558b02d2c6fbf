"""Whole mixer layers, fwd+bwd, as a model trains them: the layer's own projections, short convolutions,
gates (from its own initialisation) and output norm, on `x [B, T, width]`, with the gradient of every
parameter and of x. One row per mixer: one call waited for alone and `--stream` calls issued back to
back (per call), both medians over `--iters` rounds, and the ratio to softmax attention (`A`) of the
same run.

    python experiments/layer_benchmark.py --B=8 --T=4096 --width=1024 --heads=8 --impl=pallas
    python experiments/layer_benchmark.py --T=1024,4096,16384,65536 --tokens=32768 --impl=pallas \
        --mixers=A,F,G,K        # a sweep over T at a fixed token budget (B = tokens / T), and a plot
    python experiments/layer_benchmark.py --rows_from=a/layers.json,b/layers.json   # one sweep's table

Mixers (`--mixers`): A softmax attention; L linear attention; R retention; F GLA; D DeltaNet;
G Gated DeltaNet (V = K); G2 Gated DeltaNet with V = 2K (the paper's); K KimiDeltaAttention; Kb KDA
with the bounded gate (`gate_lower_bound=-5`). A mixer with the suffix ":xlaconv" (e.g. `G:xlaconv`) runs
its short convolutions as XLA's shifted sum (`ShortConvolution(impl="xla")`) rather than the kernels
that `impl=pallas`/`auto` give them, for the two side by side; the suffix ":pN" (e.g. `G:p132`) runs
the delta family's pair gradients in N persistent programs (`GpuConfig.grads_programs`), beside the
default's one program a chunk in the same process; ":sN" (e.g. `G:s4`) walks each sequence in N
pieces (`GpuConfig.sequence_pieces`); the suffix ":n" (e.g. `K:n`) gives kda's kernels of
l2-normalised q, k the narrower one-reference bound of other operands (`GpuConfig(unit_ref_bound=False)`;
":u" the default's wider one, explicitly); ":c" (e.g. `K:c`) runs the per-channel kernels that choose
each chunk's form without the call-wide `lax.cond` before them (`GpuConfig(call_test=False)`); ":o"
(e.g. `K:o`) takes kda's channels strongest first, so that each half of the key-side gradients' channels
takes its own form (`GpuConfig(order_channels="op")`: the op gathers q, k, g; ":l", e.g. `K:l`, orders the
KDA layer's projections instead, `"layer"`, the default; ":w", e.g. `K:w`, neither, `"none"`); ":r"
(e.g. `K:r`, `F:r`) takes dG's reverse cumsum in the per-channel gradient kernels instead of XLA
(`GpuConfig(dg_cumsum="kernel")`); ":k" (e.g. `K:k`) runs kda's key-side gradients on two warpgroups, a
half of the key channels each (`GpuConfig(key_warpgroups=2)`), ":f" its preparation kernel on two
(`GpuConfig(prep_warpgroups=2)`), and letters together set each (e.g. `K:kf`): both are the default
at K = 128 with bfloat16 operands, and ":1" (e.g. `K:1`) runs both on one warpgroup instead
(`GpuConfig(key_warpgroups=1, prep_warpgroups=1)`). Writes `{workdir}/layers.json` and `layers.md`;
with several `--T`, also `layers.png`: each mixer's time per token against T next to softmax
attention's, and the T from which each mixer is faster.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

if __package__ in (None, ""):  # run as a file: put the repository root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import common
from linear_attention_jax import layers

MIXERS = ("A", "L", "R", "F", "D", "G", "G2", "K", "Kb")


def build(mixer: str, *, width: int, heads: int, impl: str, dtype):
  """The layer of `mixer` (module docstring), bfloat16 compute over float32 parameters."""
  name, _, variant = mixer.partition(":")
  if variant != "xlaconv" and kernel_options(mixer) is None:
    raise ValueError(f"mixer suffix must be ':xlaconv', ':pN' or ':sN' (N > 0), ':u', ':n', ':c', ':o', "
                     f"':l', ':w', ':r', ':k', ':f', ':x', ':g', ':q', ':v' (letters together: each), "
                     f"':1' or none; got {mixer!r}")
  layer = _build(name, width=width, heads=heads, impl=impl, dtype=dtype)
  for conv in getattr(layer, "convs", ()) if variant == "xlaconv" else ():
    conv.impl = "xla"
  return layer


def kernel_options(mixer: str) -> dict | None:
  """The `GpuConfig` fields a mixer's (or LM pattern's) suffix sets: none for no suffix (and
  ':xlaconv', which is the layer's own), `grads_programs=N` for ':pN' (persistent pair-gradient
  programs), `sequence_pieces=N` for ':sN' (each sequence's walks in N pieces), `unit_ref_bound=True`
  for ':u' (the default) and False for ':n' (the narrower one-reference bound), `call_test=False` for
  ':c' (per-chunk kernels without the call-wide lax.cond), `order_channels="op"` for ':o' (kda's
  channels strongest first, gathered in the op), "layer" for ':l' (ordered in the KDA layers'
  projections, the default) and "none" for ':w' (neither), `dg_cumsum="kernel"` for ':r' (dG's
  reverse cumsum in the per-channel gradient kernels), `key_warpgroups=2` for ':k' (kda's key side on
  two warpgroups), `prep_warpgroups=2` for ':f' (kda's preparation, the forward's kernel, on two),
  `cumsums="xla"` for ':x' (the gates' chunk-local cumsums as XLA's products), `gate="xla"` for ':g'
  (kda's gate computed by XLA before the kernels, not in their cumsum walks), `l2_grads="kernel"` for
  ':q' (kda's l2 norms' gradients in their own kernel, `l2_grads.py`) and "xla" for ':v' (XLA's vjp);
  letters together set each
  (':kf' both), each field once; both at 1 for ':1' (the one-warpgroup kernels); None for any other suffix."""
  _, _, suffix = mixer.partition(":")
  if suffix in ("", "xlaconv"):
    return {}
  if len(suffix) > 1 and suffix.isalpha():   # letters together (e.g. 'kf'): each its own field, once
    parts = [kernel_options(f"_:{letter}") for letter in suffix]
    if any(p is None for p in parts) or len({f for p in parts for f in p}) != sum(map(len, parts)):
      return None
    return {f: value for p in parts for f, value in p.items()}
  if suffix == "c":
    return dict(call_test=False)
  if suffix in ("o", "l", "w"):
    return dict(order_channels={"o": "op", "l": "layer", "w": "none"}[suffix])
  if suffix == "r":
    return dict(dg_cumsum="kernel")
  if suffix == "k":
    return dict(key_warpgroups=2)
  if suffix == "f":
    return dict(prep_warpgroups=2)
  if suffix == "1":
    return dict(key_warpgroups=1, prep_warpgroups=1)
  if suffix == "x":
    return dict(cumsums="xla")
  if suffix == "g":
    return dict(gate="xla")
  if suffix in ("q", "v"):
    return dict(l2_grads={"q": "kernel", "v": "xla"}[suffix])
  if suffix in ("u", "n"):
    return dict(unit_ref_bound=suffix == "u")
  match = re.fullmatch(r"([ps])([1-9][0-9]*)", suffix)
  if not match:
    return None
  field = {"p": "grads_programs", "s": "sequence_pieces"}[match.group(1)]
  return {field: int(match.group(2))}


def _build(mixer: str, *, width: int, heads: int, impl: str, dtype):
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


def run_one(mixer: str, x, f):
  """The row of one mixer at the batch and length of `x` (an error is reported, not dropped)."""
  t0 = time.perf_counter()
  try:
    fn, params = step_fn(build(mixer, width=f.width, heads=f.heads, impl=f.impl, dtype=x.dtype))
    with common.kernel_config(**kernel_options(mixer)):  # the kernels are chosen when fn is traced
      jax.block_until_ready(fn(params, x))
    compile_s = time.perf_counter() - t0
    single, streamed = time_it(fn, (params, x), iters=f.iters, stream=f.stream)
    return dict(mixer=mixer, B=x.shape[0], T=x.shape[1], single_ms=single, stream_ms=streamed,
                compile_s=compile_s)
  except Exception as e:  # a mixer that cannot run here says why
    return dict(mixer=mixer, B=x.shape[0], T=x.shape[1], error=f"{type(e).__name__}: {str(e)[:300]}")


def table(rows, f, dtype, device) -> list[str]:
  lines = [f"Layer fwd+bwd, width {f.width}, {f.heads} heads, {dtype.name}, impl={f.impl}, {device}", "",
           "| mixer | B, T | single ms | stream ms | / A (single, stream) | compile s |",
           "| --- | --- | --- | --- | --- | --- |"]
  for r in rows:
    shape = f"{r['B']}, {r['T']}"
    if "error" in r:
      lines.append(f"| {r['mixer']} | {shape} | {r['error']} | | | |")
      continue
    anchor = next((a for a in rows if a["mixer"] == "A" and a["T"] == r["T"] and "error" not in a), None)
    ratio = (f"{r['single_ms'] / anchor['single_ms']:.2f}, {r['stream_ms'] / anchor['stream_ms']:.2f}"
             if anchor else "-")
    lines.append(f"| {r['mixer']} | {shape} | {r['single_ms']:.3f} | {r['stream_ms']:.3f} | {ratio} | "
                 f"{r['compile_s']:.1f} |")
  return lines


def crossover(rows, mixer: str):
  """The smallest T of the sweep from which `mixer`'s stream time is at most attention's at every
  longer T (None: never)."""
  Ts = sorted({r["T"] for r in rows})
  time_of = lambda m, T: next((r["stream_ms"] for r in rows if r["mixer"] == m and r["T"] == T
                               and "error" not in r), None)
  best = None
  for T in reversed(Ts):
    a, m = time_of("A", T), time_of(mixer, T)
    if a is None or m is None or m > a:
      break
    best = T
  return best


def plot(rows, path: str):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  for mixer in dict.fromkeys(r["mixer"] for r in rows):
    pts = sorted((r["T"], 1e3 * r["stream_ms"] / (r["B"] * r["T"])) for r in rows
                 if r["mixer"] == mixer and "error" not in r)
    if pts:
      since = None if mixer == "A" else crossover(rows, mixer)
      label = mixer if mixer == "A" else f"{mixer}: " + (f"<= A from T = {since}" if since else "> A")
      ax.plot(*zip(*pts), marker="o", label=label, lw=2.5 if mixer == "A" else 1.5)
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("T (tokens per sequence; B = token budget / T)")
  ax.set_ylabel("fwd+bwd time per token (us)")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write(rows, f, dtype, Ts, device=None) -> list[str]:
  """Writes layers.json, layers.md (and, for a sweep, layers.png) from the rows so far."""
  device = device or jax.devices()[0].device_kind
  lines = table(rows, f, dtype, device)
  if len(Ts) > 1:
    lines += ["", "From which T each mixer is at most softmax attention's time (stream), through the "
              "longest T timed:", ""]
    lines += [f"- {m}: {crossover(rows, m) or 'not within the sweep'}" for m in f.mixers if m != "A"]
  os.makedirs(f.workdir, exist_ok=True)
  with open(os.path.join(f.workdir, "layers.json"), "w") as fh:
    json.dump(dict(width=f.width, heads=f.heads, impl=f.impl, dtype=dtype.name,
                   device=device, rows=rows), fh, indent=1)
  with open(os.path.join(f.workdir, "layers.md"), "w") as fh:
    fh.write("\n".join(lines) + "\n")
  if len(Ts) > 1 and len({r["T"] for r in rows}) > 1:
    plot(rows, os.path.join(f.workdir, "layers.png"))
  return lines


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  dtype = jnp.dtype(f.dtype)
  if f.rows_from:  # a sweep measured over several processes: one table and plot of their rows
    rows, devices = [], set()
    for path in f.rows_from:
      with open(path) as fh:
        run = json.load(fh)
      for key in ("width", "heads", "impl", "dtype"):
        if str(run[key]) != str(getattr(f, key)):
          raise ValueError(f"rows_from: {path} has {key}={run[key]!r}, not --{key}={getattr(f, key)!r}")
      rows += run["rows"]
      devices.add(run["device"])
    Ts = sorted({r["T"] for r in rows})
    f.mixers = list(dict.fromkeys(r["mixer"] for r in rows))
    print("\n".join(write(rows, f, dtype, Ts, device=" + ".join(sorted(devices)))))
    print(f"wrote {os.path.join(f.workdir, 'layers.json')}")
    return
  Ts = [int(t) for t in f.T]
  rows = []
  for T in Ts:
    B = f.B if len(Ts) == 1 and not f.tokens else max(1, (f.tokens or f.B * T) // T)
    x = jax.random.normal(jax.random.key(0), (B, T, f.width), jnp.float32).astype(dtype)
    for mixer in f.mixers:
      rows.append(run_one(mixer, x, f))
      print(json.dumps(rows[-1]), flush=True)
      write(rows, f, dtype, Ts)  # after every row: a run cut short keeps what it measured
    del x
  print("\n".join(write(rows, f, dtype, Ts)))
  print(f"wrote {os.path.join(f.workdir, 'layers.json')}")


if __name__ == "__main__":
  flags.DEFINE_list("mixers", ["A", "G", "K", "Kb"], f"Mixers to time: {MIXERS}.")
  flags.DEFINE_integer("B", 8, "Batch.")
  flags.DEFINE_list("T", ["4096"], "Sequence length(s); several make a sweep (with --tokens).")
  flags.DEFINE_integer("tokens", 0, "Token budget per call of a sweep: B = tokens / T (0: B * T of --B).")
  flags.DEFINE_integer("width", 1024, "Model width.")
  flags.DEFINE_integer("heads", 8, "Heads (K = width / heads).")
  flags.DEFINE_string("impl", "auto", "impl= of the linear mixers.")
  flags.DEFINE_string("dtype", "bfloat16", "Compute dtype (parameters float32).")
  flags.DEFINE_integer("iters", 5, "Timed rounds; medians reported.")
  flags.DEFINE_integer("stream", 10, "Calls issued back to back in each round's second timing.")
  flags.DEFINE_list("rows_from", [], "layers.json files of earlier runs (each T's anchor in its own "
                    "process): write their rows' table and plot, timing nothing.")
  flags.DEFINE_string("workdir", "runs/layer_benchmark", "Where layers.json and layers.md go.")
  app.run(main)
