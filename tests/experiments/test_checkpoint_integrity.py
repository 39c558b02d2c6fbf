"""Nothing lost, nothing silent: a corrupt newest checkpoint falls back to the newest intact one, a
changed config stops before anything is overwritten, a full disk or a permission error ends in one
line naming the path and the cause, and a non-finite loss never becomes a checkpoint."""

from __future__ import annotations

import errno
import glob
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from orbax.checkpoint._src.handlers import json_checkpoint_handler

from experiments import data, train
from experiments.checkpoint import CheckpointMismatch, Checkpointer, CheckpointWriteError
from tests.experiments.test_train import losses, tiny_config

CONFIG = dict(steps=8, checkpoint_every=2, keep_checkpoints=3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """An uninterrupted 8-step run and one killed after step 6 (checkpoints 2, 4, 6)."""
  root = tmp_path_factory.mktemp("runs")
  whole, killed = str(root / "whole"), str(root / "killed")
  train.train_and_evaluate(tiny_config(**CONFIG), whole, progress=False)
  train.train_and_evaluate(tiny_config(**CONFIG), killed, progress=False, interrupt_after=6)
  return whole, killed


def copy_of(run, tmp_path) -> str:
  out = str(tmp_path / "run")
  shutil.copytree(run, out)
  return out


def flip_bytes(step_dir: str, count: int = 64):
  """Flips `count` bytes in the middle of the largest file of the step's state."""
  files = [p for p in glob.glob(os.path.join(step_dir, "state", "**", "*"), recursive=True)
           if os.path.isfile(p)]
  path = max(files, key=os.path.getsize)
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2 - count // 2)
    chunk = f.read(count)
    f.seek(-len(chunk), 1)
    f.write(bytes(b ^ 0xFF for b in chunk))


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_intact_one(runs, tmp_path, capsys):
  whole, killed = runs
  workdir = copy_of(killed, tmp_path)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  # Given 64 bytes flipped in the newest step's data file
  flip_bytes(os.path.join(ckpt_dir, "6"))
  # When the run is started again
  summary = train.train_and_evaluate(tiny_config(**CONFIG), workdir, progress=False)
  # Then it says which step was corrupt and why, and resumes from step 4
  out = capsys.readouterr().out
  print(out)
  assert "checkpoint step 6 is corrupt" in out and "trying step 4" in out
  assert "resumed from step 4" in out
  # And every later step has the uninterrupted run's loss, to the bit
  expected, got = losses(whole), losses(workdir)
  assert all(got[s] == expected[s] for s in range(5, 9)), (got, expected)
  assert np.isfinite(summary["eval/loss"])
  # And the corrupt step was moved aside, not deleted; the steps kept are verified ones
  assert os.path.isdir(os.path.join(ckpt_dir, "6.corrupt"))
  assert summary["checkpoint_steps"] == [4, 6, 8]


def test_a_changed_model_config_stops_before_anything_is_overwritten(runs, tmp_path):
  _, killed = runs
  workdir = copy_of(killed, tmp_path)
  before = {p: open(p, "rb").read() for p in glob.glob(os.path.join(workdir, "**", "*"), recursive=True)
            if os.path.isfile(p)}
  # When it resumes with a wider model
  with pytest.raises(CheckpointMismatch, match=r"does not fit this run's model.*config changed") as e:
    train.train_and_evaluate(tiny_config(**CONFIG, **{"model.width": 48}), workdir, progress=False)
  print(e.value)
  assert "\n" not in str(e.value)
  # Then config.json, the checkpoints and the metrics are byte for byte what they were
  after = {p: open(p, "rb").read() for p in glob.glob(os.path.join(workdir, "**", "*"), recursive=True)
           if os.path.isfile(p)}
  assert after == before


def poison_batch(monkeypatch, position: int):
  """The batch at `position` (step position + 1) holds a token id past the vocabulary: NaN logits."""
  original = data.Batches.__next__

  def poisoned(self):
    at = self.position
    batch = original(self)
    if at == position:
      batch = dict(batch, tokens=np.full_like(batch["tokens"], 10**6))
    return batch

  monkeypatch.setattr(data.Batches, "__next__", poisoned)


def test_a_non_finite_loss_stops_the_run_before_it_becomes_a_checkpoint(tmp_path, monkeypatch):
  poison_batch(monkeypatch, position=4)  # step 5
  workdir = str(tmp_path / "run")
  with pytest.raises(train.NonFiniteLoss, match="step 5: non-finite loss.*newest checkpoint: step 4"):
    train.train_and_evaluate(tiny_config(**CONFIG), workdir, progress=False)
  with Checkpointer(os.path.join(workdir, "checkpoints"), every=0, keep=3) as ckpt:
    assert ckpt.all_steps() == [2, 4]


def test_skip_leaves_a_non_finite_step_out_and_goes_on(tmp_path, monkeypatch, capsys):
  poison_batch(monkeypatch, position=4)
  workdir = str(tmp_path / "run")
  summary = train.train_and_evaluate(tiny_config(**CONFIG, on_nonfinite="skip"), workdir,
                                     progress=False)
  assert "skipped steps [5]" in capsys.readouterr().out
  assert summary["step"] == 8 and np.isfinite(summary["eval/loss"])
  assert all(np.isfinite(v) for v in losses(workdir).values())
  with Checkpointer(os.path.join(workdir, "checkpoints"), every=0, keep=3) as ckpt:
    step, state, _ = ckpt.restore_latest(None)
    assert step == 8 and all(np.isfinite(np.asarray(x)).all() for x in _leaves(state))


def _leaves(tree):
  import jax
  return jax.tree.leaves(tree)


STATE = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}


