"""Benchmark: time each variant's implementations against peers and softmax attention, in one run.

For every shape `(B, T, H, K)` (V = K, H_v = H) and variant, times the forward pass (o) and the forward
plus backward pass (`jax.grad` of `sum(o.astype(f32) * do)` with respect to every float input) of each
`--impls`, of each peer (`jla`: jax-linear-attention's implementations, when it is installed) and of
causal softmax attention (`jax.nn.dot_product_attention`, cuDNN on GPU). Inputs follow
shared/BENCHMARKS.md (experiments/common.py). Every contender is jitted and compiled, warmed up, then
timed interleaved (iteration outer, contender inner) so drift hits all alike. The table gives the
median milliseconds and the ratio to `--anchor` (median / anchor's median, same variant, shape and mode;
> 1 is slower), the time as a multiple of the row's roofline floor (`--roofline`: ceilings measured in
the same run, experiments/roofline.py), XLA's scratch memory and the device's peak memory (None on
CPU). Writes
`{workdir}/benchmark.json`, and `{workdir}/benchmark.png` with `--plot`.

Example:
  python experiments/benchmark.py --shapes="4,8192,16,128;1,32768,16,128" --iters=20
  python experiments/benchmark.py --shapes=4,8192,16,128 --jla_impls=chunked,mosaic_gpu --plot
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
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

from experiments import common, roofline
from linear_attention_jax import ops

try:
  from tqdm import tqdm
except ImportError:  # tqdm is optional (setup.py's "experiments" extra)
  tqdm = None

MODES = ("fwd", "fwd_bwd")
# also on request: "fwd_bwd_state", the gradients when the final state is used too (a carried state's
# training, e.g. truncated backpropagation through time): this library's impls only
ALL_MODES = MODES + ("fwd_bwd_state",)
PEERS = ("jla",)
# Our variant -> jla's kind; variants missing here have no jla counterpart.
JLA_KINDS = {"simple_gla": "simple_gla", "gla": "gla", "delta_rule": "deltanet",
             "gated_delta_rule": "gated_deltanet", "kda": "kda"}
JLA_IMPLS = ("chunked", "mosaic_gpu", "reference")


@dataclasses.dataclass(frozen=True)
class Config:
  variants: tuple[str, ...] = ("simple_gla", "gated_delta_rule", "kda")  # from ops.VARIANTS
  impls: tuple[str, ...] = ("chunk", "recurrent")  # this library's impls to time
  shapes: tuple[tuple[int, int, int, int], ...] = ((1, 4096, 4, 64),)  # (B, T, H, K); V = K, H_v = H
  dtype: str = "bfloat16"  # q, k, v, beta dtype (float32 | bfloat16); gates are float32
  gates: str = "benchmark"  # common.GATES: the benchmark's mild gates, "layer", "bounded", "strong", ...
  modes: tuple[str, ...] = MODES  # "fwd" (o), "fwd_bwd" (gradients of every float input), "fwd_bwd_state"
  warmup: int = 2  # untimed rounds over all contenders after compilation
  iters: int = 5  # timed rounds; the median is reported
  warm_s: float | None = None  # seconds of untimed rounds before timing (at least `warmup` rounds;
  # None: 2 on a GPU, which idles at low clocks during the compiles, 0 elsewhere)
  stream: int = 0  # > 1: each round also times this many calls issued back to back (host dispatch hidden)
  chunk_size: int = 64  # chunk length for this library's and jla's chunked forms
  peers: tuple[str, ...] = PEERS  # other libraries to time when installed (rows say "not installed")
  jla_impls: tuple[str, ...] = ("chunked",)  # jla implementations: chunked, mosaic_gpu, reference
  softmax: bool = True  # also time causal softmax attention on q, k, v of each shape
  anchor: str = ""  # "" = "jla:<first jla impl>" when jla is installed, else impls[0]; or "softmax"
  seed: int = 0  # inputs for (shape, variant) come from numpy default_rng([seed, shape, variant])
  plot: bool = False  # write benchmark.png (needs matplotlib)
  roofline: bool = True  # measure the copy bandwidth and matmul rate; report each time over its floor

  def __post_init__(self):
    common.check_variants(self.variants)
    common.dtype_of(self.dtype)
    if self.stream < 0:
      raise ValueError(f"stream must be >= 0; got {self.stream}")
    bad = {"impls": [i for i in self.impls if i not in ops.IMPLS],
           "modes": [m for m in self.modes if m not in ALL_MODES] + ([] if self.modes else ["(none)"]),
           "peers": [p for p in self.peers if p not in PEERS],
           "jla_impls": [i for i in self.jla_impls if i not in JLA_IMPLS],
           "shapes": [s for s in self.shapes if len(s) != 4 or min(s) < 1]}
    for name, values in bad.items():
      if values:
        raise ValueError(f"bad {name}: {values}")
    labels = set(self.impls) | {f"jla:{i}" for i in self.jla_impls} | {"softmax"}
    if self.anchor and self.anchor not in labels:
      raise ValueError(f"anchor must be '' or one of {sorted(labels)}; got {self.anchor!r}")
    if self.warmup < 0 or self.iters < 1 or (self.warm_s is not None and self.warm_s < 0):
      raise ValueError(f"need warmup >= 0, iters >= 1 and warm_s >= 0; got {self.warmup=} "
                       f"{self.iters=} {self.warm_s=}")


def parse_shapes(text: str) -> tuple[tuple[int, int, int, int], ...]:
  """`"4,8192,16,128;1,32768,16,128"` -> `((4, 8192, 16, 128), (1, 32768, 16, 128))`."""
  return tuple(tuple(int(x) for x in part.split(",")) for part in text.split(";") if part.strip())


def import_jla():
  """`(jla.ops, version)`, or `(None, why)` when jla cannot be imported."""
  try:
    module = importlib.import_module("jla.ops")
  except ModuleNotFoundError as err:
    return None, f"not installed ({err})" if err.name in ("jla", "jla.ops") else f"import failed ({err})"
  except ImportError as err:
    return None, f"import failed ({err})"
  try:
    return module, importlib.metadata.version("jax-linear-attention")
  except importlib.metadata.PackageNotFoundError:
    return module, "unknown version"


@dataclasses.dataclass
class Contender:
  """One timed callable: `compiled(*args)`, or a row with a status saying why there is none."""
  variant: str
  shape: tuple[int, int, int, int]
  impl: str
  mode: str
  forward: object = None  # inputs dict -> o; None when status says why not
  inputs: dict | None = None
  do: jax.Array | None = None  # cotangent of o for fwd_bwd, float32
  status: str = "ok"
  compiled: object = None
  args: tuple = ()
  times_ms: list = dataclasses.field(default_factory=list)
  stream_ms: list = dataclasses.field(default_factory=list)  # per call, in streams of `Config.stream`
  temp_bytes: int | None = None
  peak_bytes: int | None = None

  def compile(self):
    """Jits and compiles the mode's step; a call the implementation refuses becomes an error row."""
    try:
      self.compiled = jax.jit(self._step()).lower(*self.args).compile()
    except (ValueError, NotImplementedError, jax.errors.JaxRuntimeError) as err:
      self.status = f"error: {type(err).__name__}: {err}".splitlines()[0]
      return
    memory = self.compiled.memory_analysis()
    self.temp_bytes = None if memory is None else int(memory.temp_size_in_bytes)

  def _step(self):
    """The function to time (setting `args`): the forward, or the gradient of `sum(o * do)`."""
    if self.mode == "fwd":
      self.args = (self.inputs,)
      return self.forward
    self.args = (self.inputs, self.do)
    if self.mode == "fwd_bwd_state":   # forward gives (o, final state); the state's cotangent is itself
      def loss(x, do):
        o, final = self.forward(x)
        return jnp.sum(o.astype(jnp.float32) * do) + 0.5 * jnp.sum(jnp.square(final.astype(jnp.float32)))
      return jax.grad(loss)
    return jax.grad(lambda x, do: jnp.sum(self.forward(x).astype(jnp.float32) * do))

  def run(self, calls: int = 1) -> float:
    """Milliseconds per call of `calls` calls issued back to back and waited for together (1: one
    call, waited for; more: the host's dispatch overlaps the device's work, so this is the device's
    time per call once the host keeps ahead of it)."""
    start = time.perf_counter()
    jax.block_until_ready([self.compiled(*self.args) for _ in range(calls)])
    return (time.perf_counter() - start) * 1e3 / calls


