"""Configuration checks, in one place: every config value at start-up (`validate_config`), the input files a
run reads (`check_data_files`), and the config --mode=evaluate/translate/tune_decoding/export run with
(`config_for_mode`: the stored run's, changed only where decoding or evaluation may change), and what a resumed
training run may not change (`check_resumable_optimizer`).

Everything here reads and raises; nothing writes. `experiment.setup` calls these before a byte is written.
What they raise is an `errors.UserError` naming the key or path: `main` prints it as one line.
"""
import math

from absl import logging
from etils import epath

from transformer_jax import errors
from transformer_jax.data import input_pipeline
from transformer_jax.data import multi30k
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.data import treebank
from transformer_jax.decoding import beam
from transformer_jax.evaluation import bleu
from transformer_jax.evaluation import selection
from transformer_jax.model import sharding
from transformer_jax.model import transformer as model_lib
from transformer_jax.storage import checkpoint_checks
from transformer_jax.storage import workdir as workdir_lib


def _require(ok: bool, key: str, value, allowed: str) -> None:
  if not ok:
    raise errors.ConfigError(f'{key} must be {allowed}, got {value!r}')


def _is_positive_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_non_negative_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def validate_config(config) -> model_lib.ModelConfig:
  """Checks every configuration value at start-up, in one place, before anything is read or written.

  What needs more than the config is checked where that is at hand: the optimiser's settings when it is built
  (`optim`), the mesh against the devices and the model's dimensions where it is made (`sharding.make_mesh` with
  `mesh_dimensions`), both in `experiment.compute_setup`; the input files (`check_data_files`: compile and
  benchmark modes read none), the run folder and the vocabulary in `experiment.setup`.

  Args:
    config: the ConfigDict (configs/base.py).

  Returns:
    The ModelConfig at the configured vocabulary size.

  Raises:
    errors.ConfigError: naming the first bad key, its value and what is allowed.
  """
  train_cfg, data_cfg, decode_cfg = config.train, config.data, config.decode
  _validate_train(train_cfg)
  _validate_data(data_cfg)
  _require(_is_positive_int(decode_cfg.beam_size), 'decode.beam_size', decode_cfg.beam_size, 'an integer >= 1')
  _require(math.isfinite(decode_cfg.alpha) and decode_cfg.alpha >= 0.0, 'decode.alpha', decode_cfg.alpha,
           'a finite number >= 0')
  _require(_is_positive_int(decode_cfg.extra_length), 'decode.extra_length', decode_cfg.extra_length,
           'an integer >= 1')
  _require(_is_non_negative_int(decode_cfg.tokens_per_batch),
           'decode.tokens_per_batch', decode_cfg.tokens_per_batch, 'an integer >= 0 (0: data.tokens_per_batch)')
  _require(_is_non_negative_int(decode_cfg.compact_every_steps),
           'decode.compact_every_steps', decode_cfg.compact_every_steps, 'an integer >= 0 (0: no compaction)')
  _require(_is_non_negative_int(decode_cfg.concurrent_batches),
           'decode.concurrent_batches', decode_cfg.concurrent_batches, 'an integer >= 0 (0: automatic)')
  _require(decode_cfg.early_stopping in beam.EARLY_STOPPING, 'decode.early_stopping', decode_cfg.early_stopping,
           f'one of {beam.EARLY_STOPPING}')
  _require(1 <= config.eval.average_last_n <= train_cfg.max_checkpoints_to_keep, 'eval.average_last_n',
           config.eval.average_last_n, f'in [1, train.max_checkpoints_to_keep={train_cfg.max_checkpoints_to_keep}]')
  _validate_selection(config.eval, train_cfg, data_cfg)
  model_cfg = model_config(config)
  _require(model_cfg.max_length >= data_cfg.max_length + decode_cfg.extra_length or model_cfg.position_embedding
           != 'learned', 'data.max_length + decode.extra_length', data_cfg.max_length + decode_cfg.extra_length,
           f'<= model.max_length={model_cfg.max_length} with learned positions (the longest decode)')
  _require(not train_cfg.rdrop_alpha or any(getattr(model_cfg, name) > 0 for name in model_lib.DROPOUT_RATES),
           'train.rdrop_alpha', train_cfg.rdrop_alpha,
           f'0 when {", ".join(f"model.{name}" for name in model_lib.DROPOUT_RATES)} are all 0 (R-Drop compares '
           'two passes under different dropout masks: without dropout they agree, and each step costs twice for '
           'nothing)')
  return model_cfg


