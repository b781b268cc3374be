"""The layout of a run's folder (`--workdir`), in one place. Imports neither TensorFlow nor JAX.

  <workdir>/
    config.json                         the run's resolved config at its first start (`record_config`), never rewritten
    config_changes.json                 fields a later start changed, with the step they took effect at
    spm_<vocab_size>.model              the shared BPE vocabulary (tokenizer.py)
    vocabulary.sha256                   its SHA-256, checked whenever the run is opened (experiment.setup)
    checkpoints/<step>/                 TrainState and input position, the last train.max_checkpoints_to_keep
    best_checkpoints/<step>/            parameters of the eval.average_best_n best steps by validation BLEU
    unusable_checkpoints/<step>.<time>/ checkpoints found unreadable at resumption, set aside
    <split>.hyp.<target_lang>           the final evaluation's hypotheses, one line per source line
    final_metrics.json                  the final evaluation's figures (what transformer_jax.tools.report reads)
    run.lock                            held by the one process that writes the run (train, evaluate; `RunLock`)
    compile.json                        --mode=compile's memory and FLOP estimates
    evaluations/<YYYYmmdd-HHMMSS>/      each --mode=evaluate's hypotheses and final_metrics.json
    events.out.tfevents.*               TensorBoard scalars

The package's modules name these files and folders through this module's constants and functions. Paths are
strings, joined with `/`, so that a `gs://` workdir works wherever the writer (orbax, epath, tensorboardX)
supports it.
"""
import datetime
import importlib.util
import json
import logging
import os
import pathlib
import re
import socket
import sys

from etils import epath
import ml_collections

from transformer_jax import errors

CONFIG = 'config.json'
CONFIG_CHANGES = 'config_changes.json'
CHECKPOINTS = 'checkpoints'
BEST_CHECKPOINTS = 'best_checkpoints'
UNUSABLE_CHECKPOINTS = 'unusable_checkpoints'
FINAL_METRICS = 'final_metrics.json'
COMPILE_REPORT = 'compile.json'
EVALUATIONS = 'evaluations'
DECODING_SWEEP = 'decoding_sweep.json'  # --mode=tune_decoding's record, in evaluations/<time>/.
LOCK = 'run.lock'
VOCABULARY_HASH = 'vocabulary.sha256'  # The SHA-256 of the vocabulary the run trained with.


def path(workdir: str | os.PathLike[str], name: str) -> str:
  """`<workdir>/<name>` as a string (name: one of this module's constants, or a file name)."""
  return f'{os.fspath(workdir).rstrip("/")}/{name}'


def vocabulary_file(vocab_size: int) -> str:
  """The vocabulary's file name, `spm_<vocab_size>.model` (a size per file: runs of several sizes may share a
  workdir's folder without overwriting each other's)."""
  return f'spm_{vocab_size}.model'


def hypotheses_file(split: str, target_lang: str) -> str:
  """The final hypotheses' file name, `<split>.hyp.<target_lang>` (e.g. `test.hyp.de`)."""
  return f'{split}.hyp.{target_lang}'


def read_json(file: str | os.PathLike[str], kind: type, remedy: str) -> object:
  """The JSON value in `file`, a run folder's bookkeeping file, which must be of type `kind` (dict or list).

  Raises:
    errors.DamagedFileError: naming the file, when it cannot be read, is not valid JSON (cut short) or holds
      another kind of value; the message ends with `remedy`.
  """
  try:
    value = json.loads(epath.Path(file).read_text(encoding='utf-8'))
  except UnicodeDecodeError as e:
    raise errors.DamagedFileError(f'{file} is damaged (not UTF-8: {e.reason}); {remedy}') from None
  except ValueError as e:
    raise errors.DamagedFileError(f'{file} is damaged (not valid JSON: {e}); {remedy}') from None
  except IsADirectoryError:
    raise errors.DamagedFileError(f'{file} is a directory, not a file; {remedy}') from None
  if not isinstance(value, kind):
    raise errors.DamagedFileError(f'{file} is damaged (it holds a JSON {type(value).__name__}, not a '
                                  f'{"JSON object" if kind is dict else "JSON list"}); {remedy}')
  return value


