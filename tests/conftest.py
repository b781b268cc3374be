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
# `main`'s persistent compilation cache (in-process and subprocess runs) in a folder of this session, not ~/.cache.
os.environ['TRANSFORMER_JAX_COMPILATION_CACHE'] = tempfile.mkdtemp(prefix='xla_cache_tests_')
atexit.register(shutil.rmtree, os.environ['TRANSFORMER_JAX_COMPILATION_CACHE'], True)
# The C++ decoding kernels (transformer_jax.cpu.kernels), built once per test session into a folder of its own.
os.environ['TRANSFORMER_JAX_KERNEL_CACHE'] = tempfile.mkdtemp(prefix='kernels_tests_')
atexit.register(shutil.rmtree, os.environ['TRANSFORMER_JAX_KERNEL_CACHE'], True)

import jax  # pylint: disable=g-import-not-at-top
from jax.experimental.compilation_cache import compilation_cache  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top

import tiny_runs  # pylint: disable=g-import-not-at-top,g-bad-import-order
from transformer_jax import logs  # pylint: disable=g-import-not-at-top

jax.config.update('jax_numpy_rank_promotion', 'raise')
logs.quiet_libtpu()  # With the tpu extra on a CPU machine: the CPU backend, without libtpu's start-up errors.

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope='session')
def multi30k_dir() -> pathlib.Path:
  """The real Multi30k corpus: $MULTI30K_DIR, defaulting to ../shared/data/multi30k beside the repository."""
  path = pathlib.Path(os.environ.get('MULTI30K_DIR', REPO_ROOT.parent / 'shared' / 'data' / 'multi30k'))
  if not (path / 'train.en.gz').exists():
    pytest.skip(f'Multi30k corpus not found at {path} (set MULTI30K_DIR to the folder with train.en.gz)')
  return path


@pytest.fixture(scope='session')
def compilation_cache_dir(tmp_path_factory) -> pathlib.Path:
  """One XLA compilation cache folder for the session (in-process runs and `main` subprocesses)."""
  path = tmp_path_factory.getbasetemp() / 'jax_compilation_cache'
  path.mkdir(exist_ok=True)
  return path


@pytest.fixture(scope='module')
def persistent_compilation_cache(compilation_cache_dir):
  """Compiled steps are stored on disk and reused by the next run of the same shapes (in or out of process).

  Used by the modules that train tiny runs (`pytestmark = pytest.mark.usefixtures(...)`), not by every test.
  """
  names = ('jax_compilation_cache_dir', 'jax_persistent_cache_min_compile_time_secs',
           'jax_persistent_cache_min_entry_size_bytes')
  previous = {name: getattr(jax.config, name) for name in names}
  for name, value in zip(names, (str(compilation_cache_dir), 0.0, 0)):
    jax.config.update(name, value)
  compilation_cache.reset_cache()
  yield
  for name, value in previous.items():
    jax.config.update(name, value)
  compilation_cache.reset_cache()


@pytest.fixture(scope='session')
def corpus(tmp_path_factory) -> dict[str, str]:
  """The synthetic corpus (tiny_runs.write_corpus): data.*_files values by config key."""
  return tiny_runs.write_corpus(tmp_path_factory.getbasetemp() / 'corpus')  # The same files for every instance.


@pytest.fixture(scope='module')
def reference_run(tmp_path_factory, corpus, persistent_compilation_cache) -> tiny_runs.Run:
  """An uninterrupted run of NUM_STEPS steps, its batches and its TensorBoard scalars. Do not modify its workdir."""
  del persistent_compilation_cache  # Requested so that the cache is active when this run compiles.
  workdir = tmp_path_factory.mktemp('reference')
  with pytest.MonkeyPatch.context() as monkeypatch:
    batches = tiny_runs.record_batches(monkeypatch)
    from transformer_jax.run import train  # pylint: disable=g-import-not-at-top  (imports TensorFlow)
    results = train.train_and_evaluate(tiny_runs.text_config(corpus), str(workdir))
  return tiny_runs.Run(workdir, results, batches, tiny_runs.read_events(workdir))


@pytest.fixture(scope='session')
def synthetic_treebank(tmp_path_factory) -> pathlib.Path:
  """A treebank folder generated from a small probabilistic grammar (tests/synthetic_treebank.py): train.txt
  (3,000 trees), dev.txt and test.txt (200 each), one PTB-style tree per line. Nothing licensed."""
  import synthetic_treebank as grammar  # pylint: disable=g-import-not-at-top
  return grammar.write_treebank(tmp_path_factory.getbasetemp() / 'synthetic_treebank')


# End-to-end tests: tiny trainings on the synthetic or real corpus, the notebook, several processes. Left out of
# the fast subset a contributor runs before committing (`-m "not slow and not integration"`).
_INTEGRATION_FIXTURES = {'corpus', 'reference_run', 'multi30k_dir'}
_INTEGRATION_MODULES = {'test_notebook', 'test_multihost', 'test_shared_workdir', 'test_launch', 'test_inspect'}


def pytest_collection_modifyitems(config, items):
  """Marks the end-to-end tests `integration`; gives tests marked `slow` 4x pyproject.toml's per-test timeout."""
  slow_timeout = 4 * float(config.getini('timeout') or 0)
  for item in items:
    if _INTEGRATION_FIXTURES & set(getattr(item, 'fixturenames', ())) or item.module.__name__ in _INTEGRATION_MODULES:
      item.add_marker(pytest.mark.integration)
    if slow_timeout and item.get_closest_marker('slow') and not item.get_closest_marker('timeout'):
      item.add_marker(pytest.mark.timeout(slow_timeout))
