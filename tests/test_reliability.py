"""What a training run does when things go wrong: signals, kill -9, damaged checkpoints, NaN, bad configs and inputs.

Every test runs configs/smoke.py on the synthetic corpus of tiny_runs.py, checks what the workdir holds
afterwards and, where a run is resumed, that its batches and metrics equal those of an uninterrupted run.
"""
import json
import logging
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

from absl import flags
import jax
import numpy as np
import pytest

from transformer_jax.evaluation import evaluate
from transformer_jax.storage import workdir as workdir_lib
from transformer_jax.run import config_checks
from transformer_jax.run import evaluate as evaluate_mode
from transformer_jax.run import experiment
from transformer_jax.run import train

from tiny_runs import assert_same_batches  # pylint: disable=g-bad-import-order
from tiny_runs import checkpoint_steps
from tiny_runs import compared
from tiny_runs import config_flags
from tiny_runs import main_command
from tiny_runs import NUM_STEPS
from tiny_runs import read_events
from tiny_runs import record_batches
from tiny_runs import REPO_ROOT
from tiny_runs import SPLITS
from tiny_runs import subprocess_env
from tiny_runs import synthetic_pairs
from tiny_runs import text_config
from tiny_runs import VOCAB_SIZE
from tiny_runs import write_corpus
from tiny_runs import write_lines

pytestmark = [
    pytest.mark.usefixtures('persistent_compilation_cache'),
    # When a restore fails, tensorstore callbacks can reach orbax's already-closed asyncio loop.
    pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning'),
    pytest.mark.filterwarnings('ignore:the load_module:DeprecationWarning'),  # ml_collections loading a config.
]


def messages(caplog, level=logging.INFO) -> str:
  return '\n'.join(r.getMessage() for r in caplog.records if r.levelno >= level)


def snapshot(folder: pathlib.Path) -> dict[str, tuple[int, int]]:
  """{relative path: (size, mtime)} of every file under folder; `run.lock` by size alone (the lock's file stays,
  taken and emptied by every command that locks the run, so only its emptiness after a command is compared)."""
  return {str(p.relative_to(folder)): (p.stat().st_size, 0 if p.name == 'run.lock' else p.stat().st_mtime_ns)
          for p in sorted(folder.rglob('*')) if p.is_file()}


def restored_params_are_finite(config, workdir) -> bool:
  """Loads (and averages) the workdir's last checkpoints as evaluation does; True if every parameter is finite."""
  s = experiment.setup(config, str(workdir))
  try:
    params, _ = evaluate.load_params(config.eval, s)
  finally:
    s.checkpoints.close()
  return all(np.all(np.isfinite(np.asarray(leaf))) for leaf in jax.tree.leaves(params))


def assert_resumes_like_reference(monkeypatch, caplog, config, workdir, reference, resumed_from: int | None):
  """Reruns training in workdir; checks the resume point, the batches, every logged metric and the results."""
  batches = record_batches(monkeypatch)
  caplog.clear()
  with caplog.at_level(logging.INFO):
    results = train.train_and_evaluate(config, str(workdir))
  if resumed_from is not None:
    assert f'Resumed from checkpoint step {resumed_from} in' in messages(caplog)
  start = resumed_from or 0
  assert_same_batches(batches, reference.batches[start:])
  assert compared(read_events(workdir)) == compared(reference.events)
  assert results == reference.results
  assert checkpoint_steps(workdir) == [NUM_STEPS - 2, NUM_STEPS]


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT], ids=['SIGTERM', 'SIGINT'])
def test_signal_saves_a_checkpoint_and_stops_then_rerun_resumes(monkeypatch, tmp_path, corpus, reference_run,
                                                               caplog, signum):
  def signal_during_step_3(index, batch):
    if index == 3:
      os.kill(os.getpid(), signum)  # The handler runs now, in this (the main) thread.
    return batch

  handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
  config = text_config(corpus)
  record_batches(monkeypatch, signal_during_step_3)
  with caplog.at_level(logging.INFO):
    results = train.train_and_evaluate(config, str(tmp_path))
  name = signal.Signals(signum).name
  assert results == {'stopped_at_step': 3}
  assert checkpoint_steps(tmp_path) == [2, 3]
  assert f'Stopped by {name} after step 3: saved checkpoint step 3 in {tmp_path}' in messages(caplog)
  assert {sig: signal.getsignal(sig) for sig in handlers} == handlers  # Restored after training.
  events = read_events(tmp_path)
  assert sorted(events['train/loss']) == [1, 2, 3] and 'eval_averaged/loss' not in events

  assert_resumes_like_reference(monkeypatch, caplog, config, tmp_path, reference_run, resumed_from=3)


def wait_for(predicate, process, timeout_secs=600.0, poll_secs=0.005):
  deadline = time.monotonic() + timeout_secs
  while not predicate():
    if process.poll() is not None:
      return False
    if time.monotonic() > deadline:
      process.kill()
      pytest.fail(f'timed out after {timeout_secs} s')
    time.sleep(poll_secs)
  return True


