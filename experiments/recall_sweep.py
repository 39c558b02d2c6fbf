"""The recall suite on one GPU in a wall-clock budget: zoology's MQAR sweep, then the retrieval tasks.

Runs as much as fits in `--time_budget_s`, the most important first, every finished run written the
moment it finishes (experiments/sweep.py), so running the same command again goes on where it stopped:

  1. MQAR (config mqar_zoology) at widths 64 and 128, every model, the two middle learning rates
  2. retrieval (config recall_tasks at GPU scale, RECALL_GPU below), every model, rate 3e-3
  3. MQAR at widths 64 and 128, the two outer rates (1e-3, 3.2e-2)
  4. MQAR at width 256, all four rates
  5. retrieval at rate 1e-3

(`--phases=3,5` runs only those, in this order), then writes the tables and plots of everything
finished (`{workdir}/mqar/mqar.{md,json,png}`, `{workdir}/recall/recall.{md,json,png}`), and with
`--export_dir` copies them there with every run's config, summary and metrics (not the checkpoints)
packed in one `runs.tar.gz`. A later call on a fresh machine goes on from that archive with
`--restore_from` (experiments/RECALL.md, "Resuming").

    python3 experiments/recall_sweep.py --workdir=runs/recall_gpu --time_budget_s=540 \\
        --export_dir=$OUT/recall_gpu [--restore_from=recall_gpu_runs/runs.tar.gz]
"""

from __future__ import annotations

import os
import shutil
import sys
import tarfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # several runs share one GPU

if __package__ in (None, ""):  # run as a file: put the repository root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags

from experiments import mqar, recall, sweep, train

MIDDLE_RATES, OUTER_RATES = [3.1623e-3, 1e-2], [1e-3, 3.1623e-2]
ALL_RATES = [1e-3, 3.1623e-3, 1e-2, 3.1623e-2]

# recall_tasks at GPU scale: width 128, trained at T = 256 and 512, tested up to 2048.
RECALL_GPU = [
    "train.steps=2000", "train.model.width=128", "train.model.impl=auto", "train.model.chunk_size=64",
    "train.data.batch_size=64", "train.data.retrieval.vocab_size=1024",
    "train.data.retrieval.train_lengths=[256, 512]",
    "train.data.retrieval.test_lengths=[128, 256, 512, 1024, 2048]",
    "train.data.retrieval.digits=5", "train.data.retrieval.num_keys=4",
    "train.data.retrieval.num_pairs=8", "train.data.retrieval.num_queries=4",
    "train.eval_batches=4", "train.checkpoint_every=500", "train.log_every=100",
    "train.optimizer.warmup_steps=100", "learning_rates=[3e-3, 1e-3]",
]


def phases(mqar_set, recall_set, workers):
  """`(label, subdirectory, module, config)` in the order they run, and `(subdirectory, module,
  config)` of the full grids the tables are made of."""
  m = lambda *extra: mqar.load_config("mqar_zoology", [f"workers={workers}", *mqar_set, *extra])
  r = lambda *extra: recall.load_config("recall_tasks",
                                        [*RECALL_GPU, f"workers={workers}", *recall_set, *extra])
  return [
      ("mqar d64,128 middle rates", "mqar", mqar,
       m("widths=[64, 128]", f"learning_rates={MIDDLE_RATES}")),
      ("retrieval rate 3e-3", "recall", recall, r("learning_rates=[3e-3]")),
      ("mqar d64,128 outer rates", "mqar", mqar,
       m("widths=[64, 128]", f"learning_rates={OUTER_RATES}")),
      ("mqar d256", "mqar", mqar, m("widths=[256]", f"learning_rates={ALL_RATES}")),
      ("retrieval rate 1e-3", "recall", recall, r("learning_rates=[1e-3]")),
  ], [("mqar", mqar, m(f"learning_rates={ALL_RATES}")), ("recall", recall, r())]


