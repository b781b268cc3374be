"""What a run folder must agree with to be resumed or evaluated: the config fingerprint stored with every
checkpoint, and the vocabulary's SHA-256.

`open_checkpoints` and `open_best_checkpoints` open the run's `checkpoints.CheckpointManager`s with the
fingerprint (the architecture, the vocabulary size and the languages): a workdir holding a run with another one
raises errors.ConfigError before anything is written. `_FIELDS_ADDED_LATER` is its migration table, which keeps
checkpoints written before a model field existed resumable. `check_vocabulary` refuses a vocabulary file other
than the one the run trained with (`vocabulary.sha256`, written by `record_vocabulary_hash`).
`run/experiment.setup` calls them before it writes anything.
"""
import dataclasses
import hashlib
import re

from etils import epath
import jax

from transformer_jax import errors
from transformer_jax.model import transformer as model_lib
from transformer_jax.storage import checkpoints as checkpoints_lib
from transformer_jax.storage import workdir as workdir_lib


def _vocabulary_paths(config, workdir: str) -> tuple[epath.Path, epath.Path]:
  """(the vocabulary file, the file recording its SHA-256)."""
  return (epath.Path(workdir_lib.path(workdir, workdir_lib.vocabulary_file(config.data.vocab_size))),
          epath.Path(workdir_lib.path(workdir, workdir_lib.VOCABULARY_HASH)))


def check_vocabulary(config, workdir: str, manager: checkpoints_lib.CheckpointManager) -> None:
  """The run's vocabulary must be the one it trained with: a new one would index other pieces.

  Raises:
    errors.MissingFileError: naming the missing file and the checkpoint step, when checkpoints exist without it.
    errors.ConfigError: naming the file and both hashes, when it differs from the one the run recorded
      (`vocabulary.sha256`, written by `record_vocabulary_hash`).
    errors.DamagedFileError: naming `vocabulary.sha256`, when it does not hold a SHA-256.
  """
  vocabulary, recorded = _vocabulary_paths(config, workdir)
  expected = recorded.read_bytes().decode('utf-8', 'replace').strip() if recorded.exists() else None
  if expected is not None and not re.fullmatch('[0-9a-f]{64}', expected):
    raise errors.DamagedFileError(
        f'{recorded} is damaged (it holds {expected[:80]!r}, not a SHA-256): restore it, or delete it if '
        f'{vocabulary} is the vocabulary this run trained with (it is recorded again at the next training start).')
  if not vocabulary.exists():
    latest = manager.latest_step()
    if latest is not None:
      raise errors.MissingFileError(
          f'{vocabulary} is missing, but {workdir} holds checkpoints up to step {latest} trained with it'
          f'{f" (SHA-256 {expected})" if expected else ""}. A new vocabulary would index other pieces: restore '
          'the file, or train in another --workdir.')
    return
  actual = hashlib.sha256(vocabulary.read_bytes()).hexdigest()
  if expected is not None and actual != expected:
    raise errors.ConfigError(
        f'{vocabulary} has SHA-256 {actual}, but this run was trained with the vocabulary of SHA-256 '
        f'{expected} ({recorded}): its embeddings would index other pieces. Restore the original '
        'file, or train in another --workdir.')


def vocabulary_sha256(config, workdir: str) -> str | None:
  """The SHA-256 of the run's vocabulary file (None when there is none yet)."""
  vocabulary, _ = _vocabulary_paths(config, workdir)
  return hashlib.sha256(vocabulary.read_bytes()).hexdigest() if vocabulary.exists() else None


def record_vocabulary_hash(config, workdir: str) -> None:
  """Writes `vocabulary.sha256` when the run has none (a new run, or one older than the record)."""
  vocabulary, recorded = _vocabulary_paths(config, workdir)
  if not recorded.exists() and jax.process_index() == 0:
    recorded.write_text(hashlib.sha256(vocabulary.read_bytes()).hexdigest() + '\n')


def open_checkpoints(config, workdir: str, model_cfg: model_lib.ModelConfig,
                     read_only: bool = False) -> checkpoints_lib.CheckpointManager:
  """The checkpoint manager of `workdir`; with `read_only`, one that only restores (for the modes that read a run:
  it creates, deletes and renames nothing, and leaves a trainer's save in progress alone).

  The fingerprint stored with every checkpoint is what a run must agree with to resume or evaluate it: the
  architecture (not the compute or attention-product dtype, attention implementation or rematerialisation,
  which change no parameter), the vocabulary size and the languages.

  Raises:
    errors.ConfigError: if `workdir` holds a run with another fingerprint (nothing is written then).
  """
  return checkpoints_lib.CheckpointManager(
      workdir, max_to_keep=config.train.max_checkpoints_to_keep,
      save_interval_steps=config.train.checkpoint_every_steps, fingerprint=_fingerprint(config, model_cfg),
      read_only=read_only)


def open_best_checkpoints(config, workdir: str, model_cfg: model_lib.ModelConfig,
                          read_only: bool = False) -> checkpoints_lib.CheckpointManager:
  """`<workdir>/best_checkpoints`: the eval.average_best_n checkpoints with the highest validation BLEU
  (`read_only`: as in `open_checkpoints`).

  Each holds {'params': ...} only (no optimiser state) and the metric `bleu` it was chosen by.

  Raises:
    errors.ConfigError: if `workdir` holds a run with another fingerprint.
  """
  return checkpoints_lib.CheckpointManager(
      workdir, max_to_keep=config.eval.average_best_n, fingerprint=_fingerprint(config, model_cfg),
      subdir=workdir_lib.BEST_CHECKPOINTS, best_metric='bleu', read_only=read_only)


def require_vocabulary(config, workdir: str) -> None:
  """For the modes that read a run: its vocabulary must exist (they never train one into the run folder).

  Raises:
    errors.MissingFileError: naming the file.
  """
  vocabulary, _ = _vocabulary_paths(config, workdir)
  if not vocabulary.exists():
    raise errors.MissingFileError(f'{vocabulary} does not exist: {workdir} holds no trained run of '
                                  f'data.vocab_size={config.data.vocab_size} (train it first).')


# ModelConfig fields added after checkpoints existed: left out of the fingerprint at their defaults, so that
# those checkpoints (whose fingerprints lack them) still resume and evaluate.
_FIELDS_ADDED_LATER = {'norm': 'layer_norm', 'feed_forward': 'relu', 'num_kv_heads': None,
                       'activation_dropout_rate': 0.0}


def _fingerprint(config, model_cfg: model_lib.ModelConfig) -> dict:
  model = dataclasses.asdict(model_cfg) | {'dtype': None, 'attention_impl': None, 'remat': None}
  del model['attention_product_dtype'], model['decoding_kernel']  # Change no parameter; absent from older
  # fingerprints, so left out.
  model = {key: value for key, value in model.items()
           if key not in _FIELDS_ADDED_LATER or value != _FIELDS_ADDED_LATER[key]}
  return {'model': model,
          'data': {'vocab_size': model_cfg.vocab_size, 'source_lang': config.data.source_lang,
                   'target_lang': config.data.target_lang}}
