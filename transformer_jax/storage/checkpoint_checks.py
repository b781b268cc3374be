"""The checks `checkpoints.CheckpointManager` makes around orbax's reads and writes, as plain functions.

  write_checksums, verify_checksums  `<step>/sha256.json`: the SHA-256 of every file of a committed step,
                                     recorded once it has committed and checked before any restore
  committed_steps                    the committed steps of a folder, read without opening a manager
  agree_across_processes             every process lists the same steps (the workdir is shared storage)
  all_processes                      a condition holds on every process
  require_shardings                  every leaf of a restore target carries a sharding
  to_json, flatten                   the JSON items (data position, fingerprint) and their dotted keys
  read_json_item                     a step's JSON item (its metadata), a JSON object or one error naming it
  check_identity                     a step's recorded step and vocabulary against its folder and the run's
  check_fingerprint                  a stored config fingerprint against the run's, every differing key named

They read, and write nothing but `sha256.json`; `evaluation/selection.py` checks its averages with
`require_shardings` too.
"""
from __future__ import annotations

import collections.abc
import hashlib
import json
import os
from typing import Any

from etils import epath
import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp

from transformer_jax import errors

PyTree = Any

CHECKSUMS = 'sha256.json'  # In each step's folder, beside the items.


class ChecksumError(errors.DamagedFileError):
  """A checkpoint file's SHA-256 is not the one recorded when the step was saved."""


def _file_digests(step_dir: epath.Path) -> dict[str, str]:
  """{path relative to step_dir: SHA-256} of every file under it except the record itself."""
  digests, folders = {}, [step_dir]
  while folders:  # epath has no recursive glob on remote file systems.
    for path in sorted(folders.pop().iterdir()):
      if path.is_dir():
        folders.append(path)
      elif path.name != CHECKSUMS:
        digest = hashlib.sha256()
        with path.open('rb') as f:
          for block in iter(lambda: f.read(1 << 22), b''):
            digest.update(block)
        digests[str(path.relative_to(step_dir))] = digest.hexdigest()
  return dict(sorted(digests.items()))


def write_checksums(step_dir: str | os.PathLike[str]) -> None:
  """Records the SHA-256 of every file of a committed step in `<step_dir>/sha256.json`."""
  step_dir = epath.Path(step_dir)
  tmp = step_dir / f'{CHECKSUMS}.tmp'
  tmp.write_text(json.dumps(_file_digests(step_dir), indent=1, sort_keys=True))
  tmp.replace(step_dir / CHECKSUMS)


def verify_checksums(step_dir: str | os.PathLike[str]) -> bool:
  """Checks a step's files against its `sha256.json`; False when it has none (saved before the record existed).

  Raises:
    ChecksumError: naming the first file that differs, is missing or was added, or naming `sha256.json` itself
      when it is damaged.
  """
  step_dir = epath.Path(step_dir)
  record = step_dir / CHECKSUMS
  if not record.exists():
    return False
  try:
    expected = json.loads(record.read_text())
  except ValueError as e:  # Cut short, or not UTF-8.
    raise ChecksumError(f'{record} is damaged (not valid JSON: {e}): checkpoint step {step_dir.name} cannot be '
                        'checked.') from None
  if not isinstance(expected, dict) or not all(isinstance(v, str) for v in expected.values()):
    raise ChecksumError(f'{record} is damaged (not a {{file: SHA-256}} object): checkpoint step {step_dir.name} '
                        'cannot be checked.')
  actual = _file_digests(step_dir)
  for name in sorted(set(expected) | set(actual)):
    if expected.get(name) != actual.get(name):
      what = ('is missing' if name not in actual else 'was not in the checkpoint when it was saved'
              if name not in expected else f'has SHA-256 {actual[name]}, not the {expected[name]} recorded at save')
      raise ChecksumError(f'{step_dir / name} {what}: the checkpoint was damaged after it was written.')
  return True


def committed_steps(directory: str | os.PathLike[str]) -> list[int]:
  """The committed checkpoint steps in `directory` (e.g. `<workdir>/checkpoints`), ascending; [] when it does not
  exist. Reads only, and creates nothing (unlike opening a CheckpointManager)."""
  if not epath.Path(directory).is_dir():
    return []
  return sorted(m.step for m in ocp.step.standard_name_format().find_all(epath.Path(directory)))


def agree_across_processes(steps: list[int], what: str) -> None:
  """Raises errors.ConfigError unless every process lists the same steps (a no-op for one process)."""
  if jax.process_count() == 1:
    return
  summary = np.array([len(steps), steps[-1] if steps else -1, hash(tuple(steps)) % (2**31)], np.int64)
  gathered = np.asarray(multihost_utils.process_allgather(summary)).reshape(jax.process_count(), 3)
  if np.any(gathered != gathered[0]):
    seen = {p: f'{int(n)} steps, latest {int(last) if last >= 0 else None}' for p, (n, last, _) in enumerate(gathered)}
    raise errors.ConfigError(f'The processes disagree on {what}: {seen}. The workdir must be shared storage that every '
                             'process reads and writes.')


