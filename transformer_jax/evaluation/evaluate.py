"""§6.1 evaluation: validation loss and BLEU, the test translation of the chosen checkpoints (`load_params`
applies `selection.select_params`), and the `--mode=evaluate` and `--mode=translate` entry points.

BLEU is reported three ways (`bleu.all_bleu`): sacreBLEU on detokenised output (the headline), the tokenised
BLEU with compound splitting that the paper's numbers use, and the lowercased, Moses-tokenised BLEU of the
Multi30k literature. The search itself is `translate.py`'s; the Setup every mode builds is `experiment.py`'s.
"""
import functools
import json
import math
import re
import sys
import time
from typing import Any, Iterable

from absl import logging
from etils import epath
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import errors
from transformer_jax.data import batching
from transformer_jax.data import input_pipeline
from transformer_jax.data import multi30k
from transformer_jax.decoding import translate
from transformer_jax.evaluation import bleu
from transformer_jax.evaluation import parsing
from transformer_jax.evaluation import selection
from transformer_jax.model import sharding
from transformer_jax.model import transformer as model_lib
from transformer_jax.storage import workdir as workdir_lib
from transformer_jax.training import experiment
from transformer_jax.training import losses
from transformer_jax.training import metrics as metrics_lib
from transformer_jax.training import state as state_lib
from transformer_jax.training.experiment import Setup

Array = jax.Array
Batch = dict[str, Array]


def evaluate(eval_step_fn, params: Any, batches: Iterable[dict[str, np.ndarray]]) -> dict[str, float]:
  """Teacher-forced metrics over all batches, summed before dividing (padding rows weigh 0).

  Args:
    eval_step_fn: eval_fn(params, batch) -> metric sums (`jit_eval_step`).
    params: the parameters.
    batches: batches of global (or host-local, single-process) arrays; `example_index` is dropped.

  Returns:
    `metrics.summarize` of the summed metrics.

  Raises:
    ValueError: if there are no batches.
  """
  totals = None
  for batch in batches:
    batch = {k: v for k, v in batch.items() if k != 'example_index'}
    sums = eval_step_fn(params, batch)
    totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
  if totals is None:
    raise ValueError('evaluation got no batches')
  return metrics_lib.summarize(jax.device_get(totals))


def eval_step(params: Any, batch: Batch, *, model: model_lib.Transformer,
              label_smoothing: float) -> dict[str, Array]:
  """Teacher-forced validation metrics for one batch, as sums (see `losses.smoothed_cross_entropy`)."""
  logits = model.apply({'params': params}, batch['source_tokens'], batch['decoder_input_tokens'],
                       **state_lib.model_inputs(batch), deterministic=True)
  return losses.smoothed_cross_entropy(logits, batch['target_tokens'], losses.target_weights(batch), label_smoothing)


def jit_eval_step(setup: experiment.Build, params_sharding, label_smoothing: float):
  """`eval_step` jitted for the mesh and model of `setup`: eval_fn(params, batch) -> metric sums.

  Args:
    setup: the Build or Setup (mesh, model).
    params_sharding: the parameters' tree of NamedShardings.
    label_smoothing: train.label_smoothing (the validation loss is the training objective's).
  """
  return jax.jit(functools.partial(eval_step, model=setup.model, label_smoothing=label_smoothing),
                 in_shardings=(params_sharding, sharding.batch_sharding(setup.mesh)))


def validate(setup: experiment.Build, eval_fn, params, eval_batches, step: int) -> dict[str, float]:
  """Validation loss, nll, perplexity and accuracy of `params` (`evaluate`), logged as of `step`.

  Args:
    setup: the Build or Setup (its mesh places the batches).
    eval_fn: `jit_eval_step`'s function.
    params: the parameters, placed as for training.
    eval_batches: this host's rows of every validation batch (`input_pipeline.split_eval_batches`).
    step: the training step, for the log line.
  """
  # Global arrays: with several processes each host holds its rows of every batch (multi-host safe).
  metrics = evaluate(eval_fn, params, map(setup.device_batch, eval_batches))
  logging.info('eval at step %d | loss %.4f | nll %.4f | perplexity %.2f | acc %.3f', step, metrics['loss'],
               metrics['nll'], metrics['perplexity'], metrics['accuracy'])
  return metrics


