"""MQAR: how well each mixer recalls, per (sequence length, kv pairs), against the state it keeps.

Trains one two-layer model per entry of `models` (a layer pattern: "LL" linear attention, ..., "AA"
softmax attention, "GA" a hybrid) at every learning rate of the grid, on the multi-query associative
recall task (experiments/mqar_data.py), with train.py's loop; then reports each model at its best rate
(the highest mean accuracy over the test settings): recall accuracy per test setting, the state one
sequence keeps (`LM.state_size`, elements, at the longest test length) and the parameter count.
Writes `{workdir}/mqar.md` (the table), `{workdir}/mqar.json` (every run), `{workdir}/mqar.png`, and
each run's directory under `{workdir}/runs/` (a finished run is read back, not trained again, so an
interrupted sweep resumes).

    python experiments/mqar.py --workdir=runs/mqar                      # the CPU default, minutes
    python experiments/mqar.py --set=train.steps=4000 --set=train.model.width=128 \\
        --set='train.data.mqar.test_settings=[[64,4],[128,8],[256,16],[512,64]]' ...   # GPU scale
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import sys
import time

if __package__ in (None, ""):  # run as a file: put the repository root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags
from flax import nnx

from experiments import common, configs, train
from experiments.mqar_data import split_name
from linear_attention_jax.models import LM, count_params


@dataclasses.dataclass(frozen=True)
class SweepConfig:
  models: tuple[tuple[str, str], ...] = (("attention", "AA"), ("hybrid", "GA"))  # (name, pattern);
  # the pattern spells every layer, so its length is the depth
  learning_rates: tuple[float, ...] = (3e-3,)  # the grid; each model is reported at its best rate
  workers: int = 1  # runs trained at once, each in its own process (one per CPU core on a CPU)
  train: train.TrainConfig = train.TrainConfig()  # everything else of a run (pattern, rate replaced)

  def __post_init__(self):
    if not self.models or any(len(m) != 2 for m in self.models):
      raise ValueError(f"models must be a non-empty list of (name, pattern); got {self.models}")
    if len({name for name, _ in self.models}) != len(self.models):
      raise ValueError(f"model names must be unique; got {[name for name, _ in self.models]}")
    if self.workers < 1:
      raise ValueError(f"workers must be >= 1; got {self.workers}")
    if not self.learning_rates or min(self.learning_rates) <= 0:
      raise ValueError(f"learning_rates must be a non-empty list of positive rates; got "
                       f"{self.learning_rates}")
    if self.train.data.source != "mqar":
      raise ValueError(f"train.data.source must be 'mqar'; got {self.train.data.source!r}")
    for _, pattern in self.models:  # a bad pattern fails now, not after hours of other runs
      self.run_config(pattern, self.learning_rates[0]).lm_config(self.train.data.mqar.vocab_size)

  def run_config(self, pattern: str, learning_rate: float) -> train.TrainConfig:
    t = self.train
    return dataclasses.replace(
        t, model={**t.model, "pattern": pattern, "depth": len(pattern)},
        optimizer=dataclasses.replace(t.optimizer, learning_rate=learning_rate))


def load_config(name_or_path: str, overrides=()) -> SweepConfig:
  return configs.build(SweepConfig, configs.load(name_or_path, "mqar", overrides))


def run_sweep(config: SweepConfig, workdir: str, *, progress: bool = True) -> dict:
  """Trains (or reads back) every (model, learning rate) run; writes and returns the results."""
  test_settings = config.train.data.mqar.test_settings
  longest = max(T for T, _ in test_settings)
  plan = [(name, pattern, lr, config.run_config(pattern, lr),
           os.path.join(workdir, "runs", f"{name}_lr{lr:g}"))
          for name, pattern in config.models for lr in config.learning_rates]
  summaries = {}
  todo = []
  for name, pattern, lr, run_config, run_dir in plan:
    done = _finished(run_dir, run_config)
    if done is None:
      todo.append((run_dir, configs.to_dict(run_config)))
    else:
      summaries[run_dir] = done
  if todo:
    print(f"training {len(todo)} of {len(plan)} runs ({config.workers} at a time)")
  if config.workers == 1:
    for run_dir, run_dict in todo:
      print(f"--- {os.path.basename(run_dir)}")
      summaries[run_dir] = _train_run(run_dir, run_dict, progress)
  elif todo:
    context = multiprocessing.get_context("spawn")  # JAX does not survive fork
    with concurrent.futures.ProcessPoolExecutor(config.workers, mp_context=context) as pool:
      futures = {pool.submit(_train_run, run_dir, run_dict, False): run_dir for run_dir, run_dict in todo}
      for future in concurrent.futures.as_completed(futures):
        run_dir = futures[future]
        summaries[run_dir] = future.result()
        print(f"done: {os.path.basename(run_dir)}: mean accuracy "
              f"{summaries[run_dir]['eval/accuracy']:.3f} ({summaries[run_dir]['seconds']:.0f} s)")
  runs = []
  for name, pattern, lr, run_config, run_dir in plan:
    summary = summaries[run_dir]
    model = nnx.eval_shape(lambda c=run_config: LM(c.lm_config(config.train.data.mqar.vocab_size),
                                                   rngs=nnx.Rngs(0)))
    runs.append({
        "model": name, "pattern": pattern, "learning_rate": lr, "seconds": summary.get("seconds"),
        "accuracy": {split_name(T, kv): summary[f"eval/{split_name(T, kv)}/accuracy"]
                     for T, kv in test_settings},
        "mean_accuracy": summary["eval/accuracy"], "state_size": model.state_size(longest),
        "params": count_params(model), "workdir": run_dir})
  best = {}
  for run in runs:
    if run["model"] not in best or run["mean_accuracy"] > best[run["model"]]["mean_accuracy"]:
      best[run["model"]] = run
  results = {"config": configs.to_dict(config), "test_settings": [list(s) for s in test_settings],
             "state_size_at": longest, "best": list(best.values()), "runs": runs}
  table = markdown_table(results)
  print(table)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "mqar.md"), "w", encoding="utf-8") as f:
    f.write(table + "\n")
  results["table"] = os.path.join(workdir, "mqar.md")
  results["plot"] = plot(results, os.path.join(workdir, "mqar.png"))
  results["path"] = os.path.join(workdir, "mqar.json")
  with open(results["path"], "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1)
  print(f"wrote {results['table']}, {results['path']}" + (f", {results['plot']}" if results["plot"] else ""))
  return results


def _train_run(run_dir: str, run_dict: dict, progress: bool) -> dict:
  """Trains one run (also in a worker process) and returns its summary with the seconds it took."""
  if multiprocessing.parent_process() is not None:
    train.quiet_logs()
  start = time.perf_counter()
  summary = train.train_and_evaluate(configs.build(train.TrainConfig, run_dict), run_dir,
                                     progress=progress)
  summary["seconds"] = time.perf_counter() - start
  with open(os.path.join(run_dir, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=1)
  return summary


def _finished(run_dir: str, run_config: train.TrainConfig) -> dict | None:
  """The summary of a run that already finished with this config, else None."""
  try:
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
      summary = json.load(f)
    with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
      same = json.load(f) == configs.to_dict(run_config)
  except FileNotFoundError:
    return None
  return summary if same and summary.get("step") == run_config.steps else None


def markdown_table(results: dict) -> str:
  """One row per model at its best learning rate: accuracy per test setting, state size, params."""
  settings = [split_name(T, kv) for T, kv in results["test_settings"]]
  header = (["model", "pattern", "best lr", *(s.replace("_", " ") for s in settings), "mean",
             f"state elems/seq @ T={results['state_size_at']}", "params"])
  rows = [[r["model"], f"`{r['pattern']}`", f"{r['learning_rate']:g}",
           *(f"{r['accuracy'][s]:.3f}" for s in settings), f"{r['mean_accuracy']:.3f}",
           f"{r['state_size']:,}", f"{r['params']:,}"] for r in results["best"]]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def plot(results: dict, path: str) -> str | None:
  """Left: accuracy per test setting, a line per model. Right: mean accuracy against state size."""
  settings = [split_name(T, kv) for T, kv in results["test_settings"]]
  drawn = common.new_figure(1, 2, figsize=(12, 4.5))
  if drawn is None:
    return None
  fig, (left, right) = drawn
  for r in results["best"]:
    left.plot(range(len(settings)), [r["accuracy"][s] for s in settings], "o-",
              label=f"{r['model']} ({r['pattern']})")
    right.scatter(r["state_size"], r["mean_accuracy"])
    right.annotate(r["model"], (r["state_size"], r["mean_accuracy"]), fontsize=8,
                   xytext=(4, 4), textcoords="offset points")
  left.set_xticks(range(len(settings)), [s.replace("_", "\n") for s in settings])
  left.set_ylabel("recall accuracy (best learning rate)")
  left.set_ylim(-0.02, 1.02)
  left.legend(fontsize=8)
  right.set_xscale("log")
  right.set_xlabel(f"state elements per sequence at T={results['state_size_at']} (LM.state_size)")
  right.set_ylabel("mean recall accuracy")
  right.set_ylim(-0.02, 1.02)
  for ax in (left, right):
    ax.grid(alpha=0.3)
  fig.suptitle("MQAR: two-layer models, short conv + mixer", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return path


def _define_flags():
  flags.DEFINE_string("config", "mqar_sweep", "Config name in experiments/configs/ or a path to one.")
  flags.DEFINE_multi_string("set", [], "Override KEY=VALUE (dotted keys, e.g. train.steps=2000).")
  flags.DEFINE_string("workdir", "runs/mqar", "Where the table, plot, JSON and runs are written.")
  flags.DEFINE_bool("progress", True, "Show a progress bar per run.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  train.quiet_logs()
  run_sweep(load_config(f.config, f.set), f.workdir, progress=f.progress)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
