"""Equivalence: every implementation of every variant against the reference, forward and backward.

For each variant and sequence length T, each impl runs with an initial state and
`output_final_state=True`; random cotangents for o and the final state are pulled back through
`jax.vjp`. Each impl after the first (the reference) is compared with it by the relative RMS error
`sqrt(mean((a - b)^2) / mean(b^2))`, in float64, of o, the final state and the gradient of every input
(q, k, v, g, beta, initial_state: whichever the variant has). Prints one row per variant / T / impl and
writes `{workdir}/equivalence.json`.

Example:
  python experiments/equivalence.py --variants=gla,kda --T=63,300 --dtype=bfloat16 --workdir=runs/eq

`--interpret` runs `impl="pallas"` in the Mosaic GPU interpreter, so that the GPU kernels can be checked
on any machine (a CPU: slow, for small shapes; `NPROC` is set to 12 if unset, for the multi-warpgroup
kernels, before JAX starts):
  python experiments/equivalence.py --variants=kda --T=130 --B=1 --H=1 --H_v=1 --K=128 --V=128 \
    --dtype=bfloat16 --impls=recurrent,pallas --gates=bounded --gate_inputs --interpret
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import sys

if __package__ in (None, ""):  # run as a file: put the repository root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import common
from linear_attention_jax import ops
from linear_attention_jax.pallas_kernels import gpu as gpu_kernels

# Columns of the table and keys of each row's "errors": o, the final state, then d<input>.
QUANTITIES = ("o", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias")
_GRAD_KEYS = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "initial_state": "dh0",
              "A_log": "dA_log", "dt_bias": "ddt_bias"}


@dataclasses.dataclass(frozen=True)
class Config:
  variants: tuple[str, ...] = ops.VARIANTS  # variants to compare, names from ops.VARIANTS
  T: tuple[int, ...] = (1, 63, 64, 65, 300)  # sequence lengths: one token, around a chunk, several
  B: int = 2  # batch
  H: int = 2  # q / k heads
  H_v: int = 4  # value heads, a multiple of H (grouped heads)
  K: int = 32  # key (head) dimension
  V: int = 48  # value dimension
  dtype: str = "float32"  # q, k, v, beta dtype: float32 | bfloat16 (gates, states: float32)
  seed: int = 0  # inputs for (variant, T) come from numpy default_rng([seed, variant index, T])
  impls: tuple[str, ...] = ("recurrent", "chunk")  # the first is the reference
  chunk_size: int = 64  # chunk length of the chunked form
  # Matmul precision while tracing: "highest" keeps float32 matmuls float32 on GPUs and TPUs, which
  # otherwise run them at reduced (TF32-like) precision and show ~4e-4 errors; "default" leaves it.
  matmul_precision: str = "highest"
  # > 0: pack each row with sequences at this many random boundaries (segment_ids), else one sequence
  packed: int = 0
  # gate values (common.GATES): "benchmark", "edge" (-1.8 a token on every other channel: strong decay
  # within the per-channel kernels' bound) or "strong" (uniform in [-20, 0]: beyond it)
  gates: str = "benchmark"
  # kda takes its gate's pre-activation (`ops.kda(..., A_log=, dt_bias=)`, as the KDA layer calls it) drawn
  # as "layer" / "bounded" draw it (`common.kda_gate_inputs`): dg is then the pre-activation's cotangent,
  # with dA_log and ddt_bias beside it. Needs gates "layer" or "bounded".
  gate_inputs: bool = False
  # the GPU kernels' configuration while the impls trace: a suffix of layer_benchmark's mixers without
  # its colon (e.g. "k": kda's key side on two warpgroups, "o": the channel order); "": the defaults
  kernels: str = ""
  # impl "pallas" in the Mosaic GPU interpreter (any backend; slow: small shapes)
  interpret: bool = False

  def __post_init__(self):
    common.check_variants(self.variants)
    common.dtype_of(self.dtype)
    if len(self.impls) < 2 or any(i not in ops.IMPLS for i in self.impls):
      raise ValueError(f"impls must name a reference and at least one more from {ops.IMPLS}; "
                       f"got {list(self.impls)}")
    if self.matmul_precision not in ("default", "high", "highest"):
      raise ValueError(f"matmul_precision must be default, high or highest; got {self.matmul_precision!r}")
    if self.gates not in common.GATES:
      raise ValueError(f"gates must be one of {common.GATES}; got {self.gates!r}")
    common.suffix_options(self.kernels)
    if self.gate_inputs and self.gates not in ("layer", "bounded"):
      raise ValueError(f"gate_inputs takes gates 'layer' or 'bounded'; got {self.gates!r}")
    if not self.T or any(t < 1 for t in self.T):
      raise ValueError(f"T must be a non-empty list of positive lengths; got {list(self.T)}")


def relative_rms(a, b) -> float:
  """`sqrt(mean((a - b)^2) / mean(b^2))` in float64; the plain RMS of `a` when `b` is all zeros."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  denom = np.mean(b * b)
  return float(np.sqrt(np.mean((a - b) ** 2) / (denom if denom > 0 else 1.0)))


