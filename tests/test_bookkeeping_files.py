"""A run folder's bookkeeping files, damaged, give one line naming the file; compile checks its --workdir and
compile.topology before compiling."""
import pathlib

import pytest

from transformer_jax import errors
from transformer_jax.storage import checkpoint_checks
from transformer_jax.storage import fingerprint
from transformer_jax.storage import workdir as workdir_lib

from tiny_runs import text_config  # pylint: disable=g-bad-import-order


@pytest.mark.parametrize('record', ['[]', '{"state/a": ', '{"state/a": 1}', 'null', '"x"', '\xff'])
def test_a_damaged_sha256_json_is_named(tmp_path, record):
  step = tmp_path / '6'
  (step / 'state').mkdir(parents=True)
  (step / 'state' / 'a').write_bytes(b'x')
  (step / checkpoint_checks.CHECKSUMS).write_text(record, encoding='latin-1')
  with pytest.raises(errors.DamagedFileError, match=rf'{step / "sha256.json"} is damaged .*step 6'):
    checkpoint_checks.verify_checksums(step)


@pytest.fixture
def run(tmp_path) -> pathlib.Path:
  workdir = tmp_path / 'run'
  workdir_lib.save_config(text_config({}), workdir)
  return workdir


@pytest.mark.parametrize('changes', [
    '[{}]', '[{"changes": {"train.num_train_steps": 5}}]', '[{"changes": {"num_train_steps": [1, 5]}}]',
    '[{"changes": {"nosection.field": [1, 5]}}]', '[{"changes": {"train.no_such_field": [1, 5]}}]',
    '[{"changes": []}]', '[3]', '{"changes": {}}', '[{"from_step": 3, "changes": {"train.seed": [0, 1]}', '',
    '[{"changes": {"train.seed": [0, 1, 2]}}]'])
def test_a_damaged_config_changes_json_is_named(run, changes):
  (run / workdir_lib.CONFIG_CHANGES).write_text(changes)
  with pytest.raises(errors.DamagedFileError, match=rf'{run / workdir_lib.CONFIG_CHANGES} is damaged'):
    workdir_lib.load_run_config(run)
  from transformer_jax import main as main_lib  # pylint: disable=g-import-not-at-top
  with pytest.raises(SystemExit) as exit_:  # Before absl parses the flags: one line, no "FATAL Flags parsing".
    main_lib.prepare_argv(['main', f'--workdir={run}', '--mode=translate'])
  assert str(exit_.value).startswith('ValueError: ') and str(run / workdir_lib.CONFIG_CHANGES) in str(exit_.value)
  assert '\n' not in str(exit_.value)


@pytest.mark.parametrize('text', ['[1, 2]', '{"model": 3}', '{"model": {}', ''])
def test_a_damaged_config_json_is_named(run, text):
  (run / workdir_lib.CONFIG).write_text(text)
  with pytest.raises(errors.DamagedFileError, match=rf'{run / workdir_lib.CONFIG} is damaged'):
    workdir_lib.load_run_config(run)


@pytest.mark.parametrize('text', ['{"loss": 1.0', '[]', '', 'null'])
def test_a_damaged_final_metrics_json_is_named(monkeypatch, run, text):
  from transformer_jax.run import train  # pylint: disable=g-import-not-at-top
  (run / workdir_lib.FINAL_METRICS).write_text(text)
  setup = type('Setup', (), {'workdir': str(run), 'checkpoints': type('M', (), {
      'latest_step': staticmethod(lambda: 6), 'directory': str(run / 'checkpoints')})()})()
  with pytest.raises(errors.DamagedFileError, match=rf'{run / workdir_lib.FINAL_METRICS} is damaged'):
    train._finished_run(setup, 6)  # pylint: disable=protected-access


@pytest.mark.parametrize('text', ['', '\n', 'abc\n', '0' * 63 + '\n', '\xff\xfe'])
def test_a_damaged_vocabulary_sha256_is_named_and_the_vocabulary_not_blamed(run, text):
  config = text_config({})
  vocabulary = run / workdir_lib.vocabulary_file(config.data.vocab_size)
  vocabulary.write_bytes(b'a vocabulary')
  (run / workdir_lib.VOCABULARY_HASH).write_text(text, encoding='latin-1')
  with pytest.raises(errors.DamagedFileError, match=rf'{run / workdir_lib.VOCABULARY_HASH} is damaged') as error:
    fingerprint.check_vocabulary(config, str(run), manager=None)
  assert 'has SHA-256' not in str(error.value)


def test_num_train_steps_below_the_newest_checkpoint_is_refused(run):
  from transformer_jax.run import train  # pylint: disable=g-import-not-at-top
  setup = type('Setup', (), {'workdir': str(run), 'checkpoints': type('M', (), {
      'latest_step': staticmethod(lambda: 4), 'directory': str(run / 'checkpoints')})()})()
  with pytest.raises(errors.ConfigError, match=r'train.num_train_steps=2 is below step 4'):
    train._finished_run(setup, 2)  # pylint: disable=protected-access


@pytest.mark.parametrize('workdir', ['a file', 'a file/below', 'compile folder'])
def test_compile_checks_its_workdir_before_compiling(monkeypatch, tmp_path, workdir):
  from transformer_jax.tools import aot  # pylint: disable=g-import-not-at-top
  (tmp_path / 'a file').write_text('x')
  (tmp_path / 'compile folder' / workdir_lib.COMPILE_REPORT).mkdir(parents=True)
  def compile_(*args, **kwargs):
    raise AssertionError('compiled before the workdir was checked')
  monkeypatch.setattr(aot, 'compile_train_step', compile_)
  monkeypatch.setattr(aot, 'compile_for_slice', compile_)
  with pytest.raises(errors.PathError, match=rf'{tmp_path / workdir}'):
    aot.compile_only(text_config({}), str(tmp_path / workdir))


@pytest.mark.parametrize('topology', ['v5e-²', 'v5e-٣', 'v5e-８', 'v5e-1e3', 'v5e-' + '9' * 30, 'v5e-', '-8'])
def test_a_bad_compile_topology_names_the_field(topology):
  from transformer_jax.tools import tpu_slices  # pylint: disable=g-import-not-at-top
  with pytest.raises(errors.ConfigError, match=r'compile\.topology='):
    tpu_slices.parse(topology)