@pytest.mark.slow  # A second process: about 20 s (the in-process signal test above covers the same code).
def test_sigterm_to_main_saves_and_exits_0(monkeypatch, tmp_path, corpus, reference_run, compilation_cache_dir,
                                          caplog):
  workdir, log = tmp_path / 'run', tmp_path / 'stderr.txt'
  # Training would last 1000 steps, with the first checkpoint at step 1000; SIGTERM comes at step 3 or soon after.
  flags_ = config_flags(corpus, num_train_steps=1000, checkpoint_every_steps=1000)
  with open(log, 'w') as stderr:
    process = subprocess.Popen(main_command(workdir, flags_), cwd=REPO_ROOT, env=subprocess_env(
        compilation_cache_dir), stdout=subprocess.DEVNULL, stderr=stderr)
    running = wait_for(lambda: 'step 3/1000' in log.read_text(errors='replace'), process)
    assert running, log.read_text()[-5000:]
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=600) == 0, log.read_text()[-5000:]
  text = log.read_text()
  stopped = re.search(r'Stopped by SIGTERM after step (\d+): saved checkpoint step (\d+) in', text)
  assert stopped and stopped[1] == stopped[2], text[-5000:]
  step = int(stopped[1])
  assert checkpoint_steps(workdir) == [step]
  assert sorted(read_events(workdir)['train/loss']) == list(range(1, step + 1))
  if step < NUM_STEPS:  # The usual case; the reference run then covers the resumed steps too.
    assert_resumes_like_reference(monkeypatch, caplog, text_config(corpus), workdir, reference_run,
                                  resumed_from=step)


@pytest.mark.slow  # A second process: about 25 s (test_train.py simulates a crash in process).
def test_kill_9_during_the_first_save_then_rerun_matches_uninterrupted(monkeypatch, tmp_path, corpus,
                                                                        reference_run, compilation_cache_dir,
                                                                        caplog):
  workdir, log = tmp_path / 'run', tmp_path / 'stderr.txt'
  checkpoints = workdir / 'checkpoints'
  with open(log, 'w') as stderr:
    process = subprocess.Popen(main_command(workdir, config_flags(corpus)), cwd=REPO_ROOT,
                               env=subprocess_env(compilation_cache_dir), stdout=subprocess.DEVNULL, stderr=stderr)
    # The nastiest moment: as soon as orbax starts writing step 2 (into a temporary folder), kill -9.
    started = wait_for(lambda: checkpoints.is_dir() and any(checkpoints.iterdir()), process)
    process.kill()
    process.wait(timeout=60)
  assert started and process.returncode == -signal.SIGKILL, log.read_text()[-5000:]
  complete = checkpoint_steps(workdir)
  assert complete in ([], [2]), complete  # Either the save was cut short, or it committed in time.
  assert_resumes_like_reference(monkeypatch, caplog, text_config(corpus), workdir, reference_run,
                                resumed_from=complete[-1] if complete else None)
  assert sorted(p.name for p in checkpoints.iterdir()) == [str(NUM_STEPS - 2), str(NUM_STEPS)]  # No leftovers.


def test_damaged_newest_checkpoint_is_set_aside_and_the_previous_one_restored(monkeypatch, tmp_path, corpus,
                                                                           reference_run, caplog):
  workdir = tmp_path / 'run'
  shutil.copytree(reference_run.workdir, workdir)  # Checkpoints 4 and 6.
  (workdir / 'final_metrics.json').unlink()  # Not yet evaluated: a finished run would be left alone.
  data_files = [p for p in (workdir / 'checkpoints' / '6' / 'state' / 'd').iterdir() if p.is_file()]
  assert data_files
  for path in data_files:  # Truncated, as by a crash of the file system after orbax committed the step.
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])

  assert_resumes_like_reference(monkeypatch, caplog, text_config(corpus), workdir, reference_run, resumed_from=4)
  warnings = messages(caplog, logging.WARNING)
  assert re.search(r'Checkpoint step 6 in \S+ is unusable', warnings), warnings
  assert re.search(r'Moved unusable checkpoint step 6 to \S+/unusable_checkpoints/6\.\d{8}-\d{6}; resuming from '
                   r'step 4', warnings), warnings
  set_aside = list((workdir / 'unusable_checkpoints').iterdir())
  assert len(set_aside) == 1 and (set_aside[0] / 'state').is_dir()


def corrupt_batch_at(step: int):
  """An on_batch hook: token ids outside the vocabulary at `step`, which the embedding turns into NaN."""
  def corrupt(index, batch):
    if index == step:
      batch = dict(batch, source_tokens=np.where(batch['source_tokens'] > 0, VOCAB_SIZE + 7, 0).astype(np.int32))
    return batch
  return corrupt


