"""The pure train and eval steps (§5) and the training loop: resumable, preemptible, NaN-safe.

Reliability, as the loop implements it:
  - Resuming: every run restores the newest readable checkpoint in `<workdir>/checkpoints` (the state and the
    input iterator's position), so a rerun continues exactly where the last checkpoint left off. Newer
    checkpoints that cannot be read (a file truncated or lost after a crash) are moved to
    `<workdir>/unusable_checkpoints/` with a warning and written again by the resumed run.
  - Signals: SIGTERM or SIGINT while training saves a checkpoint at the current step, logs it and returns
    normally (exit status 0); a second SIGINT interrupts at once. A kill -9 loses only the steps after the
    last checkpoint: orbax commits a checkpoint by renaming a finished temporary folder.
  - Non-finite values: an update whose loss, gradient or parameter update is not finite is never applied
    (`train_step`); then the run stops with FloatingPointError naming the step and the checkpoint to resume
    from (train.on_nonfinite='stop'), or logs it and carries on ('skip'). Checkpoints never hold NaN.
  - Start-up: config values, input files, the workdir (writable, no incompatible run in it) and, when
    translating at the end, the test split are checked before training (`experiment.setup`).
"""
import datetime
import functools
import json
import math
import signal
import sys
import threading
import time
from typing import Any, NamedTuple

from absl import logging
from etils import epath
import flax.linen as nn
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
import optax
import tensorboardX

from transformer_jax import bleu
from transformer_jax import checkpoints as checkpoints_lib
from transformer_jax import evaluate as evaluate_lib
from transformer_jax import inspection
from transformer_jax import input_pipeline
from transformer_jax import losses
from transformer_jax import memory
from transformer_jax import model as model_lib
from transformer_jax import multi30k
from transformer_jax import sharding
# Re-exported: they lived here before experiment.py, and other modules use them as train.<name>.
from transformer_jax.experiment import create_train_state  # pylint: disable=unused-import
from transformer_jax.experiment import encode_split
from transformer_jax.experiment import make_eval_batches
from transformer_jax.experiment import model_inputs
from transformer_jax.experiment import open_checkpoints
from transformer_jax.experiment import setup
from transformer_jax.experiment import Setup
from transformer_jax.experiment import sharded_train_state
from transformer_jax.experiment import TrainState
from transformer_jax.experiment import validate_config  # pylint: disable=unused-import

Array = jax.Array
Batch = dict[str, Array]
_SUM_KEYS = ('loss_sum', 'nll_sum', 'correct_sum', 'token_count')


def target_weights(batch: Batch) -> Array:
  """float32 [batch, tgt_len]: 1 on real target tokens (including EOS), 0 on padding."""
  return (batch['target_tokens'] != 0).astype(jnp.float32)


