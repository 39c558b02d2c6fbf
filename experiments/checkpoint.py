"""Checkpoints of a training run with orbax: the train state and the data iterator's position.

Layout under the run's checkpoint directory (one folder per saved step):

    <dir>/<step>/state/...            params, optimizer state and step (orbax's standard pytree format)
    <dir>/<step>/data/...             JSON: {"train": {"split", "seed", "position"}}
    <dir>/<step>/manifest.json        sha256 of every file above, and the state's shapes and dtypes
    <dir>/<step>.corrupt/             a step that failed verification, moved aside (never deleted)

Atomicity is orbax's: a step is written into `<step>.orbax-checkpoint-tmp-<timestamp>` and renamed to
`<step>` only once every item is complete (on file systems with atomic rename; orbax falls back to a
`commit_success` marker elsewhere). Orbax lists only finalised steps, so a run killed mid-write leaves
a temporary folder that restore never picks up; the manager deletes such leftovers when it opens the
directory. Saves run in the background; the next save and `close()` wait for the one in flight.

Integrity (orbax keeps no checksums of its own):
- sealing: once a save has finished, its files are hashed into `manifest.json`; only then are the
  oldest steps beyond `keep` deleted, so rotation never removes the newest verified step.
- `restore_latest` tries the steps newest first: the manifest's hashes, orbax's restore, and finite
  floating-point arrays. A step that fails is moved aside to `<step>.corrupt` with a line saying why,
  and the next older one is tried. A step without a manifest (killed between its rename and its
  sealing) is checked by the last two alone.
- a state whose shapes or dtypes differ from the manifest's raises `CheckpointMismatch` at once: a
  changed model config, not a corrupt file; nothing is moved or written.
- a failed write (a full disk, a permission error) raises `CheckpointWriteError`, whose message is one
  line naming the path and the cause; the steps saved before it stay as they were.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

MANIFEST = "manifest.json"


class CheckpointMismatch(ValueError):
  """The train state to restore into does not have the checkpoint's shapes (the config changed)."""


class CheckpointWriteError(OSError):
  """A save failed on the file system; the message is one line: the path and the cause."""


