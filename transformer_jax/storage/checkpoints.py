"""Orbax checkpoints of the training state, the data iterator and the run's config fingerprint.

Layout: `<workdir>/checkpoints/<step>/` holds three items of one composite checkpoint:
  state/       the training state, any pytree of jax arrays (params, optimizer state, step, PRNG key
               data), written with `StandardSave` (OCDBT + zarr3, one file set per process);
  data_state/  the input iterator's position, a small JSON dict (e.g. {'epoch': 3, 'position': 120});
  metadata/    {'fingerprint': ...}, the config values that must match for a resume to be valid.
  sha256.json  {relative path: SHA-256} of every file above, written by process 0 once the step has committed.

Orbax writes each step into a temporary directory and renames it once every process has finished,
so a save cut short by preemption never appears in `all_steps()`. Damage after the fact (a
truncated or deleted file, or flipped bytes that would restore without error: `sha256.json`) is caught by
`restore_latest`, which falls back to the previous step; `restore` and `restore_subtree` (averaging, export)
verify the checksums first and name the file that differs.

A save that fails in orbax's background thread (disk full, a permission changed, a failing write)
raises `CheckpointSaveError` naming its step from the first `save` call after the failure (at the latest
from the next save that is due, which waits for it), or from `wait_until_finished`/`close`. Orbax deletes
old steps beyond `max_to_keep` only after a new step has committed, so every step written before the
failure stays on disk and the newest of them restorable.

Every public method is multi-host safe in the usual orbax sense: all processes call it with the
same arguments; orbax writes each process's shards and synchronises the processes itself.

The checks around orbax's reads and writes (the checksums, the committed steps, the processes' agreement,
shardings on every leaf, JSON items) are `checkpoint_checks`'. Which checkpoints the final evaluation averages or
picks (§6.1), and the best-by-BLEU saves, are `evaluation/selection.py`'s.
"""
from __future__ import annotations

import math
import os
import time
from typing import Any, NamedTuple

from absl import logging
from etils import epath
import jax
from jax.experimental import multihost_utils
import orbax.checkpoint as ocp

from transformer_jax import errors
from transformer_jax.storage import checkpoint_checks
from transformer_jax.storage import workdir as workdir_lib

PyTree = Any

_STATE = 'state'
_DATA_STATE = 'data_state'
_METADATA = 'metadata'


class CheckpointSaveError(errors.UserError, RuntimeError):
  """A checkpoint save failed; the message names the step, the directory and the steps left on disk."""


class Restored(NamedTuple):
  """What `CheckpointManager.restore_latest` returns."""
  step: int         # The checkpoint's step (its directory name).
  state: PyTree     # Same structure as the abstract state, arrays with its shardings.
  data_state: dict  # The data iterator's state as saved (JSON types: lists, not tuples).