def model_config(config) -> model_lib.ModelConfig:
  """`ModelConfig(vocab_size=config.data.vocab_size, **config.model)`, its checks of model.* as ConfigError.

  Raises:
    errors.ConfigError: naming the model field, for a value ModelConfig refuses.
  """
  try:
    return model_lib.ModelConfig(vocab_size=config.data.vocab_size, **config.model)
  except ValueError as e:  # ModelConfig names the field (model/transformer.py raises the built-in type).
    raise errors.ConfigError(str(e)) from e


def mesh_dimensions(model_cfg: model_lib.ModelConfig) -> dict[str, list[tuple[str, int]]]:
  """The model dimensions a mesh may split, by logical axis: the config key and size of each
  (`sharding.make_mesh` checks that every split one divides by its mesh axes, naming the key)."""
  return {
      sharding.HEADS: [('model.num_heads', model_cfg.num_heads)],
      sharding.KV_HEADS: [('model.num_kv_heads', model_cfg.key_value_heads)],
      sharding.MLP: [('model.d_ff', model_cfg.d_ff)],
      sharding.EMBED: [('model.d_model', model_cfg.d_model)],
      sharding.KV: [('model.d_k', model_cfg.d_k), ('model.d_v', model_cfg.d_v)],
      sharding.VOCAB: [('data.vocab_size', model_cfg.vocab_size)],
  }


def _validate_selection(eval_cfg, train_cfg, data_cfg) -> None:
  _require(eval_cfg.checkpoint_selection in selection.SELECTIONS, 'eval.checkpoint_selection',
           eval_cfg.checkpoint_selection, f'one of {selection.SELECTIONS}')
  _require(_is_positive_int(eval_cfg.average_best_n), 'eval.average_best_n', eval_cfg.average_best_n,
           'a positive integer')
  _require(isinstance(eval_cfg.bleu_beam_size, int) and eval_cfg.bleu_beam_size >= 0, 'eval.bleu_beam_size',
           eval_cfg.bleu_beam_size, 'an integer >= 0 (0: decode.beam_size)')
  _require(eval_cfg.metric in ('bleu', 'f1'), 'eval.metric', eval_cfg.metric, "one of ('bleu', 'f1')")
  _require((eval_cfg.metric == 'f1') == (data_cfg.dataset == 'treebank'), 'eval.metric', eval_cfg.metric,
           f"'f1' with data.dataset='treebank' (§6.3 parsing), else 'bleu'; data.dataset={data_cfg.dataset!r}")
  _require(isinstance(train_cfg.eval_bleu_every_steps, int) and train_cfg.eval_bleu_every_steps >= 0,
           'train.eval_bleu_every_steps', train_cfg.eval_bleu_every_steps, 'an integer >= 0 (0: never)')
  _require(eval_cfg.checkpoint_selection == 'average_last' or train_cfg.eval_bleu_every_steps > 0,
           'eval.checkpoint_selection', eval_cfg.checkpoint_selection,
           "'average_last' unless train.eval_bleu_every_steps > 0 (the best checkpoints are chosen by "
           'validation BLEU during training)')


def _validate_train(train_cfg) -> None:
  for key in ('num_train_steps', 'warmup_steps', 'log_every_steps', 'eval_every_steps',
              'checkpoint_every_steps', 'max_checkpoints_to_keep', 'grad_accum_steps'):
    _require(_is_positive_int(train_cfg[key]), f'train.{key}', train_cfg[key], 'a positive integer')
  _require(isinstance(train_cfg.log_every_secs, (int, float)) and math.isfinite(train_cfg.log_every_secs)
           and train_cfg.log_every_secs >= 0, 'train.log_every_secs', train_cfg.log_every_secs,
           'a finite number >= 0 (0: by steps only)')
  _require(math.isfinite(train_cfg.learning_rate_scale) and train_cfg.learning_rate_scale > 0,
           'train.learning_rate_scale', train_cfg.learning_rate_scale, 'a finite number > 0')
  _require(0.0 <= train_cfg.label_smoothing < 1.0, 'train.label_smoothing', train_cfg.label_smoothing, 'in [0, 1)')
  _require(math.isfinite(train_cfg.grad_clip_norm) and train_cfg.grad_clip_norm >= 0, 'train.grad_clip_norm',
           train_cfg.grad_clip_norm, 'a finite number >= 0 (0 disables clipping)')
  _require(math.isfinite(train_cfg.weight_decay) and train_cfg.weight_decay >= 0, 'train.weight_decay',
           train_cfg.weight_decay, "a finite number >= 0 (0: the paper's Adam)")
  _require(math.isfinite(train_cfg.rdrop_alpha) and train_cfg.rdrop_alpha >= 0, 'train.rdrop_alpha',
           train_cfg.rdrop_alpha, 'a finite number >= 0 (0: no R-Drop)')
  _require(train_cfg.on_nonfinite in ('stop', 'skip'), 'train.on_nonfinite', train_cfg.on_nonfinite,
           "one of ('stop', 'skip')")


