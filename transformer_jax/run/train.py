"""--mode=train: set-up, data, the compiled steps, the loop and the final evaluation, in that order (§5, §6.1).

`train_and_evaluate` is the whole run; the loop is resumable, preemptible and NaN-safe. The steps it compiles are
`training/step.py`'s, the evaluation it calls `evaluation/evaluate.py`'s.

Reliability, as the loop implements it:
  - Resuming: every run restores the newest readable checkpoint in `<workdir>/checkpoints` (the state and the
    input iterator's position), so a rerun continues exactly where the last checkpoint left off. Newer
    checkpoints that cannot be read (a file truncated or lost after a crash) are moved to
    `<workdir>/unusable_checkpoints/` with a warning and written again by the resumed run.
  - Signals: SIGTERM or SIGINT while training saves a checkpoint at the current step, logs it and returns
    normally (exit status 0); a second SIGINT interrupts at once. A kill -9 loses only the steps after the
    last checkpoint: orbax commits a checkpoint by renaming a finished temporary folder.
  - Non-finite values: an update whose loss, gradient or parameter update is not finite is never applied
    (`step.train_step`); then the run stops with `errors.DivergedError` (a FloatingPointError) naming the step and
    the checkpoint to resume from (train.on_nonfinite='stop'), or logs it and carries on ('skip'). Checkpoints
    never hold NaN.
  - Start-up: config values, input files, the workdir (writable, no incompatible run in it) and, when
    translating at the end, the test split are checked before training (`experiment.setup`).
"""
import datetime
import signal
import threading
import time
from typing import Any

from absl import logging
from etils import epath
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
import tensorboardX

from transformer_jax import errors
from transformer_jax.data import input_pipeline
from transformer_jax.evaluation import evaluate as evaluate_lib
from transformer_jax.run import experiment
from transformer_jax.storage import workdir as workdir_lib
from transformer_jax.training import flops as flops_lib
from transformer_jax.training import goodput
from transformer_jax.training import memory
from transformer_jax.training import metrics as metrics_lib
from transformer_jax.training import state as state_lib
from transformer_jax.training import step as step_lib
from transformer_jax.training.build import Setup
from transformer_jax.training.state import TrainState

Array = jax.Array
_SUM_KEYS = ('loss_sum', 'nll_sum', 'correct_sum', 'token_count')
# Steps of a (re)started loop before its first progress line; then every log_every_steps, and whenever
# log_every_secs have passed since the last line.
_FIRST_REPORT_AFTER = 10


@jax.jit
def _accumulate(sums: dict[str, Array], metrics: dict[str, Array]) -> dict[str, Array]:
  """Adds one step's metric sums and gradient norm (zeros for a step whose update was not applied) and counts
  the applied and the skipped steps."""
  skipped = metrics['nonfinite'] > 0
  summed = [key for key in sums if key not in ('skipped_steps', 'applied_steps')]  # In order: one trace per run.
  return {key: sums[key] + jnp.where(skipped, 0.0, metrics[key]) for key in summed} | {
      'skipped_steps': sums['skipped_steps'] + metrics['nonfinite'],
      'applied_steps': sums['applied_steps'] + 1.0 - metrics['nonfinite']}