def translate_ids(config, setup: Setup, params, source_ids, target_ids=None, beam_size: int | None = None,
                  alpha: float | None = None) -> list[str]:
  """Beam search (config.decode; `beam_size` and `alpha` override decode.beam_size and decode.alpha) over
  tokenised sources, in order, in data's buckets of decode.tokens_per_batch source tokens (0:
  data.tokens_per_batch; raised to data.max_length x data shards where smaller)."""
  if target_ids is None:
    target_ids = batching.Ragged.from_lists([[] for _ in range(len(source_ids))])
  decode_cfg = config.decode
  # At least one row of the longest bucket per data shard, whatever the device count.
  tokens_per_batch = decode_cfg.tokens_per_batch and max(decode_cfg.tokens_per_batch,
                                                         config.data.max_length * setup.data_shards)
  batches = input_pipeline.split_eval_batches(config.data, source_ids, target_ids, setup.data_shards,
                                              tokens_per_batch=tokens_per_batch)
  return translate.translate(params, batches, setup.tokenizer, len(source_ids), model=setup.model,
                                beam_size=beam_size or decode_cfg.beam_size,
                                alpha=decode_cfg.alpha if alpha is None else alpha,
                                extra_length=decode_cfg.extra_length, early_stopping=decode_cfg.early_stopping,
                                compact_every_steps=decode_cfg.compact_every_steps,
                                concurrent_batches=decode_cfg.concurrent_batches,
                                batch_sharding=sharding.batch_sharding(setup.mesh))


def translate_split(config, setup: Setup, params, split, beam_size: int | None = None,
                    alpha: float | None = None) -> tuple[list[str], dict, float]:
  """Translates a split with beam search and scores it (`bleu.all_bleu`).

  Args:
    config: the run's config (decode.*, data.*).
    setup: the Setup (mesh, model, vocabulary).
    params: the parameters to decode with.
    split: `input_pipeline.encode_split` of the split (texts and ids).
    beam_size: overrides decode.beam_size (1: greedy).
    alpha: overrides decode.alpha.

  Returns:
    (hypotheses, the three BLEUs and the sacreBLEU signature, seconds spent decoding); for a treebank split
    (split.trees set, §6.3) the EVALB figures of `parsing.score_split` instead of the BLEUs.
  """
  start = time.perf_counter()
  hypotheses = translate_ids(config, setup, params, split.source_ids, split.target_ids, beam_size=beam_size,
                             alpha=alpha)
  seconds = time.perf_counter() - start
  if split.trees is not None:
    return hypotheses, parsing.score_split(hypotheses, split.trees), seconds
  return hypotheses, bleu.all_bleu(hypotheses, split.target_texts, config.data.target_lang), seconds


_BLEUS = ('bleu', 'tokenized_bleu', 'lowercased_tokenized_bleu')
SCORES = _BLEUS + ('length_ratio',)  # What a decoded split is scored by (`bleu.all_bleu`), minus the signature.


def validation_bleu(config, setup: Setup, params, eval_split, step: int) -> dict[str, float]:
  """BLEU of the validation split decoded with beam eval.bleu_beam_size (0: decode.beam_size; 1: greedy).

  Args:
    config: the run's config.
    setup: the Setup.
    params: the parameters to decode with.
    eval_split: `input_pipeline.encode_split` of the validation split.
    step: the training step, for the log line.

  Returns:
    {'bleu', 'tokenized_bleu', 'lowercased_tokenized_bleu', 'length_ratio', 'bleu_seconds'} (see
    `bleu.all_bleu`); with eval.metric='f1', {parsing.SCORES, 'f1_seconds'} instead.
  """
  beam_size = config.eval.bleu_beam_size or config.decode.beam_size
  _, scores, seconds = translate_split(config, setup, params, eval_split, beam_size)
  if config.eval.metric == 'f1':  # A parser (§6.3): F1 instead of BLEU.
    parsing.log_validation(scores, step, beam_size, seconds)
    return {key: scores[key] for key in parsing.SCORES} | {'f1_seconds': seconds}
  logging.info('validation BLEU at step %d | bleu %.2f | lowercased tokenized %.2f | length ratio %.3f | beam %d '
               '| %.1f s', step, scores['bleu'], scores['lowercased_tokenized_bleu'], scores['length_ratio'],
               beam_size, seconds)
  return {key: scores[key] for key in SCORES} | {'bleu_seconds': seconds}


