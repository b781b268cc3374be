"""The command line itself: help, --mode=config, and configs that load from any working directory."""
import logging
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from configs import multi30k
from transformer_jax import errors
from transformer_jax import logs
from transformer_jax.storage import workdir as workdir_lib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(*flags, cwd: pathlib.Path) -> subprocess.CompletedProcess:
  """`python -m transformer_jax.main <flags>` from `cwd`, importing this checkout's package (and nothing else
  of the repository: `configs` is not importable unless main makes it so)."""
  packages = cwd / 'packages'
  packages.mkdir(exist_ok=True)
  if not (packages / 'transformer_jax').exists():
    (packages / 'transformer_jax').symlink_to(REPO_ROOT / 'transformer_jax')
  env = {**os.environ, 'PYTHONPATH': str(packages)}
  return subprocess.run([sys.executable, '-m', 'transformer_jax.main', *flags], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=300, check=False)


def main_raising(error: str, *flags, cwd: pathlib.Path) -> subprocess.CompletedProcess:
  """`main(*flags)` with `config_doc.describe`, deep in --mode=config, replaced by one that raises `error` (an
  expression; `errors` is transformer_jax.errors), as a bug or a reported mistake would."""
  packages = cwd / 'packages'
  packages.mkdir(exist_ok=True)
  if not (packages / 'transformer_jax').exists():
    (packages / 'transformer_jax').symlink_to(REPO_ROOT / 'transformer_jax')
  driver = cwd / 'raising_main.py'
  driver.write_text(textwrap.dedent(f"""\
      import runpy
      from transformer_jax import errors
      from transformer_jax.tools import config_doc

      def describe(config):
        raise {error}

      config_doc.describe = describe
      runpy.run_module('transformer_jax.main', run_name='__main__')
      """))
  env = {**os.environ, 'PYTHONPATH': str(packages), 'TRANSFORMER_JAX_ALLOCATOR': 'system'}
  return subprocess.run([sys.executable, str(driver), f'--config={REPO_ROOT}/configs/smoke.py', '--mode=config',
                         *flags], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize('error', ["RuntimeError('INTERNAL: an XLA runtime failure')",
                                   "ValueError('an internal shape check failed')"])
def test_a_bug_keeps_its_traceback(tmp_path, error):
  """Only `errors.UserError` is a user's mistake: a RuntimeError or ValueError from deep code is a bug."""
  process = main_raising(error, cwd=tmp_path)
  assert process.returncode != 0
  assert 'Traceback (most recent call last)' in process.stderr and 'in describe' in process.stderr
  assert process.stderr.strip().splitlines()[-1] == error.replace("('", ': ').removesuffix("')")
  assert '--verbosity=1 shows the traceback' not in process.stderr


def test_a_user_error_is_one_line(tmp_path):
  process = main_raising("errors.ConfigError('model.d_model must be a positive integer, got 0')", cwd=tmp_path)
  assert process.returncode == 1
  assert process.stderr.strip().splitlines() == [
      'ValueError: model.d_model must be a positive integer, got 0', '(--verbosity=1 shows the traceback)']
  verbose = main_raising("errors.ConfigError('model.d_model must be a positive integer, got 0')", '--verbosity=1',
                         cwd=tmp_path)
  assert verbose.returncode != 0 and 'Traceback' in verbose.stderr


def test_help_exits_zero_and_points_at_the_config_listing(tmp_path):
  process = main('--help', cwd=tmp_path)
  assert process.returncode == 0, process.stderr
  assert '--config:' in process.stdout and '--mode=config' in process.stdout
  assert len(process.stdout.splitlines()) < 80  # This module's flags, not JAX's 700 lines.


def test_mode_config_lists_fields_defaults_and_meanings_from_any_directory(tmp_path):
  process = main(f'--config={REPO_ROOT}/configs/multi30k.py', '--config.decode.beam_size=5', '--mode=config',
                 cwd=tmp_path)  # Not the repository root: configs/multi30k.py imports `configs.base`.
  assert process.returncode == 0, process.stderr[-3000:]
  lines = process.stdout.splitlines()
  assert 'decode.beam_size = 5  (default: 4)' in lines  # The override, applied.
  assert 'data.vocab_size = 8000  (default: 37000)' in lines  # The config file's value.
  index = lines.index('train.label_smoothing = 0.1')
  assert lines[index + 1].strip() == '§5.4 eps_ls.'  # Its comment in configs/base.py.
  assert len([line for line in lines if ' = ' in line]) > 60  # Every field.


def test_missing_config_is_one_clear_line(tmp_path):
  process = main('--workdir', str(tmp_path / 'run'), cwd=tmp_path)
  assert process.returncode == 1
  assert process.stderr.strip().splitlines() == [
      f'--config is required: --workdir={tmp_path}/run holds no run (no config.json); e.g. '
      '--config=configs/multi30k.py (--help for usage)']
  assert not (tmp_path / 'run').exists()


def test_overrides_apply_to_the_config_of_the_workdir_when_config_is_left_out(tmp_path):
  """--mode=evaluate/translate/tune_decoding take --config from --workdir; the overrides given with it parse."""
  run = tmp_path / 'run'
  workdir_lib.save_config(multi30k.get_config(), str(run))
  process = main(f'--workdir={run}', '--config.eval.average_last_n=17', '--config.decode.alpha=2.5', '--mode=config',
                 cwd=tmp_path)
  assert process.returncode == 0, process.stderr[-3000:]
  lines = process.stdout.splitlines()
  assert 'eval.average_last_n = 17  (default: 5)' in lines and 'decode.alpha = 2.5  (default: 0.6)' in lines


def test_misspelt_field_is_one_line_with_the_closest_name(tmp_path):
  process = main(f'--config={REPO_ROOT}/configs/multi30k.py', '--config.model.d_modle=128', '--mode=config',
                 cwd=tmp_path)
  assert process.returncode == 1
  assert process.stderr.strip().splitlines() == [
      '--config.model.d_modle: model.d_modle is not a config field; did you mean model.d_model? (--mode=config '
      'lists every field)']


def test_a_missing_config_file_names_it_and_the_configs(tmp_path, monkeypatch):
  """Checked before absl parses --config (ml_collections' own message names no configs); main prints a UserError
  as one line (test_user_errors_are_their_message_without_a_traceback)."""
  from transformer_jax import main as main_lib  # pylint: disable=g-import-not-at-top
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, 'path', list(sys.path))  # prepare_argv adds the config's folders.
  with pytest.raises(FileNotFoundError) as error:
    main_lib.prepare_argv(['main', '--config=configs/multi30.py:fr', f'--workdir={tmp_path}/run'])
  assert isinstance(error.value, errors.UserError)
  message = str(error.value)
  assert message.startswith(f'--config=configs/multi30.py: no such file (from {tmp_path}); the configs in '
                            f'{REPO_ROOT}/configs: base.py, big.py, multi30k.py, ')
  assert 'smoke.py' in message and 'tiny.py' in message and '__init__' not in message
  assert main_lib.prepare_argv(['main', f'--config={REPO_ROOT}/configs/tiny.py'])[1:] == [
      f'--config={REPO_ROOT}/configs/tiny.py']