def _contenders(config: Config, shape, shape_index: int, jla_ops, jla_status: str) -> list[Contender]:
  B, T, H, K = shape
  dtype = common.dtype_of(config.dtype)
  # o is [B, T, H, K] for every contender (V = K, H_v = H): one cotangent serves them all.
  do = jnp.asarray(np.random.default_rng([config.seed, shape_index]).standard_normal(
      (B, T, H, K), dtype=np.float32))
  out = []
  for variant in config.variants:
    rng = np.random.default_rng([config.seed, shape_index, ops.VARIANTS.index(variant)])
    inputs = common.make_inputs(variant, rng, B=B, T=T, H=H, K=K, V=K, dtype=dtype, gates=config.gates)
    forwards = {impl: (lambda x, v=variant, i=impl: common.call(
        v, x, impl=i, chunk_size=config.chunk_size)[0]) for impl in config.impls}
    statuses = {}
    for impl in (config.jla_impls if "jla" in config.peers else ()):
      label = f"jla:{impl}"
      if jla_ops is None:
        statuses[label] = jla_status.split(" (")[0]  # "not installed" / "import failed"; why: above
      elif variant not in JLA_KINDS:
        statuses[label] = f"unsupported: jla has no kind for {variant}"
      else:
        forwards[label] = lambda x, v=variant, i=impl: _jla_forward(jla_ops, v, x, i, config.chunk_size)
    for mode in config.modes:
      if mode == "fwd_bwd_state":
        out += [Contender(variant, shape, impl, mode, lambda x, v=variant, i=impl: common.call(
            v, x, impl=i, chunk_size=config.chunk_size, output_final_state=True), inputs, do)
            for impl in config.impls]
        out += [Contender(variant, shape, label, mode, status="n/a: this library's impls only")
                for label in list(forwards)[len(config.impls):] + list(statuses)]
        continue
      out += [Contender(variant, shape, label, mode, fn, inputs, do) for label, fn in forwards.items()]
      out += [Contender(variant, shape, label, mode, status=s) for label, s in statuses.items()]
  if config.softmax:
    rng = np.random.default_rng([config.seed, shape_index, len(ops.VARIANTS)])
    inputs = {name: jnp.asarray(rng.standard_normal((B, T, H, K), dtype=np.float32), dtype)
              for name in ("q", "k", "v")}
    on_gpu = jax.default_backend() == "gpu"
    attend = lambda x: jax.nn.dot_product_attention(x["q"], x["k"], x["v"], is_causal=True,
                                                    implementation="cudnn" if on_gpu else None)
    out += [Contender("softmax", shape, "cudnn" if on_gpu else "xla", mode, attend, inputs, do)
            for mode in config.modes if mode != "fwd_bwd_state"]
  return out