def load_params(eval_config, setup: Setup):
  """The parameters the final evaluation uses (§6.1): `selection.select_params` of the run's checkpoint
  managers, as eval.checkpoint_selection chooses (`eval_config` is config.eval).

  Returns:
    (params, steps): the (averaged) parameters, placed as for training, and the checkpoint steps they
    come from, ascending.

  A trainer may save and delete steps (train.max_checkpoints_to_keep) while this reads them: when a read fails
  and the steps on disk have changed meanwhile, the choice is made again from the new steps (up to 10 times).

  Raises:
    FileNotFoundError: if the workdir holds no checkpoint to choose from.
  """
  managers = [m for m in (setup.checkpoints, setup.best_checkpoints) if m is not None]
  for attempt in range(10):
    listed = [m.all_steps() for m in managers]
    try:
      return selection.select_params(eval_config, setup.checkpoints, setup.best_checkpoints,
                                     setup.abstract_state().params)
    except Exception as e:  # pylint: disable=broad-except
      try:
        changed = [m.reload() for m in managers] != listed
      except Exception:  # pylint: disable=broad-except
        changed = True  # A step deleted while being listed.
      if attempt == 9 or not changed:
        raise
      logging.warning('The checkpoints changed while being read (%s: %s; a trainer is saving beside this reader): '
                      'choosing again from steps %s.', type(e).__name__, e, setup.checkpoints.all_steps())
  raise AssertionError('unreachable')


def final_evaluation(config, setup: Setup, eval_fn, eval_batches, writer=None, test_split=None,
                     eval_split=None, run_info=None, output_dir: str | None = None) -> dict[str, float]:
  """Validation metrics and BLEU, and test BLEU, of the chosen checkpoints (`load_params`).

  Hypotheses are written to `<output_dir>/<split>.hyp.<target_lang>` and every figure to
  `<output_dir>/final_metrics.json` (process 0).

  Args:
    config: the run's config (eval.*, decode.*, data.*, train.translate_at_end).
    setup: the Setup.
    eval_fn: the jitted eval step.
    eval_batches: the validation split's batches.
    writer: a tensorboardX writer, or None.
    test_split: `input_pipeline.encode_split` of the test split, if already loaded; read when None.
    eval_split: `input_pipeline.encode_split` of the validation split, if already loaded; read when None.
    run_info: figures of the training run to store in final_metrics.json beside the evaluation's
      (`train_wall_seconds`: this invocation's training loop, compilation and validation included;
      `train_steps`; `mfu` over the training steps and the `peak_flops` it divides by; `goodput` and each
      stage's seconds from `goodput.Timeline.summary`), or None.
    output_dir: where the files go; None: the workdir (the training run's own final evaluation).

  Returns:
    Validation loss, nll, perplexity, accuracy; with train.translate_at_end also `validation_bleu`,
    `validation_lowercased_tokenized_bleu`, `validation_length_ratio`, and the test split's `bleu`
    (sacreBLEU), `tokenized_bleu`, `lowercased_tokenized_bleu`, `length_ratio` and
    `decode_sentences_per_sec`; with eval.metric='f1' (a parser) `parsing.final_scores`' figures instead of
    the BLEUs.
  """
  params, steps = load_params(config.eval, setup)
  data_cfg = config.data
  output_dir = output_dir or setup.workdir
  selection = config.eval.checkpoint_selection
  with setup.mesh_context():
    results = validate(setup, eval_fn, params, eval_batches, steps[-1])
    metrics_lib.write_scalars(writer, steps[-1], results, 'eval_averaged')
    if not config.train.translate_at_end:
      _write_final_metrics(selection, output_dir, results, steps, params, run_info)
      return results
    eval_split = eval_split or input_pipeline.encode_split(data_cfg, setup.tokenizer, data_cfg.eval_split)
    if config.eval.metric == 'f1':  # A parser (§6.3): validation and test F1, the trees written.
      test_split = test_split or input_pipeline.encode_split(data_cfg, setup.tokenizer, data_cfg.test_split)
      results |= parsing.final_scores(config, lambda split: translate_split(config, setup, params, split),
                                      eval_split, test_split, output_dir, steps)
      metrics_lib.write_scalars(writer, steps[-1], {'f1': results['f1']}, 'test')
      _write_final_metrics(selection, output_dir, results, steps, params, run_info)
      return results
    hypotheses, scores, _ = translate_split(config, setup, params, eval_split)
    results |= {'validation_bleu': scores['bleu'],
                'validation_lowercased_tokenized_bleu': scores['lowercased_tokenized_bleu'],
                'validation_length_ratio': scores['length_ratio']}
    _write_hypotheses(output_dir, data_cfg.eval_split, data_cfg.target_lang, hypotheses)
    test_split = test_split or input_pipeline.encode_split(data_cfg, setup.tokenizer, data_cfg.test_split)
    hypotheses, scores, seconds = translate_split(config, setup, params, test_split)
  path = _write_hypotheses(output_dir, data_cfg.test_split, data_cfg.target_lang, hypotheses)
  results |= {key: scores[key] for key in SCORES}
  results['decode_sentences_per_sec'] = len(hypotheses) / seconds
  metrics_lib.write_scalars(writer, steps[-1], {key: scores[key] for key in _BLEUS}, 'test')
  _write_final_metrics(selection, output_dir, results, steps, params, run_info)
  logging.info('Translated %d sentences in %.1f s (%.1f sentences/s); hypotheses in %s', len(hypotheses), seconds,
               len(hypotheses) / seconds, path)
  _print_bleu(config, results, scores['bleu_signature'], steps)
  return results


