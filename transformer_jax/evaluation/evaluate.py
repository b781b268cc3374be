"""§6.1 evaluation: validation loss and BLEU, and the test translation of the chosen checkpoints (`load_params`
applies `selection.select_params`), for the training run's loop and for `run/evaluate.py`'s modes.

BLEU is reported three ways (`bleu.all_bleu`): sacreBLEU on detokenised output (the headline), the tokenised
BLEU with compound splitting that the paper's numbers use, and the lowercased, Moses-tokenised BLEU of the
Multi30k literature. The search itself is `decoding/translate.py`'s; the Setup every mode builds is
`run/experiment.py`'s.
"""
import json
import math
import re
import time
from typing import Any, Iterable

from absl import logging
from etils import epath
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.data import batching
from transformer_jax.data import input_pipeline
from transformer_jax.decoding import translate
from transformer_jax.evaluation import bleu
from transformer_jax.evaluation import parsing
from transformer_jax.evaluation import selection
from transformer_jax.storage import workdir as workdir_lib
from transformer_jax.training import metrics as metrics_lib
from transformer_jax.training.build import Build
from transformer_jax.training.build import Setup


def evaluate(eval_step_fn, params: Any, batches: Iterable[dict[str, np.ndarray]]) -> dict[str, float]:
  """Teacher-forced metrics over all batches, summed before dividing (padding rows weigh 0).

  Args:
    eval_step_fn: eval_fn(params, batch) -> metric sums (`step.jit_eval_step`).
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


def validate(setup: Build, eval_fn, params, eval_batches, step: int) -> dict[str, float]:
  """Validation loss, nll, perplexity and accuracy of `params` (`evaluate`), logged as of `step`.

  Args:
    setup: the Build or Setup (its mesh places the batches).
    eval_fn: `step.jit_eval_step`'s function.
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
                                batch_sharding=setup.batch_sharding)


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
  if split.trees is None:
    return hypotheses, bleu.all_bleu(hypotheses, split.target_texts, config.data.target_lang), seconds
  return hypotheses, parsing.score_split(hypotheses, split.trees), seconds


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


def evaluate_at_step(config, setup: Setup, eval_fn, params, data, step: int, last: bool) -> dict[str, float]:
  """The training loop's evaluation after step `step` (§6.1): what is due of the validation loss (every
  train.eval_every_steps) and BLEU or F1 (every train.eval_bleu_every_steps, keeping the best checkpoints by it,
  `selection.save_best`); everything at the `last` step.

  Args:
    config: the run's config.
    setup: the Setup (its best-checkpoint manager keeps the best parameters).
    eval_fn: `step.jit_eval_step`'s function.
    params: the parameters after step `step`, placed as for training.
    data: the run's `input_pipeline.RunData` (its validation batches and split).
    step: the training step.
    last: whether `step` is the last of the run.

  Returns:
    `validate`'s figures and `validation_bleu`'s, of those due; {} when none is.
  """
  train_cfg = config.train
  scalars = {}
  if last or step % train_cfg.eval_every_steps == 0:
    scalars |= validate(setup, eval_fn, params, data.eval_batches, step)
  if train_cfg.eval_bleu_every_steps and (last or step % train_cfg.eval_bleu_every_steps == 0):
    scores = validation_bleu(config, setup, params, data.eval_split, step)
    selection.save_best(setup.best_checkpoints, step, params, scores[config.eval.metric])
    scalars |= scores
  return scalars


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

  Hypotheses are written to `<output_dir>/<split>.hyp.<target_lang>`, the figures to TensorBoard (`writer`:
  `eval_averaged/*` and `test/*` at the last chosen step), and last every figure to `<output_dir>/final_metrics.json`
  (process 0).

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
  translate_at_end = config.train.translate_at_end
  if translate_at_end:  # Read and encoded here unless the caller has them (a training run does).
    eval_split = eval_split or input_pipeline.encode_split(data_cfg, setup.tokenizer, data_cfg.eval_split)
    test_split = test_split or input_pipeline.encode_split(data_cfg, setup.tokenizer, data_cfg.test_split)
  output_dir = output_dir or setup.workdir
  with setup.mesh_context():
    results = validate(setup, eval_fn, params, eval_batches, steps[-1])
    validation_scalars, test_scalars = dict(results), {}
    if translate_at_end and config.eval.metric == 'f1':  # A parser (§6.3): validation and test F1, trees written.
      results |= parsing.final_scores(config, lambda split: translate_split(config, setup, params, split),
                                      eval_split, test_split, output_dir, steps)
      test_scalars = {'f1': results['f1']}
    elif translate_at_end:
      results |= _translate_at_end(config, setup, params, eval_split, test_split, output_dir, steps)
      test_scalars = {key: results[key] for key in _BLEUS}
  metrics_lib.write_scalars(writer, steps[-1], validation_scalars, 'eval_averaged')
  if test_scalars:
    metrics_lib.write_scalars(writer, steps[-1], test_scalars, 'test')
  # Last: a training run whose final_metrics.json exists is finished (a rerun does nothing), so everything
  # else this evaluation writes comes before it.
  _write_final_metrics(config.eval.checkpoint_selection, output_dir, results, steps, params, run_info)
  return results


def _translate_at_end(config, setup: Setup, params, eval_split, test_split, output_dir: str,
                      steps: list[int]) -> dict[str, float]:
  """The validation and test splits translated and scored (`translate_split`), their hypotheses written to
  `output_dir` and the BLEUs printed: the BLEU figures of `final_evaluation`."""
  data_cfg = config.data
  hypotheses, scores, _ = translate_split(config, setup, params, eval_split)
  results = {'validation_bleu': scores['bleu'],
             'validation_lowercased_tokenized_bleu': scores['lowercased_tokenized_bleu'],
             'validation_length_ratio': scores['length_ratio']}
  _write_hypotheses(output_dir, data_cfg.eval_split, data_cfg.target_lang, hypotheses)
  hypotheses, scores, seconds = translate_split(config, setup, params, test_split)
  path = _write_hypotheses(output_dir, data_cfg.test_split, data_cfg.target_lang, hypotheses)
  results |= {key: scores[key] for key in SCORES}
  results['decode_sentences_per_sec'] = len(hypotheses) / seconds
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
