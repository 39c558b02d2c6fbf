"""MQAR: how well each mixer recalls, per (sequence length, kv pairs), against the state it keeps.

Trains one two-layer model per entry of `models` (a layer pattern: "LL" linear attention, ..., "AA"
softmax attention, "GA" a hybrid) at every width of `widths` and every learning rate of the grid, on
the multi-query associative recall task (experiments/mqar_data.py), with train.py's loop; then
reports each (model, width) at its best rate (the highest mean accuracy over the test settings):
recall accuracy per test setting, the state one sequence keeps at the longest test length
(`LM.state_size`, elements, and zoology's count: float32 bytes of both layers), the parameter count
and, where zoology published one (experiments/zoology_reference.py), zoology's value beside ours.
Writes `{workdir}/mqar.md` (the table), `{workdir}/mqar.json` (every run), `{workdir}/mqar.png`
(accuracy per setting; accuracy against state bytes, zoology's figure) and each run's directory
under `{workdir}/runs/` (a finished run is read back, not trained again, so an interrupted sweep
resumes; `--time_budget_s` starts no run once the time is short: experiments/sweep.py).

    python experiments/mqar.py --workdir=runs/mqar                      # the CPU default, minutes
    python experiments/mqar.py --config=mqar_zoology --workdir=runs/zoology   # zoology's setting, GPU
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

from experiments import common, configs, sweep, train, zoology_reference
from experiments.mqar_data import split_name
from linear_attention_jax.models import LM, count_params


@dataclasses.dataclass(frozen=True)
class SweepConfig:
  models: tuple[tuple[str, str], ...] = (("attention", "AA"), ("hybrid", "GA"))  # (name, pattern);
  # the pattern spells every layer, so its length is the depth
  learning_rates: tuple[float, ...] = (3e-3,)  # the grid; each model is reported at its best rate
  widths: tuple[int, ...] = ()  # model widths d swept (each its own row); () = train.model.width only
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
    if any(not isinstance(w, int) or w < 1 for w in self.widths):
      raise ValueError(f"widths must be positive integers; got {self.widths}")
    if self.train.data.source != "mqar":
      raise ValueError(f"train.data.source must be 'mqar'; got {self.train.data.source!r}")
    for _, pattern in self.models:  # a bad pattern fails now, not after hours of other runs
      for width in self.widths or (None,):
        self.run_config(pattern, self.learning_rates[0], width).lm_config(
            self.train.data.mqar.vocab_size)

  def run_config(self, pattern: str, learning_rate: float, width: int | None = None
                 ) -> train.TrainConfig:
    t = self.train
    model = {**t.model, "pattern": pattern, "depth": len(pattern)}
    if width is not None:
      model["width"] = width
    return dataclasses.replace(
        t, model=model, optimizer=dataclasses.replace(t.optimizer, learning_rate=learning_rate))

  def plan(self, workdir: str) -> list[tuple[str, str, int, float, train.TrainConfig, str]]:
    """`(name, pattern, width, rate, run config, run dir)` of every run, width-major, then model."""
    out = []
    for width in self.widths or (None,):
      for name, pattern in self.models:
        for lr in self.learning_rates:
          run_config = self.run_config(pattern, lr, width)
          tag = f"{name}_lr{lr:g}" if width is None else f"{name}_d{width}_lr{lr:g}"
          out.append((name, pattern, run_config.model["width"], lr, run_config,
                      os.path.join(workdir, "runs", tag)))
    return out


def load_config(name_or_path: str, overrides=()) -> SweepConfig:
  return configs.build(SweepConfig, configs.load(name_or_path, "mqar", overrides))


def run_sweep(config: SweepConfig, workdir: str, *, progress: bool = True,
              deadline: float | sweep.Budget | None = None) -> dict:
  """Trains (or reads back) every (model, width, learning rate) run; writes and returns the results.

  With a `deadline` (`time.monotonic()` seconds) no run starts once the time is short
  (experiments/sweep.py); the tables then cover the runs finished so far, each model at the best of
  the rates it has (`rates_done` says how many)."""
  test_settings = config.train.data.mqar.test_settings
  vocab = config.train.data.mqar.vocab_size
  longest = max(T for T, _ in test_settings)
  plan = config.plan(workdir)
  summaries = sweep.run_all([(run_dir, run_config) for *_, run_config, run_dir in plan],
                            workers=config.workers, progress=progress, deadline=deadline)
  runs = []
  for name, pattern, width, lr, run_config, run_dir in plan:
    if run_dir not in summaries:
      continue
    summary = summaries[run_dir]
    model = nnx.eval_shape(lambda c=run_config: LM(c.lm_config(vocab), rngs=nnx.Rngs(0)))
    state_size = model.state_size(longest)
    runs.append({
        "model": name, "pattern": pattern, "width": width, "learning_rate": lr,
        "seconds": summary.get("seconds"),
        "accuracy": {split_name(T, kv): summary[f"eval/{split_name(T, kv)}/accuracy"]
                     for T, kv in test_settings},
        "mean_accuracy": summary["eval/accuracy"], "state_size": state_size,
        # zoology's count (zoology/model.py::_compute_state_size): both layers, float32 bytes
        "state_bytes": 4 * state_size,
        "params": count_params(model), "workdir": run_dir})
  results = {"config": configs.to_dict(config), "test_settings": [list(s) for s in test_settings],
             "state_size_at": longest, "runs_planned": len(plan),
             "best": best_of(runs, vocab, test_settings), "runs": runs}
  return write_results(results, workdir)


def best_of(runs: list[dict], vocab: int, test_settings) -> list[dict]:
  """Each (model, width) at the run of its best mean accuracy, with `rates_done` (how many rates it
  had) and zoology's published value where there is one."""
  best = {}
  for run in runs:
    key = (run["model"], run["width"])
    run["rates_done"] = sum((r["model"], r["width"]) == key for r in runs)
    if key not in best or run["mean_accuracy"] > best[key]["mean_accuracy"]:
      best[key] = run
  for run in best.values():
    published = zoology_reference.lookup(run["model"], run["width"], vocab, test_settings)
    run["zoology"] = None if published is None else {
        "accuracy": published[0], "state_bytes": published[1], "source": zoology_reference.SOURCE}
  return list(best.values())