def _validate_data(data_cfg) -> None:
  for key in ('vocab_size', 'tokens_per_batch', 'max_length', 'tokenizer_train_sentences'):
    _require(_is_positive_int(data_cfg[key]), f'data.{key}', data_cfg[key], 'a positive integer')
  _require(all(_is_positive_int(length) for length in data_cfg.bucket_lengths), 'data.bucket_lengths',
           data_cfg.bucket_lengths, 'positive integers')
  _require(data_cfg.tokenizer_model_type in ('bpe', 'unigram'), 'data.tokenizer_model_type',
           data_cfg.tokenizer_model_type, "one of ('bpe', 'unigram')")
  _require(data_cfg.source_lang != data_cfg.target_lang, 'data.target_lang', data_cfg.target_lang,
           f'different from data.source_lang={data_cfg.source_lang!r}')
  _require(data_cfg.tokenizer_normalization in tokenizer_lib.NORMALIZATIONS, 'data.tokenizer_normalization',
           data_cfg.tokenizer_normalization, f'one of {tokenizer_lib.NORMALIZATIONS}')
  _require(isinstance(data_cfg.tokenizer_seed, int) and 0 <= data_cfg.tokenizer_seed < 2**32, 'data.tokenizer_seed',
           data_cfg.tokenizer_seed, 'an integer in [0, 2**32)')
  _require(isinstance(data_cfg.shuffle_seed, int) and 0 <= data_cfg.shuffle_seed < 2**32, 'data.shuffle_seed',
           data_cfg.shuffle_seed, 'an integer in [0, 2**32)')
  _require(data_cfg.treebank_target in treebank.TARGETS, 'data.treebank_target', data_cfg.treebank_target,
           f'one of {treebank.TARGETS}')
  _require(0.0 <= data_cfg.bpe_dropout_rate < 1.0, 'data.bpe_dropout_rate', data_cfg.bpe_dropout_rate, 'in [0, 1)')
  _require(not data_cfg.bpe_dropout_rate or data_cfg.tokenizer_model_type == 'bpe', 'data.bpe_dropout_rate',
           data_cfg.bpe_dropout_rate, "0 unless data.tokenizer_model_type='bpe'")


def check_data_files(data_config, splits) -> None:
  """Fails early when the input files of `splits` are not where the config says.

  dataset='text': `data.{train,eval,test}_files` must each name two existing files; dataset='multi30k' with a
  manual_dir: the folder must hold the files of the language pair; dataset='treebank': every tree of the splits
  is read (`treebank.split_trees`, cached), so that an unreadable tree stops the run before anything is written.
  TFDS datasets are checked by TFDS when loaded.

  Args:
    data_config: `config.data`.
    splits: split names among data_config.train_split, eval_split and test_split.

  Raises:
    errors.ConfigError: naming the key for a malformed file list or an incomplete Multi30k folder.
    errors.MissingFileError: naming the key and the path of a missing file.
    errors.MissingPackageError: if sacreBLEU's tokenizer for data.target_lang needs packages that are missing.
    treebank.TreebankError, treebank.TreebankLayoutError: naming the file and line of a tree that cannot be
      read, or what data.treebank_dir lacks.
  """
  if data_config.dataset != 'treebank':  # A parser is scored by F1, not BLEU.
    bleu.check_sacrebleu_tokenizer(data_config.target_lang)
  if data_config.dataset == 'treebank':  # Reads every tree of the splits (cached for the run): a bad one stops here.
    for split in splits:
      treebank.split_trees(data_config.treebank_dir, split)
    return
  if data_config.dataset == 'multi30k' and data_config.manual_dir:
    multi30k.check_manual_dir(data_config.manual_dir, (data_config.source_lang, data_config.target_lang))
  if data_config.dataset != 'text':
    return
  for split in splits:
    key, paths = input_pipeline.text_files(data_config, split)
    for path in paths:
      if not epath.Path(path).exists():
        raise errors.MissingFileError(f'data.{key}: {path} does not exist')


# What --mode=evaluate and --mode=translate may change in a run's stored config: how to decode and evaluate,
# where the input files are now, and the mesh. Anything else is the run's own.
_EVALUATION_FIELDS = ('decode.', 'eval.', 'mesh.', 'benchmark.', 'export.', 'train.translate_at_end', 'data.eval_split',
                      'data.test_split', 'data.manual_dir', 'data.treebank_dir', 'data.tfds_data_dir', 'data.train_files',
                      'data.eval_files', 'data.test_files', 'data.tokens_per_batch', 'model.dtype',
                      'model.attention_impl', 'model.attention_product_dtype', 'model.decoding_kernel')
