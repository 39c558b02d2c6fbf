"""Inputs and calls shared by the experiment scripts: one place that knows each variant's arguments.

Random inputs follow the benchmark recipe (shared/BENCHMARKS.md): q, k, v ~ N(0, 1) in the chosen dtype;
scalar gates `g = log_sigmoid(N(0, 1) + 4)` `[B, T, H_v]` and per-channel gates the same `[B, T, H_v, K]`,
both float32; `beta = sigmoid(N(0, 1))` `[B, T, H_v]` in the chosen dtype; an initial state ~ N(0, 1)
`[B, H_v, K, V]` float32 (`[B, H_v, K, V + 1]` for linear_attention, whose last column is the normaliser
z and is drawn as |N(0, 1)|, as a sum of positive features would be). The delta variants are called with
`use_qk_l2norm=True`, so their q and k are l2-normalised per head inside the op.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from linear_attention_jax import ops

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

DELTA_VARIANTS = ("delta_rule", "gated_delta_rule", "kda")
_GATES = {  # variant -> "scalar" | "channel" | None (no gate argument)
    "linear_attention": None, "retention": None, "simple_gla": "scalar", "gla": "channel",
    "delta_rule": None, "gated_delta_rule": "scalar", "kda": "channel",
}


def check_variants(variants) -> tuple[str, ...]:
  """Returns `variants` as a tuple after checking every name is one of `ops.VARIANTS`."""
  unknown = [v for v in variants if v not in ops.VARIANTS]
  if unknown or not variants:
    raise ValueError(f"variants must be a non-empty list from {ops.VARIANTS}; got {list(variants)}")
  return tuple(variants)


def dtype_of(name: str):
  if name not in DTYPES:
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}; got {name!r}")
  return DTYPES[name]


def input_names(variant: str, *, initial_state: bool = False) -> tuple[str, ...]:
  """Names of the variant's array inputs: q, k, v, then g and beta where it has them."""
  names = ("q", "k", "v")
  if _GATES[variant] is not None:
    names += ("g",)
  if variant in DELTA_VARIANTS:
    names += ("beta",)
  return names + (("initial_state",) if initial_state else ())


def state_shape(variant: str, B: int, H_v: int, K: int, V: int) -> tuple[int, int, int, int]:
  """`[B, H_v, K, V]`; linear_attention (normalize=True) carries z as one extra value column."""
  return (B, H_v, K, V + 1) if variant == "linear_attention" else (B, H_v, K, V)


GATES = ("benchmark", "edge", "strong", "layer", "bounded")
GATE_LOWER_BOUND = -5.0   # the bounded gate's lb (Kimi Linear's successors; fla enforces -5 <= lb < 0)


def _layer_gates(rng, shape, *, gla: bool, bounded: bool = False):
  """Gates as the layers draw them at initialisation (`layers.base.a_log_init`, `dt_bias_init`), with
  the gate projection's output `a ~ N(0, 1)`: GatedDeltaNet (scalar) and KimiDeltaAttention (per
  channel) `-A softplus(a + dt_bias)`, A ~ U(1, 16) per value head and softplus(dt_bias) ~
  logU(1e-3, 0.1) per head (GatedDeltaNet) or per head and channel (KDA); GatedLinearAttention
  `log_sigmoid(a) / 16`; `bounded`: `lb sigmoid(A (a + dt_bias))`, lb = GATE_LOWER_BOUND."""
  a = rng.standard_normal(shape).astype(np.float32)
  if gla and not bounded:
    return (-np.logaddexp(0.0, -a) / 16.0).astype(np.float32)
  Hv = shape[2]
  A = rng.uniform(1.0, 16.0, size=(Hv,) + (1,) * (len(shape) - 3)).astype(np.float32)
  dt = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), size=shape[2:])).astype(np.float32)
  dt_bias = dt + np.log(-np.expm1(-dt))
  if bounded:
    return (GATE_LOWER_BOUND / (1.0 + np.exp(-A * (a + dt_bias)))).astype(np.float32)
  return (-A * np.logaddexp(0.0, a + dt_bias)).astype(np.float32)


def kda_gate_inputs(rng, shape):
  """`(a [B, T, H_v, K], A_log [H_v], dt_bias [H_v K])` float32: `_layer_gates`' draws for KDA as the
  op's gate arguments (`ops.kda(q, k, v, a, beta, A_log=, dt_bias=)`)."""
  a = rng.standard_normal(shape).astype(np.float32)
  A = rng.uniform(1.0, 16.0, size=(shape[2],)).astype(np.float32)
  dt = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), size=shape[2:])).astype(np.float32)
  return a, np.log(A), (dt + np.log(-np.expm1(-dt))).reshape(-1)