@pytest.mark.parametrize('bad_step', [3, 4])  # 4 is a checkpoint step: the error must come before that save.
def test_nonfinite_loss_stops_naming_the_step_and_the_checkpoint(monkeypatch, tmp_path, corpus, bad_step):
  config = text_config(corpus)
  record_batches(monkeypatch, corrupt_batch_at(bad_step))
  with pytest.raises(FloatingPointError) as error:
    train.train_and_evaluate(config, str(tmp_path))
  assert re.search(rf'Non-finite loss or gradient at step {bad_step}; its update was not applied\. Stopped: '
                   rf'resume from checkpoint step 2 in {tmp_path}/checkpoints', str(error.value)), error.value
  assert checkpoint_steps(tmp_path) == [2]
  assert sorted(read_events(tmp_path)['train/loss']) == list(range(1, bad_step))
  assert restored_params_are_finite(config, tmp_path)


def test_nonfinite_loss_is_skipped_with_on_nonfinite_skip(monkeypatch, tmp_path, corpus, reference_run, caplog):
  config = text_config(corpus, on_nonfinite='skip')
  batches = record_batches(monkeypatch, corrupt_batch_at(3))
  with caplog.at_level(logging.INFO):
    results = train.train_and_evaluate(config, str(tmp_path))
  assert 'Non-finite loss or gradient at step 3; its update was not applied (train.on_nonfinite=skip).' in (
      messages(caplog, logging.WARNING))
  assert len(batches) == NUM_STEPS and np.all(np.isfinite(list(results.values())))
  events = read_events(tmp_path)
  assert events['train/skipped_steps'] == {1: 0.0, 2: 0.0, 3: 1.0, 4: 0.0, 5: 0.0, 6: 0.0}
  assert events['train/loss'][2] == reference_run.events['train/loss'][2]
  assert events['train/loss'][4] != reference_run.events['train/loss'][4]  # Step 3's update was not applied.
  assert checkpoint_steps(tmp_path) == [4, 6]
  assert restored_params_are_finite(config, tmp_path)


@pytest.mark.parametrize(('section', 'key', 'value', 'match'), [
    ('model', 'dropout_rate', 1.5, r'model\.dropout_rate must be in \[0, 1\), got 1\.5'),
    ('train', 'warmup_steps', 0, r'train\.warmup_steps must be a positive integer, got 0'),
    ('decode', 'beam_size', 0, r'decode\.beam_size must be an integer >= 1, got 0'),
    ('model', 'position_embedding', 'rotary',
     r"model\.position_embedding must be one of \('sinusoidal', 'learned', 'rope', 'none'\), got 'rotary'"),
    ('mesh', 'data', 3, r'mesh.*\b3\b.*\b8\b'),  # 3 devices asked for, 8 present.
    ('mesh', 'fsdp', -1, r'at most one of mesh\.data, mesh\.fsdp, mesh\.tensor may be -1'),
    ('train', 'on_nonfinite', 'ignore', r"train\.on_nonfinite must be one of \('stop', 'skip'\), got 'ignore'"),
    ('train', 'learning_rate_scale', float('inf'), r'train\.learning_rate_scale must be a finite number > 0, got inf'),
    ('data', 'vocab_size', 0, r'data\.vocab_size must be a positive integer, got 0'),
    ('data', 'bpe_dropout_rate', 1.0, r'data\.bpe_dropout_rate must be in \[0, 1\), got 1\.0'),
    ('eval', 'average_last_n', 3, r'eval\.average_last_n must be in \[1, train\.max_checkpoints_to_keep=2\], got 3'),
    ('data', 'shuffle_seed', -1, r'data\.shuffle_seed must be an integer in \[0, 2\*\*32\), got -1'),
    ('decode', 'alpha', float('inf'), r'decode\.alpha must be a finite number >= 0, got inf'),
    ('train', 'weight_decay', -0.1,
     r"train\.weight_decay must be a finite number >= 0 \(0: the paper's Adam\), got -0\.1"),
    ('train', 'weight_decay', float('inf'), r'train\.weight_decay must be a finite number >= 0 .*got inf'),
    ('model', 'activation_dropout_rate', 1.0, r'model\.activation_dropout_rate must be in \[0, 1\), got 1\.0'),
])
def test_bad_config_value_fails_before_anything_is_written(tmp_path, corpus, section, key, value, match):
  config = text_config(corpus)
  config[section][key] = value
  workdir = tmp_path / 'run'
  with pytest.raises(ValueError, match=match):
    train.train_and_evaluate(config, str(workdir))
  assert not workdir.exists()


def test_a_vocabulary_the_corpus_cannot_fill_leaves_no_folder_behind(tmp_path, corpus):
  """The vocabulary size is checked by training the vocabulary, after the workdir and checkpoints/ exist: the
  folders this run created go again, and an existing workdir keeps only what it held."""
  config = text_config(corpus)
  config.data.vocab_size = 100  # The synthetic corpus needs 286 pieces (tiny_runs.VOCAB_SIZE).
  workdir = tmp_path / 'run'
  with pytest.raises(ValueError, match=r'data\.vocab_size=100 does not fit this corpus: .* 100 vs 2\d\d'):
    train.train_and_evaluate(config, str(workdir))
  assert not workdir.exists()
  workdir.mkdir()
  (workdir / 'notes.txt').write_text('mine')
  with pytest.raises(ValueError, match=r'data\.vocab_size=100 does not fit'):
    train.train_and_evaluate(config, str(workdir))
  assert sorted(p.name for p in workdir.iterdir()) == ['notes.txt']