# Model and data fields that act in training only: a config file's values (today's recipe, say) are not an error.
_TRAINING_ONLY_FIELDS = ('model.dropout_rate', 'model.attention_dropout_rate', 'model.activation_dropout_rate',
                         'model.remat', 'data.bpe_dropout_rate')


# train.* fields that add a node to the optimiser's state when above 0 (optax's masked decay, the clipping's
# state): a run's checkpoints restore only into the layout they were saved with.
_OPTIMIZER_LAYOUT_FIELDS = {'weight_decay': "0: the paper's Adam; above 0: AdamW",
                            'grad_clip_norm': '0: no clipping; above 0: clipping first'}


def check_resumable_optimizer(config, workdir: str) -> None:
  """A training run resumed from its checkpoints keeps its optimiser's state layout: train.weight_decay and
  train.grad_clip_norm may change value (recorded as config changes), not go from 0 to above 0 or back.

  Reads `<workdir>/config.json` (as `workdir.load_run_config` resolves it) where the workdir holds a committed
  checkpoint; a fresh workdir passes. Writes nothing.

  Raises:
    errors.ConfigError: naming the field, the run's value and this config's.
  """
  if not checkpoint_checks.committed_steps(workdir_lib.path(workdir, workdir_lib.CHECKPOINTS)):
    return
  stored_path = workdir_lib.path(workdir, workdir_lib.CONFIG)
  if not epath.Path(stored_path).is_file():
    return  # Checkpoints without a config.json: the fingerprint check names what the run holds.
  stored = workdir_lib.load_run_config(workdir).train
  for name, meaning in _OPTIMIZER_LAYOUT_FIELDS.items():
    if (stored[name] > 0) != (config.train[name] > 0):
      raise errors.ConfigError(
          f'train.{name}={config.train[name]!r} cannot resume the run in {workdir}, trained with '
          f'train.{name}={stored[name]!r} ({stored_path}; {meaning}): its checkpoints hold another optimiser state. '
          f'Resume with a value {"above 0" if stored[name] > 0 else "of 0"}, or use a new workdir.')


def config_for_mode(config, workdir: str, mode: str):
  """The config --mode=evaluate/translate runs with: the run's `<workdir>/config.json`, changed only where the
  command line's config changes decoding or evaluation fields (`_EVALUATION_FIELDS`). Reads only.

  Training fields that differ (a config file's schedule or dropout rate, say) are the run's own: the stored
  values are kept, and the log says which were ignored. The compute dtype and attention implementation may
  change (they change no parameter).

  Args:
    config: the command line's config (--config with its overrides, or the stored one when --config was
      left out).
    workdir: the trained run's folder.
    mode: 'evaluate' or 'translate', for messages.

  Raises:
    errors.MissingFileError: if the workdir holds no config.json or no checkpoint (nothing is written then).
    errors.ConfigError: naming the first model or data field that differs from the run's (e.g. model.d_model).
  """
  stored_path = workdir_lib.path(workdir, workdir_lib.CONFIG)
  if not epath.Path(stored_path).is_file():
    raise errors.MissingFileError(f'--mode={mode}: {stored_path} does not exist: --workdir={workdir} holds no trained '
                                  'run (train first with --mode=train, or check the path)')
  if not checkpoint_checks.committed_steps(workdir_lib.path(workdir, workdir_lib.CHECKPOINTS)):
    raise errors.MissingFileError(
        f'--mode={mode}: no checkpoint in {workdir_lib.path(workdir, workdir_lib.CHECKPOINTS)}'
        ': train first (--mode=train)')
  stored = workdir_lib.load_run_config(workdir)
  vocabulary = workdir_lib.path(workdir, workdir_lib.vocabulary_file(stored.data.vocab_size))
  if not epath.Path(vocabulary).is_file():
    raise errors.MissingFileError(f'--mode={mode}: the run\'s vocabulary {vocabulary} is missing')
  given, kept = workdir_lib.config_leaves(config), workdir_lib.config_leaves(stored)
  resolved, ignored = stored, []
  for key, value in given.items():
    if key in kept and value == kept[key]:
      continue
    section, name = key.split('.', 1)
    if key not in kept:  # A field added after the run was trained: its default (the code's behaviour then).
      resolved[section][name] = value
    elif key.startswith(_EVALUATION_FIELDS):
      resolved[section][name] = value
    elif key.startswith(('model.', 'data.')) and key not in _TRAINING_ONLY_FIELDS:
      raise errors.ConfigError(f'--mode={mode}: {key}={value!r} differs from the run in {workdir} ({key}={kept[key]!r} '
                               f'in {stored_path}); only decoding and evaluation fields may change')
    else:
      ignored.append(key)
  if ignored:
    logging.info('--mode=%s uses the run\'s own values of %s (from %s), not the command line\'s.', mode,
                 ', '.join(ignored), stored_path)
  return resolved
