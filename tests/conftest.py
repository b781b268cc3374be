"""Shared fixtures. XLA_FLAGS is set before jax is imported so that sharding tests see 8 CPU devices."""
import os
import pathlib

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import jax  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top

jax.config.update('jax_numpy_rank_promotion', 'raise')

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope='session')
def multi30k_dir() -> pathlib.Path:
  """The real Multi30k corpus: $MULTI30K_DIR, defaulting to ../shared/data/multi30k beside the repository."""
  path = pathlib.Path(os.environ.get('MULTI30K_DIR', REPO_ROOT.parent / 'shared' / 'data' / 'multi30k'))
  if not (path / 'train.en.gz').exists():
    pytest.skip(f'Multi30k corpus not found at {path} (set MULTI30K_DIR to the folder with train.en.gz)')
  return path