def test_bpe_dropout_needs_a_bpe_vocabulary(corpus):
  config = text_config(corpus)
  config.data.update(tokenizer_model_type='unigram', bpe_dropout_rate=0.1)
  with pytest.raises(ValueError, match=r"data\.bpe_dropout_rate must be 0 unless "
                                       r"data\.tokenizer_model_type='bpe', got 0\.1"):
    config_checks.validate_config(config)
  config.data.tokenizer_model_type = 'bpe'
  config_checks.validate_config(config)


@pytest.mark.parametrize(('section', 'key', 'value', 'stored'), [
    ('model', 'd_model', 64, 'model.d_model=32'),
    ('data', 'vocab_size', 512, f'data.vocab_size={VOCAB_SIZE}'),
])
def test_incompatible_workdir_fails_before_anything_is_written(tmp_path, corpus, reference_run, section, key,
                                                               value, stored):
  workdir = tmp_path / 'run'
  shutil.copytree(reference_run.workdir, workdir)
  before = snapshot(workdir)
  config = text_config(corpus)
  config[section][key] = value
  with pytest.raises(ValueError, match=rf'holds a run with {re.escape(stored)}; this config has '
                                       rf'{section}\.{key}={value}'):
    train.train_and_evaluate(config, str(workdir))
  assert snapshot(workdir) == before  # In particular, no spm_512.model.


def test_rerunning_a_finished_run_changes_nothing(tmp_path, corpus, reference_run, caplog):
  workdir = tmp_path / 'run'
  shutil.copytree(reference_run.workdir, workdir)
  before = snapshot(workdir)
  with caplog.at_level(logging.WARNING):
    results = train.train_and_evaluate(text_config(corpus), str(workdir))
  # final_metrics.json's figures (with the checkpoints and sizes it also records), not a new evaluation.
  assert {key: results[key] for key in reference_run.results} == pytest.approx(reference_run.results)
  assert re.search(rf'The run in {re.escape(str(workdir))} is finished \(step {NUM_STEPS} of {NUM_STEPS}',
                   messages(caplog, logging.WARNING))
  assert snapshot(workdir) == before  # No second translation, no TensorBoard points, no new checkpoint.


def test_evaluate_and_translate_start_from_the_runs_config(tmp_path, corpus, reference_run):
  empty = tmp_path / 'empty'
  empty.mkdir()
  for mode in ('evaluate', 'translate'):
    with pytest.raises(FileNotFoundError, match=rf'--mode={mode}: {re.escape(str(empty))}/config.json does not '
                                                 'exist'):
      config_checks.config_for_mode(text_config(corpus), str(empty), mode)
  assert not list(empty.iterdir())
  config = text_config(corpus)
  config.decode.beam_size, config.train.warmup_steps, config.model.dropout_rate = 7, 999, 0.3
  resolved = config_checks.config_for_mode(config, str(reference_run.workdir), 'evaluate')
  stored = workdir_lib.load_config(reference_run.workdir)
  assert resolved.decode.beam_size == 7  # Decoding fields come from the command line,
  assert resolved.train.warmup_steps == stored.train.warmup_steps  # training's do not,
  assert resolved.model.dropout_rate == stored.model.dropout_rate  # nor the model's training-only ones.
  config.model.d_model = 64
  with pytest.raises(ValueError, match=r'--mode=translate: model.d_model=64 differs from the run in .*'
                                       r'\(model.d_model=32 in .*config.json\); only decoding and evaluation'):
    config_checks.config_for_mode(config, str(reference_run.workdir), 'translate')


def test_translate_on_an_empty_workdir_fails_before_writing(tmp_path, corpus, compilation_cache_dir):
  workdir = tmp_path / 'typo'
  process = subprocess.run(main_command(workdir, ['--mode=translate']), cwd=REPO_ROOT, input='a man\n',
                           env=subprocess_env(compilation_cache_dir), capture_output=True, text=True, timeout=300,
                           check=False)
  assert process.returncode != 0 and '--config is required' in process.stderr, process.stderr[-3000:]
  process = subprocess.run(main_command(workdir, ['--mode=translate', *config_flags(corpus)]), cwd=REPO_ROOT,
                           input='a man\n', env=subprocess_env(compilation_cache_dir), capture_output=True,
                           text=True, timeout=300, check=False)
  assert process.returncode != 0, process.stderr[-3000:]
  assert f'{workdir}/config.json does not exist' in process.stderr, process.stderr[-3000:]
  assert not workdir.exists()  # No vocabulary trained, no checkpoints/ created.