# On CPU these programs run once, so LLVM's optimisations cost more than they save: -O0 compiles the
# defaults about twice as fast (XLA:CPU does no fast-math at any level; errors stay at rounding level).
_CPU_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _forward_backward(inputs, cotangents, segment_ids, *, variant, impl, chunk_size, lower_bound=None,
                      interpret=False):
  """o, the final state and the gradient of every input under the given cotangents, keyed as QUANTITIES
  (`lower_bound`: the bounded gate's, where kda takes its gate's pre-activation; `interpret`: traced
  inside `gpu_kernels.interpret_kernels()`, a static argument so that jit's cache tells the two apart)."""
  del interpret
  bound = {} if lower_bound is None else dict(gate_lower_bound=lower_bound)
  fn = lambda x: common.call(variant, x, impl=impl, chunk_size=chunk_size, output_final_state=True,
                             segment_ids=segment_ids, **bound)
  (o, final), pull = jax.vjp(fn, inputs)
  (grads,) = pull(cotangents)
  return {"o": o, "state": final, **{_GRAD_KEYS[name]: g for name, g in grads.items()}}


@functools.cache
def _jitted_forward_backward():
  options = _CPU_COMPILER_OPTIONS if jax.default_backend() == "cpu" else None
  return jax.jit(_forward_backward, static_argnames=("variant", "impl", "chunk_size", "lower_bound",
                                                    "interpret"), compiler_options=options)


def compare(config: Config, variant: str, T: int) -> list[dict]:
  """One row per non-reference impl: `{"variant", "T", "impl", "reference", "errors": {quantity: err}}`."""
  rng = np.random.default_rng([config.seed, ops.VARIANTS.index(variant), T])
  inputs = common.make_inputs(variant, rng, B=config.B, T=T, H=config.H, K=config.K, V=config.V,
                              H_v=config.H_v, dtype=common.dtype_of(config.dtype), initial_state=True,
                              gates=config.gates)
  lower_bound = None
  if config.gate_inputs and variant == "kda":
    a, A_log, dt_bias = common.kda_gate_inputs(rng, inputs["g"].shape)
    inputs = dict(inputs, g=jnp.asarray(a), A_log=jnp.asarray(A_log), dt_bias=jnp.asarray(dt_bias))
    lower_bound = common.GATE_LOWER_BOUND if config.gates == "bounded" else None
  cotangents = (jnp.asarray(rng.standard_normal((config.B, T, config.H_v, config.V)), inputs["v"].dtype),
                jnp.asarray(rng.standard_normal(inputs["initial_state"].shape), jnp.float32))
  segment_ids = None
  if config.packed:  # boundaries at random positions (possibly inside chunks, possibly adjacent)
    starts = np.zeros((config.B, T), np.int32)
    for row in starts:
      row[rng.integers(1, max(T, 2), size=config.packed)] = 1
    segment_ids = jnp.asarray(np.cumsum(starts, axis=1, dtype=np.int32))
  fb = _jitted_forward_backward()
  with jax.default_matmul_precision(config.matmul_precision):  # thread-local: set in this worker
    # (in this thread: the configuration is a context variable, and compare runs in a pool's threads)
    interpreted = gpu_kernels.interpret_kernels() if config.interpret else contextlib.nullcontext()
    with common.kernel_config(**common.suffix_options(config.kernels)), interpreted:
      outs = {impl: jax.device_get(fb(inputs, cotangents, segment_ids, variant=variant, impl=impl,
                                      chunk_size=config.chunk_size, lower_bound=lower_bound,
                                      interpret=config.interpret))
              for impl in config.impls}
  ref = outs[config.impls[0]]
  return [{"variant": variant, "T": T, "impl": impl, "reference": config.impls[0],
           "errors": {q: relative_rms(outs[impl][q], ref[q]) for q in QUANTITIES if q in ref}}
          for impl in config.impls[1:]]


