"""The modes that read a run (translate, export, evaluate --output, tune_decoding --output) change nothing in its
folder: they work on a folder nothing can write (even root: `chattr +i`), and leave a trainer's save in progress
alone. A trainer saving every step against 20 readers is `benchmarks/readers_vs_trainer.py`'s.
"""
import importlib.util
import os
import pathlib
import shutil
import subprocess

import pytest

from transformer_jax.evaluation import evaluate
from transformer_jax.evaluation import tune_decoding
from transformer_jax.storage import workdir as workdir_lib
from transformer_jax.training import config_checks

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
  evaluate.translate_file(config, str(run), str(tmp_path / 'in.txt'), str(tmp_path / 'out.txt'))
  assert len((tmp_path / 'out.txt').read_text().splitlines()) == 3
  config = config_checks.config_for_mode(workdir_lib.load_config(str(run)), str(run), 'evaluate')
  evaluate.evaluate_checkpoint(config, str(run), str(tmp_path / 'evaluation'))
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
