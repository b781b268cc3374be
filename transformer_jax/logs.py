"""What the command-line entry points (`main`, `demo`) log: our INFO lines and everyone's warnings.

Long silent stretches (a compilation, a decode) log a line every 20-30 s from a background thread
(`heartbeat`), and a countdown's time left leaves out the first unit's time, which includes compilation
(`Countdown`).

orbax, TFDS and JAX log dozens of INFO records per checkpoint or start-up (e.g. 'Unable to initialize backend
tpu' on every CPU or GPU machine); `quiet_libraries` drops them from absl's handler and keeps their warnings.
With libtpu installed on a machine without TPU chips, `quiet_libtpu` keeps libtpu's start-up errors away.
"""
import contextlib
import importlib.metadata
import importlib.util
import logging as python_logging
import os
import threading
import time
from typing import Callable, Iterator

from absl import logging


class QuietLibraries(python_logging.Filter):
  """Drops orbax's, TFDS's and JAX's INFO records; keeps their warnings and every other record."""
  _NOISY = (f'{os.sep}orbax{os.sep}', f'{os.sep}tensorflow_datasets{os.sep}', f'{os.sep}jax{os.sep}_src{os.sep}')

  def filter(self, record):
    return record.levelno > python_logging.INFO or not any(p in record.pathname for p in self._NOISY)


def cpu_only_with_libtpu() -> bool:
  """Whether libtpu (the `tpu` extra, for compiling TPU steps anywhere: `tpu_slices`) is installed on a machine
  with no TPU chip and no other accelerator plugin, so that the CPU is the only backend JAX can start.

  There JAX still tries the TPU backend first, and libtpu logs five lines of errors on every start before JAX
  falls back to the CPU (measured: no change in start-up time, 3.4-4.6 s with and without libtpu on a busy
  2-core CPU).
  """
  if os.environ.get('JAX_PLATFORMS') or importlib.util.find_spec('libtpu') is None:
    return False
  if importlib.util.find_spec('jax_plugins') or list(importlib.metadata.entry_points(group='jax_plugins')):
    return False  # A GPU plugin: leave the choice of backend to JAX.
  try:
    from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
    return hardware_utils.num_available_tpu_chips_and_device_id()[0] == 0
  except (ImportError, AttributeError, OSError):
    return False


def quiet_libtpu() -> None:
  """Starts JAX on the CPU where that is the only backend it could start (`cpu_only_with_libtpu`). Call before
  any JAX computation; compiling for TPU slices works either way."""
  if cpu_only_with_libtpu():
    import jax  # pylint: disable=g-import-not-at-top
    jax.config.update('jax_platforms', 'cpu')


def quiet_libraries() -> None:
  """Adds `QuietLibraries` to absl's log handler (once)."""
  handler = logging.get_absl_handler()
  if not any(isinstance(f, QuietLibraries) for f in handler.filters):
    handler.addFilter(QuietLibraries())


@contextlib.contextmanager
def heartbeat(message: Callable[[float], str], every_secs: float = 30.0, enabled: bool = True) -> Iterator[None]:
  """Logs `message(seconds since the block started)` every `every_secs` while the `with` block runs.

  From a daemon thread, so that a call that holds the main thread for minutes (an XLA compilation, which
  releases the GIL) still shows that the command is alive.

  Args:
    message: the line for a given elapsed time in seconds, e.g. `lambda s: f'Compiling: {s:.0f} s so far'`.
    every_secs: seconds between lines; the first comes after `every_secs`.
    enabled: False logs nothing (e.g. on processes other than 0).
  """
  if not enabled or every_secs <= 0:
    yield
    return
  done, start = threading.Event(), time.perf_counter()

  def beat() -> None:
    while not done.wait(every_secs):
      logging.info('%s', message(time.perf_counter() - start))

  thread = threading.Thread(target=beat, name='heartbeat', daemon=True)
  thread.start()
  try:
    yield
  finally:
    done.set()
    thread.join()


class Countdown:
  """Items done out of a total, their rate and the time left, for progress lines.

  The rate counts from the moment the first items were done, so the time left leaves out what came before
  them: the first batch of a decode waits for its compilation (once 8 sentences in 107 s gave "about 13,493 s
  left" for a decode that ended 12 s later).
  """

  def __init__(self, total: int, what: str):
    """`total` items (> 0) of kind `what` (a plural noun, e.g. 'sentences')."""
    self.total, self.what, self.done = total, what, 0
    self.start = time.perf_counter()
    self._first: tuple[float, int] | None = None  # (time, items done) when the first items were done.
    self._lock = threading.Lock()

  def add(self, count: int) -> None:
    """Records `count` more items done."""
    with self._lock:
      self.done += count
      if self._first is None:
        self._first = (time.perf_counter(), self.done)

  def line(self, seconds: float | None = None) -> str:
    """'<done> of <total> <what> in <s> s (<rate>/s, about <left> s left)'; the rate and time left need items
    done after the first ones, else the line says they come later."""
    with self._lock:
      done, first = self.done, self._first
    now = time.perf_counter()
    seconds = now - self.start if seconds is None else seconds
    head = f'{done} of {self.total} {self.what} in {seconds:.0f} s'
    if first is None or done == first[1] or now <= first[0]:
      return f'{head} (the first include compilation; rate and time left once more are done)'
    rate = (done - first[1]) / (now - first[0])
    return f'{head} ({rate:.1f} {self.what}/s since the first, about {(self.total - done) / rate:.0f} s left)'
