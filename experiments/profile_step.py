"""Where each millisecond of a layer's or an LM's training step goes: a device trace
(`jax.profiler`), its kernels summed per call and attributed to the source line of the compiled HLO
instruction that launched them.

    python experiments/profile_step.py --mixers=A,G --seq_len=4096 --tokens=32768 --impl=pallas
    python experiments/profile_step.py --mixers= --patterns=A,G --seq_len=4096 --tokens=32768 \
        --width=1024 --depth=4 --num_heads=8 --impl=pallas

Layers and LMs share the shape flags (sharded_throughput.py's model flags): the layers see
`x [tokens / seq_len, seq_len, width]` with `num_heads` heads; the LMs train at batch `tokens / seq_len`.

For each target: one compiling call, `--warmup` calls, then `--calls` traced calls back to back. An LM
trains through all of them as train.py would over a run of that many steps (its learning-rate schedule
spans them, each step takes the next batch of the data), so `--warmup=40` profiles the step of a model
trained 40 steps: a KDA LM's per-channel kernels choose their forms from the gates training moved. Every
device kernel of the trace is matched to its HLO instruction (the trace's `hlo_op`, or the kernel's own
name when XLA names the kernel after its fusion) and so to the `source_file:source_line` and the
`op_name` that the compiled module's metadata gives that instruction. Reported per target:

- kernel time per call (the sum of the kernels' durations; gaps between kernels are not in it) next to
  the wall time per call of the same calls, and the device's timeline: the span from the first kernel
  to the last, the time with a kernel running, the idle gaps between kernels and the longest of them
  (a wall time above the span is dispatch and host time the device never saw), of the idle time what
  lies in short gaps (at most `SHORT_GAP_US`: one kernel's launch after another's), and the host's time
  issuing a call's work, recording XLA's command buffers and launching them;
- what the compiled step's entry computation launches (`launches`), by kind;
- that time by part of the step (`PARTS`: the Mosaic kernels, cuDNN attention, the gemms, the short
  convolutions, the norms, ...), from each kernel's name and source line;
- the time of each source line (the innermost frame in this project's code), forward and backward apart (an `op_name` holding `transpose(` is the
  backward), largest first;
- the largest kernels by name.

Writes `{workdir}/profile.md`, `profile.json` (the rows) and, with `--keep_traces`, each target's trace
and HLO text as `trace_{target}.json.gz` / `hlo_{target}.txt`.
"""

from __future__ import annotations

import collections
import glob
import gzip
import itertools
import json
import os
import re
import shutil
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a file: put the repository root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
from absl import app, flags

from experiments import common, data, layer_benchmark, sharded_throughput, train
from linear_attention_jax.pallas_kernels.gpu import shared_compiles

FLAGS = flags.FLAGS

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s")
_METADATA = re.compile(r"metadata=\{([^}]*)\}")
_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')
_TABLE_ROW = re.compile(r'^(\d+) (?:"(.*)"|\{(.*)\})$')
_PROJECT = ("linear_attention_jax/", "pallas_kernels/", "experiments/")


def _tables(hlo_text: str) -> dict[str, dict[int, object]]:
  """The module's `FileNames`, `FunctionNames`, `FileLocations` and `StackFrames` tables."""
  tables, current = {}, None
  for line in hlo_text.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      current = tables.setdefault(line, {})
      continue
    m = _TABLE_ROW.match(line) if current is not None else None
    if not m:
      current = None
      continue
    current[int(m.group(1))] = (m.group(2) if m.group(2) is not None else
                                {k: int(v) for k, v in _FIELD.findall(m.group(3)) if v.lstrip("-").isdigit()})
  return tables


def _short(path: str) -> str:
  for marker in _PROJECT + ("site-packages/",):
    if marker in path:
      return marker + path.split(marker, 1)[1]
  return path