def test_workdir_below_a_regular_file_fails_before_training(tmp_path, corpus):
  (tmp_path / 'file').write_text('not a folder')
  with pytest.raises(OSError, match=rf'--workdir={tmp_path}/file/run is not writable'):
    train.train_and_evaluate(text_config(corpus), str(tmp_path / 'file' / 'run'))
  assert (tmp_path / 'file').read_text() == 'not a folder'


@pytest.mark.skipif(os.geteuid() == 0, reason='root writes into a read-only (0o500) folder all the same')
def test_read_only_workdir_fails_before_training(tmp_path, corpus):
  workdir = tmp_path / 'run'
  workdir.mkdir(mode=0o500)
  with pytest.raises(OSError, match=rf'--workdir={workdir} is not writable'):
    train.train_and_evaluate(text_config(corpus), str(workdir))
  assert not any(workdir.iterdir())


def run_main(monkeypatch, workdir, flags_: list[str]) -> None:
  """Runs `python -m transformer_jax.main` in this process (absl flags parsed from argv as the real one)."""
  from transformer_jax import main as main_lib  # pylint: disable=g-import-not-at-top
  # --verbosity=0 logs INFO, as app.run makes it; parsing flags sets the level of the 'absl' logger.
  argv = ['transformer_jax.main', f'--workdir={workdir}', '--verbosity=0', *flags_]
  monkeypatch.setattr(sys, 'argv', argv)  # config_flags reads the overrides from sys.argv.
  absl_logger = logging.getLogger('absl')
  level = absl_logger.level
  flags.FLAGS.unparse_flags()
  flags.FLAGS(argv)
  try:
    main_lib.main(argv[:1])
  finally:
    flags.FLAGS.unparse_flags()
    for name in [name for name in flags.FLAGS if name.startswith('config.')]:
      delattr(flags.FLAGS, name)  # The --config.* overrides, which each parse defines anew.
    absl_logger.setLevel(level)


def nothing_trained(workdir: pathlib.Path) -> bool:
  return not checkpoint_steps(workdir) and not list(workdir.glob('events.out.tfevents.*'))


def test_missing_input_file_fails_before_anything_is_written(monkeypatch, tmp_path, corpus):
  missing = str(tmp_path / 'nowhere.de')
  files = dict(corpus, test_files=corpus['test_files'].split(',')[0] + ',' + missing)
  with pytest.raises(FileNotFoundError, match=rf'data\.test_files: {re.escape(missing)} does not exist'):
    run_main(monkeypatch, tmp_path / 'run', config_flags(files, translate_at_end=True))
  assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize('split', ['train', 'val', 'test'])
def test_unequal_line_counts_fail_before_training(monkeypatch, tmp_path, split):
  folder = tmp_path / 'corpus'
  files = write_corpus(folder)
  source = folder / f'{split}.en'
  source.write_text(source.read_text() + 'one line too many\n')
  with pytest.raises(ValueError, match=rf'same number of lines: {re.escape(str(source))} has '
                                       rf'{SPLITS[split] + 1}, {folder}/{split}\.de has {SPLITS[split]}'):
    run_main(monkeypatch, tmp_path / 'run', config_flags(files, translate_at_end=True))
  assert nothing_trained(tmp_path / 'run')


@pytest.mark.parametrize('split', ['train', 'val', 'test'])
def test_invalid_utf8_names_file_and_line_before_training(monkeypatch, tmp_path, split):
  folder = tmp_path / 'corpus'
  files = write_corpus(folder)
  target = folder / f'{split}.de'
  lines = target.read_bytes().split(b'\n')
  lines[4] = b'ein \xff\xfe hund'
  target.write_bytes(b'\n'.join(lines))
  with pytest.raises(ValueError, match=rf'{re.escape(str(target))}: line 5 is not valid UTF-8'):
    run_main(monkeypatch, tmp_path / 'run', config_flags(files, translate_at_end=True))
  assert nothing_trained(tmp_path / 'run')
  assert split != 'train' or not (tmp_path / 'run' / f'spm_{VOCAB_SIZE}.model').exists()


