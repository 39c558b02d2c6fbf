"""train.py: exact resume, checkpoints that a killed write leaves behind are never restored, and a
smoke run per data source and through the command line."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import data, train
from experiments.checkpoint import Checkpointer
from experiments.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = {  # width 32, 2 layers, T = 16, 6 steps; a checkpoint every 3 steps
    "steps": 6, "log_every": 1, "eval_every": 0, "eval_batches": 1, "checkpoint_every": 3,
    "keep_checkpoints": 2, "model.width": 32, "model.num_heads": 2, "model.impl": "recurrent",
    "model.chunk_size": 16, "data.batch_size": 8, "data.mqar.vocab_size": 32,
    "data.mqar.train_settings": [[16, 2], [16, 4]], "data.mqar.test_settings": [[16, 4]],
    "optimizer.warmup_steps": 2,
}


def tiny_config(**changes) -> train.TrainConfig:
  return train.load_config("mqar_hybrid", {**TINY, **changes})


def losses(workdir) -> dict[int, float]:
  return {r["step"]: r["train/loss"] for r in read_metrics(os.path.join(workdir, "metrics.jsonl"))
          if "train/loss" in r}


def final_params_and_state(workdir):
  with Checkpointer(os.path.join(workdir, "checkpoints"), every=0, keep=2) as ckpt:
    return ckpt.restore(ckpt.latest_step())


def final_params(workdir):
  state, position = final_params_and_state(workdir)
  return state["params"], position


def test_resume_after_a_kill_continues_exactly(tmp_path):
  config = tiny_config()
  # Given an uninterrupted run of 6 steps
  whole = str(tmp_path / "whole")
  train.train_and_evaluate(config, whole, progress=False)
  # And a run killed after step 4, whose last checkpoint is step 3
  killed = str(tmp_path / "killed")
  assert train.train_and_evaluate(config, killed, progress=False, interrupt_after=4) is None
  assert Checkpointer(os.path.join(killed, "checkpoints"), every=3, keep=2).latest_step() == 3
  # When it is started again on the same workdir
  summary = train.train_and_evaluate(config, killed, progress=False)
  # Then it resumed at step 3 and every later step has the uninterrupted run's loss, to the bit
  expected, got = losses(whole), losses(killed)
  print("losses, uninterrupted:", expected, "\nresumed:", got)
  assert sorted(got) == list(range(1, 7))  # the killed run's step-4 record was replaced, not repeated
  assert all(got[s] == expected[s] for s in range(1, 7)), (got, expected)
  # And the final parameters and data position are identical
  (p_whole, pos_whole), (p_killed, pos_killed) = final_params(whole), final_params(killed)
  assert pos_whole == pos_killed == {"train": {"split": "train", "seed": 0, "position": 6}}
  for a, b in zip(jax.tree.leaves(p_whole), jax.tree.leaves(p_killed)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert summary["step"] == 6 and summary["checkpoint_steps"] == [3, 6]
  # And starting the finished run again trains nothing and reports the same evaluation
  records = read_metrics(os.path.join(killed, "metrics.jsonl"))
  again = train.train_and_evaluate(config, killed, progress=False)
  assert again["eval/accuracy"] == summary["eval/accuracy"]
  assert read_metrics(os.path.join(killed, "metrics.jsonl")) == records


def test_a_half_written_checkpoint_is_never_restored(tmp_path):
  config = tiny_config()
  workdir = str(tmp_path / "run")
  ckpt_dir = os.path.join(workdir, "checkpoints")
  train.train_and_evaluate(config, workdir, progress=False, interrupt_after=4)
  # Given the step-6 save killed mid-write: orbax writes into "<step>.orbax-checkpoint-tmp" and
  # renames only when complete, so what a kill leaves is that folder, here half copied from step 3
  leftover = os.path.join(ckpt_dir, "6.orbax-checkpoint-tmp")
  shutil.copytree(os.path.join(ckpt_dir, "3"), leftover)
  for path in glob.glob(os.path.join(leftover, "state", "**", "*"), recursive=True)[::2]:
    if os.path.isfile(path):
      with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
  # When the checkpoint directory is opened again
  ckpt = Checkpointer(ckpt_dir, every=3, keep=2)
  # Then only the finalised step is listed
  assert ckpt.all_steps() == [3] and ckpt.latest_step() == 3
  ckpt.close()
  # And training resumes from step 3, and the leftover is cleaned away before its first save
  summary = train.train_and_evaluate(config, workdir, progress=False)
  assert sorted(losses(workdir)) == list(range(1, 7)) and summary["checkpoint_steps"] == [3, 6]
  assert not os.path.exists(leftover)


def test_a_save_killed_before_its_rename_leaves_nothing_restorable(tmp_path, monkeypatch):
  from orbax.checkpoint._src.path import atomicity

  async def killed(self):  # the process dies after writing every file, before the rename
    raise RuntimeError("killed before the rename")

  monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", killed)
  config = tiny_config()
  workdir = str(tmp_path / "run")
  # Given a run whose first save (step 3) was written by orbax but never finalised
  with pytest.raises(Exception, match="killed before the rename"):
    train.train_and_evaluate(config, workdir, progress=False)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  # (the failed save's temporary folder is removed on the way out; a real kill leaves it behind)
  assert "3" not in os.listdir(ckpt_dir)
  monkeypatch.undo()
  # Then restore finds no checkpoint, and opening the directory has already removed the leftover (so a
  # second manager opened next does not race the first one's deletion of it): a new run starts from 0
  with Checkpointer(ckpt_dir, every=3, keep=2) as ckpt:
    assert ckpt.latest_step() is None and ckpt.all_steps() == []
    assert not any("orbax-checkpoint-tmp" in name for name in os.listdir(ckpt_dir))
  summary = train.train_and_evaluate(config, workdir, progress=False)
  assert summary["checkpoint_steps"] == [3, 6] and sorted(losses(workdir)) == list(range(1, 7))


def tensorboard_tags(logdir) -> set[str]:
  """Scalar tags in the event files under `logdir` (TFRecord framing: length, crc, event, crc)."""
  from tensorboardX.proto import event_pb2
  tags = set()
  for path in glob.glob(os.path.join(logdir, "events.out.tfevents.*")):
    with open(path, "rb") as f:
      blob = f.read()
    offset = 0
    while offset < len(blob):
      length = int.from_bytes(blob[offset:offset + 8], "little")
      event = event_pb2.Event.FromString(blob[offset + 12:offset + 12 + length])
      tags |= {value.tag for value in event.summary.value}
      offset += 12 + length + 4
  return tags


def test_text_source_trains_in_bfloat16_and_writes_metrics_tensorboard_and_plot(tmp_path):
  # Given the embedded corpus (Python's stdlib sources), byte-level, T = 32, bf16 activations and
  # parameters
  config = train.load_config("text_small", {
      "steps": 4, "log_every": 2, "eval_every": 2, "eval_batches": 1, "checkpoint_every": 2,
      "model.width": 32, "model.depth": 2, "model.pattern": "GA", "model.num_heads": 2,
      "model.chunk_size": 32, "model.dtype": "bfloat16", "model.param_dtype": "bfloat16",
      "data.batch_size": 4,
      "data.text.seq_len": 32, "optimizer.warmup_steps": 1})
  # When it trains for 4 steps
  summary = train.train_and_evaluate(config, str(tmp_path), progress=False)
  # Then the losses are finite, the evaluation ran on the held-out bytes, and every output exists
  assert np.isfinite(summary["train/loss"]) and 0 <= summary["eval/valid/accuracy"] <= 1
  records = read_metrics(summary["metrics"])
  assert [r["step"] for r in records if "train/loss" in r] == [2, 4]
  assert [r["step"] for r in records if "eval/loss" in r] == [2, 4]
  if summary["tensorboard"] is not None:  # tensorboardX installed
    assert {"train/loss", "train/tokens_per_s", "eval/valid/accuracy"} <= tensorboard_tags(
        summary["tensorboard"])
  assert summary["plot"] is None or os.path.getsize(summary["plot"]) > 0
  assert summary["checkpoint_steps"] == [2, 4]
  # And the checkpoint holds bf16 parameters and float32 optimizer moments
  state, _ = final_params_and_state(str(tmp_path))
  assert {x.dtype for x in jax.tree.leaves(state["params"])} == {np.dtype(jnp.bfloat16)}
  assert {x.dtype for x in jax.tree.leaves(state["opt_state"]) if x.ndim} == {np.dtype(np.float32)}
  with open(tmp_path / "config.json", encoding="utf-8") as f:
    assert json.load(f)["data"]["source"] == "text"


def test_text_source_reads_a_local_file(tmp_path):
  path = tmp_path / "notes.txt"
  path.write_bytes(bytes(range(256)) * 4)
  source = data.ByteTextSource(data.TextConfig(path=str(path), seq_len=8, valid_fraction=0.25), 3)
  batch = source.batch("train", seed=0, index=5)
  assert batch["tokens"].shape == batch["targets"].shape == (3, 8)
  np.testing.assert_array_equal(batch["targets"][:, :-1], batch["tokens"][:, 1:])
  np.testing.assert_array_equal(batch["tokens"], source.batch("train", seed=0, index=5)["tokens"])
  assert source.batch("valid", 0, 0)["tokens"].max() <= 255


def test_main_trains_from_flags_and_says_where_everything_is(tmp_path):
  sets = [f"--set={k}={v!r}" if isinstance(v, str) else f"--set={k}={v}" for k, v in TINY.items()]
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "train.py"), "--config=mqar_hybrid",
         f"--workdir={tmp_path}", "--noprogress", *sets, "--set=steps=3"]
  done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode == 0, done.stderr[-3000:]
  assert "final eval accuracy" in done.stdout
  assert f"checkpoint: {tmp_path}/checkpoints/3" in done.stdout
  assert os.path.exists(tmp_path / "summary.json") and os.path.exists(tmp_path / "metrics.jsonl")


def test_main_rejects_an_unknown_override(tmp_path):
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "train.py"), f"--workdir={tmp_path}",
         "--set=model.widht=64"]
  done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode != 0 and "model.widht" in done.stderr


def test_only_process_zero_writes_metrics_plots_and_summaries(tmp_path, monkeypatch):
  # Given a process that is not process 0 of a multi-host job
  monkeypatch.setattr(train, "is_primary", lambda: False)
  # When it trains (checkpoints are collective: every process takes part)
  summary = train.train_and_evaluate(tiny_config(), str(tmp_path), progress=False)
  # Then it saved checkpoints but wrote none of process 0's files
  assert summary["checkpoint_steps"] == [3, 6]
  assert sorted(os.listdir(tmp_path)) == ["checkpoints"]


def test_evaluation_in_row_pieces_equals_the_whole_batch():
  # One device evaluates a batch a few rows at a time so that a large batch, length and vocabulary
  # never hold all their logits at once; the sums are those of one forward over the whole batch.
  config = tiny_config()
  source = data.make_source(config.data)
  setup = train.setup_training(config, config.lm_config(source.vocab_size))
  batch = source.batch(source.eval_splits[0], 1, 0)
  params = setup.state["params"]
  whole = train.eval_step(params, batch, graphdef=setup.graphdef)
  pieces = train.eval_step(params, batch, graphdef=setup.graphdef, rows=2)
  np.testing.assert_allclose(np.array(pieces, np.float64), np.array(whole, np.float64), rtol=1e-5)
  assert int(whole[2]) > 0
  assert train.eval_rows(256, 1024) == 32 and train.eval_rows(8, 16, tokens=48) == 2
  assert train.eval_rows(6, 16, tokens=64) == 3 and train.eval_rows(4, 10**6) == 1
  # The setup's step on one device is the bounded one, with the same sums
  np.testing.assert_allclose(np.array(setup.eval_step(params, batch), np.float64),
                             np.array(whole, np.float64), rtol=1e-5)