def make_inputs(variant: str, rng: np.random.Generator, *, B: int, T: int, H: int, K: int, V: int,
                H_v: int | None = None, dtype=jnp.float32, initial_state: bool = False,
                gates: str = "benchmark") -> dict[str, jax.Array]:
  """Random inputs of `variant`, keyed by `input_names(variant, initial_state=...)`, in that order.

  gates (`GATES`): "benchmark" `log_sigmoid(N(0, 1) + 4)`; "edge" the same with g = -1.8 a token on
  every other key channel (per-channel gates) or value head (scalar gates): 115 nats over a 64-token
  chunk, inside the one-reference bound of 16-bit operands (2 x 60 nats) for bfloat16; "strong"
  uniform in [-20, 0], far beyond it (per-channel kernels take their 8-token groups' grams); "layer"
  what the layers draw at initialisation (`_layer_gates`: GatedDeltaNet's and KDA's -A softplus(.),
  GLA's log_sigmoid(.) / 16; other variants "benchmark"); "bounded" the bounded per-channel gate
  `-5 sigmoid(A (a + dt_bias))` (other variants "layer").

  Drawn with NumPy (no per-shape compilation, unlike `jax.random` run eagerly), then put on the device.
  """
  H_v = H if H_v is None else H_v
  normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
  inputs = {"q": normal(B, T, H, K), "k": normal(B, T, H, K), "v": normal(B, T, H_v, V)}
  gate = _GATES[variant]
  if gate is not None:
    shape = (B, T, H_v) if gate == "scalar" else (B, T, H_v, K)
    if gates not in GATES:
      raise ValueError(f"gates must be one of {GATES}; got {gates!r}")
    layer_like = gates == "layer" and variant in ("gla", "kda", "gated_delta_rule")
    if gates == "strong":
      inputs["g"] = rng.uniform(-20.0, 0.0, size=shape).astype(np.float32)
    elif layer_like or (gates == "bounded" and variant in ("gla", "kda", "gated_delta_rule")):
      inputs["g"] = _layer_gates(rng, shape, gla=variant == "gla",
                                 bounded=gates == "bounded" and gate == "channel")
    else:
      inputs["g"] = -np.logaddexp(0.0, -(normal(*shape) + 4.0))  # log_sigmoid(N(0, 1) + 4)
      if gates == "edge":
        inputs["g"][..., ::2] = -1.8
  if variant in DELTA_VARIANTS:
    inputs["beta"] = 1.0 / (1.0 + np.exp(-normal(B, T, H_v)))  # sigmoid(N(0, 1))
  if initial_state:
    h0 = normal(*state_shape(variant, B, H_v, K, V))
    if variant == "linear_attention":
      h0[..., -1] = np.abs(h0[..., -1])
    inputs["initial_state"] = h0
  in_dtype = {"q": dtype, "k": dtype, "v": dtype, "beta": dtype}  # gates and states stay float32
  return {name: jnp.asarray(x, in_dtype.get(name, jnp.float32)) for name, x in inputs.items()}


def call(variant: str, inputs: dict, **options):
  """Runs `ops.<variant>` on `inputs` (from `make_inputs`) and `options` (impl, chunk_size, ...).

  Positional arguments are taken in `input_names` order; `initial_state` is passed when present; the
  delta variants get `use_qk_l2norm=True`. Returns the op's `(o, final_state)`.
  """
  args = tuple(inputs[name] for name in input_names(variant))
  for name in ("initial_state", "A_log", "dt_bias"):   # the last two: kda given its gate's pre-activation
    if name in inputs:
      options[name] = inputs[name]
  if variant in DELTA_VARIANTS:
    options["use_qk_l2norm"] = True
  return getattr(ops, variant)(*args, **options)


def define_op_flags(variants, *, B: int, T: int, H: int, K: int = 128, V: int = 128, gates: str,
                    T_help: str = "Sequence length."):
  """The flags of the scripts that run one op's forward and backward at one shape (kernel_phases.py,
  ptxas_report.py): --variants, --B, --T, --H, --K, --V, --gates, --dtype, with these defaults."""
  from absl import flags
  flags.DEFINE_list("variants", list(variants), "Ops to run.")
  flags.DEFINE_integer("B", B, "Batch.")
  flags.DEFINE_integer("T", T, T_help)
  flags.DEFINE_integer("H", H, "Heads.")
  flags.DEFINE_integer("K", K, "Key channels.")
  flags.DEFINE_integer("V", V, "Value channels.")
  flags.DEFINE_enum("gates", gates, GATES, "Gates (make_inputs).")
  flags.DEFINE_string("dtype", "bfloat16", "Input dtype.")


def op_gradient(variant: str, f, seed: int = 0):
  """`(grads, args)`: `jax.grad` of `sum(o^2)` over every input of `variant` (`impl="pallas"`, not
  jitted) and its inputs from the flags of `define_op_flags` (`f`)."""
  names = input_names(variant)
  inputs = make_inputs(variant, np.random.default_rng(seed), B=f.B, T=f.T, H=f.H, K=f.K, V=f.V,
                       dtype=dtype_of(f.dtype), gates=f.gates)

  def loss(*args):
    o, _ = call(variant, dict(zip(names, args)), impl="pallas")
    return jnp.sum(o.astype(jnp.float32) ** 2)

  return jax.grad(loss, argnums=tuple(range(len(names)))), tuple(inputs[n] for n in names)