@pytest.mark.integration
def test_empty_and_long_lines_through_main(monkeypatch, tmp_path, caplog, capsys):
  folder = tmp_path / 'corpus'
  files = write_corpus(folder)
  long_pair = synthetic_pairs(1, seed=9)[0]
  long_pair = (' '.join([long_pair[0]] * 8), ' '.join([long_pair[1]] * 8))  # Far over 32 pieces.
  for split, extra in (('train', [('', 'ein hund'), ('a dog', ''), ('', ''), long_pair]), ('val', [long_pair]),
                       ('test', [('', '')])):
    for i, lang in enumerate(('en', 'de')):
      path = folder / f'{split}.{lang}'
      lines = path.read_text().splitlines()
      write_lines(path, lines[:2] + [pair[i] for pair in extra] + lines[2:])  # Inserted as lines 3, 4, ...
  workdir = tmp_path / 'run'
  with caplog.at_level(logging.INFO):
    run_main(monkeypatch, workdir, config_flags(files, num_train_steps=2, translate_at_end=True))
  logged = messages(caplog)
  assert (f'Training pairs: {SPLITS["train"]} kept; skipped 3 with an empty side and 1 longer than '
          'max_length=32.') in logged
  assert 'Truncated 1 of 17 source sentences to max_length=32 tokens (EOS included); lines [3].' in logged
  # The long target is left out of the validation loss, not cut (#16 class 10).
  assert ('1 of 17 evaluation lines longer than data.max_length=32 (EOS included) on the target side: left out '
          'of the validation loss') in logged
  hypotheses = (workdir / 'test.hyp.de').read_text(encoding='utf-8').split('\n')
  assert len(hypotheses) == SPLITS['test'] + 2 and hypotheses[-1] == ''  # One line per test line, '\n'-ended.
  assert re.search(r'^bleu: \d+\.\d\d ', capsys.readouterr().out, re.MULTILINE)
  assert checkpoint_steps(workdir) == [2]


def test_training_stops_before_the_first_step_when_the_step_cannot_fit(monkeypatch, tmp_path, corpus):
  from transformer_jax.training import memory  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(memory, 'available_bytes', lambda devices=None: (1024, 'test limit'))
  with pytest.raises(memory.DoesNotFitError, match=r'The train step at its largest batch \[\d+, \d+\] needs '
                                                   r'[\d.]+ GiB per device, 0\.00 GiB available \(test limit\).*'
                                                   r'Lower data\.tokens_per_batch'):
    train.train_and_evaluate(text_config(corpus), str(tmp_path))
  assert checkpoint_steps(tmp_path) == []  # No state was allocated and no step ran.


def test_a_run_trained_before_new_config_fields_still_evaluates(tmp_path, corpus, reference_run):
  """A config.json written before data.tokenizer_seed and data.tokenizer_normalization existed: evaluate and
  translate fill them with their defaults (the behaviour the run had) instead of failing on them."""
  workdir = tmp_path / 'old'
  shutil.copytree(reference_run.workdir, workdir)
  stored = json.loads((workdir / 'config.json').read_text())
  for key in ('tokenizer_seed', 'tokenizer_normalization'):
    del stored['data'][key]
  (workdir / 'config.json').write_text(json.dumps(stored))
  for config in (text_config(corpus), workdir_lib.get_config(str(workdir))):  # --config given, or left out.
    resolved = config_checks.config_for_mode(config, str(workdir), 'evaluate')
    assert resolved.data.tokenizer_seed == 0 and resolved.data.tokenizer_normalization == 'nmt_nfkc'
    config_checks.validate_config(resolved)


def test_mode_evaluate_writes_a_new_folder_and_leaves_the_runs_files(tmp_path, corpus, reference_run):
  workdir = tmp_path / 'run'
  shutil.copytree(reference_run.workdir, workdir)
  before = snapshot(workdir)
  config = config_checks.config_for_mode(text_config(corpus), str(workdir), 'evaluate')
  for _ in range(2):  # Twice, however close in time: two folders.
    results = evaluate_mode.evaluate_checkpoint(config, str(workdir))
  folders = sorted((workdir / 'evaluations').iterdir())
  assert len(folders) == 2
  for folder in folders:
    assert json.loads((folder / 'final_metrics.json').read_text())['loss'] == pytest.approx(results['loss'])
  after = snapshot(workdir)
  assert {path: after[path] for path in before} == before  # The training run's own outputs are untouched.


def test_second_writer_stops_at_once_naming_the_holder(tmp_path, corpus, reference_run):
  # Issue #32, 1: two trainers on one workdir. The first holds run.lock; the second stops before writing.
  workdir = tmp_path / 'run'
  shutil.copytree(reference_run.workdir, workdir)
  config = text_config(corpus)
  config.train.num_train_steps = NUM_STEPS + 2  # Would train on.
  with workdir_lib.RunLock(workdir, 'train'):
    before = snapshot(workdir)
    with pytest.raises(workdir_lib.WorkdirInUseError,
                       match=rf'{re.escape(str(workdir))} is in use by process {os.getpid()} on .*, train since .*'
                             r'Wait for it to finish, stop it, or use another --workdir'):
      train.train_and_evaluate(config, str(workdir))
    assert snapshot(workdir) == before
    with pytest.raises(workdir_lib.WorkdirInUseError):  # An evaluation writes too.
      evaluate_mode.evaluate_checkpoint(config_checks.config_for_mode(config, str(workdir), 'evaluate'), str(workdir))
  assert (workdir / workdir_lib.LOCK).read_text() == ''  # Released on exit (the file stays, empty).