class _Progress:
  """Sums metrics on the device between reports; checks each step for non-finite values one step late.

  Rates, MFU and the time left count training steps only: the seconds `timeline` gives to compiling, input,
  validation and checkpoints are left out (they are reported apart). MFU is the model FLOPs of the batches
  trained (`flops.train_step_flops` of their padded or packed shapes) per second, over the peak (`peak`; a
  measured one is re-measured at a progress line at most once a minute, its time left out of the steps').
  """

  def __init__(self, train_config, setup: Setup, writer, first_step: int, peak: flops_lib.Peak,
               timeline: goodput.Timeline):
    self.train_config, self.setup, self.writer, self.peak, self.timeline = train_config, setup, writer, peak, timeline
    self.sums, self.tokens, self.flops, self.pending = self._zeros(), 0, 0.0, None
    self.time, self.step, self.excluded = time.perf_counter(), first_step, timeline.in_loop_seconds()
    self.total_flops = 0.0  # Over the whole loop, for final_metrics.json.

  def _zeros(self) -> dict[str, Array]:
    keys = (*_SUM_KEYS, *(('kl_sum',) if self.train_config.rdrop_alpha else ()), 'grad_norm', 'skipped_steps',
            'applied_steps')
    return {key: jnp.zeros((), jnp.float32) for key in keys}

  def update(self, step: int, metrics: dict[str, Array], batch: dict[str, np.ndarray]) -> None:
    """Records step `step`'s metrics, then checks the previous step's (by now computed: no pipeline stall)."""
    self.check_pending()
    self.pending = (step, metrics)
    self.sums = _accumulate(self.sums, metrics)
    self.tokens += sum(int(np.count_nonzero(batch[k])) for k in ('source_tokens', 'target_tokens'))
    rows = batch['source_tokens'].shape[0] * jax.process_count()  # Every process holds an equal share.
    step_flops = flops_lib.train_step_flops(self.setup.model.cfg, rows, batch['source_tokens'].shape[1],
                                            batch['target_tokens'].shape[1],
                                            step_lib.passes_per_step(self.train_config.rdrop_alpha))
    self.flops += step_flops
    self.total_flops += step_flops

  def check_pending(self) -> None:
    """Checks the last recorded step; raises errors.DivergedError or warns (train.on_nonfinite) if it was skipped."""
    if self.pending is None:
      return
    (step, metrics), self.pending = self.pending, None
    if float(metrics['nonfinite']) == 0.0:
      return
    latest = self.setup.checkpoints.latest_step()
    message = f'Non-finite loss or gradient at step {step}; its update was not applied'
    if self.train_config.on_nonfinite == 'skip':
      logging.warning('%s (train.on_nonfinite=skip).', message)
      return
    resume = (f'resume from checkpoint step {latest} in {self.setup.checkpoints.directory}' if latest is not None
              else f'no checkpoint has been written to {self.setup.checkpoints.directory} yet')
    raise errors.DivergedError(f'{message}. Stopped: {resume} (e.g. with a lower train.learning_rate_scale), '
                               'or set train.on_nonfinite=skip.')

  def due(self) -> bool:
    """Whether train.log_every_secs have passed since the last line (on one process only: over several, every
    process must report at the same step, and their clocks differ)."""
    every = self.train_config.log_every_secs
    return bool(every) and jax.process_count() == 1 and time.perf_counter() - self.time >= every

  def report(self, step: int) -> None:
    self.check_pending()
    now = time.perf_counter()
    sums = jax.device_get(self.sums)
    summary = metrics_lib.summarize(sums)
    excluded = self.timeline.in_loop_seconds()
    seconds = max(now - self.time - (excluded - self.excluded), 1e-9)  # Training steps only.
    # After `now`, so the next line's window holds it, as a stage its steps' time leaves out.
    with self.timeline.stage('peak_measurement'):
      peak = self.peak.remeasure()
    steps_per_sec = (step - self.step) / seconds
    remaining = (self.train_config.num_train_steps - step) / max(steps_per_sec, 1e-9)
    tokens = self.tokens  # This process's rows; every process reports at the same step, so sum them.
    if jax.process_count() > 1:
      tokens = int(np.sum(multihost_utils.process_allgather(np.int64(tokens))))
    summary |= {'learning_rate': float(self.setup.schedule(step - 1)), 'steps_per_sec': steps_per_sec,
                'tokens_per_sec': tokens / seconds, 'skipped_steps': float(sums['skipped_steps']),
                'grad_norm': float(sums['grad_norm']) / max(float(sums['applied_steps']), 1.0),
                'mfu': self.flops / seconds / peak}
    kl = f' | kl {summary["kl"]:.4f}' if 'kl' in summary else ''
    logging.info('step %d/%d | loss %.4f | nll %.4f%s | acc %.3f | grad norm %.3g | lr %.3g | %.2f steps/s | '
                 '%.0f tokens/s | MFU %.1f%% | %s left', step, self.train_config.num_train_steps,
                 summary['loss'], summary['nll'], kl, summary['accuracy'], summary['grad_norm'],
                 summary['learning_rate'], steps_per_sec, summary['tokens_per_sec'], 100 * summary['mfu'],
                 datetime.timedelta(seconds=int(remaining)))
    metrics_lib.write_scalars(self.writer, step, summary, prefix='train')
    self.sums, self.tokens, self.flops, self.time, self.step, self.excluded = (
        self._zeros(), 0, 0.0, now, step, excluded)


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


def _restore_or_init(setup: Setup, data: input_pipeline.RunData, seed: int) -> TrainState:
  """The newest readable checkpoint's state (and iterator position), else a new state."""
  abstract = setup.abstract_state()
  newest = setup.checkpoints.latest_step()
  restored = setup.checkpoints.restore_latest(abstract)
  if restored is None:
    state, _ = state_lib.sharded_train_state(jax.random.key(seed), setup.model, setup.tx,
                                             setup.device_batch(data.eval_batches[0]), setup.mesh, setup.rules)
    return state
  if restored.step != newest:
    setup.checkpoints.set_aside_newer_than(restored.step,
                                           workdir_lib.path(setup.workdir, workdir_lib.UNUSABLE_CHECKPOINTS))
  data.train_iter.set_state(restored.data_state)
  logging.info('Resumed from checkpoint step %d in %s.', restored.step, setup.checkpoints.directory)
  return restored.state


