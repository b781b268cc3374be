"""§6.3 parsing end to end: F1 as the validation metric, `main` on a treebank folder, and (slow) that the CPU
variant learns the synthetic grammar (dev and test F1 >= 95)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from transformer_jax import errors
from transformer_jax.data import treebank
from transformer_jax.evaluation import parsing
from transformer_jax.run import config_checks

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
  sys.path.insert(0, str(REPO_ROOT))
from configs import parsing as parsing_config  # pylint: disable=g-import-not-at-top,wrong-import-position
import synthetic_treebank  # pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order


def test_config_has_the_papers_section_6_3_values():
  paper, cpu = parsing_config.get_config(), parsing_config.get_config('cpu')
  assert (paper.model.num_layers, paper.model.d_model, paper.data.vocab_size) == (4, 1024, 16000)
  assert (paper.decode.beam_size, paper.decode.alpha, paper.decode.extra_length) == (21, 0.3, 300)
  assert (paper.data.dataset, paper.eval.metric, paper.eval.checkpoint_selection) == ('treebank', 'f1', 'best')
  assert (cpu.decode.beam_size, cpu.decode.alpha, cpu.decode.extra_length) == (21, 0.3, 300)
  assert cpu.model.d_model < paper.model.d_model
  assert (paper.data.treebank_target, cpu.data.treebank_target) == ('xx', 'words')  # XX: Vinyals et al.'s.
  with pytest.raises(ValueError, match='variants'):
    parsing_config.get_config('big')


def test_score_split_of_gold_outputs_is_100_and_of_one_flat_output_worked_by_hand(synthetic_treebank):
  trees = treebank.split_trees(synthetic_treebank, 'dev')[:20]
  _, targets = treebank.split_pairs(synthetic_treebank, 'dev')
  scores = parsing.score_split(targets[:20], trees)
  assert (scores['f1'], scores['complete_match'], scores['repaired_fraction']) == (100.0, 100.0, 0.0)
  # One output without any bracket: its sentence keeps no test bracket (TOP is deleted), so recall loses that
  # sentence's gold brackets and precision is unchanged.
  gold_brackets = [len([node for node in tree.subtrees() if node.height() > 2]) for tree in trees]
  flat = ['XX ' * len(trees[0].leaves())] + targets[1:20]
  scores = parsing.score_split(flat, trees)
  total = sum(gold_brackets)
  assert scores['precision'] == 100.0
  assert scores['recall'] == pytest.approx(100.0 * (total - gold_brackets[0]) / total, abs=1e-12)
  assert scores['repaired_fraction'] == 0.0  # Well formed, only flat.


def test_the_metric_goes_with_the_dataset():
  config = parsing_config.get_config('cpu')
  config.data.treebank_dir = '/nonexistent'
  config_checks.validate_config(config)
  config.eval.metric = 'bleu'
  with pytest.raises(errors.ConfigError, match="eval.metric must be 'f1' with data.dataset='treebank'.*got 'bleu'"):
    config_checks.validate_config(config)
  config.eval.metric, config.data.treebank_target = 'f1', 'tags'
  with pytest.raises(errors.ConfigError, match=r"data.treebank_target must be one of \('xx', 'words'\), got 'tags'"):
    config_checks.validate_config(config)
  config.data.treebank_target, config.data.dataset = 'xx', 'multi30k'
  with pytest.raises(errors.ConfigError, match="data.dataset='multi30k', got 'f1'"):
    config_checks.validate_config(config)


def _main(*flags: str, cwd: pathlib.Path, timeout: float = 600) -> subprocess.CompletedProcess:
  """`python -m transformer_jax.main` of this checkout, from `cwd`."""
  env = {key: value for key, value in os.environ.items() if key != 'XLA_FLAGS'}  # One CPU device: less to compile.
  env['PYTHONPATH'] = str(REPO_ROOT)
  return subprocess.run([sys.executable, '-m', 'transformer_jax.main', f'--config={REPO_ROOT}/configs/parsing.py:cpu',
                         *flags], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.integration
def test_an_unreadable_tree_stops_main_in_one_line_before_the_workdir_exists(tmp_path):
  folder = synthetic_treebank.write_treebank(tmp_path / 'trees', (('train', 20), ('dev', 5), ('test', 5)))
  lines = (folder / 'dev.txt').read_text().split('\n')
  lines[3] = lines[3][:-2]  # Two closing brackets short.
  (folder / 'dev.txt').write_text('\n'.join(lines))
  process = _main(f'--config.data.treebank_dir={folder}', f'--workdir={tmp_path / "run"}', cwd=tmp_path)
  assert process.returncode == 1
  errors_printed = [line for line in process.stderr.split('\n') if not line.startswith(('I1', 'W1', '('))]
  assert errors_printed[0].startswith(f'TreebankError: {folder / "dev.txt"}:4: not a bracketed tree'), process.stderr
  assert not (tmp_path / 'run').exists()
  process = _main(f'--config.data.treebank_dir={tmp_path / "nowhere"}', f'--workdir={tmp_path / "run"}',
                  cwd=tmp_path)
  errors_printed = [line for line in process.stderr.split('\n') if not line.startswith(('I1', 'W1', '('))]
  assert errors_printed[0] == f'FileNotFoundError: data.treebank_dir: the folder {tmp_path / "nowhere"} does not exist'
  assert not (tmp_path / 'run').exists()


@pytest.mark.integration
def test_main_trains_on_a_treebank_folder_and_reports_dev_and_test_f1(tmp_path):
  folder = synthetic_treebank.write_treebank(tmp_path / 'trees', (('train', 300), ('dev', 8), ('test', 6)))
  workdir = tmp_path / 'run'
  process = _main(f'--config.data.treebank_dir={folder}', f'--workdir={workdir}', '--config.data.vocab_size=360',
                  '--config.data.bucket_lengths=(128,)', '--config.train.num_train_steps=6',
                  '--config.train.eval_every_steps=3', '--config.train.eval_bleu_every_steps=3',
                  '--config.train.checkpoint_every_steps=3', '--config.decode.beam_size=2',
                  '--config.decode.extra_length=8', cwd=tmp_path, timeout=1800)
  assert process.returncode == 0, process.stderr[-3000:]
  printed = dict(line.split(': ', 1) for line in process.stdout.split('\n') if line.startswith(('f1:',
                                                                                               'validation_f1:')))
  assert set(printed) == {'f1', 'validation_f1'}
  assert 'beam 2, alpha 0.3, max length input + 8; best: steps [' in printed['f1']
  metrics = json.loads((workdir / 'final_metrics.json').read_text())
  assert 0.0 <= metrics['f1'] <= 100.0 and 0.0 <= metrics['validation_f1'] <= 100.0
  assert f'{metrics["f1"]:.2f}' == printed['f1'].split()[0]
  assert metrics['checkpoint_selection'] == 'best'
  assert 'validation F1 at step 3' in process.stderr and 'validation F1 at step 6' in process.stderr
  hypotheses = (workdir / 'test.hyp.tree').read_text().splitlines()
  gold = (workdir / 'test.gold.tree').read_text().splitlines()
  assert len(hypotheses) == len(gold) == 6
  assert all(line.startswith('(TOP ') for line in hypotheses + gold)


@pytest.mark.slow
def test_the_cpu_variant_learns_the_synthetic_grammar(synthetic_treebank, tmp_path):
  """configs/parsing.py:cpu as it is (the words target, 2,000 steps), on 3,000 synthetic training trees: dev
  and test F1 >= 95 with beam 21 (measured in docs/parsing.md)."""
  workdir = tmp_path / 'run'
  process = _main(f'--config.data.treebank_dir={synthetic_treebank}', f'--workdir={workdir}', cwd=tmp_path,
                  timeout=3600)
  assert process.returncode == 0, process.stderr[-3000:]
  metrics = json.loads((workdir / 'final_metrics.json').read_text())
  assert metrics['validation_f1'] >= 95.0 and metrics['f1'] >= 95.0, metrics