@pytest.mark.integration
def test_user_errors_are_their_message_without_a_traceback(tmp_path):
  process = main(f'--config={REPO_ROOT}/configs/multi30k.py', f'--workdir={tmp_path}/run', '--config.data.manual_dir=typo',
                 cwd=tmp_path)
  assert process.returncode == 1
  assert 'Traceback' not in process.stderr
  assert process.stderr.strip().splitlines()[-2:] == [
      f'FileNotFoundError: data.manual_dir: the folder {tmp_path}/typo does not exist; for en-de it must hold '
      'train.en.gz, train.de.gz, val.en.gz, val.de.gz, test_2016_flickr.en.gz, test_2016_flickr.de.gz.',
      '(--verbosity=1 shows the traceback)']
  assert not (tmp_path / 'run').exists()
  verbose = main(f'--config={REPO_ROOT}/configs/multi30k.py', f'--workdir={tmp_path}/run',
                 '--config.data.manual_dir=typo', '--verbosity=1', cwd=tmp_path)
  assert verbose.returncode == 1 and 'Traceback' in verbose.stderr


def test_relative_paths_are_stored_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  config = multi30k.get_config()
  config.data.update(manual_dir='data/multi30k', train_files='a.en,../b.de', tfds_data_dir='gs://bucket/tfds')
  workdir_lib.absolute_paths(config)
  assert config.data.manual_dir == f'{tmp_path}/data/multi30k'
  assert config.data.train_files == f'{tmp_path}/a.en,{tmp_path.parent}/b.de'
  assert config.data.tfds_data_dir == 'gs://bucket/tfds' and config.data.eval_files == ''