def _train_loop(config, setup: Setup, state: TrainState, train_fn, eval_fn, data: input_pipeline.RunData, writer,
                stop: _StopRequest, progress: _Progress, timeline: goodput.Timeline
                ) -> tuple[TrainState, int | None]:
  """Steps state.step + 1 .. train.num_train_steps; returns (state, the step it stopped at on request or None).

  Each stage's wall time goes to `timeline` (input, compile, evaluation, checkpoint; the rest is training steps).
  """
  cfg = config.train
  first_step = int(state.step)
  logging.info('Training steps %d to %d. Progress lines: loss = the label-smoothed cross-entropy that is '
               'optimised (train.label_smoothing=%g; with train.rdrop_alpha > 0, over both passes, and the objective '
               "per target token is loss + alpha / 4 kl, R-Drop's L1 + L2 + alpha / 2 (KL(P1||P2) + KL(P2||P1)) per "
               'pair of passes, with kl = KL(P1||P2) + KL(P2||P1) per target token of one pass, shown after nll), '
               'nll = the plain cross-entropy per target token (of the sampled segmentations with '
               'data.bpe_dropout_rate > 0: finer, so not comparable with validation), acc = next-token accuracy, '
               'grad norm = the mean global gradient norm; steps/s and the time left count training steps only '
               '(compilation and validation are logged apart).', int(state.step) + 1,
               cfg.num_train_steps, cfg.label_smoothing)
  for step in range(int(state.step) + 1, cfg.num_train_steps + 1):
    with timeline.stage('input'):
      batch = next(data.train_iter)
      device_batch = setup.device_batch(batch)
    compiled, start = train_fn._cache_size(), time.perf_counter()  # pylint: disable=protected-access
    state, metrics = train_fn(state, device_batch)
    if train_fn._cache_size() != compiled:  # pylint: disable=protected-access
      seconds = time.perf_counter() - start  # The call returned once compiled (the step runs asynchronously).
      timeline.add('compile', seconds)
      logging.info('Train step ready for batch shape %s in %.1f s (compiled, or read from the compilation '
                   'cache).', list(batch['source_tokens'].shape), seconds)
    progress.update(step, metrics, batch)
    last, stopping = step == cfg.num_train_steps, stop.requested(step)
    if last or stopping or step % cfg.checkpoint_every_steps == 0:
      progress.check_pending()  # With on_nonfinite='stop', a skipped step's state is never saved.
    if (last or step % cfg.log_every_steps == 0 or step == first_step + _FIRST_REPORT_AFTER
        or progress.due()):
      progress.report(step)
    with timeline.stage('evaluation'):
      scalars = evaluate_lib.evaluate_at_step(config, setup, eval_fn, state.params, data, step, last)
      if scalars:
        metrics_lib.write_scalars(writer, step, scalars, 'eval')
    with timeline.stage('checkpoint'):
      setup.checkpoints.save(step, state, data.train_iter.get_state(), force=last or stopping)
    if stopping:
      return state, step
  return state, None


def _finished_run(setup: Setup, num_train_steps: int) -> dict[str, Any] | None:
  """The stored final metrics when the workdir's run has trained all train.num_train_steps and been evaluated
  (a rerun of the same command then does nothing: no second test translation, no duplicate TensorBoard
  points); else None.

  Raises:
    errors.ConfigError: when the newest checkpoint is past num_train_steps (before anything is written).
    errors.DamagedFileError: naming final_metrics.json, when it is damaged.
  """
  metrics_path = epath.Path(workdir_lib.path(setup.workdir, workdir_lib.FINAL_METRICS))
  steps = num_train_steps
  latest = setup.checkpoints.latest_step()
  if latest is not None and latest > steps:
    raise errors.ConfigError(
        f'train.num_train_steps={steps} is below step {latest}, the newest checkpoint in {setup.checkpoints.directory}:'
        f' set it to {latest} or more to train on, or use --mode=evaluate to evaluate the run.')
  if latest != steps or not metrics_path.is_file():
    return None
  metrics = workdir_lib.read_json(metrics_path, dict, 'delete it, and the same command evaluates the run again.')
  if metrics.get('train_steps') != steps:  # The evaluation of an earlier, shorter run: evaluate again.
    return None
  logging.warning('The run in %s is finished (step %d of %d; final figures in %s): nothing to do. Evaluate it '
                  'again with --mode=evaluate, or raise train.num_train_steps to train on.', setup.workdir,
                  steps, steps, metrics_path)
  return metrics