def run_equivalence(config: Config, workdir: str) -> dict:
  """Compares every (variant, T, impl), prints the table, writes `{workdir}/equivalence.json`.

  Returns `{"config", "rows", "max", "path"}`: rows as from `compare`, max the largest error per quantity.
  """
  cells = [(variant, T) for variant in config.variants for T in config.T]
  with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # compiles overlap
    futures = [pool.submit(compare, config, *cell) for cell in cells]
    for future in concurrent.futures.as_completed(futures):  # each row as it finishes: a run cut
      for r in future.result():                              # short by a time limit still reports
        print(f"done: {r['variant']} T={r['T']} {r['impl']}: "
              + " ".join(f"{q}={e:.1e}" for q, e in r["errors"].items()), flush=True)
    rows = [row for future in futures for row in future.result()]
  max_err = {q: max(r["errors"][q] for r in rows if q in r["errors"])
             for q in QUANTITIES if any(q in r["errors"] for r in rows)}
  print(f"relative RMS error against impl={config.impls[0]!r}, dtype={config.dtype}, B={config.B} "
        f"H={config.H} H_v={config.H_v} K={config.K} V={config.V} chunk_size={config.chunk_size} "
        f"matmul_precision={config.matmul_precision} packed={config.packed} gates={config.gates} "
        f"on {jax.devices()[0].device_kind}" + (", the GPU kernels interpreted" if config.interpret else ""))
  fmt = lambda e: "-" if e is None else f"{e:.1e}"
  print(common.format_table(
      ("variant", "T", "impl") + QUANTITIES,
      [(r["variant"], r["T"], r["impl"]) + tuple(fmt(r["errors"].get(q)) for q in QUANTITIES)
       for r in rows] + [("max", "", "") + tuple(fmt(max_err.get(q)) for q in QUANTITIES)]))
  results = {"config": dataclasses.asdict(config), "rows": rows, "max": max_err}
  results["path"] = common.write_json(workdir, "equivalence.json", results)
  print(f"wrote {results['path']}")
  return results


def _define_flags():
  d = Config()
  flags.DEFINE_list("variants", list(d.variants), "Variants to compare (from ops.VARIANTS).")
  flags.DEFINE_list("T", [str(t) for t in d.T], "Sequence lengths.")
  flags.DEFINE_integer("B", d.B, "Batch size.")
  flags.DEFINE_integer("H", d.H, "q / k heads.")
  flags.DEFINE_integer("H_v", d.H_v, "Value heads (a multiple of H).")
  flags.DEFINE_integer("K", d.K, "Key dimension.")
  flags.DEFINE_integer("V", d.V, "Value dimension.")
  flags.DEFINE_enum("dtype", d.dtype, sorted(common.DTYPES), "dtype of q, k, v and beta.")
  flags.DEFINE_integer("seed", d.seed, "Random seed.")
  flags.DEFINE_list("impls", list(d.impls), "Implementations; the first is the reference.")
  flags.DEFINE_integer("chunk_size", d.chunk_size, "Chunk length of the chunked form.")
  flags.DEFINE_enum("matmul_precision", d.matmul_precision, ["default", "high", "highest"],
                    "Matmul precision while tracing (GPUs and TPUs run float32 matmuls as TF32 by default).")
  flags.DEFINE_integer("packed", d.packed, "Random sequence boundaries per row (segment_ids); 0: none.")
  flags.DEFINE_enum("gates", d.gates, list(common.GATES), "Gate values (experiments/common.py).")
  flags.DEFINE_bool("gate_inputs", d.gate_inputs, "kda takes its gate's pre-activation with A_log and "
                    "dt_bias (as the KDA layer calls it); dg is the pre-activation's cotangent. With "
                    "--gates=layer or bounded.")
  flags.DEFINE_string("kernels", d.kernels, "The GPU kernels' configuration: a suffix of layer_benchmark's "
                      "mixers without its colon (e.g. k: kda's key side on two warpgroups); empty: defaults.")
  flags.DEFINE_bool("interpret", d.interpret, "Run impl pallas in the Mosaic GPU interpreter (any backend, "
                    "slow: small shapes; sets NPROC=12 if unset).")
  flags.DEFINE_string("workdir", "runs/equivalence", "Where equivalence.json is written.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  if f.interpret:   # before JAX starts its CPU pool: a warpgroup waiting on a barrier holds a thread
    os.environ.setdefault("NPROC", "12")
  config = Config(variants=tuple(f.variants), T=tuple(int(t) for t in f.T), B=f.B, H=f.H, H_v=f.H_v,
                  K=f.K, V=f.V, dtype=f.dtype, seed=f.seed, impls=tuple(f.impls),
                  chunk_size=f.chunk_size, matmul_precision=f.matmul_precision, packed=f.packed,
                  gates=f.gates, kernels=f.kernels, gate_inputs=f.gate_inputs, interpret=f.interpret)
  run_equivalence(config, f.workdir)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
