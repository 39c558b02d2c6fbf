"""Checkpoints of a training run with orbax: the train state and the data iterator's position.

Layout under the run's checkpoint directory (one folder per saved step):

    <dir>/<step>/state/...      params, optimizer state and step (orbax's standard pytree format)
    <dir>/<step>/data/...       JSON: {"train": {"split", "seed", "position"}}

Atomicity is orbax's: a step is written into `<step>.orbax-checkpoint-tmp-<timestamp>` and renamed to
`<step>` only once every item is complete (on file systems with atomic rename; orbax falls back to a
`commit_success` marker elsewhere). Orbax lists only finalised steps, so a run killed mid-write leaves
a temporary folder that restore never picks up; the manager deletes such leftovers when it opens the
directory. Saves run in the background; `close()` waits for the last one.
"""

from __future__ import annotations

import os

import orbax.checkpoint as ocp


class Checkpointer:
  """Saves every `every` steps (and when forced), keeps the newest `keep`, restores the latest.

  Args:
    directory: where the step folders live (created if missing).
    every: save at steps that are multiples of `every` (0: only forced saves).
    keep: how many of the newest checkpoints to keep.
  """

  def __init__(self, directory: str, *, every: int, keep: int):
    if every < 0 or keep < 1:
      raise ValueError(f"need checkpoint_every >= 0 and keep_checkpoints >= 1; got {every=} {keep=}")
    self.directory = os.path.abspath(directory)
    self.every = every
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, cleanup_tmp_directories=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data"))
    # The manager deletes a killed run's temporary folders in a background thread, awaited only by its
    # next save; a second manager opened on the same directory before that (a restart, a check of the
    # latest step) starts its own deletion of the same folders and one of the two fails. Waiting here
    # makes the deletion part of opening the directory.
    await_cleanup = getattr(self.manager, "_maybe_await_cleanup_tmp_directory", None)
    if await_cleanup is not None:
      await_cleanup()

  def latest_step(self) -> int | None:
    """The newest finalised step, or None."""
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, state, data_state: dict, *, force: bool = False) -> bool:
    """Starts saving `state` (a pytree) and `data_state` (JSON) at `step` if it is due (or forced)."""
    due = force or (self.every and step % self.every == 0)
    if not due or step in self.manager.all_steps():
      return False
    return self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=True)

  def restore(self, step: int, abstract_state=None):
    """`(state, data_state)` of `step`. `abstract_state` (e.g. from `jax.eval_shape`) gives the pytree
    structure, shapes and dtypes; without it the state comes back as nested dicts of arrays."""
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    return restored.state, restored.data

  def close(self):
    """Waits for a save in flight, then releases the manager."""
    self.manager.wait_until_finished()
    self.manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc):
    self.close()