def test_lock_is_released_on_errors_and_a_stale_one_is_taken_over(tmp_path, caplog):
  lock = workdir_lib.RunLock(tmp_path, 'train')
  with pytest.raises(RuntimeError, match='boom'):
    with lock:
      assert json.loads((tmp_path / workdir_lib.LOCK).read_text())['pid'] == os.getpid()
      raise RuntimeError('boom')
  assert (tmp_path / workdir_lib.LOCK).read_text() == ''  # Released: the file stays (locked with flock), empty.
  dead = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True, text=True,
                        check=True)
  stale = json.loads(json.dumps({'host': __import__('socket').gethostname(), 'pid': int(dead.stdout),
                                 'started': 'yesterday', 'command': 'killed -9'}))
  (tmp_path / workdir_lib.LOCK).write_text(json.dumps(stale))
  with caplog.at_level(logging.WARNING):
    with workdir_lib.RunLock(tmp_path, 'train'):
      assert json.loads((tmp_path / workdir_lib.LOCK).read_text())['pid'] == os.getpid()
  assert f'left by process {int(dead.stdout)}' in messages(caplog, logging.WARNING)
  (tmp_path / workdir_lib.LOCK).write_text(json.dumps(stale | {'host': 'another-host'}))
  with pytest.raises(workdir_lib.WorkdirInUseError, match=r'on another-host.*if that process no longer runs, '
                                                          r'delete .*run\.lock'):
    workdir_lib.RunLock(tmp_path, 'train').acquire()  # Another host's process cannot be checked from here.


def test_lost_or_replaced_vocabulary_stops_a_resumed_run(tmp_path, corpus, reference_run):
  # Issue #32, 3: with checkpoints present, a missing vocabulary is not retrained, a different one is refused.
  workdir = tmp_path / 'run'
  shutil.copytree(reference_run.workdir, workdir)
  vocabulary = workdir / f'spm_{VOCAB_SIZE}.model'
  recorded = (workdir / workdir_lib.VOCABULARY_HASH).read_text().strip()
  original = vocabulary.read_bytes()
  config = text_config(corpus)
  config.train.num_train_steps = NUM_STEPS + 2
  vocabulary.unlink()
  with pytest.raises(FileNotFoundError, match=rf'{re.escape(str(vocabulary))} is missing, but .* checkpoints up '
                                              rf'to step {NUM_STEPS} trained with it \(SHA-256 {recorded}\)'):
    train.train_and_evaluate(config, str(workdir))
  assert not vocabulary.exists()  # Not trained again.
  vocabulary.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
  with pytest.raises(ValueError, match=rf'has SHA-256 [0-9a-f]{{64}}, but this run was trained with the vocabulary '
                                       rf'of SHA-256 {recorded}'):
    train.train_and_evaluate(config, str(workdir))


def test_failed_rerun_leaves_the_config_and_a_resume_records_its_changes(tmp_path, corpus, reference_run):
  # Issue #32, 4: config.json is the first start's; a later start's changes go to config_changes.json.
  workdir = tmp_path / 'run'
  shutil.copytree(reference_run.workdir, workdir)
  stored = (workdir / workdir_lib.CONFIG).read_text()
  config = text_config(corpus)
  config.train.num_train_steps, config.train.label_smoothing, config.data.shuffle_seed = NUM_STEPS + 2, 0.3, -1
  with pytest.raises(ValueError, match='data.shuffle_seed'):
    train.train_and_evaluate(config, str(workdir))
  assert (workdir / workdir_lib.CONFIG).read_text() == stored
  assert not (workdir / workdir_lib.CONFIG_CHANGES).exists()
  config.data.shuffle_seed = 0
  train.train_and_evaluate(config, str(workdir))
  assert (workdir / workdir_lib.CONFIG).read_text() == stored
  history = json.loads((workdir / workdir_lib.CONFIG_CHANGES).read_text())
  assert [(h['from_step'], h['changes']) for h in history] == [
      (NUM_STEPS + 1, {'train.num_train_steps': [NUM_STEPS, NUM_STEPS + 2], 'train.label_smoothing': [0.1, 0.3]})]
  run_config = workdir_lib.get_config(str(workdir))  # What --mode=evaluate and the notebook read.
  assert (run_config.train.num_train_steps, run_config.train.label_smoothing) == (NUM_STEPS + 2, 0.3)


def test_resume_refuses_another_optimizer_state_before_writing(tmp_path, corpus, reference_run):
  """Weight decay switched on for a run trained with Adam: its checkpoints hold no AdamW state, so the start
  stops naming train.weight_decay (not as a damaged checkpoint), and the run folder is left as it was."""
  workdir = tmp_path / 'run'
  shutil.copytree(reference_run.workdir, workdir)
  before = {path: path.stat().st_mtime_ns for path in workdir.rglob('*')}
  config = text_config(corpus, weight_decay=0.1)
  config.train.num_train_steps = NUM_STEPS + 2
  with pytest.raises(ValueError, match=rf'train\.weight_decay=0\.1 cannot resume the run in {re.escape(str(workdir))}, '
                                       r"trained with train\.weight_decay=0\.0 .*0: the paper's Adam"):
    train.train_and_evaluate(config, str(workdir))
  assert {path: path.stat().st_mtime_ns for path in workdir.rglob('*')} == before
  assert checkpoint_steps(workdir) == checkpoint_steps(reference_run.workdir)


