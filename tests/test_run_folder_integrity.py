"""What a run folder's readers and a resume trust: the modes that read a run (translate, export, evaluate --output,
tune_decoding --output) change nothing in its folder (they work on a folder nothing can write, even root: `chattr
+i`, and leave a trainer's save in progress alone), and a checkpoint is restored only as the step and vocabulary it
was saved with. A trainer saving every step against 20 readers is `benchmarks/readers_vs_trainer.py`'s.
"""
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess

import pytest

from transformer_jax import errors
from transformer_jax.evaluation import evaluate
from transformer_jax.run import evaluate as evaluate_mode
from transformer_jax.run import tune_decoding
from transformer_jax.storage import workdir as workdir_lib
from transformer_jax.storage import checkpoint_checks
from transformer_jax.run import config_checks
from transformer_jax.run import experiment
from transformer_jax.run import train

from tiny_runs import NUM_STEPS  # pylint: disable=g-bad-import-order
from tiny_runs import text_config

pytestmark = [pytest.mark.usefixtures('persistent_compilation_cache'),
              pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')]


def snapshot(folder: pathlib.Path) -> dict[str, tuple[int, int]]:
  """{relative path: (size, mtime)} of everything under folder, folders included."""
  return {str(p.relative_to(folder)): (p.stat().st_size if p.is_file() else -1, p.stat().st_mtime_ns)
          for p in sorted(folder.rglob('*'))}


def _protect(folder: pathlib.Path, on: bool) -> bool:
  """Makes folder unwritable (`chattr +i` as root, whom permissions do not stop; else chmod a-w); True if done."""
  if os.geteuid() == 0:
    return subprocess.run(['chattr', '-R', '+i' if on else '-i', str(folder)], capture_output=True,
                          check=False).returncode == 0
  for path in [folder, *folder.rglob('*')]:
    path.chmod(path.stat().st_mode & ~0o222 if on else path.stat().st_mode | 0o200)
  return True


def _reading_modes(run: pathlib.Path, tmp_path: pathlib.Path) -> None:
  """translate, export (beside a user's <output>.tmp), evaluate --output and tune_decoding --output on run."""
  (tmp_path / 'in.txt').write_text('a man runs\n\nthe red dog\n')
  config = config_checks.config_for_mode(workdir_lib.load_config(str(run)), str(run), 'translate')
  evaluate_mode.translate_file(config, str(run), str(tmp_path / 'in.txt'), str(tmp_path / 'out.txt'))
  assert len((tmp_path / 'out.txt').read_text().splitlines()) == 3
  config = config_checks.config_for_mode(workdir_lib.load_config(str(run)), str(run), 'evaluate')
  evaluate_mode.evaluate_checkpoint(config, str(run), str(tmp_path / 'evaluation'))
  assert (tmp_path / 'evaluation' / workdir_lib.FINAL_METRICS).is_file()
  config = config_checks.config_for_mode(workdir_lib.load_config(str(run)), str(run), 'tune_decoding')
  tune_decoding.tune_decoding(config, str(run), [1], [0.6], output_dir=str(tmp_path / 'sweep'))
  assert (tmp_path / 'sweep' / tune_decoding.SWEEP_FILE).is_file()
  if importlib.util.find_spec('ctranslate2'):
    from transformer_jax.tools import export  # pylint: disable=g-import-not-at-top
    user_files = tmp_path / 'ct2.tmp'
    user_files.mkdir()
    (user_files / 'notes.txt').write_text('mine')
    config = config_checks.config_for_mode(workdir_lib.load_config(str(run)), str(run), 'export')
    export.export_run(config, str(run), str(tmp_path / 'ct2'))
    assert (tmp_path / 'ct2' / 'model.bin').is_file()
    assert (user_files / 'notes.txt').read_text() == 'mine'  # A user's <output>.tmp is left alone.
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith('.ct2.')] == []