def hlo_sources(hlo_text: str) -> dict[str, dict]:
  """HLO instruction name -> `op_name` and `where`: the innermost frame of this project's code, `file:line
  (function)`, else the innermost frame (a flax `Linear.__call__`: a projection). The compiled text's
  stack frames carry no parents that can be followed, so one frame is all a kernel gets."""
  t = _tables(hlo_text)
  files, funcs = t.get("FileNames", {}), t.get("FunctionNames", {})
  locs, frames = t.get("FileLocations", {}), t.get("StackFrames", {})

  def stack(frame_id):  # innermost first
    out, seen = [], set()
    while frame_id in frames and frame_id not in seen:
      seen.add(frame_id)
      loc = locs.get(frames[frame_id].get("file_location_id"), {})
      out.append((_short(files.get(loc.get("file_name_id"), "?")), loc.get("line", 0),
                  funcs.get(loc.get("function_name_id"), "?")))
      frame_id = frames[frame_id].get("parent_frame_id")
    return out

  out = {}
  for line in hlo_text.splitlines():
    m = _INSTR.match(line)
    if not m:
      continue
    # an instruction the compiler added (a copy, a wrapped reduction) carries no metadata: no source
    md = _METADATA.search(line)
    fields = {k: v.strip('"') for k, v in _FIELD.findall(md.group(1))} if md else {}
    if "stack_frame_id" in fields and fields["stack_frame_id"].isdigit():
      frames_ = stack(int(fields["stack_frame_id"]))
    elif "source_file" in fields:
      frames_ = [(_short(fields["source_file"]), int(fields.get("source_line", 0) or 0), "?")]
    else:
      frames_ = []
    ours = [f for f in frames_ if f[0].startswith(_PROJECT[:2])]
    where = ours[0] if ours else (frames_[0] if frames_ else None)
    fmt = lambda f: "(no source)" if f is None else f"{f[0]}:{f[1]} ({f[2]})"
    # a kernel is named after its instruction with '.' and '-' as '_' (a command buffer's kernels
    # carry no other name of their instruction)
    out[re.sub(r"[.\-]", "_", m.group(1))] = out[m.group(1)] = dict(op_name=fields.get("op_name", ""),
                                                                   where=fmt(where))
  return out


def source_of(meta: dict) -> tuple[str, str]:
  """`(where, direction)` of an instruction: its frame (`hlo_sources`) and fwd/bwd."""
  return meta["where"], "bwd" if "transpose(" in meta["op_name"] else "fwd"


def device_kernels(trace: dict) -> list[dict]:
  """The trace's device kernel events (`ph == "X"` on a process named after a GPU or TPU)."""
  names = {e["pid"]: e.get("args", {}).get("name", "") for e in trace.get("traceEvents", [])
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  devices = {pid for pid, n in names.items() if re.search(r"/device:(GPU|TPU)", n)}
  if not devices:  # the CPU backend: its thunks, named after their HLO instructions
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e
            and e.get("args", {}).get("hlo_op")]
  return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("pid") in devices
          and "dur" in e]


# (part, test on the kernel's name and source line), first match wins; the rest is "other"
PARTS = (   # the first part that matches a kernel takes it
    ("short convolutions", lambda name, where: "short_conv" in name or "layers/conv.py" in where
     or "pallas_kernels/gpu/conv.py" in where),
    ("Mosaic GPU kernels", lambda name, where: "mosaic_gpu" in name),
    ("cuDNN attention", lambda name, where: "cudnn" in name or "sdpa" in name),
    ("gemms (projections, MLPs, head)", lambda name, where: name.startswith(("nvjet", "gemm_fusion",
                                                                             "cutlass", "sm90_xmma"))
     or "nn/linear.py" in where),
    ("block RMSNorms", lambda name, where: "nnx/nn/normalization.py" in where),
    ("mixer output norms", lambda name, where: "layers/norm.py" in where),
    ("rotary embedding", lambda name, where: "layers/rope.py" in where),
    ("MLP elementwise", lambda name, where: "layers/mlp.py" in where),
    ("kernel glue (XLA around the kernels)", lambda name, where: "pallas_kernels/" in where),
    ("XLA chunked form and ops", lambda name, where: "linear_attention_jax/ops/" in where),
    ("mixer gates", lambda name, where: where.startswith("linear_attention_jax/layers/")
     and "gates" in where),
    ("optimizer", lambda name, where: "optax/" in where and "losses" not in where),
    ("embedding, head, loss", lambda name, where: any(s in where for s in (
        "layers/embed.py", "models/lm.py", "optax/losses", "experiments/train.py")))
)