def median_ms(fn, args, *, warmup: int, iters: int, calls: int = 1) -> float:
  """The median wall time of `fn(*args)` in ms over `iters` rounds, after one call (compilation) and
  `warmup` more. A round issues `calls` calls back to back and waits for them together, and counts its
  time per call: with more than one, the host's dispatch hides behind the device's work."""
  for _ in range(1 + warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready([fn(*args) for _ in range(calls)])
    times.append((time.perf_counter() - start) * 1e3 / calls)
  return statistics.median(times)


def format_table(header, rows) -> str:
  """A plain-text table: numbers (and "-") right-aligned, other text left-aligned."""
  cells = [list(map(str, header))] + [list(map(str, row)) for row in rows]
  widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
  line = lambda row: "  ".join(c.rjust(w) if _numeric(c) else c.ljust(w)
                               for c, w in zip(row, widths)).rstrip()
  return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


def _numeric(text: str) -> bool:
  try:
    float(text.replace(",", ""))
  except ValueError:
    return text == "-"
  return True


def kernel_config(grads_programs: int = 0, unit_ref_bound: bool | None = None,
                  sequence_pieces: int | None = None, call_test: bool | None = None,
                  order_channels: str | None = None, dg_cumsum: str | None = None,
                  key_warpgroups: int | None = None, prep_warpgroups: int | None = None,
                  cumsums: str | None = None, gate: str | None = None, l2_grads: str | None = None):
  """The GPU kernels' configuration for a benchmark's whole run (`pallas_kernels.gpu.default_config`):
  `grads_programs` > 0 runs the delta family's pair gradients in that many persistent programs (0: the
  library's default, one program a chunk); `unit_ref_bound` True or False sets the per-channel
  one-reference bound of l2-normalised q, k (`GpuConfig.unit_ref_bound`; None: the library's
  default); `sequence_pieces` splits each sequence's walks into that many pieces
  (`GpuConfig.sequence_pieces`; None: as many as fill one wave of programs); `call_test` False runs
  the per-chunk kernels without the call-wide test (`GpuConfig.call_test`; None: the default);
  `order_channels` "op", "layer" (the default), "ordered" or "none" says where kda's channels are
  taken strongest first (`GpuConfig.order_channels`);
  `dg_cumsum` "kernel" or "xla" says where dG's reverse cumsum runs (`GpuConfig.dg_cumsum`);
  `key_warpgroups`, `prep_warpgroups` 1 or 2: kda's key side, its preparation on one warpgroup or two
  (`GpuConfig.key_warpgroups`, `GpuConfig.prep_warpgroups`); `cumsums` "kernel" or "xla": the gates'
  chunk-local cumsums (`GpuConfig.cumsums`); `gate` "kernel" or "xla": where kda's gate is computed
  (`GpuConfig.gate`); `l2_grads` "key_side", "kernel" or "xla": where kda's backward takes the l2
  norms' gradients (`GpuConfig.l2_grads`)."""
  if grads_programs < 0:
    raise ValueError(f"grads_programs must be >= 0; got {grads_programs}")
  switches = (("unit_ref_bound", unit_ref_bound), ("call_test", call_test),
              ("order_channels", order_channels), ("dg_cumsum", dg_cumsum),
              ("key_warpgroups", key_warpgroups), ("prep_warpgroups", prep_warpgroups),
              ("cumsums", cumsums), ("gate", gate), ("l2_grads", l2_grads))
  if not grads_programs and sequence_pieces is None and all(value is None for _, value in switches):
    return contextlib.nullcontext()
  from linear_attention_jax.pallas_kernels import gpu
  fields = dict(grads_programs=grads_programs or None, sequence_pieces=sequence_pieces)
  for name, value in switches:
    if value is not None:
      fields[name] = value
  return gpu.default_config(gpu.GpuConfig(**fields))


def suffix_options(suffix: str) -> dict:
  """`kernel_config`'s arguments for one of layer_benchmark's mixer suffixes without its colon (e.g. "k",
  "kf"; "": the defaults), for the scripts that take the kernels' configuration as `--kernels`. Raises
  ValueError for any other suffix."""
  from experiments.layer_benchmark import kernel_options   # it imports this module
  options = kernel_options(f"_:{suffix}")
  if options is None:
    raise ValueError(f"kernels must be one of layer_benchmark's mixer suffixes without ':' (e.g. 'k', 'kf'); "
                     f"got {suffix!r}")
  return options


def write_json(workdir, name: str, results: dict) -> str:
  """Writes `results` to `{workdir}/{name}` (creating workdir) and returns the path."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, name)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1)
  return path


def new_figure(nrows: int = 1, ncols: int = 1, figsize=(8, 4)):
  """`(figure, axes)` drawn off-screen with matplotlib's object API, or None (said once) without
  matplotlib. No pyplot: the process's backend is left alone (a notebook keeps its inline plots) and
  nothing needs closing; `figure.savefig(path)` writes the file."""
  try:
    from matplotlib.figure import Figure
  except ImportError:
    print("matplotlib is not installed: no plot")
    return None
  figure = Figure(figsize=figsize)
  return figure, figure.subplots(nrows, ncols)
