"""--mode=tune_decoding: beam size and length penalty chosen on the validation split (§6.1), never on test."""
import json
import shutil
import subprocess

import pytest

from tests import tiny_runs
from transformer_jax.data import input_pipeline
from transformer_jax.decoding import translate
from transformer_jax.evaluation import bleu
from transformer_jax.evaluation import evaluate
from transformer_jax.run import tune_decoding
from transformer_jax.run import config_checks
from transformer_jax.run import experiment

pytestmark = pytest.mark.usefixtures('persistent_compilation_cache')


def test_every_pair_of_the_grid_reaches_the_search_on_the_validation_split_only(tmp_path, corpus, reference_run,
                                                                             monkeypatch):
  workdir = tmp_path / 'run'
  shutil.copytree(reference_run.workdir, workdir)
  config = config_checks.config_for_mode(tiny_runs.text_config(corpus), str(workdir), 'tune_decoding')
  config.data.test_files = str(tmp_path / 'absent.en') + ',' + str(tmp_path / 'absent.de')  # Read: an error.
  searched, encoded = [], []
  translate_fn, encode_split = translate.translate, input_pipeline.encode_split
  monkeypatch.setattr(translate, 'translate', lambda *args, **kwargs: (
      searched.append((kwargs['beam_size'], kwargs['alpha'])), translate_fn(*args, **kwargs))[1])
  monkeypatch.setattr(input_pipeline, 'encode_split', lambda data_config, tokenizer, split: (
      encoded.append(split), encode_split(data_config, tokenizer, split))[1])
  result = tune_decoding.tune_decoding(config, str(workdir), [1, 2], [0.0, 1.5])
  assert searched == [(1, 0.0), (1, 1.5), (2, 0.0), (2, 1.5)]  # Each override reaches the search.
  assert encoded == [config.data.eval_split]
  assert [(row['beam_size'], row['alpha']) for row in result['rows']] == searched
  assert result['best'] == max(result['rows'], key=lambda row: row['bleu'])
  assert result['checkpoint_steps'] == [4, 6]  # eval.average_last_n of the tiny config.
  # A row is the BLEU of that search's hypotheses: greedy decoding ignores alpha.
  assert result['rows'][0]['bleu'] == result['rows'][1]['bleu']
  written, = (workdir / 'evaluations').glob(f'*/{tune_decoding.SWEEP_FILE}')
  assert json.loads(written.read_text()) == json.loads(json.dumps(result))


def test_rows_equal_the_evaluation_of_the_same_decoding(tmp_path, corpus, reference_run, monkeypatch):
  workdir = tmp_path / 'run'
  shutil.copytree(reference_run.workdir, workdir)
  config = config_checks.config_for_mode(tiny_runs.text_config(corpus), str(workdir), 'tune_decoding')
  row, = tune_decoding.tune_decoding(config, str(workdir), [2], [0.6])['rows']
  setup = experiment.setup(config, str(workdir), data_splits=(config.data.eval_split,))
  try:
    params, _ = evaluate.load_params(config.eval, setup)
    split = input_pipeline.encode_split(config.data, setup.tokenizer, config.data.eval_split)
    hypotheses = evaluate.translate_ids(config, setup, params, split.source_ids, beam_size=2, alpha=0.6)
    # decode.tokens_per_batch sets the decoding batches apart from data.tokens_per_batch (the same
    # translations); decode.early_stopping reaches the search.
    calls = []
    decode_batch = translate.decode_batch
    monkeypatch.setattr(translate, 'decode_batch', lambda *args, **kwargs: (
        calls.append((*args[1].shape, kwargs['early_stopping'])), decode_batch(*args, **kwargs))[1])
    config.data.tokens_per_batch = 512  # [16, 32] batches (the run trained on [8, 32]).
    larger = evaluate.translate_ids(config, setup, params, split.source_ids, beam_size=2, alpha=0.6)
    assert set(calls) == {(16, 32, 'bound')}
    calls.clear()
    config.decode.tokens_per_batch = 100  # Raised to one [1, 32] row per data shard: [8, 32] on 8 devices.
    smaller = evaluate.translate_ids(config, setup, params, split.source_ids, beam_size=2, alpha=0.6)
    assert set(calls) == {(8, 32, 'bound')}
    calls.clear()
    config.decode.early_stopping = 'finished'
    evaluate.translate_ids(config, setup, params, split.source_ids, beam_size=2, alpha=0.6)
  finally:
    setup.close()
  assert set(calls) == {(8, 32, 'finished')} and larger == smaller == hypotheses
  scores = bleu.all_bleu(hypotheses, split.target_texts, config.data.target_lang)
  for key in ('bleu', 'tokenized_bleu', 'lowercased_tokenized_bleu', 'length_ratio'):
    assert row[key] == pytest.approx(scores[key])