def part_of(name: str, where: str) -> str:
  """The part of a step a kernel belongs to (`PARTS`), from its name and source line."""
  return next((part for part, test in PARTS if test(name, where)), "other")


def timeline(kernels: list[dict], calls: int) -> dict:
  """How the device spent the traced calls: `span_ms` a call from the first kernel's start to the last
  one's end, `busy_ms` a call with at least one kernel running (overlapping kernels counted once),
  `idle_ms` = span - busy, and the longest idle interval with the kernel that ended it. A wall time
  per call above the span is time the device did not see (dispatch before the first kernel, the host
  between calls); idle inside the span is gaps between kernels."""
  spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]) for e in kernels)
  if not spans:
    return dict(span_ms=0.0, busy_ms=0.0, idle_ms=0.0, longest_idle_ms=0.0, longest_idle_before="")
  busy, longest, before, short, shorts = 0.0, 0.0, "", 0.0, 0
  start, end = spans[0][0], spans[0][1]
  for s, e, name in spans[1:]:
    if s > end:   # an idle interval: close the running busy interval
      if s - end > longest:
        longest, before = s - end, name
      if s - end <= SHORT_GAP_US:
        short, shorts = short + s - end, shorts + 1
      busy += end - start
      start = s
    end = max(end, e)
  busy += end - start
  span = end - spans[0][0]
  per_call = lambda us: us / 1e3 / calls
  return dict(span_ms=per_call(span), busy_ms=per_call(busy), idle_ms=per_call(span - busy),
              longest_idle_ms=longest / 1e3, longest_idle_before=before[:80],
              short_gaps_ms=per_call(short), short_gaps=shorts / calls)


SHORT_GAP_US = 50.0   # a gap between kernels up to this long: a launch's, not the host falling behind


def launches(hlo_text: str) -> dict:
  """What the compiled step's entry computation launches: `launched`, its instructions that run as
  kernels (parameters, tuples and the like left out), and `launched_kinds` by kind (a fusion, a gemm's or
  another custom call's target, a copy, ...). Which of them XLA then records into command buffers
  (CUDA graphs) is decided on its thunks, not in this text (the host side's `command_buffer` times
  show they are there)."""
  entry, depth = [], 0
  for line in hlo_text.splitlines():
    if not depth and line.startswith("ENTRY"):
      depth = 1
      continue
    if depth:
      if line.strip() == "}":
        break
      entry.append(line)
  kinds = collections.Counter()
  for line in entry:
    m = _OPCODE.search(line)
    if not m or m.group(1) in _NOT_LAUNCHED:
      continue
    op = m.group(1)
    target = re.search(r'custom_call_target="([^"]+)"', line)
    kinds[f"custom-call {target.group(1)}" if op == "custom-call" and target else op] += 1
  return dict(launched=sum(kinds.values()), launched_kinds=dict(kinds.most_common(12)))


_OPCODE = re.compile(r"=\s.*?\s([a-z][a-z0-9-]*)\(")
_NOT_LAUNCHED = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
                 "opt-barrier", "partition-id", "replica-id", "add-dependency"}


# the host's side of a call, from XLA's own trace annotations (absent on other backends: 0)
HOST_EVENTS = (("host_execute_ms", "ExecuteThunks"), ("host_command_buffer_update_ms", "command_buffer::update"),
               ("host_command_buffer_launch_ms", "command_buffer::execute"))