def _print_bleu(config, results: dict[str, float], signature: str, steps: list[int]) -> None:
  """The lines a final evaluation prints: validation BLEU, then the test split's three BLEUs."""
  decode_cfg = config.decode
  print(f'validation_bleu: {results["validation_bleu"]:.2f}  (sacreBLEU, {config.data.eval_split}; lowercased '
        f'tokenized {results["validation_lowercased_tokenized_bleu"]:.2f}; length ratio '
        f'{results["validation_length_ratio"]:.3f})')
  print(f'bleu: {results["bleu"]:.2f}  ({signature}; beam {decode_cfg.beam_size}, alpha {decode_cfg.alpha:g}, '
        f'length ratio {results["length_ratio"]:.3f}, {config.eval.checkpoint_selection}: averaged steps '
        f'{steps})')
  print(f'tokenized_bleu: {results["tokenized_bleu"]:.2f}  (tokenized, compound-split, as in the paper)')
  print(f'lowercased_tokenized_bleu: {results["lowercased_tokenized_bleu"]:.2f}  (lowercased, Moses-normalised '
        'and -tokenised, multi-bleu: the Multi30k literature\'s BLEU)')


# Every character at which str.splitlines (and so an editor, or a reader of the file) ends a line.
_LINE_BREAKS = re.compile('\r\n|[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]')


def single_line(text: str) -> str:
  """`text` with every line break (\\n, \\r, \\u2028 and the others `str.splitlines` splits at) replaced by a space:
  a hypothesis is written as one line, whatever its pieces decode to (byte pieces can decode to any of them), so
  that line i of an output file stays the translation of input line i."""
  return _LINE_BREAKS.sub(' ', text)


def _write_hypotheses(output_dir: str, split: str, target_lang: str, hypotheses: list[str]) -> epath.Path:
  path = epath.Path(workdir_lib.path(output_dir, workdir_lib.hypotheses_file(split, target_lang)))
  if jax.process_index() == 0:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(''.join(single_line(h) + '\n' for h in hypotheses), encoding='utf-8')
  return path


def _write_final_metrics(checkpoint_selection: str, output_dir: str, results: dict[str, float], steps: list[int],
                         params, run_info=None) -> None:
  """`<output_dir>/final_metrics.json`: the final evaluation's figures, the checkpoints they come from and the
  parameter count of `params` (what transformer_jax.tools.report reads)."""
  if jax.process_index() == 0:
    num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    record = {key: float(value) for key, value in results.items()} | (run_info or {}) | {
        'checkpoint_steps': list(steps), 'checkpoint_selection': checkpoint_selection,
        'num_params': num_params}
    epath.Path(output_dir).mkdir(parents=True, exist_ok=True)
    epath.Path(workdir_lib.path(output_dir, workdir_lib.FINAL_METRICS)).write_text(
        json.dumps(record, indent=2, sort_keys=True))


