"""experiments/train.py on a mesh (8 simulated CPU devices): sharded steps, and a checkpoint written on
one mesh that resumes on another.

Given the tiny MQAR config of tests/experiments/test_train.py (a Gated DeltaNet + attention hybrid,
AdamW, 4 steps, checkpoints at steps 2 and 4) and its uninterrupted one-device run, when a run on an
fsdp = 2 mesh is killed after step 3 and started again through train.py's command line with
`--mesh_tensor=2 --sharding_rules=tp` (data x tensor = 4 x 2), then it resumes from the step-2
checkpoint onto the new mesh, every step it runs takes and returns parameters, Adam moments and
batches laid out as the "tp" rules say, and every step's loss (the fsdp steps and the tp steps) and
the final parameters equal the one-device run's within 1e-5 (relative). The same checkpoint also
resumes on one device, with the same losses.

One test, one child process: the three runs share the one-device run and its compilation (XLA's
compile time is most of the cost on a CPU).
"""

from __future__ import annotations

import shutil

import jax
from absl import flags
from flax import nnx

from experiments import train
from linear_attention_jax import sharding
from linear_attention_jax.sharding import MeshConfig, make_mesh
from linear_attention_jax.sharding.rules import logical_axes_of
from tests.experiments.test_train import TINY, final_params, losses
from tests.sharding import util
from tests.sharding.multidevice import multidevice

RUN = {**TINY, "steps": 4, "checkpoint_every": 2}  # checkpoints at steps 2 and 4


def config() -> train.TrainConfig:
  return train.load_config("mqar_hybrid", RUN)


def assert_losses_match(got: dict, want: dict):
  assert sorted(got) == sorted(want) == list(range(1, RUN["steps"] + 1)), (got, want)
  errors = {s: abs(got[s] - want[s]) / abs(want[s]) for s in want}
  print("relative loss differences per step:", errors)
  assert max(errors.values()) <= util.TOL, (got, want)


def assert_final_params_match(run: str, reference: str):
  (got, position), (want, _) = final_params(run), final_params(reference)
  assert position == {"train": {"split": "train", "seed": 0, "position": RUN["steps"]}}
  errors = jax.tree.leaves(jax.tree.map(util.rel_rms, got, want))
  print("final parameters: largest relative RMS difference", max(errors))
  assert max(errors) <= util.TOL


def run_main(argv: list[str]):
  """train.py's `main` in this process, on `argv` (flags defined once per process)."""
  if "sharding_rules" not in flags.FLAGS:
    train._define_flags()
  flags.FLAGS(argv)
  train.main(argv[:1])


def record_steps(monkeypatch) -> list:
  """Makes `train.setup_training` record `(state, batch)` going into and coming out of each step."""
  seen, make = [], train.setup_training

  def setup_training(*args, **kwargs):
    setup = make(*args, **kwargs)
    step = setup.train_step

    def recorded(state, batch):
      seen.append((state, batch))
      new, metrics = step(state, batch)
      seen.append((new, None))
      return new, metrics

    setup.train_step = recorded
    return setup

  monkeypatch.setattr(train, "setup_training", setup_training)
  return seen


def _variables(tree):
  return [v for v in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
          if isinstance(v, nnx.Variable)]


@multidevice
def test_a_run_saved_on_one_mesh_resumes_sharded_on_another(tmp_path, monkeypatch, capsys):
  # Given the uninterrupted run on one device
  whole = str(tmp_path / "whole")
  train.train_and_evaluate(config(), whole, progress=False)
  # And the same run on an fsdp = 2 mesh (2 of the 8 devices), killed after step 3: its last
  # checkpoint is step 2
  killed = str(tmp_path / "killed")
  fsdp = make_mesh(MeshConfig(data=1, fsdp=2), devices=jax.devices()[:2])
  assert train.train_and_evaluate(config(), killed, progress=False, mesh=fsdp, rules="fsdp",
                                  interrupt_after=3) is None
  on_one = str(tmp_path / "on_one")
  shutil.copytree(killed, on_one)
  # When train.py's command line starts it again with the tensor-parallel rules on all 8 devices
  seen = record_steps(monkeypatch)
  sets = [f"--set={k}={v!r}" if isinstance(v, str) else f"--set={k}={v}" for k, v in RUN.items()]
  capsys.readouterr()
  run_main(["train.py", "--config=mqar_hybrid", f"--workdir={killed}", "--noprogress",
            "--mesh_tensor=2", "--sharding_rules=tp", *sets])
  out = capsys.readouterr().out
  print(out)
  # Then it resumed from step 2 onto data x tensor = 4 x 2
  assert "sharded: tp (data=4, tensor=2) over 8 cpu devices" in out
  assert "resumed from step 2" in out
  # And every loss, the fsdp steps' and the tp steps', and the final parameters are the one-device
  # run's
  assert_losses_match(losses(killed), losses(whole))
  assert_final_params_match(killed, whole)
  # And steps 3 and 4 ran on the mesh: parameters and Adam moments split as their logical axes say
  # (in and out), batch rows over ("data", "fsdp")
  assert len(seen) == 4
  mesh = sharding.make_mesh(MeshConfig(tensor=2))
  for state, batch in seen:
    if batch is not None:
      tokens = batch["tokens"]
      assert tokens.sharding.spec == sharding.to_spec(("batch", "seq"), "tp", mesh)
      assert tokens.sharding.shard_shape(tokens.shape) == (RUN["data.batch_size"] // 4, 16)
    for var in _variables(state):
      x = var.get_value()
      if x.is_deleted():  # a step's input, donated to it: checked before the call
        continue
      assert x.sharding.mesh.shape == mesh.shape, x.sharding
      names = logical_axes_of(var)
      assert x.sharding.spec == (sharding.to_spec(names, "tp", mesh) if names
                                 else jax.sharding.PartitionSpec()), (names, x.sharding.spec)
  final, _ = seen[-1]
  q = final["params"]["blocks"][0]["mixer"]["q_proj"]["kernel"].get_value()  # [embed, heads]
  assert q.sharding.shard_shape(q.shape) == (q.shape[0], q.shape[1] // 2)
  mu = final["opt_state"][1][0].mu["blocks"][0]["mixer"]["q_proj"]["kernel"].get_value()
  assert mu.sharding.is_equivalent_to(q.sharding, q.ndim)
  # And the fsdp checkpoint resumes on one device as well
  train.train_and_evaluate(config(), on_one, progress=False)
  assert_losses_match(losses(on_one), losses(whole))
  assert_final_params_match(on_one, whole)
