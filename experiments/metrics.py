"""Metrics of a run: JSON lines, TensorBoard event files, and a PNG of the curves.

Every record is `{"step": n, "<name>": value, ...}` with names such as `train/loss` or
`eval/T64_kv8/accuracy`; the same scalars go to TensorBoard under the same tags (through tensorboardX,
which needs no TensorFlow; skipped with a note when it is not installed). On resume from step N the
JSONL file drops the records after N, and TensorBoard is told to purge them, so the curves show the
resumed run once.
"""

from __future__ import annotations

import json
import os

from experiments import common

try:
  from tensorboardX import SummaryWriter
except ImportError:  # optional: setup.py's "experiments" extra
  SummaryWriter = None

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def read_metrics(path: str) -> list[dict]:
  """The records of a JSONL metrics file (an empty list when there is none)."""
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


class MetricsWriter:
  """Appends records to `{workdir}/metrics.jsonl` and `{workdir}/tensorboard/`.

  Args:
    workdir: the run's directory.
    resume_step: the step the run restarts from; records after it are dropped (None: a fresh run, so
      all earlier records are dropped).
    enabled: False writes nothing (the other processes of a multi-host job: process 0 writes).
  """

  def __init__(self, workdir: str, resume_step: int | None = None, enabled: bool = True):
    self.path = os.path.join(workdir, METRICS_FILE)
    self.tensorboard_dir = os.path.join(workdir, TENSORBOARD_DIR)
    self.enabled = enabled
    self._tb = None
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    keep = [r for r in read_metrics(self.path) if resume_step is not None and r["step"] <= resume_step]
    with open(self.path, "w", encoding="utf-8") as f:
      f.writelines(json.dumps(r) + "\n" for r in keep)
    if SummaryWriter is not None:
      purge = None if resume_step is None else resume_step + 1
      self._tb = SummaryWriter(logdir=self.tensorboard_dir, purge_step=purge, flush_secs=10)

  @property
  def has_tensorboard(self) -> bool:
    return self._tb is not None

  def write(self, step: int, scalars: dict[str, float]):
    if not self.enabled:
      return
    record = {"step": int(step), **{k: float(v) for k, v in scalars.items()}}
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(json.dumps(record) + "\n")
    if self._tb is not None:
      for name, value in scalars.items():
        self._tb.add_scalar(name, float(value), int(step))

  def close(self):
    if self._tb is not None:
      self._tb.close()


def plot_curves(records: list[dict], path: str, title: str = "") -> str | None:
  """Loss (left) and accuracy (right) against the step: train and every eval split. Returns the path,
  or None without matplotlib."""
  drawn = common.new_figure(1, 2, figsize=(11, 4))
  if drawn is None:
    return None
  fig, axes = drawn
  for ax, metric in zip(axes, ("loss", "accuracy")):
    names = sorted({k for r in records for k in r if k.endswith("/" + metric)},
                   key=lambda k: (not k.startswith("train"), k))
    for name in names:
      points = [(r["step"], r[name]) for r in records if name in r]
      style = "-" if name.startswith("train") else "o-"
      label = name.rsplit("/", 1)[0]
      ax.plot(*zip(*points), style, label="eval (mean of splits)" if label == "eval" else label,
              markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    if metric == "loss" and names:
      ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if names:
      ax.legend(fontsize=7)
  if title:
    fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return path