def save_steps(directory, steps, state=STATE, keep=3):
  with Checkpointer(directory, every=1, keep=keep) as ckpt:
    for step in steps:
      ckpt.save(step, state, {"position": step})


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES], ids=["disk_full", "permission"])
def test_a_failed_save_ends_in_one_line_naming_the_path_and_the_cause(tmp_path, monkeypatch, code):
  directory = str(tmp_path / "ckpt")
  save_steps(directory, [1, 2], keep=2)
  original = json_checkpoint_handler.JsonCheckpointHandler._save_fn

  async def failing(self, x, path):
    if x == {"position": 3}:
      raise OSError(code, os.strerror(code), str(path / "metadata"))
    return await original(self, x, path)

  monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", failing)
  # When step 3's write fails
  with pytest.raises(CheckpointWriteError) as e:
    save_steps(directory, [3], keep=2)
  message = str(e.value)
  print(message)
  # Then the error is one line with the step's path and the cause
  assert "\n" not in message and os.strerror(code) in message
  assert os.path.join(directory, "3") in message
  monkeypatch.undo()
  # And the steps saved before it are intact and restore
  with Checkpointer(directory, every=1, keep=2) as ckpt:
    assert ckpt.all_steps() == [1, 2]
    step, state, position = ckpt.restore_latest(None)
  assert step == 2 and position == {"position": 2}
  np.testing.assert_array_equal(state["w"], STATE["w"])


def test_rotation_deletes_only_after_the_new_step_is_sealed(tmp_path):
  directory = str(tmp_path / "ckpt")
  with Checkpointer(directory, every=1, keep=1) as ckpt:
    ckpt.save(1, STATE, {})
    ckpt.save(2, STATE, {})  # seals 1, then starts 2: step 1 stays until 2 is sealed
    assert ckpt.all_steps() == [1, 2]
  with Checkpointer(directory, every=1, keep=1) as ckpt:
    assert ckpt.all_steps() == [2]
    assert os.path.exists(os.path.join(directory, "2", "manifest.json"))


def test_non_finite_parameters_in_the_newest_step_fall_back(tmp_path):
  directory = str(tmp_path / "ckpt")
  save_steps(directory, [1])
  save_steps(directory, [2], state={"w": STATE["w"].at[0, 1].set(jnp.nan), "b": STATE["b"]})
  lines = []
  with Checkpointer(directory, every=1, keep=3) as ckpt:
    step, _, _ = ckpt.restore_latest(None, say=lines.append)
  assert step == 1 and len(lines) == 1 and "non-finite values in ['w']" in lines[0], lines


def test_an_unreadable_data_item_falls_back(tmp_path):
  directory = str(tmp_path / "ckpt")
  save_steps(directory, [1, 2])
  os.remove(os.path.join(directory, "2", "manifest.json"))  # unsealed: orbax's checks alone
  with open(os.path.join(directory, "2", "data", "metadata"), "w") as f:
    f.write("{not json")
  lines = []
  with Checkpointer(directory, every=1, keep=3) as ckpt:
    step, _, position = ckpt.restore_latest(None, say=lines.append)
  assert step == 1 and position == {"position": 1} and "orbax could not restore" in lines[0], lines
