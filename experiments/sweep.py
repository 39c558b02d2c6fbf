"""Running a sweep's runs: each trained once (in worker processes when asked), read back when finished.

A run is a directory and a `train.TrainConfig`. It is finished when its `summary.json` exists, its
`config.json` is the same config and it reached the config's steps; a finished run is read back, never
trained again, so an interrupted sweep resumes (a run cut off mid-way resumes from its last checkpoint).
Each run writes its summary the moment it finishes.

A deadline (`time.monotonic()` seconds, or a `Budget` shared by several sweeps) stops the sweep from
starting runs: a run starts only while the time left exceeds the longest run finished so far under
that budget (0 before the first), so the last one started still ends near the deadline. Runs not
started are left out of the returned summaries.

A run that fails is reported and left out; the others go on. With several workers, one that ran out of
accelerator memory beside the others is tried once more at the end, by itself in a fresh process.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import multiprocessing
import os
import time

from experiments import configs, train


@dataclasses.dataclass
class Budget:
  """A deadline (`time.monotonic()` seconds; None: none) and the longest run finished under it."""
  deadline: float | None = None
  longest: float = 0.0

  def may_start(self) -> bool:
    return self.deadline is None or self.deadline - time.monotonic() > self.longest

  def left(self) -> str:
    return "" if self.deadline is None else f", {max(self.deadline - time.monotonic(), 0):.0f} s left"


def train_run(run_dir: str, run_dict: dict, progress: bool) -> dict:
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


def _pool(workers: int) -> concurrent.futures.Executor:
  """The processes that train a sweep's runs (spawned: JAX does not survive fork)."""
  return concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))


def out_of_memory(error: str) -> bool:
  """Whether a run's error (its type and first line) says the accelerator ran out of memory."""
  return "RESOURCE_EXHAUSTED" in error or "out of memory" in error.lower()


def finished(run_dir: str, run_config: train.TrainConfig) -> dict | None:
  """The summary of a run that already finished with this config, else None."""
  try:
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
      summary = json.load(f)
    with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
      same = json.load(f) == configs.to_dict(run_config)
  except FileNotFoundError:
    return None
  return summary if same and summary.get("step") == run_config.steps else None


def run_all(runs: list[tuple[str, train.TrainConfig]], *, workers: int = 1, progress: bool = True,
            deadline: float | Budget | None = None) -> dict[str, dict]:
  """`{run_dir: summary}` of the runs finished before (read back) or now, in the order given."""
  budget = deadline if isinstance(deadline, Budget) else Budget(deadline)
  summaries, todo = {}, []
  for run_dir, run_config in runs:
    done = finished(run_dir, run_config)
    if done is None:
      todo.append((run_dir, configs.to_dict(run_config)))
    else:
      summaries[run_dir] = done
  if not todo:
    return summaries
  may_start = budget.may_start
  if may_start():
    print(f"training {len(todo)} of {len(runs)} runs ({workers} at a time{budget.left()})")

  def record(run_dir, summary):
    summaries[run_dir] = summary
    budget.longest = max(budget.longest, summary["seconds"])
    print(f"done: {os.path.basename(run_dir)}: mean accuracy {summary['eval/accuracy']:.3f} "
          f"({summary['seconds']:.0f} s)", flush=True)

  failed = {}

  def attempt(run_dir, result):  # one run's failure (out of memory, say) stops no other run
    try:
      record(run_dir, result())
    except Exception as error:  # noqa: BLE001: reported below, and the run is left out
      first = str(error).splitlines()[0] if str(error) else ""
      failed[run_dir] = f"{type(error).__name__}: {first}"
      print(f"FAILED: {os.path.basename(run_dir)}: {failed[run_dir]}", flush=True)

  if workers == 1:
    for run_dir, run_dict in todo:
      if not may_start():
        break
      print(f"--- {os.path.basename(run_dir)}", flush=True)
      attempt(run_dir, functools.partial(train_run, run_dir, run_dict, progress))
  else:
    queue, alone = list(todo), []
    with _pool(workers) as pool:
      running = {}
      while queue or running:
        while queue and len(running) < workers and may_start():
          run_dir, run_dict = queue.pop(0)
          running[pool.submit(train_run, run_dir, run_dict, False)] = (run_dir, run_dict)
        if not running:
          break
        done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
        for future in done:
          run_dir, run_dict = running.pop(future)
          attempt(run_dir, future.result)
          if run_dir in failed and out_of_memory(failed[run_dir]):
            alone.append((run_dir, run_dict))
    # A run that ran out of accelerator memory beside the others is tried once more, by itself, in a
    # fresh process: the pool's processes, idle or not, keep what their runs allocated until they exit.
    for run_dir, run_dict in alone:
      if not may_start():
        break
      print(f"--- {os.path.basename(run_dir)}: again, alone (out of memory beside other runs)",
            flush=True)
      del failed[run_dir]
      with _pool(1) as pool:
        attempt(run_dir, pool.submit(train_run, run_dir, run_dict, False).result)
  if failed:
    print(f"{len(failed)} of {len(runs)} runs failed (left out of the tables; a rerun tries them "
          f"again): " + "; ".join(f"{os.path.basename(d)}: {e}" for d, e in failed.items()))
  left = len(todo) - sum(run_dir in summaries for run_dir, _ in todo) - len(failed)
  if left:
    print(f"{left} of {len(runs)} runs not trained yet: no time left (rerun to go on)")
  return {run_dir: summaries[run_dir] for run_dir, _ in runs if run_dir in summaries}


def define_flags(config: str, workdir: str):
  """The absl flags of a sweep script (mqar.py, recall.py): its config, overrides, workdir, progress
  bars and time budget."""
  from absl import flags
  flags.DEFINE_string("config", config, "Config name in experiments/configs/ or a path to one.")
  flags.DEFINE_multi_string("set", [], "Override KEY=VALUE (dotted keys, e.g. train.steps=2000).")
  flags.DEFINE_string("workdir", workdir, "Where the tables, plot, JSON and runs are written.")
  flags.DEFINE_bool("progress", True, "Show a progress bar per run.")
  flags.DEFINE_float("time_budget_s", 0, "Start no run once this many seconds are spent (0: no limit); "
                     "the tables cover the runs finished, and a rerun goes on.")


def main_of(load_config, run_sweep):
  """The `main(argv)` of a sweep script: loads its config from the flags and runs it in the budget."""
  def main(argv):
    from absl import app, flags
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    train.quiet_logs()
    deadline = time.monotonic() + f.time_budget_s if f.time_budget_s > 0 else None
    run_sweep(load_config(f.config, f.set), f.workdir, progress=f.progress, deadline=deadline)
  return main