def host_side(trace: dict, calls: int) -> dict:
  """Per call, the host's time in XLA's `ExecuteThunks` (issuing the call's work), and within it in
  recording (`command_buffer::update`) and launching (`command_buffer::execute`) XLA's command buffers
  (CUDA graphs): a command buffer whose buffers moved is recorded again before its launch, custom calls
  (the Mosaic GPU kernels) included."""
  events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
  return {key: sum(float(e["dur"]) for e in events if e.get("name", "").endswith(suffix)) / 1e3 / calls
          for key, suffix in HOST_EVENTS}


def summarize(trace: dict, hlo_text: str, calls: int, top: int) -> dict:
  """Kernel time per call, by source line and by kernel name (module docstring), the device's
  timeline (`timeline`) and the host's side (`host_side`)."""
  meta = hlo_sources(hlo_text)
  kernels = device_kernels(trace)
  by_line, by_part = collections.Counter(), collections.Counter()
  by_name, unmatched = collections.Counter(), collections.Counter()
  total = 0.0
  for e in kernels:
    args = e.get("args", {})
    key = next((c for c in (args.get("hlo_op"), e["name"], e["name"].removeprefix("wrapped_"))
                if c in meta), None)
    dur = float(e["dur"]) / 1e3 / calls  # us -> ms per call
    total += dur
    if key is None:
      unmatched[e["name"][:80]] += dur
      where, direction = f"(kernel {e['name'][:60]})", "?"
    else:
      where, direction = source_of(meta[key])
    by_line[(where, direction)] += dur
    by_part[part_of(e["name"], where)] += dur
    by_name[e["name"][:80]] += dur
  return dict(
      kernel_ms=total, kernels_per_call=len(kernels) / calls, **timeline(kernels, calls),
      **launches(hlo_text),
      **host_side(trace, calls),
      parts=[dict(part=p, ms=ms) for p, ms in by_part.most_common()],
      lines=[dict(where=w, direction=d, ms=ms) for (w, d), ms in by_line.most_common(top)],
      kernels=[dict(name=n, ms=ms) for n, ms in by_name.most_common(top)],
      unmatched_ms=sum(unmatched.values()))


