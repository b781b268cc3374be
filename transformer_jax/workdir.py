"""The layout of a run's folder (`--workdir`), in one place. Imports neither TensorFlow nor JAX.

  <workdir>/
    config.json                         the run's resolved config (`save_config`, `load_config`)
    spm_<vocab_size>.model              the shared BPE vocabulary (tokenizer.py)
    checkpoints/<step>/                 TrainState and input position, the last train.max_checkpoints_to_keep
    best_checkpoints/<step>/            parameters of the eval.average_best_n best steps by validation BLEU
    unusable_checkpoints/<step>.<time>/ checkpoints found unreadable at resumption, set aside
    <split>.hyp.<target_lang>           the final evaluation's hypotheses, one line per source line
    final_metrics.json                  the final evaluation's figures (what transformer_jax.report reads)
    compile.json                        --mode=compile's memory and FLOP estimates
    evaluations/<YYYYmmdd-HHMMSS>/      each --mode=evaluate's hypotheses and final_metrics.json
    events.out.tfevents.*               TensorBoard scalars

The package's modules name these files and folders through this module's constants and functions. Paths are
strings, joined with `/`, so that a `gs://` workdir works wherever the writer (orbax, epath, tensorboardX)
supports it.
"""
import importlib.util
import json
import os
import pathlib
import re
import sys

from etils import epath
import ml_collections

CONFIG = 'config.json'
CHECKPOINTS = 'checkpoints'
BEST_CHECKPOINTS = 'best_checkpoints'
UNUSABLE_CHECKPOINTS = 'unusable_checkpoints'
FINAL_METRICS = 'final_metrics.json'
COMPILE_REPORT = 'compile.json'
EVALUATIONS = 'evaluations'


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


def load_config(config: ml_collections.ConfigDict | str | os.PathLike[str]) -> ml_collections.ConfigDict:
  """Returns a ConfigDict given itself, a `config.json`, a workdir holding one, or a config file.

  Args:
    config: a ConfigDict (returned as is); a path to a JSON file or to a workdir with `config.json`; or a
      Python config file, optionally with an argument as on the command line ('configs/table3.py:B1').
      Config files do `from configs import base`, so the folder above the file's is put on sys.path.

  Raises:
    FileNotFoundError: naming the path when there is no such file.
  """
  if isinstance(config, ml_collections.ConfigDict):
    return config
  text = os.fspath(config)
  if os.path.isdir(text):
    text = path(text, CONFIG)
  match = re.fullmatch(r'(.+\.py):(.+)', text)
  file, arg = (match[1], match[2]) if match else (text, '')
  if not epath.Path(file).is_file():
    raise FileNotFoundError(f'no config file {file!r} (give a ConfigDict, configs/<name>.py or a config.json)')
  if file.endswith('.json'):
    return ml_collections.ConfigDict(json.loads(epath.Path(file).read_text(encoding='utf-8')))
  root = str(pathlib.Path(file).resolve().parents[1])
  if root not in sys.path:
    sys.path.insert(0, root)
  spec = importlib.util.spec_from_file_location(f'_config_{pathlib.Path(file).stem}', file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def get_config(workdir: str) -> ml_collections.ConfigDict:
  """A run's stored config as a config file: `--config=transformer_jax/workdir.py:<workdir>` loads
  `<workdir>/config.json` (what `main` passes when --config is left out and the workdir has one).

  Raises:
    FileNotFoundError: if `<workdir>/config.json` does not exist.
  """
  file = path(workdir, CONFIG)
  if not epath.Path(file).is_file():
    raise FileNotFoundError(f'{file} does not exist: --workdir={workdir} holds no run (pass --config=...)')
  return with_defaults(load_config(file))


BASE_CONFIG = pathlib.Path(__file__).resolve().parents[1] / 'configs' / 'base.py'


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
