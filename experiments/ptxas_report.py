"""Registers and spills of every Mosaic GPU kernel an op compiles, from ptxas's own report.

    python experiments/ptxas_report.py --variants=kda,gated_delta_rule --gates=strong

Each variant's forward and backward (`jax.grad` of `sum(o^2)`, `impl="pallas"`) is compiled and run
once at a small shape, in a child process started with `MOSAIC_GPU_DUMP_PTXAS=1`: ptxas then prints,
for every kernel it assembles, the registers a thread uses, the bytes it spills to local memory
(stores and loads), its stack frame and its own compile time. The parent reads that report and
tabulates it per variant and kernel. Which kernels compile follows the gates: `--gates=strong` (beyond
one reference) compiles the per-channel kernels that choose a form per chunk beside the
one-reference ones; `--gates=benchmark` compiles the same set (the call-wide test's two branches).

A kernel at 255 registers that spills is where a change to its body can cost or save most: kda's
per-chunk key side spilled 5,256 bytes before NOTES.md v56 and 2,396 after, and ran 28% faster in a
trained LM. To compare two trees, run the script in each.

Needs a CUDA GPU (Mosaic GPU compiles there). Writes `{workdir}/ptxas.json` and `ptxas.md`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

if __package__ in (None, ""):  # run as a file: put the repository root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
from absl import app, flags

from experiments import common

FLAGS = flags.FLAGS
SUFFIX = "_mosaic_gpu_kernel"

_FUNCTION = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_TIME = re.compile(r"Compile time = ([\d.]+) ms")


def parse(text: str) -> list[dict]:
  """ptxas's `-v` report -> one row per kernel it assembled, in order: `kernel` (its name without
  `_mosaic_gpu_kernel`), `registers`, `spill_stores`, `spill_loads`, `stack_bytes` and `ptxas_ms`
  (None where the report gives none). A kernel assembled twice with the same numbers is one row; with
  other numbers (another specialisation) its later rows are named `name#2`, `name#3`, ..."""
  rows, row = [], None
  for line in text.splitlines():
    if m := _FUNCTION.search(line):
      row = dict(kernel=m.group(1).removesuffix(SUFFIX), registers=None, spill_stores=None,
                 spill_loads=None, stack_bytes=None, ptxas_ms=None)
      rows.append(row)
    elif row is None:
      continue
    elif m := _FRAME.search(line):
      row.update(stack_bytes=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
    elif m := _USED.search(line):
      row["registers"] = int(m.group(1))
    elif m := _TIME.search(line):
      row["ptxas_ms"] = float(m.group(1))
      row = None
  numbers = lambda r: tuple(v for k, v in r.items() if k not in ("kernel", "ptxas_ms"))
  out, seen = [], {}
  for r in rows:
    kept = seen.setdefault(r["kernel"], [])
    if any(numbers(r) == numbers(k) for k in kept):
      continue
    kept.append(r)
    out.append(dict(r, kernel=r["kernel"] + (f"#{len(kept)}" if len(kept) > 1 else "")))
  return out


def render(results: dict) -> str:
  lines = [f"# ptxas: registers and spills, {results['device']}, jax {results['jax']}", "",
           f"Shape {results['shape']}, gates {results['gates']}, {results['dtype']}; forward and backward.", ""]
  for variant, rows in results["variants"].items():
    lines += [f"## {variant}", ""]
    if isinstance(rows, str):
      lines += [f"error: {rows}", ""]
      continue
    lines += ["| kernel | registers | spill stores B | spill loads B | stack B | ptxas ms |",
              "| --- | --- | --- | --- | --- | --- |"]
    fmt = lambda x: "-" if x is None else f"{x:,}" if isinstance(x, int) else f"{x:.0f}"
    lines += [f"| `{r['kernel']}` | {fmt(r['registers'])} | {fmt(r['spill_stores'])} | "
              f"{fmt(r['spill_loads'])} | {fmt(r['stack_bytes'])} | {fmt(r['ptxas_ms'])} |" for r in rows]
    lines.append("")
  return "\n".join(lines)


def compile_once(variant: str) -> None:
  """The child: `variant`'s forward and backward at the flags' shape, compiled and run once."""
  grads, args = common.op_gradient(variant, FLAGS)
  with common.kernel_config(**common.suffix_options(FLAGS.kernels)):   # chosen as the call traces
    jax.block_until_ready(jax.jit(grads)(*args))


def main(argv):
  del argv
  f = FLAGS
  variants = common.check_variants(f.variants)
  if f.child:
    compile_once(variants[0])
    return
  if jax.default_backend() != "gpu":
    raise app.UsageError(f"ptxas_report.py needs a CUDA GPU (Mosaic GPU compiles there); the backend "
                         f"here is {jax.default_backend()!r}")
  results = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                 shape=dict(B=f.B, T=f.T, H=f.H, K=f.K, V=f.V), gates=f.gates, dtype=f.dtype,
                 kernels=f.kernels, variants={})
  os.makedirs(f.workdir, exist_ok=True)
  for variant in variants:
    flag_args = [f"--{name}={getattr(f, name)}"
                 for name in ("B", "T", "H", "K", "V", "gates", "dtype", "kernels")]
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", f"--variants={variant}",
                           *flag_args], capture_output=True, text=True, timeout=f.timeout,
                          env=dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1"))
    text = done.stdout + "\n" + done.stderr
    rows = parse(text)
    if done.returncode != 0 or not rows:
      results["variants"][variant] = f"exit {done.returncode}, {len(rows)} kernels: {text[-600:]}"
    else:
      results["variants"][variant] = rows
    print(variant, json.dumps(results["variants"][variant])[:2000], flush=True)
    common.write_json(f.workdir, "ptxas.json", results)
  with open(os.path.join(f.workdir, "ptxas.md"), "w", encoding="utf-8") as out:
    out.write(render(results))
  print(f"wrote {os.path.join(f.workdir, 'ptxas.md')}")


def _define_flags():
  """The script's flags, defined when it runs (importing its functions defines none: several scripts
  share flag names)."""
  common.define_op_flags(["kda", "gated_delta_rule"], B=1, T=256, H=1, gates="strong",
                         T_help="Sequence length (the kernels' code does not depend on it).")
  flags.DEFINE_integer("timeout", 600, "Seconds a variant's compile may take.")
  flags.DEFINE_string("kernels", "", "The GPU kernels' configuration: a suffix of layer_benchmark's mixers "
                      "without its colon (e.g. k: kda's key side on two warpgroups); empty: the defaults.")
  flags.DEFINE_bool("child", False, "Internal: compile the one variant of --variants and exit.")
  flags.DEFINE_string("workdir", "runs/ptxas_report", "Where ptxas.json and ptxas.md go.")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
