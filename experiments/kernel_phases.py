"""Where a Mosaic GPU kernel's program spends its cycles, phase by phase: the kernels' `tiles.phase`
scopes timed on the device by Mosaic GPU's on-device profiler (`tiles.phase_trace`), one op's forward
and backward at a layer's shapes.

    python experiments/kernel_phases.py --variants=gated_delta_rule,kda --B=8 --T=4096 --H=8 --K=128 \
        --V=128 --gates=layer

Every program's warpgroups record the SM clock where each phase starts and ends; each kernel call
writes one Chrome trace (kept with `--keep_traces`). Per kernel and phase the tables give the mean
cycles a warpgroup spends in it (`cycles`), its share of the mean program (from the warpgroup's first
record to its last), and the 90th percentile. `outside` is the program's cycles in no phase (the
copies issued before the first phase, the code between phases). The programs' start times (the
device's ns timer) give each kernel's span and each SM's programs a second measure: `program ns` is
the median gap between two programs' starts on one SM, which with one program a multiprocessor at a
time is a program's time; `ns / cycle` compares it with the cycles. After the traced call the op runs
compiled without the records, back to back for 2 s, while `nvidia-smi` samples the SM clock: at that
clock a program's records span `span us`, and for a kernel of one program an SM at a time, the gap
between that and `program ns` is what a program costs outside its phases (its start, its end, the next
one's launch). The records cost a few cycles each (the profiler subtracts its own estimate). Only kernels with phases (the delta family's
preparation and pair gradients, kda's preparation and key side) are reported.

Needs a Hopper GPU. Writes `{workdir}/phases.json` and `phases.md`.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

if __package__ in (None, ""):  # run as a file: put the repository root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
from absl import app, flags

from experiments import common
from linear_attention_jax.pallas_kernels.gpu import tiles

FLAGS = flags.FLAGS


def read_trace(path: str):
  """`(kernel, programs)` of one Chrome trace: `kernel` the prefix of its phase names (`pair.r_u` ->
  "pair") or None without phases, `programs` a list of `(sm, start_ns, phases)` per warpgroup with
  `phases` a list of `(name, cycles)` of its outermost records, in order, and the record's span."""
  with open(path, encoding="utf-8") as f:
    events = json.load(f)["traceEvents"]
  by_trace = collections.OrderedDict()
  for e in events:
    by_trace.setdefault((e["pid"], e["tid"]), []).append(e)
  kernel, programs = None, []
  for (sm, _), evs in by_trace.items():
    if not evs:
      continue
    open_, phases = [], []
    start_ts = evs[0]["ts"]
    for e in evs:
      if e["ph"] == "B":
        open_.append(e)
      else:
        begin = open_.pop()
        if not open_:   # outermost only: a phase's nested records (its products' scopes) are inside it
          phases.append((begin["name"], (e["ts"] - begin["ts"]) * 1e3))
    span = (evs[-1]["ts"] - start_ts) * 1e3
    named = [e["name"] for e in evs if "." in e["name"]]   # the profiler's own records ("Init") have none
    kernel = kernel or (named[0].split(".")[0] if named else None)
    programs.append((sm, start_ts * 1e3, phases, span))
  return kernel, programs


SAME_PROGRAM_NS = 500   # warpgroups of one SM starting closer than this are one program's


def _programs_started(starts_ns):
  """The sorted start times of the programs of one SM from its warpgroups' start times."""
  out = []
  for t in sorted(starts_ns):
    if not out or t - out[-1] > SAME_PROGRAM_NS:
      out.append(t)
  return out


def summarise(programs) -> dict:
  """Per phase: mean and 90th percentile cycles a warpgroup, share of the mean span; the programs'
  time from their start times on each SM."""
  per_phase = collections.defaultdict(list)
  spans, inside = [], []
  for _, _, phases, span in programs:
    spans.append(span)
    inside.append(sum(c for _, c in phases))
    totals = collections.defaultdict(float)
    for name, cycles in phases:
      totals[name] += cycles
    for name, cycles in totals.items():
      per_phase[name].append(cycles)
  mean_span = float(np.mean(spans))
  order = []
  for _, _, phases, _ in programs[:1]:
    order = list(dict.fromkeys(name for name, _ in phases))
  order += sorted(set(per_phase) - set(order))
  rows = [dict(phase=name, cycles=float(np.mean(per_phase[name])),
               p90=float(np.percentile(per_phase[name], 90)),
               share=float(np.mean(per_phase[name])) / mean_span) for name in order]
  rows.append(dict(phase="outside", cycles=mean_span - float(np.mean(inside)),
                   p90=float(np.percentile(np.array(spans) - np.array(inside), 90)),
                   share=1.0 - float(np.mean(inside)) / mean_span))
  starts = collections.defaultdict(list)
  for sm, start_ns, _, _ in programs:
    starts[sm].append(start_ns)
  # a program's warpgroups start within a few ns of each other: one start a program
  starts = {sm: _programs_started(s) for sm, s in starts.items()}
  gaps = [b - a for s in starts.values() for a, b in zip(s, s[1:])]
  all_starts = [s for v in starts.values() for s in v]
  program_ns = float(np.median(gaps)) if gaps else float("nan")
  return dict(rows=rows, programs=len(all_starts),
              warpgroup_traces=len(programs), mean_span_cycles=mean_span, sms=len(starts),
              program_ns=program_ns, ns_per_cycle=program_ns / mean_span,
              start_spread_us=(max(all_starts) - min(all_starts)) / 1e3)


