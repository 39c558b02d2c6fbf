"""Retrieval against context length: needle-in-a-haystack, copying and two-hop lookup, per mixer.

Trains one model per entry of `models` (a layer pattern: "LLLL" linear attention, ..., "AAAA" softmax
attention, "GGGA" and "KKKA" hybrids) at every learning rate of the grid on a mix of the tasks of
experiments/retrieval_data.py at the training lengths, then tests every (task, length), the longer
lengths beyond training included; each model is reported at its best rate (the highest mean accuracy
over all splits). Accuracy is per scored token (a passkey's digits, a copied word, a two-hop answer).
Writes `{workdir}/recall.md` (a table per task: models x lengths), `{workdir}/recall.json` (every
run), `{workdir}/recall.png` (a heat map per task) and each run's directory under `{workdir}/runs/`
(a finished run is read back, not trained again; experiments/sweep.py).

    python experiments/recall.py --workdir=runs/recall                  # the CPU default, minutes
    python experiments/recall.py --config=recall_tasks --set=train.steps=3000 ...  # larger
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

if __package__ in (None, ""):  # run as a file: put the repository root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app
from flax import nnx

from experiments import common, configs, sweep, train
from experiments.retrieval_data import split_name
from linear_attention_jax.models import LM, count_params


@dataclasses.dataclass(frozen=True)
class RecallSweepConfig:
  models: tuple[tuple[str, str], ...] = (("attention", "AAAA"), ("hybrid", "GGGA"))  # (name, pattern)
  learning_rates: tuple[float, ...] = (3e-3,)  # the grid; each model is reported at its best rate
  workers: int = 1  # runs trained at once, each in its own process
  train: train.TrainConfig = dataclasses.field(default_factory=lambda: train.TrainConfig(
      data=train.data.DataConfig(source="retrieval")))  # everything else of a run

  def __post_init__(self):
    if not self.models or any(len(m) != 2 for m in self.models):
      raise ValueError(f"models must be a non-empty list of (name, pattern); got {self.models}")
    if len({name for name, _ in self.models}) != len(self.models):
      raise ValueError(f"model names must be unique; got {[name for name, _ in self.models]}")
    if self.workers < 1 or not self.learning_rates or min(self.learning_rates) <= 0:
      raise ValueError(f"need workers >= 1 and positive learning rates; got workers={self.workers} "
                       f"learning_rates={self.learning_rates}")
    if self.train.data.source != "retrieval":
      raise ValueError(f"train.data.source must be 'retrieval'; got {self.train.data.source!r}")
    for _, pattern in self.models:  # a bad pattern fails now, not after hours of other runs
      self.run_config(pattern, self.learning_rates[0]).lm_config(self.train.data.retrieval.vocab_size)

  def run_config(self, pattern: str, learning_rate: float) -> train.TrainConfig:
    t = self.train
    return dataclasses.replace(
        t, model={**t.model, "pattern": pattern, "depth": len(pattern)},
        optimizer=dataclasses.replace(t.optimizer, learning_rate=learning_rate))

  def plan(self, workdir: str) -> list[tuple[str, str, float, train.TrainConfig, str]]:
    """`(name, pattern, rate, run config, run dir)` of every run, model-major."""
    return [(name, pattern, lr, self.run_config(pattern, lr),
             os.path.join(workdir, "runs", f"{name}_lr{lr:g}"))
            for name, pattern in self.models for lr in self.learning_rates]


def load_config(name_or_path: str, overrides=()) -> RecallSweepConfig:
  return configs.build(RecallSweepConfig, configs.load(name_or_path, "recall", overrides))


def run_sweep(config: RecallSweepConfig, workdir: str, *, progress: bool = True,
              deadline: float | sweep.Budget | None = None) -> dict:
  """Trains (or reads back) every (model, learning rate) run; writes and returns the results
  (with a `deadline`, of the runs finished by then; experiments/sweep.py)."""
  data = config.train.data.retrieval
  longest = max(data.test_lengths)
  plan = config.plan(workdir)
  summaries = sweep.run_all([(run_dir, run_config) for *_, run_config, run_dir in plan],
                            workers=config.workers, progress=progress, deadline=deadline)
  runs = []
  for name, pattern, lr, run_config, run_dir in plan:
    if run_dir not in summaries:
      continue
    summary = summaries[run_dir]
    model = nnx.eval_shape(lambda c=run_config: LM(c.lm_config(data.vocab_size), rngs=nnx.Rngs(0)))
    state_size = model.state_size(longest)
    runs.append({
        "model": name, "pattern": pattern, "learning_rate": lr, "seconds": summary.get("seconds"),
        "accuracy": {task: {str(L): summary[f"eval/{split_name(task, L)}/accuracy"]
                            for L in data.test_lengths} for task in data.tasks},
        "mean_accuracy": summary["eval/accuracy"], "state_size": state_size,
        "state_bytes": 4 * state_size, "params": count_params(model), "workdir": run_dir})
  best = {}
  for run in runs:
    run["rates_done"] = sum(r["model"] == run["model"] for r in runs)
    if run["model"] not in best or run["mean_accuracy"] > best[run["model"]]["mean_accuracy"]:
      best[run["model"]] = run
  results = {"config": configs.to_dict(config), "tasks": list(data.tasks),
             "train_lengths": list(data.train_lengths), "test_lengths": list(data.test_lengths),
             "state_size_at": longest, "runs_planned": len(plan), "best": list(best.values()),
             "runs": runs}
  table = markdown_tables(results)
  print(table)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "recall.md"), "w", encoding="utf-8") as f:
    f.write(table + "\n")
  results["table"] = os.path.join(workdir, "recall.md")
  results["plot"] = plot(results, os.path.join(workdir, "recall.png"))
  results["path"] = os.path.join(workdir, "recall.json")
  with open(results["path"], "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1)
  print(f"wrote {results['table']}, {results['path']}" + (f", {results['plot']}" if results["plot"] else ""))
  return results


def markdown_tables(results: dict) -> str:
  """A summary (mean per task, state bytes) and, per task, accuracy at every test length."""
  trained = max(results["train_lengths"])
  lengths = [str(L) for L in results["test_lengths"]]
  shown = [f"T={L}" + ("" if int(L) <= trained else " (beyond training)") for L in lengths]
  best = results["best"]
  out = [f"Trained at T = {results['train_lengths']}; per scored token; each model at its best rate "
         f"(of the rates finished).", "",
         "| model | pattern | best lr (of) | " + " | ".join(results["tasks"]) + " | mean | "
         f"state bytes (fp32) @ T={results['state_size_at']} | params |",
         "|" + "---|" * (len(results["tasks"]) + 6)]
  for r in best:
    means = [sum(r["accuracy"][t].values()) / len(lengths) for t in results["tasks"]]
    out.append(f"| {r['model']} | `{r['pattern']}` | {r['learning_rate']:g} ({r['rates_done']}) | "
               + " | ".join(f"{m:.3f}" for m in means)
               + f" | {r['mean_accuracy']:.3f} | {r['state_bytes']:,} | {r['params']:,} |")
  for task in results["tasks"]:
    out += ["", f"**{task}**", "", "| model | " + " | ".join(shown) + " |",
            "|" + "---|" * (len(lengths) + 1)]
    out += [f"| {r['model']} | " + " | ".join(f"{r['accuracy'][task][L]:.3f}" for L in lengths)
            + " |" for r in best]
  return "\n".join(out)


def plot(results: dict, path: str) -> str | None:
  """A heat map per task: models (rows) x context length (columns), colour = accuracy."""
  tasks, best = results["tasks"], results["best"]
  if not best:
    return None
  drawn = common.new_figure(1, len(tasks), figsize=(3.2 * len(tasks) + 1, 0.45 * len(best) + 2))
  if drawn is None:
    return None
  fig, axes = drawn
  axes = axes if len(tasks) > 1 else [axes]
  lengths = [str(L) for L in results["test_lengths"]]
  trained = max(results["train_lengths"])
  image = None
  for ax, task in zip(axes, tasks):
    grid = [[r["accuracy"][task][L] for L in lengths] for r in best]
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    for i, row in enumerate(grid):
      for j, value in enumerate(row):
        ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=6,
                color="white" if value < 0.6 else "black")
    ax.set_xticks(range(len(lengths)), [L + ("*" if int(L) > trained else "") for L in lengths],
                  fontsize=7)
    ax.set_yticks(range(len(best)), [r["model"] for r in best] if ax is axes[0] else [], fontsize=7)
    ax.set_title(task, fontsize=9)
    ax.set_xlabel("context length (* beyond training)", fontsize=7)
  fig.colorbar(image, ax=list(axes), fraction=0.02)
  fig.suptitle(f"Retrieval accuracy against context length (trained at T <= {trained})", fontsize=10,
               y=1.04)
  fig.savefig(path, dpi=110, bbox_inches="tight")
  return path


def _define_flags():
  sweep.define_flags("recall_tasks", "runs/recall")


main = sweep.main_of(load_config, run_sweep)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