def _jla_forward(jla_ops, variant, x, impl, chunk_size):
  """jla's o for our inputs: same gates; delta kinds l2-normalise q, k inside, as ours do."""
  options = {name: x[name] for name in ("g", "beta") if name in x}
  if variant in common.DELTA_VARIANTS:
    options["use_qk_l2norm"] = True
  if impl == "chunked":
    options["chunk_size"] = chunk_size
  return jla_ops.linear_attention(JLA_KINDS[variant], x["q"], x["k"], x["v"], impl=impl, **options)[0]


def _time(contenders: list[Contender], config: Config, desc: str):
  """Compiles, warms up, then times the runnable contenders, interleaved; fills times and memory."""
  for c in contenders:
    if c.status == "ok":
      c.compile()
  live = [c for c in contenders if c.status == "ok"]
  device = jax.devices()[0]
  rounds = config.warmup + config.iters
  bar = tqdm(total=(rounds + 1) * len(live), desc=desc, leave=False, disable=None) if tqdm else None
  tick = bar.update if bar is not None else lambda: None
  for c in list(live):  # first call, one contender at a time: the device's peak then includes it
    try:
      c.run()
    except jax.errors.JaxRuntimeError as err:  # e.g. out of memory: say so in the table, time the rest
      c.status = f"error: {type(err).__name__}: {err}".splitlines()[0]
      live.remove(c)
      continue
    stats = device.memory_stats()
    c.peak_bytes = None if stats is None else stats.get("peak_bytes_in_use")
    tick()
  warm_s = config.warm_s if config.warm_s is not None else (2.0 if device.platform == "gpu" else 0.0)
  start, warm_rounds = time.perf_counter(), 0
  while live and (warm_rounds < config.warmup or time.perf_counter() - start < warm_s):
    for c in live:
      c.run()
    warm_rounds += 1
    if warm_rounds <= config.warmup:
      for _ in live:
        tick()
  for _ in range(config.iters):
    for c in live:
      c.times_ms.append(c.run())
      if config.stream > 1:
        c.stream_ms.append(c.run(config.stream))
      tick()
  if bar is not None:
    bar.close()