class CheckpointManager:
  """Saves and restores `(state, data_state)` under `<workdir>/checkpoints` with orbax.

  A thin wrapper over `ocp.CheckpointManager`: saves are asynchronous (the device-to-host copy
  happens before `save` returns, so the caller may donate or delete the state right after), old
  checkpoints beyond `max_to_keep` are deleted, and a config fingerprint stored with every step
  guards against resuming a run with an incompatible config.

  Usage (all processes):
    manager = CheckpointManager(workdir, max_to_keep=config.train.max_checkpoints_to_keep,
                                save_interval_steps=config.train.checkpoint_every_steps,
                                fingerprint={'model': dict(config.model), ...})
    restored = manager.restore_latest(abstract_state)  # None on a fresh workdir.
    ...
    manager.save(step, state, data_state)                   # No-op between intervals.
    manager.save(last_step, state, data_state, force=True)  # At the end of training.
    manager.close()
  """

  def __init__(self, workdir: str | os.PathLike[str], *, max_to_keep: int | None = None,
               save_interval_steps: int = 1, fingerprint: dict | None = None,
               async_save: bool = True, read_only: bool = False, subdir: str = workdir_lib.CHECKPOINTS,
               best_metric: str | None = None):
    """Opens (and, once the fingerprint check has passed, creates) `<workdir>/<subdir>`.

    Args:
      workdir: the run's directory; checkpoints go to its `checkpoints` subdirectory.
      max_to_keep: newest checkpoints kept; older ones are deleted after each save. None keeps
        all. Keep at least `config.eval.average_last_n` for Sec. 6.1 averaging.
      save_interval_steps: `save` writes only at multiples of this many steps unless forced or
        at a preemption sync point.
      fingerprint: config values that must agree with the run already in `workdir` (nested dicts
        allowed, e.g. {'model': {'d_model': 512}, 'data': {'vocab_size': 37000}}). Checked by
        `check_compatible` before anything is written, and stored with every checkpoint.
      async_save: write in a background thread; `wait_until_finished` blocks until done.
      read_only: open for restoring only (e.g. a notebook beside a running job): creates nothing and
        leaves temporary directories of saves in progress alone.
      subdir: the folder under `workdir` ('checkpoints'; 'best_checkpoints' for the best by a metric).
      best_metric: keep the `max_to_keep` checkpoints with the highest `metrics[best_metric]` (given to
        `save`) instead of the newest; every save must then pass metrics.

    Raises:
      ValueError: if `max_to_keep` or `save_interval_steps` is not positive.
      errors.ConfigError: if the fingerprint differs from the one stored in `workdir` (see `check_compatible`).
    """
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f'max_to_keep must be positive or None; got {max_to_keep}.')
    if save_interval_steps < 1:
      raise ValueError(f'save_interval_steps must be positive; got {save_interval_steps}.')
    self._workdir = os.fspath(workdir)
    if '://' not in self._workdir:  # orbax needs absolute paths; gs:// and other URLs already are.
      self._workdir = os.path.abspath(self._workdir)
    self._directory = os.path.join(self._workdir, subdir)
    self._best_metric = best_metric
    self._save_interval_steps = save_interval_steps
    self._pending_step: int | None = None  # A started save not yet confirmed complete.
    self._unrecorded: list[int] = []  # Steps this manager saved whose checksums are not written yet.
    # The same naming orbax uses by default (`<step>`, committed steps only); kept here so that the
    # fingerprint can be read before the orbax manager creates anything on disk.
    self._name_format = ocp.step.standard_name_format()
    self._read_only = read_only
    # The SHA-256 of the run's vocabulary (`fingerprint.vocabulary_sha256`), stored with every save and compared
    # with the one stored in a checkpoint before it is restored; None: neither.
    self.vocabulary_sha256: str | None = None
    self._fingerprint = None if fingerprint is None else checkpoint_checks.to_json(fingerprint, 'fingerprint')
    if fingerprint is not None:
      self.check_compatible(fingerprint)
    if read_only:  # Restores only: creates nothing and never cleans up a save in progress.
      self._manager = ocp.CheckpointManager(self._directory, options=ocp.CheckpointManagerOptions(
          read_only=True, create=False, cleanup_tmp_directories=False,
          # Lists the step folders without reading each one's metadata, which a trainer may delete meanwhile.
          lightweight_initialize=True,
          step_name_format=self._name_format, enable_async_checkpointing=False))
      return
    self._manager = ocp.CheckpointManager(
        self._directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            best_fn=None if best_metric is None else (lambda metrics: metrics[best_metric]),
            best_mode='max',
            keep_checkpoints_without_metrics=best_metric is None,
            # Orbax's default policy would also write the first step of a fresh run.
            save_decision_policy=ocp.checkpoint_managers.AnySavePolicy([
                ocp.checkpoint_managers.FixedIntervalPolicy(save_interval_steps),
                ocp.checkpoint_managers.PreemptionCheckpointingPolicy()]),
            step_name_format=self._name_format,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,  # Leftovers of saves cut short by preemption.
            create=True))

  @property
  def directory(self) -> str:
    """`<workdir>/checkpoints`."""
    return self._directory

  def check_compatible(self, fingerprint: dict) -> None:
    """Raises if the run stored in the workdir was made with a different fingerprint.

    Compares against the newest checkpoint whose metadata can be read. Reads only: a fresh or
    empty workdir, or a run saved without a fingerprint, passes.

    Args:
      fingerprint: see `__init__`. Nested dicts are compared key by key ('model.d_model'); values
        are compared after a JSON round trip, so a tuple equals the list it was saved as.

    Raises:
      errors.ConfigError: naming every differing key with the stored and the given value.
    """
    found = self._stored_fingerprint()
    if found is not None:
      checkpoint_checks.check_fingerprint(found[1], fingerprint, where=f'the checkpoint at step {found[0]} in '
                                          f'{self._directory}', workdir=self._workdir)

  def _stored_fingerprint(self) -> tuple[int, dict] | None:
    """(step, fingerprint) of the newest checkpoint with readable metadata, or None."""
    if not os.path.isdir(self._directory):
      return None
    steps = sorted((m.step for m in self._name_format.find_all(self._directory)), reverse=True)
    for step in steps:
      try:
        metadata = checkpoint_checks.read_json_item(os.path.join(self._step_path(step), _METADATA))
      except errors.DamagedFileError as e:
        logging.warning('%s Trying the previous step.', e)
        continue
      fingerprint = metadata.get('fingerprint')
      return None if fingerprint is None else (step, fingerprint)
    return None

  def _step_path(self, step: int) -> str:
    return os.path.join(self._directory, self._name_format.build_name(step))

  def save(self, step: int, state: PyTree, data_state: dict, force: bool = False,
           metrics: dict[str, float] | None = None) -> bool:
    """Starts saving `state` and `data_state` as checkpoint `step`.

    Args:
      step: the training step the state belongs to (number of updates applied).
      state: pytree of jax arrays (any sharding), numpy arrays or numpy scalars.
      data_state: JSON-serialisable dict (numpy scalars are converted); copied before returning.
      force: save even if `step` is not a multiple of `save_interval_steps`.
      metrics: scalars stored with the step (needed when the manager keeps the best by `best_metric`).

    Returns:
      True if a save was started; False if `step` is not a multiple of `save_interval_steps`
      (and neither forced nor at a preemption sync point, where orbax saves so that a preempted
      multi-host job loses no work), or if checkpoint `step` already exists (orbax never
      overwrites a step). Calling `save` every step is therefore cheap and correct.

    Raises:
      RuntimeError: if the manager was opened read-only.
      ValueError: if `data_state` is not JSON-serialisable.
      CheckpointSaveError: if an earlier save has failed in the background (checked without blocking
        at every call, and by waiting for it before a save that is due), or this save fails to start.
    """
    if self._read_only:
      raise RuntimeError(f'The checkpoints in {self._directory} were opened read-only: not saving step {step}.')
    data_state = checkpoint_checks.to_json(data_state, 'data_state')
    self._raise_if_failed(wait=force or step % self._save_interval_steps == 0)
    if step in self._manager.all_steps():
      logging.info('Checkpoint step %d already exists in %s; not saving it again.', step,
                   self._directory)
      return False
    previous, self._pending_step = self._pending_step, step
    try:
      started = self._manager.save(
          step,
          args=ocp.args.Composite(**{
              _STATE: ocp.args.StandardSave(state),
              _DATA_STATE: ocp.args.JsonSave(data_state),
              _METADATA: ocp.args.JsonSave({'fingerprint': self._fingerprint, 'step': int(step)}
                                           | ({'vocabulary_sha256': self.vocabulary_sha256}
                                              if self.vocabulary_sha256 else {})),
          }),
          metrics=None if metrics is None else {k: float(v) for k, v in metrics.items()},
          force=force)
    except Exception as e:  # pylint: disable=broad-except
      # Orbax first waits for a save still in flight (only at a preemption save between intervals).
      raise self._save_error(step if previous is None else previous, e) from e
    if not started:
      self._pending_step = previous
    else:
      self._unrecorded.append(step)
    return started

  def _raise_if_failed(self, wait: bool) -> None:
    """Raises CheckpointSaveError if the save in flight has failed; waits for it to end if `wait`."""
    if self._pending_step is None or not (wait or not self._manager.is_saving_in_progress()):
      return
    try:
      self._manager.wait_until_finished()  # Re-raises the background thread's exception.
    except Exception as e:  # pylint: disable=broad-except
      raise self._save_error(self._pending_step, e) from e
    self._pending_step = None
    self._record_checksums()

  def _record_checksums(self) -> None:
    """Writes the checksums of the steps saved since the last call (all committed by now; process 0)."""
    steps, self._unrecorded = self._unrecorded, []
    if jax.process_index() != 0:
      return
    for step in steps:
      step_dir = epath.Path(self._step_path(step))
      if step_dir.is_dir():  # Not deleted meanwhile (max_to_keep).
        checkpoint_checks.write_checksums(step_dir)

  def _save_error(self, step: int, error: Exception) -> CheckpointSaveError:
    self._pending_step = None
    kept = checkpoint_checks.committed_steps(self._directory)
    newest = f'the newest, step {kept[-1]}, was complete before this save' if kept else 'none is restorable'
    logging.error('Checkpoint step %d failed: %s: %s', step, type(error).__name__, error)
    return CheckpointSaveError(
        f'Saving checkpoint step {step} in {self._directory} failed ({type(error).__name__}: {error}). '
        f'Stopped so that no further steps run unsaved. Steps on disk: {kept} ({newest}); '
        'free space or fix the permissions, then rerun to resume.')

  def metrics(self, step: int) -> dict[str, float] | None:
    """The metrics saved with checkpoint `step` (see `save`), or None."""
    return self._manager.metrics(step)

  def best_steps(self) -> list[int]:
    """Committed steps, best first by `best_metric` (ties: the earlier step first); newest first without it."""
    steps = self.all_steps()
    if self._best_metric is None:
      return steps[::-1]
    return sorted(steps, key=lambda step: (-(self.metrics(step) or {}).get(self._best_metric, -math.inf), step))

  def wait_until_finished(self) -> None:
    """Blocks until the last asynchronous save is on disk (and old steps are deleted).

    Raises:
      CheckpointSaveError: if that save failed.
    """
    self._raise_if_failed(wait=True)
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases orbax's threads.

    Raises:
      CheckpointSaveError: if the last save failed (orbax's threads are released all the same).
    """
    try:
      self._raise_if_failed(wait=True)
    finally:
      self._manager.close()

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def reload(self) -> list[int]:
    """Lists the committed steps again (a trainer beside a reader adds and deletes them); returns them, ascending."""
    self._manager.reload()
    return self.all_steps()

  def latest_step(self) -> int | None:
    """The newest committed step, or None. It may still be unreadable: see `restore_latest`."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """Committed steps, ascending."""
    return sorted(self._manager.all_steps())

  def restore(self, step: int, abstract_state: PyTree) -> tuple[PyTree, dict]:
    """Restores checkpoint `step` onto the shardings of `abstract_state`.

    The saving and restoring device counts may differ (e.g. saved on 8 devices, restored on 1):
    orbax reads each target shard from the saved chunks.

    Args:
      step: a step in `all_steps()`.
      abstract_state: the state's structure, with a `jax.ShapeDtypeStruct` per leaf carrying
        shape, dtype and sharding, e.g. `jax.eval_shape` output with NamedShardings attached.

    Returns:
      (state, data_state): state has abstract_state's structure, dtypes and shardings.

    Raises:
      ValueError: if `step` is not a committed step or a leaf has no sharding. Errors from orbax
        (a damaged checkpoint, a structure or shape mismatch) propagate.
      ChecksumError: if a file differs from the checksums recorded when the step was saved.
      errors.DamagedFileError: for a step folder that holds another step (renamed), or a damaged record.
      errors.ConfigError: for a checkpoint trained with another vocabulary than `vocabulary_sha256`.
    """
    self._check_step(step)
    checkpoint_checks.require_shardings(abstract_state, 'abstract_state')
    checkpoint_checks.verify_checksums(self._step_path(step))
    self._check_identity(step)
    restored = self._manager.restore(
        step,
        args=ocp.args.Composite(**{
            _STATE: ocp.args.StandardRestore(abstract_state),
            _DATA_STATE: ocp.args.JsonRestore(),
        }))
    saved_step = getattr(restored[_STATE], 'step', None)
    if saved_step is not None and int(jax.device_get(saved_step)) != step:
      raise errors.DamagedFileError(
          f'{self._step_path(step)} holds the training state of step {int(jax.device_get(saved_step))}, not of step '
          f'{step}: the folder was renamed or copied in. Move it away (or name it after its step) and rerun.')
    return restored[_STATE], restored[_DATA_STATE]

  def _check_identity(self, step: int) -> None:
    """`checkpoint_checks.check_identity` of checkpoint `step` against this folder and this run's vocabulary."""
    metadata = checkpoint_checks.read_json_item(os.path.join(self._step_path(step), _METADATA))
    checkpoint_checks.check_identity(metadata, self._step_path(step), step, self.vocabulary_sha256)

  def restore_latest(self, abstract_state: PyTree) -> Restored | None:
    """Restores the newest checkpoint that can be read completely.

    A damaged step (a file truncated or deleted after the save committed) is skipped with an absl
    warning naming the step and the error, and the previous step is tried.

    Args:
      abstract_state: see `restore`.

    Returns:
      Restored(step, state, data_state), or None if the workdir holds no checkpoint.

    With several processes, all of them restore the same step: they must list the same steps
    (else the workdir is not shared), and a step that fails on any process is skipped by all.

    Raises:
      ValueError: if checkpoints exist but none can be restored. Failing every step is more
        likely a mismatch between `abstract_state` and the saved state than damage to all of
        them, and training from scratch in a workdir with newer steps would never save again.
      errors.ConfigError: if the processes list different steps (the workdir is not shared storage), or from
        `restore` for a checkpoint of another vocabulary.
    """
    checkpoint_checks.require_shardings(abstract_state, 'abstract_state')
    steps = self.all_steps()
    checkpoint_checks.agree_across_processes(steps, f'the checkpoint steps in {self._directory}')
    failures = []
    for step in reversed(steps):
      try:
        state, data_state = self.restore(step, abstract_state)
        error = None
      except errors.ConfigError:
        raise  # Another run's checkpoint, not damage: the previous step would hide it.
      except Exception as e:  # pylint: disable=broad-except
        error = f'{type(e).__name__}: {e}'
      if not checkpoint_checks.all_processes(error is None):
        error = error or 'unusable on another process'
        logging.warning('Checkpoint step %d in %s is unusable (%s); trying the previous one.',
                        step, self._directory, error)
        failures.append(f'step {step}: {error}')
        continue
      return Restored(step, state, data_state)
    if failures:
      raise ValueError(f'No checkpoint in {self._directory} could be restored:\n'
                       + '\n'.join(failures))
    return None

  def set_aside_newer_than(self, step: int, target_dir: str | os.PathLike[str]) -> list[int]:
    """Moves every checkpoint newer than `step` (unreadable ones that `restore_latest` skipped) to target_dir.

    They are moved rather than deleted because a read error may be transient, and their files tell what
    went wrong; the resumed run writes those steps again (orbax never overwrites a step). Each lands in
    `<target_dir>/<step>.<YYYYmmdd-HHMMSS>`, with a warning. All processes call it; process 0 moves.

    Returns:
      The steps moved, ascending.

    Raises:
      RuntimeError: if the manager was opened read-only.
      errors.RunFolderError: if a newer step is still listed afterwards.
    """
    if self._read_only:
      raise RuntimeError(f'The checkpoints in {self._directory} were opened read-only: not moving any.')
    newer = [s for s in self.all_steps() if s > step]
    self._manager.wait_until_finished()
    if jax.process_index() == 0 and newer:
      target = epath.Path(target_dir)
      target.mkdir(parents=True, exist_ok=True)
      for moved in newer:
        destination = target / f'{moved}.{time.strftime("%Y%m%d-%H%M%S")}'
        epath.Path(self._step_path(moved)).rename(destination)
        logging.warning('Moved unusable checkpoint step %d to %s; resuming from step %d.', moved, destination,
                        step)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices('unusable checkpoints moved')
    self._manager.reload()
    left = [s for s in self.all_steps() if s > step]
    if left:
      raise errors.RunFolderError(f'Unusable checkpoint steps {left} are still in {self._directory}; move them away '
                                  'and rerun.')
    return newer

  def restore_subtree(self, step: int, abstract_subtree: PyTree,
                      subtree: str = 'params') -> PyTree:
    """Restores only `state[subtree]` of checkpoint `step` (e.g. params without Adam moments).

    Args:
      step: a step in `all_steps()`.
      abstract_subtree: abstract arrays with shardings (see `restore`) for that subtree.
      subtree: the top-level key (dict state) or attribute (dataclass state) to read.

    Returns:
      The subtree with abstract_subtree's structure, dtypes and shardings.

    Raises:
      ValueError: if `step` is not a committed step, a leaf has no sharding, or the checkpoint
        lacks a leaf of `abstract_subtree`.
      ChecksumError: if a file differs from the checksums recorded when the step was saved.
      errors.DamagedFileError, errors.ConfigError: as `restore`.
    """
    self._check_step(step)
    checkpoint_checks.require_shardings(abstract_subtree, 'abstract_subtree')
    checkpoint_checks.verify_checksums(self._step_path(step))
    self._check_identity(step)
    item = {subtree: abstract_subtree}
    # StandardRestore cannot restore part of a tree, and the composite manager binds the `state`
    # item to the handler it first saw; a separate PyTree checkpointer reads the same files.
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
      restored = checkpointer.restore(
          os.path.join(self._step_path(step), _STATE),
          args=ocp.args.PyTreeRestore(
              item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
              partial_restore=True))
    # A partial restore hands back the abstract leaf for any path the checkpoint lacks.
    missing = [jax.tree_util.keystr(path)
               for path, leaf in jax.tree_util.tree_leaves_with_path(restored)
               if isinstance(leaf, jax.ShapeDtypeStruct)]
    if missing:
      raise ValueError(f'Checkpoint step {step} in {self._directory} has no leaves '
                       f'{missing[:5]}{" ..." if len(missing) > 5 else ""}.')
    return restored[subtree]

  def _check_step(self, step: int) -> None:
    if step not in self._manager.all_steps():
      raise ValueError(f'No checkpoint for step {step} in {self._directory}; '
                       f'steps: {self.all_steps()}.')