def profile(name: str, args, lower, f, *, threaded: bool = False, batch=None) -> dict:
  """Compiles `lower(*args)`, warms it up and traces its calls; returns the summary row of `name`.

  `threaded`: the call donates its first argument and returns the next one first (a train step's
  state). `batch(i)`, if given, is the second argument of call i (call 0 compiles; a train step's
  batches).
  """
  t0 = time.perf_counter()
  compiled = lower(*args).compile()   # called directly: one compile
  hlo_text = compiled.as_text()

  calls = itertools.count(1)

  def call(args):
    out = compiled(*args)
    args = (out[0],) + tuple(args[1:]) if threaded else args
    if batch is not None:
      args = (args[0], batch(next(calls))) + tuple(args[2:])
    return out, args

  out, args = call(args)
  jax.block_until_ready(out)
  compile_s = time.perf_counter() - t0
  losses = [out[1]["loss"]] if threaded else []   # a train step's (state, metrics)
  for _ in range(f.warmup):
    out, args = call(args)
    jax.block_until_ready(out)
    losses += [out[1]["loss"]] if threaded else []
  logdir = tempfile.mkdtemp(prefix="profile_step_")
  try:
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
      t0 = time.perf_counter()
      outs = []
      for _ in range(f.calls):
        out, args = call(args)
        outs.append(out[1] if threaded else out)
        losses += [out[1]["loss"]] if threaded else []
      jax.block_until_ready((outs, args))
      wall_ms = 1e3 * (time.perf_counter() - t0) / f.calls
    found = glob.glob(os.path.join(logdir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not found:
      raise RuntimeError(f"no perfetto_trace.json.gz under {logdir}")
    with gzip.open(found[0], "rt") as fh:
      trace = json.load(fh)
    if f.keep_traces:
      os.makedirs(f.workdir, exist_ok=True)
      shutil.copy(found[0], os.path.join(f.workdir, f"trace_{name}.json.gz"))
      with open(os.path.join(f.workdir, f"hlo_{name}.txt"), "w") as fh:
        fh.write(hlo_text)
  finally:
    shutil.rmtree(logdir, ignore_errors=True)
  row = dict(target=name, wall_ms=wall_ms, compile_s=compile_s, **summarize(trace, hlo_text, f.calls,
                                                                            f.top))
  if threaded:   # every call's training loss, the compiling one first
    row["losses"] = [float(x) for x in losses]
  return row


def layer_target(mixer: str, f):
  dtype = jnp.dtype(f.dtype)
  layer = layer_benchmark.build(mixer, width=f.width, heads=f.num_heads, impl=f.impl, dtype=dtype)
  fn, params = layer_benchmark.step_fn(layer)
  x = jax.random.normal(jax.random.key(0), (max(1, f.tokens // f.seq_len), f.seq_len, f.width),
                        jnp.float32).astype(dtype)
  return dict(args=(params, x), lower=fn.lower)


def lm_target(pattern: str, f):
  """train.py's jitted step of the LM `pattern`, its first (state, batch) and its later batches: a run
  of `1 + warmup + calls` steps (sharded_throughput.train_config takes `f.steps + 1`), so the
  learning-rate schedule spans the profiled calls rather than ending at the first."""
  f.pattern, f.batch_size, f.steps = pattern, max(1, f.tokens // f.seq_len), f.warmup + f.calls
  config = sharded_throughput.train_config()
  source = data.make_source(config.data)
  model_config = config.lm_config(source.vocab_size)
  setup = train.setup_training(config, model_config)
  batch = lambda i: setup.place(source.batch("train", config.data.seed, i))
  return dict(args=(setup.state, batch(0)), lower=setup.lower, threaded=True, batch=batch)


def table(row) -> list[str]:
  lines = [f"### {row['target']}: wall {row['wall_ms']:.3f} ms a call, kernels {row['kernel_ms']:.3f} ms "
           f"({row['kernels_per_call']:.0f} kernels a call; {row['unmatched_ms']:.3f} ms not matched to "
           f"HLO), compile {row['compile_s']:.1f} s", "",
           f"Device timeline a call: span {row['span_ms']:.3f} ms (first kernel's start to last one's end), "
           f"busy {row['busy_ms']:.3f}, idle between kernels {row['idle_ms']:.3f} (longest "
           f"{row['longest_idle_ms']:.3f} ms, before `{row['longest_idle_before']}`); the wall's "
           f"{max(row['wall_ms'] - row['span_ms'], 0):.3f} ms beyond the span is time the device did not see; "
           f"of the idle time {row['short_gaps_ms']:.3f} ms in {row['short_gaps']:.0f} gaps of at most "
           f"{SHORT_GAP_US:.0f} us (launches). The entry launches {row['launched']} instructions "
           f"({row['launched_kinds']}). "
           f"Host a call: {row['host_execute_ms']:.3f} ms issuing the work, of which "
           f"{row['host_command_buffer_update_ms']:.3f} recording command buffers and "
           f"{row['host_command_buffer_launch_ms']:.3f} launching them.", "",
           "| part | ms a call | share |", "| --- | --- | --- |"]
  share = lambda ms: f"{100 * ms / max(row['kernel_ms'], 1e-9):.1f}%"
  lines += [f"| {r['part']} | {r['ms']:.3f} | {share(r['ms'])} |" for r in row["parts"]]
  lines += ["", "| source line | pass | ms a call | share |", "| --- | --- | --- | --- |"]
  lines += [f"| {r['where']} | {r['direction']} | {r['ms']:.3f} | {share(r['ms'])} |" for r in row["lines"]]
  lines += ["", "| kernel | ms a call |", "| --- | --- |"]
  lines += [f"| `{r['name']}` | {r['ms']:.3f} |" for r in row["kernels"]]
  return lines + [""]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = FLAGS
  train.quiet_logs()
  if f.share_kernel_compiles and jax.default_backend() == "gpu":
    shared_compiles.enable()
  rows = []
  os.makedirs(f.workdir, exist_ok=True)
  # a suffix (layer_benchmark.kernel_options: e.g. K:o) sets the kernels' configuration while traced
  targets = [(f"layer_{m}", m, lambda m=m: layer_target(m, f)) for m in f.mixers]
  targets += [(f"lm_{p}_T{f.seq_len}", p, lambda p=p: lm_target(p.partition(":")[0], f)) for p in f.patterns]
  for name, spec, make in targets:
    try:
      options = layer_benchmark.kernel_options(spec)
      if options is None:
        raise ValueError(f"unknown suffix in {spec!r} (layer_benchmark.kernel_options)")
      # jit's caches do not key on the kernels' configuration: a target traced after another of the
      # same model would reuse its program (K:o's compiled as K's)
      jax.clear_caches()
      with common.kernel_config(**options):
        t = make()
        rows.append(profile(name, t["args"], t["lower"], f, threaded=t.get("threaded", False),
                            batch=t.get("batch")))
    except Exception as e:  # a target that cannot run here says why
      rows.append(dict(target=name, error=f"{type(e).__name__}: {str(e)[:400]}"))
    print(json.dumps({k: v for k, v in rows[-1].items() if k in ("target", "wall_ms", "kernel_ms",
                                                                   "error")}), flush=True)
    with open(os.path.join(f.workdir, "profile.json"), "w") as fh:
      json.dump(rows, fh, indent=1)
    lines = [f"Profile, {jax.devices()[0].device_kind}, jax {jax.__version__}", ""]
    for r in rows:
      lines += [f"### {r['target']}: {r['error']}", ""] if "error" in r else table(r)
    with open(os.path.join(f.workdir, "profile.md"), "w") as fh:
      fh.write("\n".join(lines))
  print(open(os.path.join(f.workdir, "profile.md")).read())
  print(f"wrote {os.path.join(f.workdir, 'profile.json')}")


def _define_flags():
  """This script's own flags, defined only when it runs (lm_benchmark.py defines --patterns, --tokens
  and --share_kernel_compiles too: importing both into one process must not collide)."""
  flags.DEFINE_list("mixers", ["A", "G"], f"Layers to profile: {layer_benchmark.MIXERS}, each with "
                    "layer_benchmark.py's suffixes (e.g. K:o).")
  flags.DEFINE_list("patterns", [], "LM patterns to profile (train.py's step, as lm_benchmark.py runs it), "
                    "each with lm_benchmark.py's suffixes (e.g. K:o).")
  flags.DEFINE_integer("tokens", 32768, "Tokens per call: batch = tokens / seq_len.")
  flags.DEFINE_bool("share_kernel_compiles", True, "Compile a Mosaic GPU kernel that several layers share "
                    "once (pallas_kernels.gpu.shared_compiles), as lm_benchmark.py can.")
  flags.DEFINE_integer("warmup", 2, "Calls after the compiling one, before the trace.")
  flags.DEFINE_integer("calls", 3, "Traced calls.")
  flags.DEFINE_integer("top", 25, "Rows of each table.")
  flags.DEFINE_bool("keep_traces", False, "Also write each target's trace and HLO text.")


if __name__ == "__main__":
  _define_flags()
  for name, value in dict(width=1024, num_heads=8, seq_len=4096, impl="pallas", dtype="bfloat16",
                          workdir="runs/profile_step").items():
    FLAGS.set_default(name, value)
  app.run(main)