def _rows(contenders: list[Contender], anchor: str, ceilings: dict | None = None,
          chunk_size: int = 64) -> list[dict]:
  medians = {(c.variant, c.shape, c.impl, c.mode): statistics.median(c.times_ms)
             for c in contenders if c.times_ms}
  streams = {(c.variant, c.shape, c.impl, c.mode): statistics.median(c.stream_ms)
             for c in contenders if c.stream_ms}
  def anchor_of(table, c):
    """The anchor's entry in `table` for contender c's variant (softmax: its shape), shape and mode."""
    if anchor == "softmax":
      return next((m for (v, s, i, mode), m in table.items() if v == "softmax" and s == c.shape
                   and mode == c.mode), None)
    return table.get((c.variant, c.shape, anchor, c.mode))

  rows = []
  for c in contenders:
    ms = medians.get((c.variant, c.shape, c.impl, c.mode))
    ref = anchor_of(medians, c)
    rows.append({"variant": c.variant, "shape": list(c.shape), "impl": c.impl, "mode": c.mode,
                 "status": c.status, "median_ms": ms, "times_ms": c.times_ms,
                 "ratio": None if ms is None or ref is None else ms / ref,
                 "temp_bytes": c.temp_bytes, "peak_bytes": c.peak_bytes})
    stream = streams.get((c.variant, c.shape, c.impl, c.mode))
    stream_ref = anchor_of(streams, c)
    rows[-1].update(stream_ms=stream, stream_times_ms=c.stream_ms,
                    stream_ratio=None if stream is None or stream_ref is None else stream / stream_ref)
    if ceilings is not None and c.inputs is not None:
      nbytes, flops = roofline.op_cost(c.variant, c.shape, c.mode, c.inputs, c.do, chunk_size=chunk_size)
      floor = roofline.floor_ms(nbytes, flops, ceilings)
      timed = stream if stream is not None else ms   # the device's time where it was measured
      rows[-1].update(model_bytes=nbytes, model_flops=flops, floor_ms=floor,
                      floor_multiple=None if timed is None else timed / floor)
  return rows


def run_benchmark(config: Config, workdir: str) -> dict:
  """Times every contender, prints the table, writes `{workdir}/benchmark.json`; returns the results."""
  jla_ops, jla_status = import_jla() if "jla" in config.peers else (None, "not requested")
  if "jla" in config.peers and jla_ops is None:
    print(f"jla: {jla_status}; its rows say so and are not timed")
  anchor = config.anchor or (f"jla:{config.jla_impls[0]}" if jla_ops is not None else config.impls[0])
  contenders = []
  for index, shape in enumerate(config.shapes):
    group = _contenders(config, shape, index, jla_ops, jla_status)
    _time(group, config, desc="B,T,H,K=" + ",".join(map(str, shape)))
    contenders += group
  ceilings = roofline.measure_ceilings() if config.roofline else None
  rows = _rows(contenders, anchor, ceilings, config.chunk_size)
  device = jax.devices()[0]
  print(f"{device.platform} ({device.device_kind}), jax {jax.__version__}, dtype={config.dtype}, "
        f"chunk_size={config.chunk_size}, median of {config.iters} after {config.warmup} warm-up")
  print(f"ratio = median / median of {anchor!r} (same variant, shape, mode); > 1 is slower. temp MiB: "
        "XLA's scratch for the contender; peak MiB: the device's high-water mark after its first call "
        "(cumulative over the run: JAX cannot reset it)")
  if ceilings is not None:
    print(f"ceilings measured in this run: copy {ceilings['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s, bf16 "
          f"matmul {ceilings['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s; x floor = "
          f"{'stream ms' if config.stream > 1 else 'median'} / (the op's bytes "
          "or FLOPs at them, whichever is longer; experiments/roofline.py)")
  if config.stream > 1:
    print(f"stream ms: the median over rounds of the time per call of {config.stream} calls issued back "
          "to back and waited for together (the host's dispatch hidden behind the device's work); "
          "s.ratio: its ratio to the anchor's")
  mib = lambda b: "-" if b is None else f"{b / 2**20:.1f}"
  fmt = lambda x, spec: "-" if x is None else format(x, spec)
  streamed = config.stream > 1
  print(common.format_table(
      ("variant", "B,T,H,K", "impl", "mode", "median ms", "ratio")
      + (("stream ms", "s.ratio") if streamed else ()) + ("x floor", "temp MiB", "peak MiB", "note"),
      [(r["variant"], ",".join(map(str, r["shape"])), r["impl"], r["mode"],
        fmt(r["median_ms"], ".3f"), fmt(r["ratio"], ".2f"))
       + ((fmt(r["stream_ms"], ".3f"), fmt(r["stream_ratio"], ".2f")) if streamed else ())
       + (fmt(r.get("floor_multiple"), ".1f"), mib(r["temp_bytes"]), mib(r["peak_bytes"]),
          "" if r["status"] == "ok" else r["status"][:48]) for r in rows]))
  for error in dict.fromkeys(r["status"] for r in rows if r["status"].startswith("error")):
    print(error)
  results = {"config": dataclasses.asdict(config), "anchor": anchor, "jax": jax.__version__,
             "device": f"{device.platform} ({device.device_kind})",
             "peers": {"jla": jla_status} if "jla" in config.peers else {}, "ceilings": ceilings,
             "rows": rows}
  results["path"] = common.write_json(workdir, "benchmark.json", results)
  print(f"wrote {results['path']}")
  if config.plot:
    results["plot"] = _plot(rows, workdir)
  return results


