"""Where a training run's wall time goes: training steps against compilation, evaluation, checkpoints, input
and the re-measurement of the MFU peak.

Goodput is the share of the wall time spent in training steps. `Timeline` is wall-clock accounting on the
host: the loop times each stage it runs (`with timeline.stage('checkpoint'): ...`), and the seconds of the
steps themselves are what is left of the loop's time. A step is dispatched asynchronously, so a stage
that waits for the device (a validation, a checkpoint) also waits for the step before it; that step's time
is counted in the stage (at most one step per stage).
"""
import contextlib
import time

# The stages a run's wall time is split into, in the order the end-of-run line lists them.
STAGES = ('train_steps', 'compile', 'input', 'evaluation', 'checkpoint', 'peak_measurement', 'setup',
          'final_evaluation')
_IN_LOOP = ('compile', 'input', 'evaluation', 'checkpoint', 'peak_measurement')  # Timed inside the training loop.


class Timeline:
  """Seconds per stage since creation; `train_steps` is the loop's time not taken by any other stage."""

  def __init__(self):
    self.start = time.perf_counter()
    self.seconds = dict.fromkeys(STAGES, 0.0)
    self._loop_start: float | None = None
    self._loop_seconds = 0.0

  @contextlib.contextmanager
  def stage(self, name: str):
    """Adds the block's wall time to stage `name` (one of STAGES, not 'train_steps').

    Raises:
      KeyError: for a name not in STAGES.
    """
    if name not in STAGES or name == 'train_steps':
      raise KeyError(f'unknown stage {name!r}; one of {STAGES[1:]}')
    start = time.perf_counter()
    try:
      yield
    finally:
      self.seconds[name] += time.perf_counter() - start

  def add(self, name: str, seconds: float) -> None:
    """Adds seconds measured elsewhere (e.g. a compilation inside a step's call) to stage `name`.

    Raises:
      KeyError: for a name not in STAGES, or 'train_steps'.
    """
    if name not in STAGES or name == 'train_steps':
      raise KeyError(f'unknown stage {name!r}; one of {STAGES[1:]}')
    self.seconds[name] += seconds

  def in_loop_seconds(self) -> float:
    """Seconds so far of the stages timed inside the training loop (compile, input, evaluation, checkpoint,
    peak_measurement: re-measuring the CPU's peak for MFU)."""
    return sum(self.seconds[name] for name in _IN_LOOP)

  @contextlib.contextmanager
  def loop(self):
    """The training loop: its wall time, less the stages timed inside it, is `train_steps`."""
    inside_before, start = self.in_loop_seconds(), time.perf_counter()
    try:
      yield
    finally:
      self.seconds['train_steps'] += time.perf_counter() - start - (self.in_loop_seconds() - inside_before)

  def summary(self) -> dict[str, float]:
    """{'wall_seconds', 'goodput' (train_steps / wall), '<stage>_seconds' for each stage}; the stages do not
    quite sum to the wall time: the rest is start-up outside any stage (imports, config checks)."""
    wall = max(time.perf_counter() - self.start, 1e-9)
    return {'wall_seconds': wall, 'goodput': self.seconds['train_steps'] / wall} | {
        f'{name}_seconds': value for name, value in self.seconds.items()}

  def line(self) -> str:
    """One line for the end of a run: the wall time, the goodput and each stage's share."""
    summary = self.summary()
    wall = summary['wall_seconds']
    parts = ', '.join(f'{name.replace("_", " ")} {value:.0f} s ({100 * value / wall:.1f}%)'
                      for name, value in self.seconds.items() if value >= 0.05)
    return f'Wall time {wall:.0f} s, goodput {100 * summary["goodput"]:.1f}% (training steps): {parts}.'
