"""--mode=evaluate and --mode=translate: a trained run's chosen checkpoints on the validation and test splits, or on
a file of sentences (§6.1).
"""
import sys
import time

from absl import logging
from etils import epath

from transformer_jax import errors
from transformer_jax.data import input_pipeline
from transformer_jax.data import multi30k
from transformer_jax.evaluation import evaluate
from transformer_jax.evaluation import parsing
from transformer_jax.run import experiment
from transformer_jax.storage import workdir as workdir_lib
from transformer_jax.training import step as step_lib


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
    The figures of `evaluate.final_evaluation`.

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
    eval_fn = step_lib.jit_eval_step(setup, setup.state_sharding().params, config.train.label_smoothing)
    eval_split = input_pipeline.encode_split(data_cfg, setup.tokenizer, data_cfg.eval_split)
    batches = input_pipeline.split_eval_batches(data_cfg, eval_split.source_ids, eval_split.target_ids,
                                                setup.data_shards)
    results = evaluate.final_evaluation(config, setup, eval_fn, batches, eval_split=eval_split, output_dir=output_dir)
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
    params, steps = evaluate.load_params(config.eval, setup)
    unfinished = setup.checkpoints.latest_step() != config.train.num_train_steps
  finally:
    setup.close()
  start = time.perf_counter()
  with setup.mesh_context():
    hypotheses = evaluate.translate_ids(config, setup, params, input_pipeline.encode(setup.tokenizer, lines))
  seconds = time.perf_counter() - start
  hypotheses = [evaluate.single_line(h) if line.strip() else '' for line, h in zip(lines, hypotheses)]
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