def run(workdir: str, budget_s: float, *, mqar_set=(), recall_set=(), workers: int = 4,
        export_dir: str = "", restore_from: str = "", only=()) -> dict:
  """`only`: the phases to run (1-5, module docstring), in their order; empty: all of them."""
  if restore_from:
    restore(restore_from, workdir)
  budget = sweep.Budget(time.monotonic() + budget_s)  # shared: the longest run so far counts for all
  work, tables = phases(list(mqar_set), list(recall_set), workers)
  numbers = [str(i) for i in range(1, len(work) + 1)]
  if any(str(i).strip() not in numbers for i in only):
    raise ValueError(f"phases must be numbers from 1 to {len(work)}; got {list(only)}")
  if only:
    work = [w for i, w in zip(numbers, work) if i in {str(j).strip() for j in only}]
  out = {}
  try:
    for label, subdir, module, config in work:
      if not budget.may_start():
        break
      print(f"=== {label}{budget.left()}", flush=True)
      module.run_sweep(config, os.path.join(workdir, subdir), progress=False, deadline=budget)
  finally:  # whatever stopped the work, the runs finished so far reach the tables and the export
    try:
      for name, module, config in tables:  # every run finished so far, none started
        out[name] = module.run_sweep(config, os.path.join(workdir, name), progress=False,
                                     deadline=float("-inf"))
    finally:
      if export_dir:
        export(workdir, export_dir)
  return out


RUNS_ARCHIVE = "runs.tar.gz"  # every run's config, summary and metrics, for a rerun to read back
TABLES = {"mqar": ("mqar.md", "mqar.json", "mqar.png"), "recall": ("recall.md", "recall.json", "recall.png")}
RUN_FILES = ("config.json", "summary.json", "metrics.jsonl")


def export(workdir: str, export_dir: str) -> list[str]:
  """Copies the tables and plots (`{export_dir}/{mqar,recall}/...`) and packs each run's config,
  summary and metrics (no checkpoints) into `{export_dir}/runs.tar.gz`: seven files at most two
  folders down, so the whole export comes back from a device machine that returns a few files, none
  deeper (a tree of one folder per run does not). `restore` puts the archive back into a workdir."""
  written = []
  for sub, names in TABLES.items():
    for name in names:
      source = os.path.join(workdir, sub, name)
      if os.path.exists(source):
        os.makedirs(os.path.join(export_dir, sub), exist_ok=True)
        written.append(shutil.copy2(source, os.path.join(export_dir, sub, name)))
  os.makedirs(export_dir, exist_ok=True)
  archive = os.path.join(export_dir, RUNS_ARCHIVE)
  with tarfile.open(archive, "w:gz") as tar:
    for root, dirs, files in os.walk(workdir):
      dirs[:] = sorted(d for d in dirs if d not in ("checkpoints", "tensorboard"))
      for name in sorted(files):
        if name in RUN_FILES:
          path = os.path.join(root, name)
          tar.add(path, arcname=os.path.relpath(path, workdir))
  written.append(archive)
  print(f"exported the results to {export_dir} ({len(written)} files)")
  return written


def restore(archive: str, workdir: str) -> int:
  """Unpacks an export's `runs.tar.gz` into `workdir` (each run's config, summary, metrics): its
  finished runs are then read back, not trained again. Returns how many runs it holds."""
  with tarfile.open(archive, "r:gz") as tar:
    members = [m for m in tar.getmembers() if m.isfile()]
    tar.extractall(workdir, members=members, filter="data")
  runs = sum(os.path.basename(m.name) == "summary.json" for m in members)
  print(f"restored {runs} finished runs from {archive} into {workdir}")
  return runs


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  train.quiet_logs()
  run(f.workdir, f.time_budget_s, mqar_set=f.mqar_set, recall_set=f.recall_set, workers=f.workers,
      export_dir=f.export_dir, restore_from=f.restore_from, only=f.phases)


if __name__ == "__main__":
  flags.DEFINE_string("workdir", "runs/recall_gpu", "Where every run and the tables are written.")
  flags.DEFINE_float("time_budget_s", 540, "Start no run once the time left is shorter than the "
                     "longest run so far; then write the tables.")
  flags.DEFINE_integer("workers", 4, "Runs trained at once, each in its own process.")
  flags.DEFINE_multi_string("mqar_set", [], "Override KEY=VALUE of the MQAR sweep (mqar_zoology).")
  flags.DEFINE_multi_string("recall_set", [], "Override KEY=VALUE of the retrieval sweep.")
  flags.DEFINE_string("export_dir", "", "Copy the tables here at the end, and every run's config, "
                      "summary and metrics as runs.tar.gz (no checkpoints).")
  flags.DEFINE_list("phases", [], "Run only these phases (1-5, module docstring), e.g. 2,3; "
                    "default: all. The tables still show every finished run.")
  flags.DEFINE_string("restore_from", "", "An earlier export's runs.tar.gz: unpacked into the workdir "
                      "first, so its finished runs are read back, not trained again.")
  app.run(main)
