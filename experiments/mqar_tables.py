"""The MQAR table and plot of runs gathered from several places: each model at its best learning rate.

A GPU sweep that spans sessions comes back in pieces (an archive per call, a call whose archive was
lost but whose log holds the numbers); `experiments/results/mqar_gpu_runs.json` gathers them, one
entry per run with where it came from. This writes `mqar.{md,json,png}` of that file the way
`experiments/mqar.py` writes a sweep's, with the same choice of the best rate and zoology's values:

    python experiments/mqar_tables.py --runs=experiments/results/mqar_gpu_runs.json --workdir=experiments/results/mqar_gpu

A run without per-setting accuracies (`"accuracy": null`, only its mean is known) counts for the choice
of the best rate; the best run of each model must have them.
"""

from __future__ import annotations

import json
import os
import sys

if __package__ in (None, ""):  # run as a file: put the repository root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags

from experiments import mqar

REQUIRED = ("model", "pattern", "width", "learning_rate", "accuracy", "mean_accuracy", "state_size",
            "state_bytes", "params")


def tables(path: str, workdir: str) -> dict:
  with open(path, encoding="utf-8") as f:
    gathered = json.load(f)
  runs = gathered["runs"]
  for i, run in enumerate(runs):
    missing = [k for k in REQUIRED if k not in run]
    if missing:
      raise ValueError(f"runs[{i}] of {path} lacks {missing}; every run needs {list(REQUIRED)}")
  settings = [mqar.split_name(T, kv) for T, kv in gathered["test_settings"]]
  best = mqar.best_of(runs, gathered["vocab_size"], gathered["test_settings"])
  for run in best:
    if not run["accuracy"] or any(s not in run["accuracy"] for s in settings):
      raise ValueError(f"the best run of {run['model']} at width {run['width']} (rate "
                       f"{run['learning_rate']:g}) has no accuracy for each of {settings}")
  results = {"config": gathered.get("config"), "test_settings": gathered["test_settings"],
             "state_size_at": gathered["state_size_at"], "runs_planned": len(runs), "best": best,
             "runs": runs}
  return mqar.write_results(results, workdir)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  tables(flags.FLAGS.runs, flags.FLAGS.workdir)


if __name__ == "__main__":
  flags.DEFINE_string("runs", "experiments/results/mqar_gpu_runs.json", "The gathered runs (JSON).")
  flags.DEFINE_string("workdir", "runs/mqar_tables", "Where mqar.{md,json,png} are written.")
  app.run(main)