def test_report_and_sweep_help_exit_zero(tmp_path):
  report = subprocess.run([sys.executable, '-m', 'transformer_jax.report', '--help'], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
  assert report.returncode == 0 and '--rows' in report.stdout, report.stderr[-2000:]
  sweep = subprocess.run([str(REPO_ROOT / 'launch' / 'sweep_table3.sh'), '--help'], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60, check=False)
  assert sweep.returncode == 0 and '--dry-run' in sweep.stdout, sweep.stderr


def test_a_mode_that_needs_a_workdir_says_so_in_one_line(tmp_path):
  process = main(f'--config={REPO_ROOT}/configs/smoke.py', '--mode=evaluate', cwd=tmp_path)
  assert process.returncode == 1
  assert process.stderr.strip().splitlines() == [
      "--workdir is required for --mode=evaluate (the run's folder; --help for usage)"]


def test_library_info_records_are_dropped_and_their_warnings_kept():
  record = lambda path, level: logging.LogRecord('x', level, path, 1, 'message', None, None)
  quiet = logs.QuietLibraries()
  orbax = f'{os.sep}venv{os.sep}orbax{os.sep}checkpoint{os.sep}manager.py'
  assert not quiet.filter(record(orbax, logging.INFO))
  assert quiet.filter(record(orbax, logging.WARNING))
  assert quiet.filter(record(f'{os.sep}repo{os.sep}transformer_jax{os.sep}train.py', logging.INFO))


@pytest.mark.integration
def test_compile_for_an_unknown_tpu_slice_is_one_line_without_a_workdir(tmp_path):
  process = main(f'--config={REPO_ROOT}/configs/smoke.py', '--mode=compile', '--config.compile.topology=v5e-7',
                 cwd=tmp_path)
  assert process.returncode == 1 and [p.name for p in tmp_path.iterdir()] == ['packages']  # Nothing written.
  lines = [line for line in process.stderr.strip().splitlines() if not re.match(r'I\d{4} ', line)]  # absl INFO lines.
  assert lines[0].startswith("ValueError: compile.topology='v5e-7' is not a known TPU slice; known: v4-8, ")
  assert len(lines) == 2


def test_the_compilation_cache_loads_back_what_it_stored(tmp_path):
  """`main.use_compilation_cache`: a program compiled once is loaded from disk by the next compilation of it,
  with no warning (a size cap without `filelock`, or over entries without access-time files, warned at every
  read or write and loaded nothing)."""
  import warnings  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental.compilation_cache import compilation_cache  # pylint: disable=g-import-not-at-top
  from transformer_jax import main  # pylint: disable=g-import-not-at-top
  names = ('jax_compilation_cache_dir', 'jax_persistent_cache_min_compile_time_secs',
           'jax_compilation_cache_max_size', 'jax_persistent_cache_min_entry_size_bytes')
  previous = {name: getattr(jax.config, name) for name in names}
  hits = []
  listener = lambda event, **kwargs: hits.append(event) if 'cache_hits' in event else None
  jax.monitoring.register_event_listener(listener)
  try:
    main.use_compilation_cache(str(tmp_path))
    jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)  # Store the tiny program too.
    compilation_cache.reset_cache()
    with warnings.catch_warnings():
      warnings.simplefilter('error')  # A cache read or write that fails warns: fail the test instead.
      program = jax.jit(lambda x: x * 3.25 - 1.5)
      program(jax.numpy.ones(13)).block_until_ready()
      jax.clear_caches()  # Only the disk remembers it now.
      program(jax.numpy.ones(13)).block_until_ready()
    assert any(tmp_path.iterdir()) and hits, (list(tmp_path.iterdir()), hits)
  finally:
    jax.monitoring.unregister_event_listener(listener)
    for name, value in previous.items():
      jax.config.update(name, value)
    compilation_cache.reset_cache()