def parse_clock_mhz(text: str) -> float | None:
  """The median of the SM clocks (MHz) in `nvidia-smi --query-gpu=clocks.sm --format=csv,noheader,
  nounits` output (one line a sample), or None without any."""
  values = [float(line) for line in text.split() if line.replace(".", "", 1).isdigit()]
  return float(np.median(values)) if values else None


def sm_clock_mhz(fn, seconds: float = 2.0) -> float | None:
  """The SM clock (MHz, median of `nvidia-smi` samples every 0.1 s) while `fn()` runs back to back for
  `seconds`; None where nvidia-smi is not there."""
  if shutil.which("nvidia-smi") is None:
    return None
  samples, done = [], threading.Event()

  def sample():
    while not done.is_set():
      out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, check=False).stdout
      samples.append(out.strip().splitlines()[0] if out.strip() else "")
      done.wait(0.1)

  thread = threading.Thread(target=sample, daemon=True)
  jax.block_until_ready(fn())
  thread.start()
  end = time.perf_counter() + seconds
  while time.perf_counter() < end:
    jax.block_until_ready(fn())
  done.set()
  thread.join()
  return parse_clock_mhz("\n".join(samples))


def trace_op(variant: str, directory: str) -> float | None:
  """Runs `variant`'s forward and backward once under `tiles.phase_trace(directory)`; then, compiled
  without the records, back to back for 2 s while the SM clock is sampled. Returns the clock (MHz)."""
  grads, args = common.op_gradient(variant, FLAGS)
  with common.kernel_config(**common.suffix_options(FLAGS.kernels)):   # chosen as the calls trace
    with tiles.phase_trace(directory, ranges=FLAGS.ranges):
      jax.block_until_ready(jax.jit(grads)(*args))
      jax.effects_barrier()   # the traces are written by host callbacks
    plain = jax.jit(lambda *a: grads(*a))   # a new trace, without the records
    return sm_clock_mhz(lambda: plain(*args))


def render(results: dict) -> str:
  lines = [f"# Kernel phases, {jax.devices()[0].device_kind}, jax {jax.__version__}", ""]
  for variant, kernels in results["variants"].items():
    for kernel, s in kernels.items():
      lines += [f"## {variant}: `{kernel}` ({s['programs']} programs on {s['sms']} SMs, "
                f"{s['warpgroup_traces']} warpgroup traces)", "",
                f"mean program {s['mean_span_cycles']:.0f} cycles; programs start {s['program_ns']:.0f} ns "
                f"apart on one SM ({s['ns_per_cycle']:.3f} ns a cycle); starts spread over "
                f"{s['start_spread_us']:.1f} us" + ("" if s.get("span_us") is None else
                f"; at the sampled SM clock a program's records span {s['span_us']:.2f} us"), "",
                "| phase | cycles | share | p90 |", "| --- | --- | --- | --- |"]
      lines += [f"| {r['phase']} | {r['cycles']:.0f} | {100 * r['share']:.1f}% | {r['p90']:.0f} |"
                for r in s["rows"]]
      lines.append("")
  return "\n".join(lines)


def main(argv):
  del argv
  f = FLAGS
  common.check_variants(f.variants)
  results = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                 shape=dict(B=f.B, T=f.T, H=f.H, K=f.K, V=f.V), gates=f.gates, dtype=f.dtype,
                 kernels=f.kernels, variants={})
  for variant in f.variants:
    directory = tempfile.mkdtemp(prefix=f"phases_{variant}_")
    clock = trace_op(variant, directory)
    results.setdefault("clock_mhz", {})[variant] = clock
    kernels = {}
    for path in sorted(glob.glob(os.path.join(directory, "*-trace.json"))):
      kernel, programs = read_trace(path)
      if kernel is None:
        continue
      while kernel in kernels:   # a kernel called twice (e.g. the forward's and the backward's)
        kernel += "'"
      kernels[kernel] = summarise(programs)
      kernels[kernel]["span_us"] = None if clock is None else kernels[kernel]["mean_span_cycles"] / clock
      print(variant, kernel, json.dumps(kernels[kernel]["rows"]), flush=True)
    results["variants"][variant] = kernels
    if f.keep_traces:
      shutil.copytree(directory, os.path.join(f.workdir, f"traces_{variant}"), dirs_exist_ok=True)
    shutil.rmtree(directory, ignore_errors=True)
    common.write_json(f.workdir, "phases.json", results)
  with open(os.path.join(f.workdir, "phases.md"), "w", encoding="utf-8") as out:
    out.write(render(results))
  print(f"wrote {f.workdir}/phases.md")


def _define_flags():
  """The script's flags, defined when it runs (importing its functions defines none: several scripts
  share flag names)."""
  common.define_op_flags(["gated_delta_rule", "kda"], B=8, T=4096, H=8, gates="layer")   # the delta family
  flags.DEFINE_integer("ranges", 40, "Phases a warpgroup may record in one program (16 bytes of shared "
                       "memory each a warpgroup: the pair gradients have room for 40).")
  flags.DEFINE_bool("keep_traces", False, "Also keep every kernel call's Chrome trace.")
  flags.DEFINE_string("kernels", "", "The GPU kernels' configuration: a suffix of layer_benchmark's mixers "
                      "without its colon (e.g. kf: kda's key side and preparation on two warpgroups).")
  flags.DEFINE_string("workdir", "runs/kernel_phases", "Where phases.json and phases.md go.")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