def test_reading_modes_work_on_a_run_folder_nothing_can_write_and_change_nothing(tmp_path, reference_run):
  run = tmp_path / 'run'
  shutil.copytree(reference_run.workdir, run)
  before = snapshot(run)
  if not _protect(run, True):
    pytest.skip('cannot make a folder unwritable here (chattr +i failed as root)')
  try:
    _reading_modes(run, tmp_path)
  finally:
    _protect(run, False)
  assert snapshot(run) == before


def test_reading_modes_leave_a_save_in_progress_alone(tmp_path, reference_run):
  run = tmp_path / 'run'
  shutil.copytree(reference_run.workdir, run)
  in_progress = run / 'checkpoints' / '8.orbax-checkpoint-tmp-1796400000000000'  # A trainer saving step 8.
  (in_progress / 'state').mkdir(parents=True)
  (in_progress / 'state' / 'partial').write_bytes(b'\0' * 100)
  before = snapshot(run)
  _reading_modes(run, tmp_path)
  assert snapshot(run) == before


def _reader_params(run: pathlib.Path):
  config = config_checks.config_for_mode(workdir_lib.load_config(str(run)), str(run), 'translate')
  setup = experiment.setup(config, str(run))
  try:
    return evaluate.load_params(config.eval, setup)
  finally:
    setup.close()


@pytest.mark.parametrize('renamed', [(NUM_STEPS, NUM_STEPS + 2), (NUM_STEPS - 2, NUM_STEPS - 1)])
def test_a_renamed_step_folder_is_never_restored_as_its_new_step(tmp_path, corpus, reference_run, renamed):
  run = tmp_path / 'run'
  shutil.copytree(reference_run.workdir, run)
  old, new = renamed
  (run / 'checkpoints' / str(old)).rename(run / 'checkpoints' / str(new))
  with pytest.raises(errors.DamagedFileError, match=rf'checkpoints/{new} holds checkpoint step {old}, not step {new}'):
    _reader_params(run)  # Averaging reads the parameters only.
  setup = experiment.setup(text_config(corpus), str(run))
  try:
    with pytest.raises(errors.DamagedFileError, match=rf'checkpoints/{new} holds'):
      setup.checkpoints.restore(new, setup.abstract_state())
  finally:
    setup.close()


def test_a_checkpoint_of_another_vocabulary_of_the_same_size_is_refused(tmp_path, corpus, reference_run):
  run = tmp_path / 'run'
  shutil.copytree(reference_run.workdir, run)
  step = run / 'checkpoints' / str(NUM_STEPS)
  metadata = next(p for p in (step / 'metadata').rglob('*') if p.is_file() and p.suffix != '.tmp'
                  and 'fingerprint' in p.read_text(errors='replace'))
  value = json.loads(metadata.read_text())
  metadata.write_text(json.dumps(value | {'vocabulary_sha256': 'f' * 64}))  # Copied in from another run.
  checkpoint_checks.write_checksums(step)
  with pytest.raises(errors.ConfigError, match=rf'checkpoints/{NUM_STEPS} was trained with the vocabulary of '
                                               rf'SHA-256 f{{64}}'):
    _reader_params(run)
  config = text_config(corpus)
  config.train.num_train_steps = NUM_STEPS + 2
  with pytest.raises(errors.ConfigError, match=rf'checkpoints/{NUM_STEPS} was trained with the vocabulary'):
    train.train_and_evaluate(config, str(run))  # Resuming: refused, not set aside for the step before.
  assert step.is_dir()


@pytest.mark.parametrize('steps', [NUM_STEPS - 1, 2])
def test_num_train_steps_below_the_finished_step_changes_nothing(tmp_path, corpus, reference_run, steps):
  run = tmp_path / 'run'
  shutil.copytree(reference_run.workdir, run)
  before = snapshot(run)
  config = text_config(corpus)
  config.train.num_train_steps = steps
  with pytest.raises(errors.ConfigError, match=rf'train.num_train_steps={steps} is below step {NUM_STEPS}'):
    train.train_and_evaluate(config, str(run))
  after = snapshot(run)
  assert {k: v for k, v in after.items() if k != 'run.lock'} == {k: v for k, v in before.items() if k != 'run.lock'}
