"""fla's chunked GLA and KDA kernels (PyTorch + Triton), timed on the benchmark's shapes and inputs, for
the side-by-side rows of pallas_kernels/gpu/NOTES.md next to `experiments/benchmark.py`'s (same shapes,
same gate recipe; run on the same machine).

Needs torch with a CUDA device, triton and fla (`flash-linear-attention` with `fla-core`; 0.6.0 is the
version the notes quote). Without them every row says why and nothing is timed. Inputs follow
shared/BENCHMARKS.md: q, k, v ~ N(0, 1) in `--dtype`, per-channel log-decay `g = log_sigmoid(N(0, 1) + 4)`
float32 `[B, T, H, K]`, KDA's `beta = sigmoid(N(0, 1))`; KDA l2-normalises q and k inside
(`use_qk_l2norm_in_kernel`) as our delta variants do, and takes g as the log-decay itself
(`use_gate_in_kernel=False`). fwd is timed under `torch.no_grad()`; fwd_bwd is
`(o * do).sum().backward()` w.r.t. q, k, v, g (and beta). Medians from `triton.testing.do_bench`; the
first call (Triton's compile and autotuning, tens of seconds per kernel) is reported separately.
Prints one line per measurement as it goes and writes `{workdir}/fla_benchmark.json`.

Example:
  python experiments/fla_benchmark.py --kinds=gla,kda --shapes="4,8192,16,128;1,32768,16,128"
"""

from __future__ import annotations

import os
import sys
import time

if __package__ in (None, ""):  # run as a file: put the repository root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# JAX (imported by experiments.common) must not take most of the GPU that torch is about to use.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from absl import app, flags  # noqa: E402

from experiments import common  # noqa: E402

KINDS = ("gla", "kda")


def import_fla():
  """`(modules, status)`: modules is None when torch, CUDA, triton or fla is missing."""
  try:
    import torch
    from triton.testing import do_bench
  except ImportError as err:
    return None, f"not installed ({err})"
  if not torch.cuda.is_available():
    return None, "no CUDA device for torch"
  # fla 0.6.0's package __init__ also imports its layers and models, which want a recent transformers;
  # the ops timed here need neither, and fla treats a missing submodule as an absent extension.
  sys.modules.setdefault("fla.layers", None)
  sys.modules.setdefault("fla.models", None)
  try:
    import fla
    from fla.ops.gla import chunk_gla
    from fla.ops.kda import chunk_kda
  except ImportError as err:
    return None, f"not installed ({err})"
  return {"torch": torch, "do_bench": do_bench, "gla": chunk_gla, "kda": chunk_kda}, \
      f"fla {getattr(fla, '__version__', '?')}, torch {torch.__version__}"


def _inputs(m, kind, shape, dtype, seed):
  torch = m["torch"]
  B, T, H, D = shape
  gen = torch.Generator(device="cuda").manual_seed(seed)
  randn = lambda *s: torch.randn(*s, generator=gen, device="cuda")
  x = {n: randn(B, T, H, D).to(dtype) for n in ("q", "k", "v")}
  x["g"] = torch.nn.functional.logsigmoid(randn(B, T, H, D) + 4)
  if kind == "kda":
    x["beta"] = torch.sigmoid(randn(B, T, H)).to(dtype)
  return x, randn(B, T, H, D).to(dtype)


def _forward(m, kind, x):
  if kind == "gla":
    return m["gla"](x["q"], x["k"], x["v"], x["g"], output_final_state=False)[0]
  return m["kda"](x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=False,
                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False)[0]