def _plot(rows, workdir) -> str | None:
  """A horizontal bar chart of the medians (log scale) at `{workdir}/benchmark.png`."""
  timed = [r for r in rows if r["median_ms"] is not None]
  drawn = common.new_figure(figsize=(8, 0.3 * len(timed) + 1))
  if drawn is None:
    return None
  fig, ax = drawn
  ax.barh([f"{r['variant']} {r['impl']} {r['mode']} {','.join(map(str, r['shape']))}" for r in timed],
          [r["median_ms"] for r in timed])
  ax.set_xscale("log")
  ax.set_xlabel("median ms")
  ax.invert_yaxis()
  fig.tight_layout()
  path = os.path.join(workdir, "benchmark.png")
  fig.savefig(path, dpi=120)
  print(f"wrote {path}")
  return path


def _define_flags():
  d = Config()
  flags.DEFINE_list("variants", list(d.variants), "Variants to time (from ops.VARIANTS).")
  flags.DEFINE_list("impls", list(d.impls), "This library's implementations to time.")
  flags.DEFINE_string("shapes", ";".join(",".join(map(str, s)) for s in d.shapes),
                      "Semicolon list of B,T,H,K (V = K, H_v = H).")
  flags.DEFINE_enum("dtype", d.dtype, sorted(common.DTYPES), "dtype of q, k, v and beta.")
  flags.DEFINE_list("modes", list(d.modes), "fwd, fwd_bwd and/or fwd_bwd_state (the final state used too: "
                    "its own value as its cotangent; this library's impls only).")
  flags.DEFINE_enum("gates", d.gates, list(common.GATES), "Gates: the mild 'benchmark' ones, the layers' "
                    "own at initialisation ('layer'), the bounded per-channel gate, 'strong' (U(-20, 0)).")
  flags.DEFINE_integer("warmup", d.warmup, "Untimed rounds after compilation.")
  flags.DEFINE_integer("iters", d.iters, "Timed rounds; the median is reported.")
  flags.DEFINE_integer("stream", d.stream, "> 1: each round also times this many calls issued back to "
                       "back and waited for together, per call (the device's time once the host's "
                       "dispatch hides behind it); reported as 'stream ms' with its own ratio.")
  flags.DEFINE_float("warm_s", d.warm_s, "Seconds of untimed rounds before timing (at least --warmup "
                     "rounds), so the timed ones run at steady clocks; default 2 on a GPU, 0 elsewhere.")
  flags.DEFINE_integer("chunk_size", d.chunk_size, "Chunk length of the chunked forms.")
  flags.DEFINE_list("peers", list(d.peers), f"Peers to time when installed: {PEERS}.")
  flags.DEFINE_list("jla_impls", list(d.jla_impls), f"jla implementations: {JLA_IMPLS}.")
  flags.DEFINE_bool("softmax", d.softmax, "Also time causal softmax attention.")
  flags.DEFINE_string("anchor", d.anchor, "Ratio reference: an impl, jla:<impl> or softmax; "
                      "'' = jla:<first jla impl> when jla is installed, else the first impl.")
  flags.DEFINE_integer("seed", d.seed, "Random seed.")
  flags.DEFINE_bool("plot", d.plot, "Write benchmark.png (needs matplotlib).")
  flags.DEFINE_bool("roofline", d.roofline, "Measure the copy bandwidth and matmul rate in this run and "
                    "report each time as a multiple of its floor (experiments/roofline.py).")
  flags.DEFINE_string("workdir", "runs/benchmark", "Where benchmark.json (and .png) are written.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  config = Config(variants=tuple(f.variants), impls=tuple(f.impls), shapes=parse_shapes(f.shapes),
                  dtype=f.dtype, gates=f.gates, modes=tuple(f.modes), warmup=f.warmup, iters=f.iters,
                  warm_s=f.warm_s,
                  stream=f.stream,
                  chunk_size=f.chunk_size, peers=tuple(f.peers), jla_impls=tuple(f.jla_impls),
                  softmax=f.softmax, anchor=f.anchor, seed=f.seed, plot=f.plot, roofline=f.roofline)
  run_benchmark(config, f.workdir)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