def new_evaluation_dir(workdir: str, output: str | None = None) -> str:
  """The folder an evaluation writes into, created now (`workdir.make_output_dir`): `output` (--output), else a new
  `<workdir>/evaluations/<YYYYmmdd-HHMMSS>[-<n>]`.

  Raises:
    errors.PathError: naming the folder, when it cannot be created.
  """
  return workdir_lib.make_output_dir(output, workdir, time.strftime('%Y%m%d-%H%M%S'))


def evaluate_checkpoint(config, workdir: str, output_dir: str | None = None) -> dict[str, float]:
  """--mode=evaluate: validation metrics and test BLEU of the checkpoints eval.checkpoint_selection chooses.

  The outputs (hypotheses, final_metrics.json) go to `output_dir` (--output) when given, and the run folder is then
  only read (it may be read-only); else to a new folder, `<workdir>/evaluations/<YYYYmmdd-HHMMSS>/`, under the run's
  lock. The training run's own final evaluation in the workdir is never overwritten.

  Returns:
    The figures of `final_evaluation`.

  Raises:
    errors.UserError: from `experiment.setup` (a missing file, a config the run disagrees with, a run folder in use
      or not writable) or `new_evaluation_dir`, before anything is evaluated.
  """
  data_cfg = config.data
  setup = experiment.setup(config, workdir, data_splits=(data_cfg.eval_split,) + (
      (data_cfg.test_split,) if config.train.translate_at_end else ()), lock=None if output_dir else 'evaluate')
  try:
    output_dir = new_evaluation_dir(workdir, output_dir)
  except BaseException:
    setup.close()
    raise
  try:
    eval_split = input_pipeline.encode_split(data_cfg, setup.tokenizer, data_cfg.eval_split)
    eval_fn = jit_eval_step(setup, sharding.shardings_of(setup.abstract_state().params), config.train.label_smoothing)
    batches = input_pipeline.split_eval_batches(data_cfg, eval_split.source_ids, eval_split.target_ids,
                                                setup.data_shards)
    results = final_evaluation(config, setup, eval_fn, batches, eval_split=eval_split, output_dir=output_dir)
  finally:
    setup.close()
  logging.info('--mode=evaluate wrote its hypotheses and figures to %s', output_dir)
  return results


def translate_file(config, workdir: str, input_path: str | None, output_path: str | None) -> None:
  """--mode=translate: one output line per input line (a blank line stays blank), stdin/stdout by default.

  Raises:
    errors.MissingFileError: for a missing input file (read before the model is loaded).
    errors.PathError: for an --output that cannot be written (checked before the model is loaded).
    errors.UserError: from `experiment.setup`.
  """
  # Lines end at '\n' only: str.splitlines would also split at Unicode separators inside a sentence.
  if input_path and not epath.Path(input_path).is_file():
    raise errors.MissingFileError(f'--input={input_path} does not exist')
  if output_path:
    workdir_lib.check_output_file(output_path)  # Before the model is loaded and every line decoded.
  if input_path:
    lines = multi30k.read_lines(input_path)
  else:
    lines = sys.stdin.read().split('\n')
    lines = [line.removesuffix('\r') for line in (lines[:-1] if lines[-1] == '' else lines)]
  setup = experiment.setup(config, workdir)
  try:
    params, steps = load_params(config.eval, setup)
    unfinished = setup.checkpoints.latest_step() != config.train.num_train_steps
  finally:
    setup.close()
  start = time.perf_counter()
  with setup.mesh_context():
    hypotheses = translate_ids(config, setup, params, input_pipeline.encode(setup.tokenizer, lines))
  seconds = time.perf_counter() - start
  hypotheses = [single_line(h) if line.strip() else '' for line, h in zip(lines, hypotheses)]
  if config.data.dataset == 'treebank':  # A parser: one bracketed tree per sentence (tags XX, not predicted).
    hypotheses = [parsing.tree_line(h, line) if line.strip() else '' for line, h in zip(lines, hypotheses)]
  text = ''.join(h + '\n' for h in hypotheses)
  if output_path:
    epath.Path(output_path).write_text(text, encoding='utf-8')
  else:
    sys.stdout.write(text)
  logging.info('Translated %d lines to %s in %.1f s, compilation included, with checkpoint steps %s%s.', len(lines),
               output_path or 'stdout', seconds, steps,
               f' of an unfinished run (train.num_train_steps={config.train.num_train_steps})' if unfinished else '')