def test_byte_order_mark_is_not_part_of_the_first_line(tmp_path):
  # Issue #32, 6: a BOM stayed in reference line 1 (a hypothesis equal to the line scored 89.3, not 100).
  from transformer_jax.data import multi30k  # pylint: disable=g-import-not-at-top
  path = tmp_path / 'refs.de'
  path.write_bytes('\ufeffein Mann\nein Hund\n'.encode('utf-8'))
  assert multi30k.read_lines(path) == ['ein Mann', 'ein Hund']


def test_truncated_config_and_vocabulary_name_the_file(tmp_path, reference_run):
  # Issue #32, 5: a JSONDecodeError without a file, a SentencePiece ParseFromArray error.
  from transformer_jax.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  config_json = tmp_path / 'config.json'
  config_json.write_text((reference_run.workdir / 'config.json').read_text()[:100])
  with pytest.raises(ValueError, match=rf'{re.escape(str(config_json))} is damaged \(not valid JSON'):
    workdir_lib.get_config(str(tmp_path))
  vocabulary = tmp_path / f'spm_{VOCAB_SIZE}.model'
  vocabulary.write_bytes((reference_run.workdir / vocabulary.name).read_bytes()[:300])
  with pytest.raises(ValueError, match=rf'{re.escape(str(vocabulary))} is not a readable SentencePiece model'):
    tokenizer_lib.Tokenizer.load(vocabulary)


def test_flipped_bytes_in_a_checkpoint_are_caught_by_its_checksums(tmp_path, corpus, reference_run, caplog):
  # Issue #32, 2: 16 flipped bytes in a data chunk restored without error, with corrupted values.
  from transformer_jax.storage import checkpoint_checks  # pylint: disable=g-import-not-at-top
  workdir = tmp_path / 'run'
  shutil.copytree(reference_run.workdir, workdir)
  newest = workdir / 'checkpoints' / str(NUM_STEPS)
  assert json.loads((newest / checkpoint_checks.CHECKSUMS).read_text())  # Written once the step committed.
  chunk = max((p for p in (newest / 'state').rglob('*') if p.is_file()), key=lambda p: p.stat().st_size)
  data = bytearray(chunk.read_bytes())
  middle = len(data) // 2
  data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
  chunk.write_bytes(bytes(data))
  with pytest.raises(checkpoint_checks.ChecksumError,
                     match=rf'{re.escape(str(chunk))} has SHA-256 [0-9a-f]{{64}}, not '
                           r'the [0-9a-f]{64} recorded at save'):
    checkpoint_checks.verify_checksums(newest)
  config = text_config(corpus)
  config.train.num_train_steps = NUM_STEPS + 2
  with caplog.at_level(logging.WARNING):
    train.train_and_evaluate(config, str(workdir))
  log = messages(caplog, logging.WARNING)
  assert re.search(rf'Checkpoint step {NUM_STEPS} .* is unusable \(ChecksumError: .*damaged after it was written',
                   log), log
  assert f'Moved unusable checkpoint step {NUM_STEPS}' in log
  assert checkpoint_steps(workdir)[-1] == NUM_STEPS + 2  # Resumed from the previous step and trained on.


def test_truncated_gzip_empty_training_and_validation_files_name_the_cause(monkeypatch, tmp_path):
  # Issue #32, 5: an EOFError with no file name; SentencePiece's `!sentences_.empty()`; an IndexError after the
  # vocabulary and config.json were written.
  import gzip  # pylint: disable=g-import-not-at-top
  from transformer_jax.data import multi30k  # pylint: disable=g-import-not-at-top
  cut = tmp_path / 'cut.en.gz'
  cut.write_bytes(gzip.compress(b'a man\n' * 1000)[:-30])
  with pytest.raises(ValueError, match=rf'{re.escape(str(cut))} is not a complete gzip file'):
    multi30k.read_lines(cut)
  folder = tmp_path / 'corpus'
  files = write_corpus(folder)
  for lang in ('en', 'de'):
    write_lines(folder / f'train.{lang}', [''] * 5)
  with pytest.raises(ValueError, match=r"The 'train' split has no non-empty line to train the vocabulary on "
                                       r'\(data\.train_files='):
    run_main(monkeypatch, tmp_path / 'run', config_flags(files))
  files = write_corpus(folder)
  for lang in ('en', 'de'):
    write_lines(folder / f'val.{lang}', [])
  with pytest.raises(ValueError, match=r"The validation split 'validation' has no non-empty pair \(data\.eval_files="):
    run_main(monkeypatch, tmp_path / 'run2', config_flags(files))
  assert not (tmp_path / 'run2' / workdir_lib.CONFIG).exists()