def measure(m, kind, shape, mode, *, dtype, seed=0) -> dict:
  """`{median_ms, first_s, peak_mib}` of one (kind, shape, mode)."""
  torch = m["torch"]
  x, do = _inputs(m, kind, shape, dtype, seed)
  if mode == "fwd":
    def run():
      with torch.no_grad():
        return _forward(m, kind, x)
  else:
    for t in x.values():
      t.requires_grad_(True)

    def run():
      (_forward(m, kind, x) * do).sum().backward()
  start = time.perf_counter()
  run()
  torch.cuda.synchronize()
  first_s = time.perf_counter() - start
  torch.cuda.reset_peak_memory_stats()
  run()
  torch.cuda.synchronize()
  peak_mib = torch.cuda.max_memory_allocated() / 2**20
  grads = list(x.values()) if mode != "fwd" else None
  median = m["do_bench"](run, warmup=10, rep=50, grad_to_none=grads, return_mode="median")
  return {"median_ms": float(median), "first_s": first_s, "peak_mib": peak_mib}


def _define_flags():
  flags.DEFINE_list("kinds", list(KINDS), f"fla kernels to time: {KINDS}.")
  flags.DEFINE_string("shapes", "4,8192,16,128;1,32768,16,128;16,2048,16,128",
                      "';'-separated B,T,H,D (K = V = D).")
  flags.DEFINE_list("modes", ["fwd", "fwd_bwd"], "fwd and/or fwd_bwd.")
  flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16"], "dtype of q, k, v (and beta).")
  flags.DEFINE_float("budget_s", 600.0, "Rows not started within this many seconds are skipped.")
  flags.DEFINE_string("workdir", "runs/fla_benchmark", "Where fla_benchmark.json is written.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  unknown = [k for k in f.kinds if k not in KINDS] + [m for m in f.modes if m not in ("fwd", "fwd_bwd")]
  if unknown or not f.kinds or not f.modes:
    raise app.UsageError(f"--kinds must be from {KINDS} and --modes from fwd, fwd_bwd; got {unknown}")
  shapes = [tuple(int(v) for v in s.split(",")) for s in f.shapes.split(";") if s]
  if any(len(s) != 4 for s in shapes):
    raise app.UsageError(f"--shapes must be ';'-separated B,T,H,D; got {f.shapes!r}")
  modules, status = import_fla()
  print(f"fla: {status}", flush=True)
  dtype = None if modules is None else getattr(modules["torch"], f.dtype)
  start, rows = time.perf_counter(), []
  for shape in shapes:
    for kind in f.kinds:
      for mode in f.modes:
        row = {"kind": kind, "shape": list(shape), "mode": mode, "median_ms": None, "first_s": None,
               "peak_mib": None, "status": "ok"}
        if modules is None:
          row["status"] = status
        elif time.perf_counter() - start > f.budget_s:
          row["status"] = f"skipped (--budget_s={f.budget_s:g} spent)"
        else:
          try:
            row.update(measure(modules, kind, shape, mode, dtype=dtype))
          except Exception as err:  # an unsupported shape or an out-of-memory: say so, time the rest
            row["status"] = f"error: {type(err).__name__}: {err}".splitlines()[0][:200]
        rows.append(row)
        fmt = lambda v, spec: "-" if v is None else format(v, spec)
        print(f"{kind} {','.join(map(str, shape))} {mode}: {fmt(row['median_ms'], '.3f')} ms, first call "
              f"{fmt(row['first_s'], '.1f')} s, peak {fmt(row['peak_mib'], '.0f')} MiB  {row['status']}",
              flush=True)
        common.write_json(f.workdir, "fla_benchmark.json", {"fla": status, "dtype": f.dtype, "rows": rows})
  print(common.format_table(
      ("kind", "B,T,H,D", "mode", "median ms", "first call s", "peak MiB", "note"),
      [(r["kind"], ",".join(map(str, r["shape"])), r["mode"],
        "-" if r["median_ms"] is None else f"{r['median_ms']:.3f}",
        "-" if r["first_s"] is None else f"{r['first_s']:.1f}",
        "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}", "" if r["status"] == "ok" else r["status"])
       for r in rows]))
  print(f"wrote {os.path.join(f.workdir, 'fla_benchmark.json')}")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
