"""Shared fixtures. XLA_FLAGS is set before jax is imported so that sharding tests see 8 CPU devices.

TFDS_DATA_DIR points at a temporary folder (TFDS reads it when imported), so that tests never read or write
~/tensorflow_datasets, and a test that forgets data_dir cannot read data prepared by a real run.
"""
import atexit
import os
import pathlib
import shutil
import tempfile

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
os.environ['TFDS_DATA_DIR'] = tempfile.mkdtemp(prefix='tfds_tests_')
atexit.register(shutil.rmtree, os.environ['TFDS_DATA_DIR'], True)

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
