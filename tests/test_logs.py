"""transformer_jax.logs' progress helpers, and the training loop's progress lines by the clock.

The clock is faked (time.perf_counter) or the thread is driven by events: nothing here waits on real time.
"""
import contextlib
import threading
import types

from absl import logging
import pytest

from transformer_jax import logs
from transformer_jax.run import train


class FakeClock:
  def __init__(self, now: float = 1000.0):
    self.now = now

  def __call__(self) -> float:
    return self.now


def test_heartbeat_logs_while_the_block_runs_and_stops_after(monkeypatch):
  calls, two = [], threading.Event()

  def message(seconds):
    calls.append(seconds)
    if len(calls) == 2:
      two.set()
    return f'working: {seconds:.3f} s'

  lines = []
  monkeypatch.setattr(logging, 'info', lambda fmt, *args: lines.append(fmt % args))
  with logs.heartbeat(message, every_secs=0.01):
    assert two.wait(timeout=30)  # The main thread is busy here, as in a compilation.
  count = len(calls)
  assert count >= 2 and calls == sorted(calls) and calls[0] > 0
  assert lines[:2] == [f'working: {calls[0]:.3f} s', f'working: {calls[1]:.3f} s']
  assert not any(t.name == 'heartbeat' and t.is_alive() for t in threading.enumerate())
  assert len(calls) == count  # Nothing after the block.


def test_heartbeat_disabled_starts_no_thread():
  before = threading.active_count()
  with logs.heartbeat(lambda s: 'never', every_secs=0.01, enabled=False):
    assert threading.active_count() == before


def test_countdown_time_left_leaves_out_the_first_batch(monkeypatch):
  """A decode whose first batch of 8 sentences waited 107 s for compilation, then ran 10 sentences/s: the time
  left counts from the first batch (the elapsed time over everything would say 981 s left)."""
  clock = FakeClock(0.0)
  monkeypatch.setattr(logs.time, 'perf_counter', clock)
  countdown = logs.Countdown(1014, 'sentences')
  assert countdown.line() == '0 of 1014 sentences in 0 s (the first include compilation; rate and time left once more are done)'
  clock.now = 107.0
  countdown.add(8)
  assert countdown.line().startswith('8 of 1014 sentences in 107 s (the first include compilation')
  clock.now = 117.0
  countdown.add(100)
  assert countdown.line() == '108 of 1014 sentences in 117 s (10.0 sentences/s since the first, about 91 s left)'


@pytest.mark.parametrize(('every', 'elapsed', 'due'), [(30.0, 29.9, False), (30.0, 30.0, True), (0.0, 1e6, False)])
def test_training_reports_by_the_clock_as_well_as_by_steps(monkeypatch, every, elapsed, due):
  """A resumed run of log_every_steps=100 would be silent until the next multiple of 100 otherwise."""
  clock = FakeClock()
  monkeypatch.setattr(train.time, 'perf_counter', clock)
  progress = object.__new__(train._Progress)  # pylint: disable=protected-access
  progress.train_config = types.SimpleNamespace(log_every_secs=every)
  progress.time = clock.now
  clock.now += elapsed
  assert progress.due() is due


@pytest.mark.parametrize('rdrop_alpha', [0.0, 5.0])
def test_progress_lines_sum_r_drops_divergence_and_leave_skipped_steps_out(monkeypatch, rdrop_alpha):
  """Under R-Drop the progress sums carry kl_sum, and a skipped (non-finite) step adds nothing to them; the line
  shows kl = KL(P1‖P2) + KL(P2‖P1) per target token of one pass (token_count counts both passes), and TensorBoard
  gets train/kl. Without R-Drop neither appears."""
  clock, lines, scalars = FakeClock(), [], {}
  monkeypatch.setattr(train.time, 'perf_counter', clock)
  monkeypatch.setattr(train.logging, 'info', lambda message, *args: lines.append(message % args))
  monkeypatch.setattr(train.metrics_lib, 'write_scalars', lambda writer, step, values, prefix: scalars.update(values))
  progress = object.__new__(train._Progress)  # pylint: disable=protected-access
  progress.train_config = types.SimpleNamespace(rdrop_alpha=rdrop_alpha, num_train_steps=10)
  progress.setup = types.SimpleNamespace(schedule=lambda step: 1e-3)
  progress.peak = types.SimpleNamespace(remeasure=lambda: 1e12)
  progress.timeline = types.SimpleNamespace(in_loop_seconds=lambda: 0.0, stage=lambda name: contextlib.nullcontext())
  progress.writer, progress.pending, progress.tokens, progress.flops = None, None, 100, 1e12
  progress.sums, progress.time, progress.step, progress.excluded = progress._zeros(), clock.now, 0, 0.0
  applied = {'loss_sum': 6.0, 'nll_sum': 4.0, 'correct_sum': 3.0, 'token_count': 8.0, 'kl_sum': 2.0,
             'grad_norm': 1.0, 'nonfinite': 0.0}
  skipped = {key: float('nan') for key in applied} | {'nonfinite': 1.0}
  for metrics in (applied, skipped):
    progress.sums = train._accumulate(progress.sums, metrics)  # pylint: disable=protected-access
  clock.now += 2.0
  progress.report(2)
  assert float(progress.sums['token_count']) == 0.0  # Reset after the line.
  assert scalars['loss'] == pytest.approx(0.75) and scalars['skipped_steps'] == 1.0
  if rdrop_alpha:
    assert scalars['kl'] == pytest.approx(0.5)
    assert '| nll 0.5000 | kl 0.5000 | acc 0.375 |' in lines[0]
  else:
    assert 'kl' not in scalars and '| kl' not in lines[0]