def _config_changes(workdir: str | os.PathLike[str], config_keys: dict | None = None) -> list:
  """`config_changes.json`'s entries, each checked: {'from_step': int, 'changes': {'<section>.<field>': [old,
  new]}, ...}, with every key a field of the run's config where `config_keys` (config_leaves of it) is given.

  Raises:
    errors.DamagedFileError: naming the file and the entry, for anything else.
  """
  changes_path = path(workdir, CONFIG_CHANGES)
  if not epath.Path(changes_path).exists():
    return []
  remedy = 'restore it from a copy, or remove the damaged entry.'
  history = read_json(changes_path, list, remedy)
  for i, entry in enumerate(history):
    where = f'{changes_path} is damaged (entry {i + 1}'
    if not isinstance(entry, dict) or not isinstance(entry.get('changes'), dict):
      raise errors.DamagedFileError(f'{where} has no "changes" object); {remedy}')
    for key, change in entry['changes'].items():
      if not isinstance(change, list) or len(change) != 2:
        raise errors.DamagedFileError(f'{where}: {key!r} is not an [old, new] pair); {remedy}')
      section, _, name = key.partition('.')
      if not name or config_keys is not None and key not in config_keys:
        raise errors.DamagedFileError(f'{where}: {key!r} is not a <section>.<field> of the config); {remedy}')
  return history


def save_config(config: ml_collections.ConfigDict, workdir: str | os.PathLike[str]) -> str:
  """Writes `<workdir>/config.json` (sorted keys) by writing a temporary file and renaming it; returns its path.

  Tuples come back from JSON as lists (`load_config`); nothing in `config.model` is a tuple.

  Raises:
    OSError: if the workdir cannot be written.
  """
  target = epath.Path(path(workdir, CONFIG))
  target.parent.mkdir(parents=True, exist_ok=True)
  tmp = epath.Path(f'{target}.tmp-{os.getpid()}')
  tmp.write_text(config.to_json_best_effort(indent=2, sort_keys=True), encoding='utf-8')
  tmp.replace(target)  # Overwrites an older config.json (a resumed run).
  return os.fspath(target)


# Config fields that name local files or folders ('SOURCE,TARGET' for the *_files fields).
PATH_FIELDS = ('manual_dir', 'tfds_data_dir', 'train_files', 'eval_files', 'test_files')