def _report_time(timeline: goodput.Timeline) -> None:
  """Logs and prints where this invocation's wall time went (`goodput.Timeline.line`)."""
  line = timeline.line()
  logging.info('%s', line)
  if jax.process_index() == 0:
    print(line)


def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
  """Trains (resuming from the latest checkpoint in workdir), evaluates periodically, then translates.

  A run that has already trained every step and been evaluated is left as it is (its final_metrics.json
  is returned).

  Returns:
    The final metrics (`evaluate.final_evaluation`): validation loss/nll/perplexity/accuracy, and with
    train.translate_at_end the BLEUs (a parser: F1); or {'stopped_at_step': step} when a signal stopped training
    (after saving checkpoint `step`).

  Raises:
    errors.DivergedError: for a non-finite loss or gradient with train.on_nonfinite='stop'.
    memory.DoesNotFitError: when the train step at its largest batch would not fit the device's memory.
    ValueError, FileNotFoundError, OSError: from the start-up checks (`experiment.setup`).
  """
  data_cfg = config.data
  splits = (data_cfg.train_split, data_cfg.eval_split) + ((data_cfg.test_split,) if config.train.translate_at_end
                                                          else ())
  timeline = goodput.Timeline()
  with timeline.stage('setup'):
    setup = experiment.setup(config, workdir, data_splits=splits, lock='train')
  writer = None
  try:
    finished = _finished_run(setup, config.train.num_train_steps)
    if finished is not None:
      return finished
    with timeline.stage('setup'):
      data = input_pipeline.load_run_data(
          config.data, setup.tokenizer, rows_multiple=setup.rows_multiple, data_shards=setup.data_shards,
          with_test=config.train.translate_at_end)
      state_sharding = setup.state_sharding()
      train_fn = step_lib.jit_train_step(setup, state_sharding, config.train.label_smoothing,
                                         rdrop_alpha=config.train.rdrop_alpha)
      eval_fn = step_lib.jit_eval_step(setup, state_sharding.params, config.train.label_smoothing)
      # Stops before any state is allocated if the step cannot fit.
      memory.check_train_step(setup, train_fn, config.data, data.train_iter.shapes)
      if jax.process_index() == 0:  # Every check has passed: the run's record (notebooks, --mode=evaluate).
        workdir_lib.record_config(config, workdir, setup.checkpoints.latest_step() or 0)
      state = _restore_or_init(setup, data, config.train.seed)
      peak = flops_lib.Peak(setup.model.cfg.compute_dtype)
      logging.info('MFU is reported against a peak of %.3g TFLOP/s (%s%s).', peak.flops / 1e12, peak.source,
                   '; re-measured at most once a minute, the highest kept' if peak.measured else '')
    writer = tensorboardX.SummaryWriter(workdir) if jax.process_index() == 0 else None
    progress = _Progress(config.train, setup, writer, int(state.step), peak, timeline)
    start, first_step = time.perf_counter(), int(state.step)
    with (_StopRequest() as stop, setup.mesh_context(),
          timeline.loop()):
      state, stopped_at = _train_loop(config, setup, state, train_fn, eval_fn, data, writer, stop, progress,
                                      timeline)
    with timeline.stage('checkpoint'):
      setup.checkpoints.wait_until_finished()
    steps_seconds = max(timeline.seconds['train_steps'], 1e-9)
    run_info = {'train_wall_seconds': time.perf_counter() - start, 'train_steps': int(state.step),
                'first_step': first_step,  # This invocation trained steps first_step + 1 .. train_steps.
                'mfu': progress.total_flops / steps_seconds / peak.flops, 'peak_flops': peak.flops}
    if stopped_at is not None:
      logging.warning('Stopped by %s after step %d: saved checkpoint step %d in %s. Run the same command to '
                      'resume.', stop.reason, stopped_at, setup.checkpoints.latest_step(),
                      setup.checkpoints.directory)
      _report_time(timeline)
      return {'stopped_at_step': stopped_at}
    with timeline.stage('final_evaluation'):
      # final_metrics.json holds the timeline as of the final evaluation's start; the last line, after it.
      results = evaluate_lib.final_evaluation(config, setup, eval_fn, data.eval_batches, writer,
                                              test_split=data.test, eval_split=data.eval_split,
                                              run_info=run_info | timeline.summary())
    _report_time(timeline)
    return results
  finally:
    if writer is not None:
      writer.close()
    setup.close()