def train_step(state: TrainState, batch: Batch, *, model: model_lib.Transformer,
               tx: optax.GradientTransformation, label_smoothing: float,
               grad_accum_steps: int = 1) -> tuple[TrainState, dict[str, Array]]:
  """One Adam update on the label-smoothed loss averaged over the batch's real target tokens.

  With grad_accum_steps = n > 1 the batch is cut into n micro-batches (rows i, i + n, i + 2n, ... form
  micro-batch i, so every device keeps an equal share of each), whose gradients a `lax.scan` sums: activations
  are held for one micro-batch at a time, and the update is the one of the whole batch. Each micro-batch's
  loss is divided by the whole batch's token count (over every micro-batch and device), so the sum of their
  gradients is the gradient of (x1 + ... + xn) / (n1 + ... + nn), not a mean of per-micro-batch means.

  A non-finite loss, gradient or parameter update leaves the state unchanged except for the step counter
  (the parameters are never overwritten with NaN or inf) and reports `nonfinite=1`; the caller stops or
  carries on (`train.on_nonfinite`).

  Args:
    state: the TrainState (its buffers are donated by the jitted caller).
    batch: int32 arrays `source_tokens` [batch, src_len], `decoder_input_tokens`, `target_tokens`
      [batch, tgt_len], and for packed batches `*_segment_ids` and `*_positions`.
    model: the Transformer (static).
    tx: the optimiser (static).
    label_smoothing: ε_ls (static).
    grad_accum_steps: micro-batches per update (static); it must divide the batch's rows.

  Returns:
    (new state, metrics): float32 sums `loss_sum`, `nll_sum`, `correct_sum`, `token_count`, plus
    `grad_norm` and `nonfinite` (1.0 when the update was not applied) for this step.

  Raises:
    ValueError: at trace time, if grad_accum_steps does not divide the rows of the batch.
  """
  dropout_rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
  token_count = jnp.maximum(jnp.sum(target_weights(batch)), 1.0)

  def loss_fn(params, micro_batch, rng):
    logits = model.apply({'params': params}, micro_batch['source_tokens'], micro_batch['decoder_input_tokens'],
                         **model_inputs(micro_batch), deterministic=False, rngs={'dropout': rng})
    sums = losses.smoothed_cross_entropy(logits, micro_batch['target_tokens'], target_weights(micro_batch),
                                         label_smoothing)
    return sums['loss_sum'] / token_count, sums

  grad_fn = jax.grad(loss_fn, has_aux=True)
  if grad_accum_steps == 1:
    grads, sums = grad_fn(state.params, batch, dropout_rng)
  else:
    rows = batch['source_tokens'].shape[0]
    if rows % grad_accum_steps:
      raise ValueError(f'train.grad_accum_steps={grad_accum_steps} does not divide the {rows} rows of a batch')
    micro_batches = jax.tree.map(  # [n, rows / n, length]; micro-batch i holds rows i, i + n, ...
        lambda x: jnp.swapaxes(x.reshape(rows // grad_accum_steps, grad_accum_steps, *x.shape[1:]), 0, 1), batch)

    def accumulate(totals, inputs):
      index, micro_batch = inputs
      step_grads, step_sums = grad_fn(state.params, micro_batch, jax.random.fold_in(dropout_rng, index))
      return jax.tree.map(jnp.add, totals, (step_grads, step_sums)), None

    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(
        grad_fn, state.params, jax.tree.map(lambda x: x[0], micro_batches), dropout_rng))
    (grads, sums), _ = jax.lax.scan(accumulate, zeros, (jnp.arange(grad_accum_steps), micro_batches))
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  grad_norm = optax.tree.norm(grads)
  # The update can overflow when the gradient does not (an infinite learning rate, Adam's moments).
  finite = (jnp.isfinite(sums['loss_sum']) & jnp.isfinite(grad_norm)
            & jnp.isfinite(optax.tree.norm(updates)))
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  new_state = state.replace(step=state.step + 1, params=keep(params, state.params),
                            opt_state=keep(opt_state, state.opt_state))
  metrics = dict(sums, grad_norm=grad_norm, nonfinite=1.0 - finite.astype(jnp.float32))
  return new_state, metrics


def eval_step(params: Any, batch: Batch, *, model: model_lib.Transformer,
              label_smoothing: float) -> dict[str, Array]:
  """Teacher-forced validation metrics for one batch, as sums (see `losses.smoothed_cross_entropy`)."""
  logits = model.apply({'params': params}, batch['source_tokens'], batch['decoder_input_tokens'],
                       **model_inputs(batch), deterministic=True)
  return losses.smoothed_cross_entropy(logits, batch['target_tokens'], target_weights(batch), label_smoothing)


def jit_steps(s: Setup, state_sharding):
  """`train_step` and `eval_step` jitted as training runs them (§5), for the mesh and config of `s`.

  Args:
    s: the Setup (mesh, model, optimiser, train.label_smoothing).
    state_sharding: the TrainState's tree of NamedShardings (`jax.tree.map(lambda x: x.sharding,
      s.abstract_state())`).

  Returns:
    (train_fn(state, batch) -> (state, metrics), which donates the state it is given;
     eval_fn(params, batch) -> metric sums). Batches are split over the data axes (`sharding.batch_sharding`);
    each compiles once per batch shape.
  """
  batch_sharding = sharding.batch_sharding(s.mesh)
  train_fn = jax.jit(
      functools.partial(train_step, model=s.model, tx=s.tx, label_smoothing=s.config.train.label_smoothing,
                        grad_accum_steps=s.config.train.grad_accum_steps),
      in_shardings=(state_sharding, batch_sharding), out_shardings=(state_sharding, None), donate_argnums=0)
  eval_fn = jax.jit(
      functools.partial(eval_step, model=s.model, label_smoothing=s.config.train.label_smoothing),
      in_shardings=(state_sharding.params, batch_sharding))
  return train_fn, eval_fn


@jax.jit
def _accumulate(sums: dict[str, Array], metrics: dict[str, Array]) -> dict[str, Array]:
  """Adds one step's metric sums (zeros for a step whose update was not applied) and counts those steps."""
  skipped = metrics['nonfinite'] > 0
  return {key: sums[key] + jnp.where(skipped, 0.0, metrics[key]) for key in _SUM_KEYS} | {
      'skipped_steps': sums['skipped_steps'] + metrics['nonfinite']}


class _Progress:
  """Sums metrics on the device between reports; checks each step for non-finite values one step late."""

  def __init__(self, s: Setup, writer, first_step: int):
    self.s, self.writer = s, writer
    self.sums, self.tokens, self.pending = self._zeros(), 0, None
    self.time, self.step = time.perf_counter(), first_step

  @staticmethod
  def _zeros() -> dict[str, Array]:
    return {key: jnp.zeros((), jnp.float32) for key in (*_SUM_KEYS, 'skipped_steps')}

  def update(self, step: int, metrics: dict[str, Array], batch: dict[str, np.ndarray]) -> None:
    """Records step `step`'s metrics, then checks the previous step's (by now computed: no pipeline stall)."""
    self.check_pending()
    self.pending = (step, metrics)
    self.sums = _accumulate(self.sums, metrics)
    self.tokens += sum(int(np.count_nonzero(batch[k])) for k in ('source_tokens', 'target_tokens'))

  def check_pending(self) -> None:
    """Checks the last recorded step; raises FloatingPointError or warns (train.on_nonfinite) if it was skipped."""
    if self.pending is None:
      return
    (step, metrics), self.pending = self.pending, None
    if float(metrics['nonfinite']) == 0.0:
      return
    latest = self.s.checkpoints.latest_step()
    message = f'Non-finite loss or gradient at step {step}; its update was not applied'
    if self.s.config.train.on_nonfinite == 'skip':
      logging.warning('%s (train.on_nonfinite=skip).', message)
      return
    resume = (f'resume from checkpoint step {latest} in {self.s.checkpoints.directory}' if latest is not None
              else f'no checkpoint has been written to {self.s.checkpoints.directory} yet')
    raise FloatingPointError(f'{message}. Stopped: {resume} (e.g. with a lower train.learning_rate_scale), '
                             'or set train.on_nonfinite=skip.')

  def report(self, step: int) -> None:
    self.check_pending()
    now = time.perf_counter()
    sums = jax.device_get(self.sums)
    summary = evaluate_lib.summarize_metrics(sums)
    steps_per_sec = (step - self.step) / (now - self.time)
    remaining = (self.s.config.train.num_train_steps - step) / max(steps_per_sec, 1e-9)
    tokens = self.tokens  # This process's rows; every process reports at the same step, so sum them.
    if jax.process_count() > 1:
      tokens = int(np.sum(multihost_utils.process_allgather(np.int64(tokens))))
    summary |= {'learning_rate': float(self.s.schedule(step - 1)), 'steps_per_sec': steps_per_sec,
                'tokens_per_sec': tokens / (now - self.time), 'skipped_steps': float(sums['skipped_steps'])}
    logging.info('step %d/%d | loss %.4f | nll %.4f | acc %.3f | lr %.3g | %.2f steps/s | %.0f tokens/s | '
                 '%s left', step, self.s.config.train.num_train_steps, summary['loss'], summary['nll'],
                 summary['accuracy'], summary['learning_rate'], steps_per_sec, summary['tokens_per_sec'],
                 datetime.timedelta(seconds=int(remaining)))
    write_scalars(self.writer, step, summary, prefix='train')
    self.sums, self.tokens, self.time, self.step = self._zeros(), 0, now, step


def write_scalars(writer, step: int, scalars: dict[str, float], prefix: str) -> None:
  if writer is not None:
    for key, value in scalars.items():
      writer.add_scalar(f'{prefix}/{key}', value, step)
    writer.flush()


class _StopRequest:
  """Turns SIGTERM and SIGINT into a request to save and stop, which the loop reads once per step.

  A single-process run installs the handlers for the duration of the loop and restores the previous ones
  after. On multi-host runs JAX's preemption service owns SIGTERM and the processes agree on the step to
  stop at through `multihost_utils.reached_preemption_sync_point` (not tested here: one host only).
  """
  _SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.reason: str | None = None
    self._previous = {}

  def __enter__(self) -> '_StopRequest':
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      self._previous = {sig: signal.signal(sig, self._handle) for sig in self._SIGNALS}
    return self

  def __exit__(self, *exc_info) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, signal.SIG_DFL if handler is None else handler)

  def _handle(self, signum: int, frame) -> None:
    del frame
    if self.reason is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt  # A second Ctrl-C: stop now, without a checkpoint.
    self.reason = signal.Signals(signum).name
    logging.warning('Received %s: saving a checkpoint after the current step, then stopping.', self.reason)

  def requested(self, step: int) -> bool:
    if self.reason is None and jax.process_count() > 1 and multihost_utils.reached_preemption_sync_point(step):
      self.reason = 'a preemption notice'
    return self.reason is not None


class _Data(NamedTuple):
  """The splits a training run reads, all loaded before the first step (so that bad files fail early)."""
  train_iter: input_pipeline.TrainIterator
  eval_batches: list[dict[str, np.ndarray]]
  eval_split: tuple  # encode_split of the validation split (its texts for validation BLEU).
  test: tuple | None  # encode_split of the test split when train.translate_at_end, else None.


def _load_data(s: Setup) -> _Data:
  data_cfg = s.config.data
  train_source, train_target = input_pipeline.load_split(data_cfg, data_cfg.train_split)
  train_iter = input_pipeline.TrainIterator.from_config(
      data_cfg, input_pipeline.encode(s.tokenizer, train_source), input_pipeline.encode(s.tokenizer, train_target),
      pad_rows_to=s.data_shards * s.config.train.grad_accum_steps, process_index=jax.process_index(),
      process_count=jax.process_count())
  del train_source, train_target
  eval_split = encode_split(s, data_cfg.eval_split)
  test = encode_split(s, data_cfg.test_split) if s.config.train.translate_at_end else None
  return _Data(train_iter, make_eval_batches(s, eval_split[2], eval_split[3]), eval_split, test)


def _restore_or_init(s: Setup, data: _Data) -> tuple[TrainState, Any]:
  """The newest readable checkpoint's state (and iterator position), else a new state; and its shardings."""
  abstract = s.abstract_state()
  state_sharding = jax.tree.map(lambda x: x.sharding, abstract)
  newest = s.checkpoints.latest_step()
  restored = s.checkpoints.restore_latest(abstract)
  if restored is None:
    state, _ = sharded_train_state(jax.random.key(s.config.train.seed), s.model, s.tx,
                                   s.device_batch(data.eval_batches[0]), s.mesh, s.rules)
    return state, state_sharding
  if restored.step != newest:
    _set_aside_unusable(s, restored.step)
  data.train_iter.set_state(restored.data_state)
  logging.info('Resumed from checkpoint step %d in %s.', restored.step, s.checkpoints.directory)
  return restored.state, state_sharding


def _set_aside_unusable(s: Setup, restored_step: int) -> None:
  """Moves checkpoints newer than `restored_step` (unreadable: see restore_latest) to unusable_checkpoints/.

  They are moved rather than deleted because a read error may be transient, and their files tell what went
  wrong; the resumed run writes those steps again (orbax never overwrites a step).

  Raises:
    RuntimeError: if a newer step is still listed afterwards.
  """
  unusable = [step for step in s.checkpoints.all_steps() if step > restored_step]
  s.checkpoints.close()
  if jax.process_index() == 0:
    target_dir = epath.Path(s.workdir) / 'unusable_checkpoints'
    target_dir.mkdir(parents=True, exist_ok=True)
    for step in unusable:
      target = target_dir / f'{step}.{time.strftime("%Y%m%d-%H%M%S")}'
      (epath.Path(s.checkpoints.directory) / str(step)).rename(target)
      logging.warning('Moved unusable checkpoint step %d to %s; resuming from step %d.', step, target,
                      restored_step)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices('unusable checkpoints moved')
  s.checkpoints = open_checkpoints(s.config, s.workdir, s.model.cfg)
  left = [step for step in s.checkpoints.all_steps() if step > restored_step]
  if left:
    raise RuntimeError(f'Unusable checkpoint steps {left} are still in {s.checkpoints.directory}; move them away '
                       'and rerun.')


def _train_loop(s: Setup, state: TrainState, train_fn, eval_fn, data: _Data, writer,
                stop: _StopRequest) -> tuple[TrainState, int | None]:
  """Steps state.step + 1 .. train.num_train_steps; returns (state, the step it stopped at on request or None)."""
  cfg = s.config.train
  progress = _Progress(s, writer, int(state.step))
  for step in range(int(state.step) + 1, cfg.num_train_steps + 1):
    batch = next(data.train_iter)
    state, metrics = train_fn(state, s.device_batch(batch))
    progress.update(step, metrics, batch)
    last, stopping = step == cfg.num_train_steps, stop.requested(step)
    if last or stopping or step % cfg.checkpoint_every_steps == 0:
      progress.check_pending()  # With on_nonfinite='stop', a skipped step's state is never saved.
    if last or step % cfg.log_every_steps == 0:
      progress.report(step)
    if last or step % cfg.eval_every_steps == 0:
      write_scalars(writer, step, _validate(s, eval_fn, state.params, data.eval_batches, step), 'eval')
    if cfg.eval_bleu_every_steps and (last or step % cfg.eval_bleu_every_steps == 0):
      scores = validation_bleu(s, state.params, data.eval_split, step)
      write_scalars(writer, step, scores, 'eval')
      s.best_checkpoints.save(step, {'params': state.params}, {}, force=True, metrics={'bleu': scores['bleu']})
    s.checkpoints.save(step, state, data.train_iter.get_state(), force=last or stopping)
    if stopping:
      return state, step
  return state, None


def train_and_evaluate(config, workdir: str) -> dict[str, float]:
  """Trains (resuming from the latest checkpoint in workdir), evaluates periodically, then translates.

  Returns:
    The final metrics: validation loss/nll/perplexity/accuracy, and `bleu` when train.translate_at_end; or
    {'stopped_at_step': step} when a signal stopped training (after saving checkpoint `step`).

  Raises:
    FloatingPointError: for a non-finite loss or gradient with train.on_nonfinite='stop'.
    ValueError, FileNotFoundError, OSError: from the start-up checks (`experiment.setup`).
  """
  data_cfg = config.data
  splits = (data_cfg.train_split, data_cfg.eval_split) + ((data_cfg.test_split,) if config.train.translate_at_end
                                                          else ())
  s = setup(config, workdir, data_splits=splits)
  writer = None
  try:
    if jax.process_index() == 0:
      inspection.save_config(config, workdir)  # config.json, for notebooks and --mode=evaluate/translate readers.
    data = _load_data(s)
    memory.check_train_step(s, jit_steps)  # Stops before any state is allocated if the step cannot fit (#16).
    state, state_sharding = _restore_or_init(s, data)
    train_fn, eval_fn = jit_steps(s, state_sharding)
    writer = tensorboardX.SummaryWriter(workdir) if jax.process_index() == 0 else None
    start = time.perf_counter()
    with _StopRequest() as stop, jax.set_mesh(s.mesh), nn.logical_axis_rules(s.rules):
      state, stopped_at = _train_loop(s, state, train_fn, eval_fn, data, writer, stop)
    run_info = {'train_wall_seconds': time.perf_counter() - start, 'train_steps': int(state.step)}
    s.checkpoints.wait_until_finished()
    if stopped_at is not None:
      logging.warning('Stopped by %s after step %d: saved checkpoint step %d in %s. Run the same command to '
                      'resume.', stop.reason, stopped_at, s.checkpoints.latest_step(), s.checkpoints.directory)
      return {'stopped_at_step': stopped_at}
    return final_evaluation(s, eval_fn, data.eval_batches, writer, test_split=data.test,
                            eval_split=data.eval_split, run_info=run_info)
  finally:
    if writer is not None:
      writer.close()
    s.close()


def _validate(s: Setup, eval_fn, params, eval_batches, step: int) -> dict[str, float]:
  # Global arrays: with several processes each host holds its rows of every batch (multi-host safe).
  metrics = evaluate_lib.evaluate(eval_fn, params, map(s.device_batch, eval_batches))
  logging.info('eval at step %d | loss %.4f | nll %.4f | perplexity %.2f | acc %.3f', step, metrics['loss'],
               metrics['nll'], metrics['perplexity'], metrics['accuracy'])
  return metrics


def translate_split(s: Setup, params, split, beam_size: int | None = None) -> tuple[list[str], dict, float]:
  """Translates a split with beam search and scores it (`bleu.all_bleu`).

  Args:
    s: the Setup.
    params: the parameters to decode with.
    split: `encode_split` of the split (texts and ids).
    beam_size: overrides decode.beam_size (1: greedy).

  Returns:
    (hypotheses, the three BLEUs and the sacreBLEU signature, seconds spent decoding).
  """
  _, references, source_ids, target_ids = split
  start = time.perf_counter()
  hypotheses = translate_ids(s, params, source_ids, target_ids, beam_size=beam_size)
  seconds = time.perf_counter() - start
  return hypotheses, bleu.all_bleu(hypotheses, references, s.config.data.target_lang), seconds


_BLEUS = ('bleu', 'tokenized_bleu', 'lowercased_tokenized_bleu')


def validation_bleu(s: Setup, params, eval_split, step: int) -> dict[str, float]:
  """BLEU of the validation split decoded with beam eval.bleu_beam_size (0: decode.beam_size; 1: greedy).

  Args:
    s: the Setup.
    params: the parameters to decode with.
    eval_split: `encode_split` of the validation split.
    step: the training step, for the log line.

  Returns:
    {'bleu', 'tokenized_bleu', 'lowercased_tokenized_bleu', 'bleu_seconds'} (see `bleu.all_bleu`).
  """
  beam_size = s.config.eval.bleu_beam_size or s.config.decode.beam_size
  _, scores, seconds = translate_split(s, params, eval_split, beam_size)
  logging.info('validation BLEU at step %d | bleu %.2f | lowercased tokenized %.2f | beam %d | %.1f s', step,
               scores['bleu'], scores['lowercased_tokenized_bleu'], beam_size, seconds)
  return {key: scores[key] for key in _BLEUS} | {'bleu_seconds': seconds}


def load_params(s: Setup):
  """The parameters the final evaluation uses (§6.1), chosen by eval.checkpoint_selection.

  'average_last': the mean of the last eval.average_last_n checkpoints; 'best': the checkpoint of
  `<workdir>/best_checkpoints` with the best validation BLEU; 'average_best': the mean of the
  eval.average_best_n best.

  Returns:
    (params, steps): the (averaged) parameters, placed as for training, and the checkpoint steps they
    come from, ascending.

  Raises:
    FileNotFoundError: if the workdir holds no checkpoint to choose from.
  """
  selection = s.config.eval.checkpoint_selection
  if selection == 'average_last':
    manager = s.checkpoints
    steps = manager.all_steps()[-s.config.eval.average_last_n:]
  else:
    manager = s.best_checkpoints
    steps = sorted(manager.best_steps()[:1 if selection == 'best' else s.config.eval.average_best_n])
  if not steps:
    raise FileNotFoundError(f'no checkpoint in {manager.directory}: train first (--mode=train)')
  logging.info('Averaging the parameters of checkpoint steps %s (eval.checkpoint_selection=%s).', steps,
               selection)
  return checkpoints_lib.average_checkpoints(manager, steps, s.abstract_state().params), steps


def final_evaluation(s: Setup, eval_fn, eval_batches, writer=None, test_split=None,
                     eval_split=None, run_info=None) -> dict[str, float]:
  """Validation metrics and BLEU, and test BLEU, of the chosen checkpoints (`load_params`).

  Hypotheses are written to `<workdir>/<split>.hyp.<target_lang>` and every figure to
  `<workdir>/final_metrics.json` (process 0).

  Args:
    s: the Setup.
    eval_fn: the jitted eval step.
    eval_batches: the validation split's batches.
    writer: a tensorboardX writer, or None.
    test_split: `encode_split` of the test split, if already loaded; read when None.
    eval_split: `encode_split` of the validation split, if already loaded; read when None.
    run_info: figures of the training run to store in final_metrics.json beside the evaluation's
      (`train_wall_seconds`: this invocation's training loop, compilation and validation included;
      `train_steps`), or None.

  Returns:
    Validation loss, nll, perplexity, accuracy; with train.translate_at_end also `validation_bleu`,
    `validation_lowercased_tokenized_bleu`, and the test split's `bleu` (sacreBLEU), `tokenized_bleu`,
    `lowercased_tokenized_bleu` and `decode_sentences_per_sec`.
  """
  params, steps = load_params(s)
  data_cfg = s.config.data
  with jax.set_mesh(s.mesh), nn.logical_axis_rules(s.rules):
    results = _validate(s, eval_fn, params, eval_batches, steps[-1])
    write_scalars(writer, steps[-1], results, 'eval_averaged')
    if not s.config.train.translate_at_end:
      _write_final_metrics(s, results, steps, params, run_info)
      return results
    eval_split = eval_split or encode_split(s, data_cfg.eval_split)
    hypotheses, scores, _ = translate_split(s, params, eval_split)
    results |= {'validation_bleu': scores['bleu'],
                'validation_lowercased_tokenized_bleu': scores['lowercased_tokenized_bleu']}
    _write_hypotheses(s, data_cfg.eval_split, hypotheses)
    test_split = test_split or encode_split(s, data_cfg.test_split)
    hypotheses, scores, seconds = translate_split(s, params, test_split)
  path = _write_hypotheses(s, data_cfg.test_split, hypotheses)
  results |= {key: scores[key] for key in _BLEUS}
  results['decode_sentences_per_sec'] = len(hypotheses) / seconds
  write_scalars(writer, steps[-1], {key: scores[key] for key in _BLEUS}, 'test')
  _write_final_metrics(s, results, steps, params, run_info)
  logging.info('Translated %d sentences in %.1f s (%.1f sentences/s); hypotheses in %s', len(hypotheses), seconds,
               len(hypotheses) / seconds, path)
  _print_bleu(s, results, scores['bleu_signature'], steps)
  return results


def _print_bleu(s: Setup, results: dict[str, float], signature: str, steps: list[int]) -> None:
  """The lines a final evaluation prints: validation BLEU, then the test split's three BLEUs."""
  print(f'validation_bleu: {results["validation_bleu"]:.2f}  (sacreBLEU, {s.config.data.eval_split}; lowercased '
        f'tokenized {results["validation_lowercased_tokenized_bleu"]:.2f})')
  print(f'bleu: {results["bleu"]:.2f}  ({signature}; beam {s.config.decode.beam_size}, '
        f'{s.config.eval.checkpoint_selection}: averaged steps {steps})')
  print(f'tokenized_bleu: {results["tokenized_bleu"]:.2f}  (tokenized, compound-split, as in the paper)')
  print(f'lowercased_tokenized_bleu: {results["lowercased_tokenized_bleu"]:.2f}  (lowercased, Moses-normalised '
        'and -tokenised, multi-bleu: the Multi30k literature\'s BLEU)')


def _write_hypotheses(s: Setup, split: str, hypotheses: list[str]) -> epath.Path:
  path = epath.Path(s.workdir) / f'{split}.hyp.{s.config.data.target_lang}'
  if jax.process_index() == 0:
    path.write_text(''.join(h + '\n' for h in hypotheses), encoding='utf-8')
  return path


def _write_final_metrics(s: Setup, results: dict[str, float], steps: list[int], params, run_info=None) -> None:
  """`<workdir>/final_metrics.json`: the final evaluation's figures, the checkpoints they come from and the
  parameter count of `params` (what transformer_jax.report reads)."""
  if jax.process_index() == 0:
    num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    record = {key: float(value) for key, value in results.items()} | (run_info or {}) | {
        'checkpoint_steps': list(steps), 'checkpoint_selection': s.config.eval.checkpoint_selection,
        'num_params': num_params}
    (epath.Path(s.workdir) / 'final_metrics.json').write_text(json.dumps(record, indent=2, sort_keys=True))


def translate_ids(s: Setup, params, source_ids, target_ids=None, beam_size: int | None = None) -> list[str]:
  """Beam search (decode.*; `beam_size` overrides decode.beam_size) over tokenised sources, in order."""
  if target_ids is None:
    target_ids = input_pipeline.Ragged.from_lists([[] for _ in range(len(source_ids))])
  batches = make_eval_batches(s, source_ids, target_ids)
  decode_cfg = s.config.decode
  return evaluate_lib.translate(params, batches, s.tokenizer, len(source_ids), model=s.model,
                                beam_size=beam_size or decode_cfg.beam_size, alpha=decode_cfg.alpha,
                                extra_length=decode_cfg.extra_length,
                                batch_sharding=sharding.batch_sharding(s.mesh))


def evaluate_checkpoint(config, workdir: str) -> dict[str, float]:
  """--mode=evaluate: validation metrics and test BLEU of the latest (averaged) checkpoints."""
  data_cfg = config.data
  s = setup(config, workdir, data_splits=(data_cfg.eval_split,) + ((data_cfg.test_split,)
                                                                   if config.train.translate_at_end else ()))
  try:
    eval_split = encode_split(s, data_cfg.eval_split)
    state_sharding = jax.tree.map(lambda x: x.sharding, s.abstract_state())
    _, eval_fn = jit_steps(s, state_sharding)
    return final_evaluation(s, eval_fn, make_eval_batches(s, eval_split[2], eval_split[3]),
                            eval_split=eval_split)
  finally:
    s.close()


def translate_file(config, workdir: str, input_path: str | None, output_path: str | None) -> None:
  """--mode=translate: one output line per input line (a blank line stays blank), stdin/stdout by default."""
  s = setup(config, workdir)
  try:
    # Lines end at '\n' only: str.splitlines would also split at Unicode separators inside a sentence.
    if input_path:
      lines = multi30k.read_lines(input_path)
    else:
      lines = sys.stdin.read().split('\n')
      lines = [line.removesuffix('\r') for line in (lines[:-1] if lines[-1] == '' else lines)]
    params, _ = load_params(s)
  finally:
    s.close()
  with jax.set_mesh(s.mesh), nn.logical_axis_rules(s.rules):
    hypotheses = translate_ids(s, params, input_pipeline.encode(s.tokenizer, lines))
  hypotheses = [h if line.strip() else '' for line, h in zip(lines, hypotheses)]
  text = ''.join(h + '\n' for h in hypotheses)
  if output_path:
    epath.Path(output_path).write_text(text, encoding='utf-8')
  else:
    sys.stdout.write(text)