class Checkpointer:
  """Saves every `every` steps (and when forced), keeps the newest `keep`, restores the newest intact.

  Args:
    directory: where the step folders live (created if missing).
    every: save at steps that are multiples of `every` (0: only forced saves).
    keep: how many of the newest checkpoints to keep (counted once a save is sealed).
  """

  def __init__(self, directory: str, *, every: int, keep: int):
    if every < 0 or keep < 1:
      raise ValueError(f"need checkpoint_every >= 0 and keep_checkpoints >= 1; got {every=} {keep=}")
    self.directory = os.path.abspath(directory)
    self.every = every
    self.keep = keep
    self._pending = None  # (step, shapes) of a save not yet sealed
    self._failed = None  # the CheckpointWriteError of a failed save: later saves are refused
    try:
      options = ocp.CheckpointManagerOptions(max_to_keep=None, create=True,
                                             cleanup_tmp_directories=True)
      self.manager = ocp.CheckpointManager(self.directory, options=options,
                                           item_names=("state", "data"))
    except OSError as e:
      raise _write_error(e, self.directory, "open") from None
    # The manager deletes a killed run's temporary folders in a background thread, awaited only by its
    # next save; a second manager opened on the same directory before that (a restart, a check of the
    # latest step) starts its own deletion of the same folders and one of the two fails. Waiting here
    # makes the deletion part of opening the directory.
    await_cleanup = getattr(self.manager, "_maybe_await_cleanup_tmp_directory", None)
    if await_cleanup is not None:
      await_cleanup()

  def step_path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def latest_step(self) -> int | None:
    """The newest finalised step, or None."""
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def due(self, step: int) -> bool:
    """Whether `save(step, ...)` would save (without force)."""
    return bool(self.every and step % self.every == 0 and step not in self.manager.all_steps())

  def save(self, step: int, state, data_state: dict, *, force: bool = False) -> bool:
    """Starts saving `state` (a pytree) and `data_state` (JSON) at `step` if it is due (or forced);
    first seals the save before it. Raises `CheckpointWriteError` when this or an earlier save failed."""
    if not (self.due(step) or (force and step not in self.manager.all_steps())):
      return False
    self._seal()
    try:
      started = self.manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=True)
    except Exception as e:  # orbax wraps the file system's error; find it
      raise self._fail(e, step) from None
    self._pending = (step, _shapes(state))
    return started

  def _seal(self):
    """Waits for the save in flight, writes its manifest, then deletes the oldest steps beyond `keep`."""
    if self._failed is not None:
      raise self._failed
    try:
      self.manager.wait_until_finished()
      self.manager.check_for_errors()
    except Exception as e:
      raise self._fail(e, self._pending[0] if self._pending else None) from None
    if self._pending is None:
      return
    step, shapes = self._pending
    self._pending = None
    path = self.step_path(step)
    try:
      if jax.process_index() == 0:
        manifest = {"step": step, "files": _hashes(path), "shapes": shapes}
        with open(os.path.join(path, MANIFEST), "w", encoding="utf-8") as f:
          json.dump(manifest, f, indent=0)
      self.manager.reload()
      for old in self.all_steps()[:-self.keep]:
        self.manager.delete(old)
    except OSError as e:
      raise self._fail(e, step) from None

  def _fail(self, error: BaseException, step) -> CheckpointWriteError:
    where = self.step_path(step) if step is not None else self.directory
    self._failed = _write_error(error, where, f"save step {step}")
    return self._failed

  def restore(self, step: int, abstract_state=None):
    """`(state, data_state)` of `step`, unverified. `abstract_state` (e.g. from `jax.eval_shape`)
    gives the pytree structure, shapes and dtypes; without it the state comes back as nested dicts."""
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    return restored.state, restored.data

  def restore_latest(self, abstract_state, say=print):
    """`(step, state, data_state)` of the newest step that verifies, or `(None, None, None)`.

    Steps that fail verification are moved aside (`<step>.corrupt`) and `say` gets one line per step
    naming it and why. Raises `CheckpointMismatch` when `abstract_state`'s shapes differ from a
    step's manifest: that is a changed config, and nothing is moved. `abstract_state` None: restore as
    nested dicts, with no shape check.
    """
    expected = None if abstract_state is None else _shapes(abstract_state)
    for step in sorted(self.all_steps(), reverse=True):
      problem = self._verify_files(step, expected)
      if problem is None:
        try:
          state, data_state = self.restore(step, abstract_state)
        except Exception as e:  # pylint: disable=broad-except  (any failure: try an older step)
          problem = f"orbax could not restore it ({type(e).__name__}: {_first_line(e)})"
        else:
          problem = _non_finite(state)
          if problem is None:
            return step, state, data_state
      aside = self.step_path(step) + ".corrupt"
      if jax.process_index() == 0:
        os.replace(self.step_path(step), aside)
      self.manager.reload()
      older = [s for s in self.all_steps() if s < step]
      say(f"checkpoint step {step} is corrupt: {problem}; moved to {aside}; "
          + (f"trying step {older[-1]}" if older else "no older checkpoint: starting from step 0"))
    return None, None, None

  def _verify_files(self, step: int, expected: dict) -> str | None:
    path = self.step_path(step)
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest_path):
      return None  # not sealed (killed right after the rename): orbax's restore and finiteness decide
    try:
      with open(manifest_path, encoding="utf-8") as f:
        manifest = json.load(f)
      files, shapes = manifest["files"], manifest["shapes"]
    except (OSError, ValueError, KeyError, TypeError) as e:
      return f"unreadable {MANIFEST} ({_first_line(e)})"
    if expected is not None and shapes != expected:
      diff = [k for k in sorted(set(shapes) | set(expected)) if shapes.get(k) != expected.get(k)]
      shown = "; ".join(f"{k}: checkpoint {shapes.get(k)}, config {expected.get(k)}" for k in diff[:4])
      raise CheckpointMismatch(
          f"the checkpoint at {path} does not fit this run's model: {len(diff)} arrays differ "
          f"({shown}{'; ...' if len(diff) > 4 else ''}); the config changed since it was saved: "
          f"resume with the old config or start in a new workdir")
    actual = _hashes(path)
    bad = sorted(name for name in set(files) | set(actual) if files.get(name) != actual.get(name))
    if bad:
      return f"{len(bad)} files differ from {MANIFEST} ({', '.join(bad[:3])})"
    return None

  def close(self):
    """Seals the save in flight, then releases the manager."""
    try:
      if self._failed is None:
        self._seal()
    finally:
      if self._failed is not None:
        try:
          self.manager.wait_until_finished()
        except Exception:  # pylint: disable=broad-except  (already reported as self._failed)
          pass
        self._remove_leftovers()
      self.manager.close()

  def _remove_leftovers(self, timeout_s: float = 10.0):
    """Deletes a failed save's temporary folders. The save's other items may still be being written
    for a moment after the failure (orbax does not cancel them), so deletion repeats until the
    folders stay gone: a directory opened next then has nothing to clean up that is still growing."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      leftovers = [n for n in os.listdir(self.directory) if ".orbax-checkpoint-tmp" in n]
      if not leftovers:
        time.sleep(0.2)  # and still none a moment later
        if not any(".orbax-checkpoint-tmp" in n for n in os.listdir(self.directory)):
          return
      for name in leftovers:
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
      time.sleep(0.1)

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc):
    self.close()


def _shapes(tree) -> dict[str, str]:
  """`{path: "dtype[shape]"}` of a pytree of arrays (or of `jax.ShapeDtypeStruct`s)."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(path): f"{np.dtype(x.dtype).name}{list(np.shape(x))}"
          for path, x in leaves}


def _hashes(path: str) -> dict[str, str]:
  out = {}
  for root, _, names in os.walk(path):
    for name in names:
      full = os.path.join(root, name)
      rel = os.path.relpath(full, path)
      if rel == MANIFEST:
        continue
      digest = hashlib.sha256()
      with open(full, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
          digest.update(block)
      out[rel] = digest.hexdigest()
  return out


def _non_finite(state) -> str | None:
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  for path, x in leaves:
    if np.issubdtype(np.dtype(x.dtype), np.inexact) and not bool(jax.numpy.isfinite(x).all()):
      return f"non-finite values in {jax.tree_util.keystr(path)}"
  return None


def _first_line(error: BaseException) -> str:
  text = str(error).strip()
  return text.splitlines()[0][:200] if text else type(error).__name__


def _os_error(error: BaseException) -> OSError | None:
  """The OSError in `error`'s chain (orbax wraps them in its own exceptions and exception groups)."""
  seen, todo = set(), [error]
  while todo:
    e = todo.pop()
    if e is None or id(e) in seen:
      continue
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno is not None:
      return e
    todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
  return None


def _write_error(error: BaseException, where: str, action: str) -> CheckpointWriteError:
  cause = _os_error(error)
  if cause is None:
    return CheckpointWriteError(f"checkpoint: could not {action} at {where}: "
                                f"{type(error).__name__}: {_first_line(error)}")
  target = cause.filename or where
  out = CheckpointWriteError(f"checkpoint: could not {action} at {where}: "
                             f"{os.strerror(cause.errno)} ({target})")
  out.errno = cause.errno
  return out
