"""What the command-line entry points (`main`, `demo`) log: our INFO lines and everyone's warnings.

orbax, TFDS and JAX log dozens of INFO records per checkpoint or start-up (e.g. 'Unable to initialize backend
tpu' on every CPU or GPU machine); `quiet_libraries` drops them from absl's handler and keeps their warnings.
"""
import logging as python_logging
import os

from absl import logging


class QuietLibraries(python_logging.Filter):
  """Drops orbax's, TFDS's and JAX's INFO records; keeps their warnings and every other record."""
  _NOISY = (f'{os.sep}orbax{os.sep}', f'{os.sep}tensorflow_datasets{os.sep}', f'{os.sep}jax{os.sep}_src{os.sep}')

  def filter(self, record):
    return record.levelno > python_logging.INFO or not any(p in record.pathname for p in self._NOISY)


def quiet_libraries() -> None:
  """Adds `QuietLibraries` to absl's log handler (once)."""
  handler = logging.get_absl_handler()
  if not any(isinstance(f, QuietLibraries) for f in handler.filters):
    handler.addFilter(QuietLibraries())