def absolute_paths(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Makes the data.* path fields absolute (relative to the working directory), in place, and returns config:
  config.json then names the same files whatever directory --mode=evaluate or the notebook runs from. Empty
  fields and remote paths (gs://...) are left as they are."""
  def absolute(value: str) -> str:
    return value if not value or '://' in value else os.path.abspath(os.path.expanduser(value))
  for field in PATH_FIELDS:
    value = config.data.get(field)
    if isinstance(value, str) and value:
      config.data[field] = ','.join(absolute(part) for part in value.split(','))
  return config


def config_leaves(config, prefix: str = '') -> dict:
  """{'section.field': value} with tuples as lists, nested ones too (as config.json stores them)."""
  leaves = {}
  for key, value in config.items():
    if hasattr(value, 'items'):
      leaves |= config_leaves(value, f'{prefix}{key}.')
    else:
      leaves[f'{prefix}{key}'] = json.loads(json.dumps(value)) if isinstance(value, (tuple, list)) else value
  return leaves


def _write_atomically(target: epath.Path, text: str) -> None:
  tmp = epath.Path(f'{target}.tmp-{os.getpid()}')
  tmp.write_text(text, encoding='utf-8')
  tmp.replace(target)


def record_config(config: ml_collections.ConfigDict, workdir: str | os.PathLike[str], step: int) -> dict:
  """Records the config a training start runs with: `config.json` at the first start, written once; later starts
  whose fields differ from the run's (`load_run_config`) append the changes to `config_changes.json`.

  Call after every check has passed, so that a command that fails leaves the record as it was.

  Args:
    config: the resolved config of this start.
    workdir: the run's folder.
    step: the step training resumes from (the changes take effect at step + 1).

  Returns:
    {'section.field': [run's value, this start's value]} for each changed field ({} for the first start).

  Raises:
    OSError: if the workdir cannot be written.
  """
  target = epath.Path(path(workdir, CONFIG))
  if not target.exists():
    save_config(config, workdir)
    return {}
  before, after = config_leaves(load_run_config(workdir)), config_leaves(config)
  changes = {key: [before.get(key), value] for key, value in after.items() if before.get(key) != value}
  if changes:
    changes_path = epath.Path(path(workdir, CONFIG_CHANGES))
    history = _config_changes(workdir)
    history.append({'from_step': step + 1, 'time': datetime.datetime.now().astimezone().isoformat(timespec='seconds'),
                    'changes': changes})
    _write_atomically(changes_path, json.dumps(history, indent=2, sort_keys=True))
    logging.warning('Resuming at step %d with changed fields (recorded in %s): %s', step + 1, changes_path,
                    ', '.join(f'{key} {old!r} -> {new!r}' for key, (old, new) in changes.items()))
  return changes


def load_run_config(workdir: str | os.PathLike[str]) -> ml_collections.ConfigDict:
  """The config a run last trained with: `config.json`, with the fields the code added since at their defaults
  (`with_defaults`) and every change recorded in `config_changes.json` applied in order.

  Raises:
    errors.MissingFileError: if `<workdir>/config.json` does not exist.
    errors.DamagedFileError: naming the file, if config.json or config_changes.json is not valid JSON, or holds
      something other than a config (an entry of changes that is not {'<section>.<field>': [old, new]}, a key
      that is not a field of the config).
  """
  stored = with_defaults(load_config(path(workdir, CONFIG)))
  for entry in _config_changes(workdir, config_leaves(stored)):
    for key, (_, value) in entry['changes'].items():
      section, name = key.split('.', 1)
      stored[section][name] = value
  return stored


def load_config(config: ml_collections.ConfigDict | str | os.PathLike[str]) -> ml_collections.ConfigDict:
  """Returns a ConfigDict given itself, a `config.json`, a workdir holding one, or a config file.

  Args:
    config: a ConfigDict (returned as is); a path to a JSON file or to a workdir with `config.json`; or a
      Python config file, optionally with an argument as on the command line ('configs/table3.py:B1').
      Config files do `from configs import base`, so the folder above the file's is put on sys.path.

  Raises:
    errors.MissingFileError: naming the path when there is no such file.
    errors.DamagedFileError: naming the file, if a config.json is not valid JSON.
  """
  if isinstance(config, ml_collections.ConfigDict):
    return config
  text = os.fspath(config)
  if os.path.isdir(text):
    text = path(text, CONFIG)
  match = re.fullmatch(r'(.+\.py):(.+)', text)
  file, arg = (match[1], match[2]) if match else (text, '')
  if not epath.Path(file).is_file():
    raise errors.MissingFileError(f'no config file {file!r} (give a ConfigDict, configs/<name>.py or a config.json)')
  if file.endswith('.json'):
    value = read_json(file, dict, 'restore it from a copy, or train in a new --workdir.')
    if not all(isinstance(section, dict) for section in value.values()):
      raise errors.DamagedFileError(f'{file} is damaged (not every config section is a JSON object); restore it '
                                    'from a copy, or train in a new --workdir.')
    return ml_collections.ConfigDict(value)
  root = str(pathlib.Path(file).resolve().parents[1])
  if root not in sys.path:
    sys.path.insert(0, root)
  spec = importlib.util.spec_from_file_location(f'_config_{pathlib.Path(file).stem}', file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def get_config(workdir: str) -> ml_collections.ConfigDict:
  """A run's stored config as a config file: `--config=transformer_jax/storage/workdir.py:<workdir>` loads
  `<workdir>/config.json` (what `main` passes when --config is left out and the workdir has one).

  Raises:
    errors.MissingFileError: if `<workdir>/config.json` does not exist.
  """
  file = path(workdir, CONFIG)
  if not epath.Path(file).is_file():
    raise errors.MissingFileError(f'{file} does not exist: --workdir={workdir} holds no run (pass --config=...)')
  return load_run_config(workdir)


BASE_CONFIG = pathlib.Path(__file__).resolve().parents[2] / 'configs' / 'base.py'


def with_defaults(stored: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A stored config with every field it lacks (added to the code after the run was trained) at its default
  from configs/base.py, which is the behaviour the run had. Returned as is when configs/ is not beside the
  package."""
  if not BASE_CONFIG.is_file():
    return stored
  for section, fields in load_config(BASE_CONFIG).items():
    if section not in stored:
      stored[section] = fields
      continue
    for key, value in fields.items():
      if key not in stored[section]:
        stored[section][key] = value
  return stored


def make_output_dir(output: str | None, workdir: str | os.PathLike[str], stamp: str) -> str:
  """Creates and returns the folder an evaluation writes into, before any work starts: `output` (--output, which
  must not exist or be an empty folder), else a new `<workdir>/evaluations/<stamp>[-<n>]` (created exclusively, so
  that two evaluations never share one).

  Raises:
    errors.PathError: naming the folder and the flag, when it cannot be created (a read-only run folder: pass
      --output=DIR), or --output names a file or a non-empty folder.
  """
  if output:
    target = epath.Path(output)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
      raise errors.PathError(f'--output={output} exists and is not an empty folder: choose a new one.')
    try:
      target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
      raise errors.PathError(f'--output={output} cannot be created ({e.strerror or e}).') from None
    return os.fspath(output)
  stem = path(workdir, f'{EVALUATIONS}/{stamp}')
  for n in range(1000):
    name = stem if n == 0 else f'{stem}-{n}'
    try:
      epath.Path(name).parent.mkdir(parents=True, exist_ok=True)
      epath.Path(name).mkdir(exist_ok=False)
      return name
    except FileExistsError:
      continue
    except OSError as e:
      raise errors.PathError(f'{name} cannot be created ({e.strerror or e}): the run folder is not writable; pass '
                             '--output=DIR to write the evaluation elsewhere.') from None
  raise errors.PathError(f'{stem}-* are all taken: pass --output=DIR.')


def check_report_folder(workdir: str, name: str) -> None:
  """Makes sure, before any long work, that `<workdir>/<name>` can be written: creates the workdir if missing.

  Raises:
    errors.PathError: naming --workdir, when it is a file, or under one, or cannot be created, or `name` in it
      is a folder.
  """
  if '://' in workdir:
    return
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise errors.PathError(f'--workdir={workdir} is a file, not a folder: give a folder for {name}.')
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise errors.PathError(f'--workdir={workdir} cannot be created ({e.strerror or e}).') from None
  if os.path.isdir(path(workdir, name)):
    raise errors.PathError(f'{path(workdir, name)} is a folder: --workdir={workdir} cannot receive {name}.')
  if not os.access(workdir, os.W_OK):
    raise errors.PathError(f'--workdir={workdir} is not writable.')


def check_output_file(output: str) -> None:
  """Checks before any work starts that a file can be written at `output` (--output of --mode=translate): not a
  folder, in a folder that exists and can be written; an existing file must be writable. Writes nothing.

  Raises:
    errors.PathError: naming --output and what is wrong.
  """
  target = pathlib.Path(output)
  if target.is_dir():
    raise errors.PathError(f'--output={output} is a folder: give the path of the file to write.')
  parent = target.parent
  if not parent.is_dir():
    raise errors.PathError(f'--output={output}: the folder {parent} does not exist.')
  if target.exists() and not os.access(target, os.W_OK) or not target.exists() and not os.access(parent, os.W_OK):
    raise errors.PathError(f'--output={output} cannot be written (permissions).')


class WorkdirInUseError(errors.RunFolderError):
  """Another process holds the run folder's `run.lock`."""


class RunLock:
  """One writer per run folder: an exclusive `fcntl.flock` on `<workdir>/run.lock`, a file that stays, holding
  the holder's host, pid, start time and command while it is held (emptied on release).

  The kernel grants the lock to one process at a time and drops it when its holder exits however it ends
  (`kill -9` included), so taking over a dead holder's lock is the same atomic step as taking a free one: of
  any number of processes racing for it, exactly one holds it. A second train or evaluate on the folder stops
  at once with `WorkdirInUseError` naming the holder. A record left by a process on another host (a shared
  folder whose file system may not pass locks between hosts) is not taken over: the error says how to remove
  it. Whatever the file holds (another program's text, binary garbage, a directory in its place), the outcome
  is this one lock or one `errors.UserError` line naming the file. Folders that are not local paths (gs://...)
  are not locked: the caller logs that. Use as a context manager, or `acquire()` and `release()` (release on
  every exit path).
  """

  def __init__(self, workdir: str | os.PathLike[str], purpose: str):
    self.file = path(workdir, LOCK)
    self.purpose = purpose
    self.held = False
    self._fd: int | None = None

  @staticmethod
  def supported(workdir: str | os.PathLike[str]) -> bool:
    """Whether the folder is a local path (where the kernel's file locks work)."""
    return '://' not in os.fspath(workdir)

  def acquire(self) -> 'RunLock':
    """Takes the lock (a free one, or one whose holder on this host has died), and writes this process's record.

    Raises:
      WorkdirInUseError: naming the holder (host, pid, start time, command) and what to do.
      errors.PathError: naming the file, when run.lock cannot be opened or locked (a directory in its place,
        no permission, a file system without locks).
    """
    import fcntl  # pylint: disable=g-import-not-at-top  (POSIX only; the package's lock is POSIX-only too)
    record = {'host': socket.gethostname(), 'pid': os.getpid(), 'purpose': self.purpose,
              'started': datetime.datetime.now().astimezone().isoformat(timespec='seconds'),
              'command': ' '.join(sys.argv)}
    for _ in range(3):
      try:
        fd = os.open(self.file, os.O_RDWR | os.O_CREAT | getattr(os, 'O_CLOEXEC', 0), 0o644)
      except IsADirectoryError:
        raise errors.PathError(f'{self.file} is a directory, not the run\'s lock file: remove it (rmdir) and '
                               'rerun.') from None
      except OSError as e:
        raise errors.PathError(f'{self.file} cannot be opened as the run\'s lock file ({e.strerror}).') from None
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = _parse_lock_record(_read_lock(fd))
        os.close(fd)
        raise WorkdirInUseError(self._in_use_message(holder)) from None
      except OSError as e:
        os.close(fd)
        raise errors.PathError(f'{self.file} cannot be locked ({e.strerror}): this file system does not support '
                               'file locks; use a local --workdir.') from None
      try:
        same = os.fstat(fd).st_ino == os.stat(self.file).st_ino
      except FileNotFoundError:
        same = False
      if not same:  # Deleted or replaced between the open and the lock: lock the file now at that path.
        os.close(fd)
        continue
      text = _read_lock(fd)
      holder = _parse_lock_record(text)
      if holder.get('host') not in (None, record['host']):
        os.close(fd)  # Releases the flock; the other host's record stays.
        raise WorkdirInUseError(self._in_use_message(holder))
      if holder:
        logging.warning('Taking over %s, left by process %s on %s (%s), which no longer runs.', self.file,
                        holder.get('pid'), holder.get('host'), holder.get('started'))
      elif text.strip():
        logging.warning('Taking over %s, which holds no lock record (%d bytes of something else); no process '
                        'holds it.', self.file, len(text))
      os.ftruncate(fd, 0)
      os.pwrite(fd, json.dumps(record).encode('utf-8'), 0)
      os.fsync(fd)
      self._fd, self.held = fd, True
      return self
    raise WorkdirInUseError(f'{self.file} was replaced three times while being locked: another program is '
                            'deleting it; stop it and rerun.')

  def release(self) -> None:
    """Empties the lock file and releases the lock, if this object holds it. The file stays (deleting it would
    let a later process lock a new file while an earlier one still holds the old)."""
    if self.held:
      self.held = False
      fd, self._fd = self._fd, None
      try:
        os.ftruncate(fd, 0)
      except OSError:
        pass
      os.close(fd)  # Releases the flock.

  def __enter__(self) -> 'RunLock':
    return self.acquire()

  def __exit__(self, *exc_info) -> None:
    self.release()

  def holder(self) -> dict:
    """The record in the lock file now ({} when empty or not a lock record), without locking."""
    try:
      with open(self.file, 'rb') as f:
        return _parse_lock_record(f.read(65536).decode('utf-8', 'replace'))
    except OSError:
      return {}

  def _in_use_message(self, holder: dict) -> str:
    who = (f"process {holder.get('pid')} on {holder.get('host')}, {holder.get('purpose', 'a run')} since "
           f"{holder.get('started')} ({holder.get('command')})" if holder
           else 'a process that has not written its record yet')
    other_host = holder.get('host') not in (None, socket.gethostname())
    return (f'{os.path.dirname(self.file)} is in use by {who}: one process writes a run folder at a time. '
            f'Wait for it to finish, stop it, or use another --workdir'
            + (f'; if that process no longer runs, delete {self.file}.' if other_host else '.'))


def _read_lock(fd: int) -> str:
  """The lock file's text (at most 64 KiB; undecodable bytes replaced)."""
  try:
    return os.pread(fd, 65536, 0).decode('utf-8', 'replace')
  except OSError:
    return ''


def _parse_lock_record(text: str) -> dict:
  """A lock record's fields, each of its expected type ({} for anything else: empty, not JSON, not an object,
  no host, a pid that is not a process id)."""
  try:
    value = json.loads(text)
  except ValueError:
    return {}
  if not isinstance(value, dict) or not isinstance(value.get('host'), str):
    return {}
  pid = value.get('pid')
  record = {key: str(value[key])[:200] for key in ('host', 'purpose', 'started', 'command')
            if isinstance(value.get(key), (str, int, float))}
  if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 2**31:
    record['pid'] = pid
  return record