def all_processes(ok: bool) -> bool:
  """Whether `ok` holds on every process."""
  if jax.process_count() == 1:
    return ok
  return bool(np.all(np.asarray(multihost_utils.process_allgather(np.array([ok])))))


def require_shardings(abstract_tree: PyTree, name: str) -> None:
  """Raises unless every leaf has a sharding (orbax needs them to restore across topologies)."""
  missing = [jax.tree_util.keystr(path)
             for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_tree)
             if getattr(leaf, 'sharding', None) is None]
  if missing:
    raise ValueError(
        f'{name} leaves {missing[:5]}{" ..." if len(missing) > 5 else ""} have no sharding; '
        'attach one to every jax.ShapeDtypeStruct (e.g. a NamedSharding), without which orbax '
        'cannot restore onto a different number of devices.')


def _json_default(value: Any) -> Any:
  if isinstance(value, (np.generic, np.ndarray)):
    return value.tolist()
  raise TypeError(f'{type(value).__name__} {value!r} is not JSON-serialisable')


def to_json(value: dict, name: str) -> dict:
  """A JSON round trip: a deep copy with JSON types, or ValueError naming what failed.

  Raises:
    ValueError: if `value` is not a dict or not JSON-serialisable.
  """
  if not isinstance(value, collections.abc.Mapping):
    raise ValueError(f'{name} must be a dict; got {type(value).__name__}: {value!r}.')
  try:
    return json.loads(json.dumps(dict(value), default=_json_default))
  except (TypeError, ValueError) as e:
    raise ValueError(f'{name} must be JSON-serialisable: {e}; got {value!r}.') from e


def flatten(tree: dict, prefix: str = '') -> dict[str, Any]:
  """{'model': {'d_model': 512}} -> {'model.d_model': 512}."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict) and value:
      flat.update(flatten(value, f'{prefix}{key}.'))
    else:
      flat[f'{prefix}{key}'] = value
  return flat


def read_json_item(path: str | os.PathLike[str]) -> dict:
  """The JSON object orbax stored at `path` (a step's metadata item).

  Raises:
    errors.DamagedFileError: naming `path`, where it cannot be read or holds no JSON object.
  """
  try:
    with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as checkpointer:
      item = checkpointer.restore(path, args=ocp.args.JsonRestore())
  except Exception as e:  # pylint: disable=broad-except
    raise errors.DamagedFileError(f'{path} cannot be read ({type(e).__name__}: {e}).') from None
  if not isinstance(item, dict):
    raise errors.DamagedFileError(f'{path} does not hold a JSON object: the checkpoint is damaged.')
  return item


def check_identity(metadata: dict, step_dir: str, step: int, vocabulary_sha256: str | None) -> None:
  """The step and vocabulary a checkpoint recorded (where it has them) are its folder's name and the run's.

  Args:
    metadata: the step's metadata item (`read_json_item`), with 'step' and 'vocabulary_sha256' where recorded.
    step_dir: the step's folder, named in the errors.
    step: the step its folder's name says.
    vocabulary_sha256: the run's vocabulary hash; None or empty skips the vocabulary check.

  Raises:
    errors.DamagedFileError: naming the folder, for a step folder renamed or copied in under another step.
    errors.ConfigError: naming the folder and both hashes, for a checkpoint of a run with another vocabulary.
  """
  saved_step = metadata.get('step')
  if saved_step is not None and saved_step != step:
    raise errors.DamagedFileError(
        f'{step_dir} holds checkpoint step {saved_step!r}, not step {step}: the folder was renamed or copied in. '
        'Move it away (or name it after its step) and rerun.')
  saved_vocabulary = metadata.get('vocabulary_sha256')
  if saved_vocabulary and vocabulary_sha256 and saved_vocabulary != vocabulary_sha256:
    raise errors.ConfigError(
        f'{step_dir} was trained with the vocabulary of SHA-256 {saved_vocabulary}, but this run\'s is '
        f'{vocabulary_sha256}: the checkpoint comes from another run, and its embeddings index other pieces. '
        'Move it out of the run folder.')


def check_fingerprint(stored: dict, given: dict, *, where: str, workdir: str | os.PathLike[str]) -> None:
  """A run's config fingerprint equals the one stored with its checkpoints.

  Args:
    stored: the fingerprint read from a checkpoint's metadata.
    given: this run's. Nested dicts are compared key by key ('model.d_model'); values after a JSON round trip,
      so a tuple equals the list it was saved as.
    where: the checkpoint `stored` was read from, for the message.
    workdir: the run folder, for the message.

  Raises:
    errors.ConfigError: naming every differing key with the stored and the given value.
  """
  given = flatten(to_json(given, 'fingerprint'))
  stored = flatten(stored)
  absent = object()
  show = lambda values, key: repr(values[key]) if key in values else '(absent)'
  differences = [f'workdir {workdir} holds a run with {key}={show(stored, key)}; this config has '
                 f'{key}={show(given, key)}'
                 for key in sorted(set(stored) | set(given)) if stored.get(key, absent) != given.get(key, absent)]
  if differences:
    raise errors.ConfigError(f'Config does not match {where}:\n  ' + '\n  '.join(differences)
                             + '\nUse a new workdir, or the config the run was started with.')