@pytest.mark.parametrize('beam_sizes, alphas, message', [
    ([], [0.6], 'at least one'), ([4], [], 'at least one'), ([0, 4], [0.6], 'at least 1'),
    ([4], [0.6, -0.1], '>= 0')])
def test_a_bad_grid_is_refused_before_the_workdir_is_read(tmp_path, beam_sizes, alphas, message):
  with pytest.raises(ValueError, match=message):
    tune_decoding.tune_decoding(None, str(tmp_path / 'no_run'), beam_sizes, alphas)


def test_the_command_line_names_the_flags_of_a_bad_grid(tmp_path, corpus, reference_run):
  process = subprocess.run(
      tiny_runs.main_command(reference_run.workdir, ['--mode=tune_decoding', '--beam_sizes=4,x']),
      capture_output=True, text=True, timeout=300, check=False, env=tiny_runs.subprocess_env(tmp_path))
  assert process.returncode != 0
  assert '--beam_sizes=4,x' in process.stderr and 'invalid literal' in process.stderr
  assert not (reference_run.workdir / 'evaluations').exists()


def test_format_table_marks_the_best_row():
  rows = [{'beam_size': 4, 'alpha': a, 'bleu': b, 'tokenized_bleu': b, 'lowercased_tokenized_bleu': b,
           'length_ratio': 1.0, 'seconds': 1.0} for a, b in ((0.6, 30.0), (1.0, 31.5), (1.4, 31.0))]
  lines = tune_decoding.format_table(rows).splitlines()
  assert [line.count('*') for line in lines[1:]] == [0, 1, 0] and '31.50*' in lines[2]


def test_averaging_windows_each_decode_the_grid_and_name_their_steps(tmp_path, corpus, reference_run):
  workdir = tmp_path / 'run'
  shutil.copytree(reference_run.workdir, workdir)  # Kept checkpoints: steps 4 and 6.
  config = config_checks.config_for_mode(tiny_runs.text_config(corpus), str(workdir), 'tune_decoding')
  windows = tune_decoding.parse_windows(['1', '2', '1@4'])
  result = tune_decoding.tune_decoding(config, str(workdir), [2], [0.6], windows)
  assert [(row['window'], row['checkpoint_steps']) for row in result['rows']] == [
      ('1', [6]), ('2', [4, 6]), ('1@4', [4])]
  default, = tune_decoding.tune_decoding(config, str(workdir), [2], [0.6])['rows']  # average_last_n = 2.
  assert result['rows'][1]['bleu'] == default['bleu'] and default['window'] is None
  with pytest.raises(ValueError, match=r'--average_windows=3: the run kept 2 checkpoints'):
    tune_decoding.tune_decoding(config, str(workdir), [2], [0.6], tune_decoding.parse_windows(['3']))
  assert len(list((workdir / 'evaluations').glob('*'))) == 2  # The refused window wrote nothing.


@pytest.mark.parametrize('value', ['0', 'x', '5@', '5@y', '-1@100'])
def test_a_bad_window_names_the_flag(value):
  with pytest.raises(ValueError, match=f'--average_windows=.*{value!r} is not N or N@STEP'):
    tune_decoding.parse_windows([value])