def write_results(results: dict, workdir: str) -> dict:
  """Writes `{workdir}/mqar.{md,png,json}` of `results` (run_sweep's dict) and returns it."""
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


def markdown_table(results: dict) -> str:
  """One row per (model, width) at its best learning rate: accuracy per test setting, the mean,
  zoology's published mean where it has one (differences above 0.03 in bold), state and params."""
  settings = [split_name(T, kv) for T, kv in results["test_settings"]]
  at = results["state_size_at"]
  header = (["model", "pattern", "width", "best lr (of)", *(s.replace("_", " ") for s in settings),
             "mean", "zoology", "ours - zoology", f"state elems/seq @ T={at}",
             f"state bytes (fp32, zoology's count) @ T={at}", "params"])
  rows = []
  for r in results["best"]:
    z = r.get("zoology")
    diff = "" if z is None else r["mean_accuracy"] - z["accuracy"]
    shown = ("" if z is None else
             f"**{diff:+.3f}**" if abs(diff) > zoology_reference.FLAG_ABOVE else f"{diff:+.3f}")
    rows.append([r["model"], f"`{r['pattern']}`", str(r["width"]),
                 f"{r['learning_rate']:g} ({r.get('rates_done', 1)})",
                 *(f"{r['accuracy'][s]:.3f}" for s in settings), f"{r['mean_accuracy']:.3f}",
                 "" if z is None else f"{z['accuracy']:.2f}", shown,
                 f"{r['state_size']:,}", f"{r['state_bytes']:,}", f"{r['params']:,}"])
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(row) + " |" for row in rows]
  if any(r.get("zoology") for r in results["best"]):
    lines += ["", f"zoology: {zoology_reference.SOURCE}; bold: differs by more than "
              f"{zoology_reference.FLAG_ABOVE}."]
  return "\n".join(lines)


def plot(results: dict, path: str) -> str | None:
  """Left: accuracy per test setting, a line per model. Right: mean accuracy against state bytes
  (zoology's recall-memory figure), a colour per model, zoology's published points hollow."""
  settings = [split_name(T, kv) for T, kv in results["test_settings"]]
  drawn = common.new_figure(1, 2, figsize=(13, 4.8))
  if drawn is None:
    return None
  fig, (left, right) = drawn
  colours = {}
  for r in results["best"]:
    colour = colours.setdefault(r["model"], f"C{len(colours) % 10}")
    left.plot(range(len(settings)), [r["accuracy"][s] for s in settings], "o-", color=colour,
              label=f"{r['model']} ({r['pattern']}, d={r['width']})")
    right.scatter(r["state_bytes"], r["mean_accuracy"], color=colour,
                  label=r["model"] if r["model"] not in right.get_legend_handles_labels()[1] else None)
    right.annotate(f"d={r['width']}", (r["state_bytes"], r["mean_accuracy"]), fontsize=7,
                   xytext=(4, 4), textcoords="offset points")
    z = r.get("zoology")
    if z:
      right.scatter(z["state_bytes"], z["accuracy"], facecolors="none", edgecolors=colour)
  left.set_xticks(range(len(settings)), [s.replace("_", "\n") for s in settings])
  left.set_ylabel("recall accuracy (best learning rate)")
  left.set_ylim(-0.02, 1.02)
  right.set_xscale("log")
  right.set_xlabel(f"state bytes per sequence at T={results['state_size_at']} (fp32, both layers)")
  right.set_ylabel("mean recall accuracy")
  right.set_ylim(-0.02, 1.02)
  if results["best"]:
    left.legend(fontsize=7)
    right.legend(fontsize=7, title="filled: ours, hollow: zoology", title_fontsize=7)
  for ax in (left, right):
    ax.grid(alpha=0.3)
  fig.suptitle("MQAR: two-layer models, short conv + mixer", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return path


def _define_flags():
  sweep.define_flags("mqar_sweep", "runs/mqar")


main = sweep.main_of(load_config, run_sweep)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
