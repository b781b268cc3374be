"""Tests for transformer_jax.tools.report and the Table 3 sweep around it: every row appears with its state, the
numbers are the runs' own, the sweep skips finished rows and records failures, and the Multi30k rows change
exactly the fields they name."""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import scipy.stats

from transformer_jax.tools import report

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
ROWS_FILE = REPO_ROOT / 'configs' / 'table3_multi30k.py'
if str(REPO_ROOT) not in sys.path:
  sys.path.insert(0, str(REPO_ROOT))
from configs import base as base_config  # pylint: disable=g-import-not-at-top,wrong-import-position
from configs import table3_multi30k  # pylint: disable=g-import-not-at-top,wrong-import-position


def fake_run(workdir: pathlib.Path, row: str, metrics: dict | None = None, exit_status: int | None = None):
  """A workdir as a run leaves it: config.json always, final_metrics.json when finished, sweep_status.json."""
  workdir.mkdir(parents=True)
  (workdir / 'config.json').write_text(table3_multi30k.get_config(row).to_json())
  if metrics is not None:
    (workdir / 'final_metrics.json').write_text(json.dumps(metrics))
  if exit_status is not None:
    (workdir / 'sweep_status.json').write_text(json.dumps({'exit_status': exit_status}))


def finished(perplexity, num_params=10_000_000):
  return {'perplexity': perplexity, 'validation_bleu': 30.0, 'bleu': 31.5, 'num_params': num_params,
          'train_wall_seconds': 120.0, 'train_steps': 600, 'checkpoint_steps': [400, 500, 600],
          'mfu': 0.25, 'train_steps_seconds': 100.0, 'peak_flops': 4e12}


def test_report_lists_finished_unfinished_failed_and_missing_rows(tmp_path):
  fake_run(tmp_path / 'base', 'base', finished(9.0, 12_345_678))
  fake_run(tmp_path / 'A1', 'A1', finished(9.5))
  fake_run(tmp_path / 'C1', 'C1', finished(12.0))
  fake_run(tmp_path / 'D1', 'D1', finished(10.0))
  fake_run(tmp_path / 'B1', 'B1')                    # Still training (or killed): no final metrics.
  (tmp_path / 'B1' / 'checkpoints' / '185').mkdir(parents=True)  # Trained 185 steps so far.
  fake_run(tmp_path / 'B2', 'B2', exit_status=1)     # The sweep saw it fail.
  (tmp_path / 'scratch').mkdir()                     # Not a row: listed after the rows.
  text = report.write_report(tmp_path, ROWS_FILE)
  records = {r['row']: r for r in json.loads((tmp_path / 'table3.json').read_text())['rows']}
  assert list(records)[:len(table3_multi30k.ROWS)] == list(table3_multi30k.ROWS) and 'scratch' in records
  assert records['base']['status'] == 'finished' and records['base']['params_millions'] == pytest.approx(12.345678)
  assert records['base']['dev_perplexity'] == 9.0 and records['base']['test_bleu'] == 31.5
  assert records['base']['train_tflop'] == pytest.approx(100.0) and records['base']['train_steps'] == 600
  assert records['A1']['num_heads'] == 1 and records['A1']['d_k'] == 256  # From the run's config.json.
  assert records['B1']['status'] == 'unfinished' and records['B1']['dev_perplexity'] is None
  assert records['B1']['train_steps'] == 185  # What it trained, not its config's goal.
  assert records['B2']['status'] == 'failed (exit 1)'
  assert records['C2']['status'] == 'not run'
  assert records['C1']['paper_ppl_dev'] == 6.11 and records['base']['paper_params_millions'] == 65
  # Ours 9.0 < 9.5 < 10.0 < 12.0 for base, A1, D1, C1; the paper's 4.92 < 5.29 < 5.77 < 6.11: the same order.
  assert json.loads((tmp_path / 'table3.json').read_text())['rank_correlations']['dev_perplexity']['spearman'] == (
      pytest.approx(1.0))
  assert "Spearman rank correlation of dev perplexity with the paper's: 1.00 over 4 rows (p = 0.000)." in text
  header = text.splitlines()[0]
  for column in ('dev PPL', 'dev BLEU', 'test BLEU', 'params', 'train TFLOP', 'paper PPL', 'P_drop', 'ε_ls'):
    assert column in header
  assert (tmp_path / 'table3.png').stat().st_size > 1000
  assert (tmp_path / 'table3.csv').read_text().count('\n') == len(records) + 1


def test_training_cost_is_its_flops_whatever_the_wall_time(tmp_path):
  """A seed paused (SIGSTOP) for an hour of its training loop has 5x the seconds and a fifth of the MFU: the same
  FLOPs. A run resumed only to be evaluated (mfu 0, as its last invocation trained nothing) has no figure."""
  fake_run(tmp_path / 'base', 'base', finished(9.0))
  fake_run(tmp_path / 'base.seed1', 'base', finished(9.2) | {'mfu': 0.05, 'train_steps_seconds': 500.0,
                                                             'train_wall_seconds': 3720.0})
  fake_run(tmp_path / 'A1', 'A1', finished(9.5) | {'mfu': 0.0, 'train_steps_seconds': 0.0003})
  # Resumed at step 450 of 600: its last invocation trained a quarter of the run's FLOPs.
  fake_run(tmp_path / 'C1', 'C1', finished(12.0) | {'mfu': 0.25, 'train_steps_seconds': 30.0, 'first_step': 450})
  # An older record, resumed, without first_step: a lower bound; the row takes its largest seed.
  fake_run(tmp_path / 'C1.seed1', 'C1', finished(12.2) | {'mfu': 0.25, 'train_steps_seconds': 10.0})
  report.write_report(tmp_path, ROWS_FILE)
  records = {r['row']: r for r in json.loads((tmp_path / 'table3.json').read_text())['rows']}
  assert records['base']['train_tflop_values'] == [pytest.approx(100.0), pytest.approx(100.0)]
  assert records['base']['train_tflop'] == pytest.approx(100.0) and records['base']['train_tflop_std'] is None
  assert records['A1']['train_tflop'] is None
  assert records['C1']['train_tflop_values'] == [pytest.approx(120.0), pytest.approx(10.0)]
  assert records['C1']['train_tflop'] == pytest.approx(120.0)


def test_plot_puts_ours_and_the_papers_on_one_axis_relative_to_base(tmp_path, monkeypatch):
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fake_run(tmp_path / 'base', 'base', finished(9.0) | {'validation_bleu': 30.0})
  fake_run(tmp_path / 'C1', 'C1', finished(12.0) | {'validation_bleu': 27.0})
  records = report.collect(tmp_path, report.load_rows_module(ROWS_FILE))
  figures = []
  monkeypatch.setattr(plt, 'close', figures.append)
  report.plot_rows(records, tmp_path / 'table3.png')
  (figure,) = figures
  assert len(figure.axes) == 2  # One axis per panel: no second y-axis for the paper.
  perplexity = figure.axes[0]
  points = {line.get_label(): line.get_ydata() for line in perplexity.get_lines()}
  paper = list(points['paper (newstest2013)'])
  rows = [r['row'] for r in records if r['dev_perplexity'] is not None or r['paper_ppl_dev'] is not None]
  assert paper[rows.index('base')] == pytest.approx(1.0)
  assert paper[rows.index('C1')] == pytest.approx(6.11 / 4.92)  # The paper's C1 over its base.
  ours = [c for c in perplexity.containers][0].lines[0].get_ydata()  # errorbar: (data line, caps, bars).
  assert list(ours)[:2] == [pytest.approx(1.0), pytest.approx(12.0 / 9.0)]


def test_seeds_are_averaged_and_rows_differ_from_base_with_an_interval(tmp_path):
  for seed, (perplexity, bleu) in enumerate(((9.0, 30.0), (9.2, 31.0), (9.4, 32.0))):
    fake_run(tmp_path / ('base' if seed == 0 else f'base.seed{seed}'), 'base', finished(perplexity) | {
        'validation_bleu': bleu})
  fake_run(tmp_path / 'A1', 'A1', finished(9.5) | {'validation_bleu': 29.0})
  fake_run(tmp_path / 'C1', 'C1', finished(12.0))
  fake_run(tmp_path / 'C1.seed1', 'C1')  # A second seed still training.
  text = report.write_report(tmp_path, ROWS_FILE)
  records = {r['row']: r for r in json.loads((tmp_path / 'table3.json').read_text())['rows']}
  base = records['base']
  assert base['seeds'] == 3 and base['dev_perplexity'] == pytest.approx(9.2) and base['dev_bleu'] == 31.0
  assert base['dev_perplexity_std'] == pytest.approx(0.2) and base['dev_bleu_std'] == pytest.approx(1.0)
  assert base['seed_ids'] == [0, 1, 2] and base['dev_bleu_values'] == [30.0, 31.0, 32.0]
  # A1 (one seed) against base's three: one run's sigma is pooled within the rows with seeds (base alone here:
  # 1.0 BLEU, 2 degrees of freedom); the difference's standard error is 1.0 * sqrt(1 + 1/3).
  half = scipy.stats.t.ppf(0.975, 2) * (4 / 3) ** 0.5
  assert records['A1']['dev_bleu_delta'] == pytest.approx(-2.0)
  assert (records['A1']['dev_bleu_delta_low'], records['A1']['dev_bleu_delta_high']) == pytest.approx(
      (-2.0 - half, -2.0 + half))
  assert records['A1']['dev_perplexity_delta'] == pytest.approx(0.3) and records['base']['dev_bleu_delta'] is None
  assert records['A1']['seeds'] == 1 and records['A1']['dev_bleu_std'] is None
  assert records['C1']['status'] == 'finished 1 of 2 seeds' and records['C1']['dev_perplexity'] == 12.0
  assert 'base.seed1' not in records and 'C1.seed1' not in records  # Seeds are their row's, not extra rows.
  assert '| 9.20 ± 0.20 ' in text and '| 31.00 ± 1.00 ' in text
  assert f'| -2.00 [{-2.0 - half:+.2f}, {-2.0 + half:+.2f}] ' in text
  assert "Spearman rank correlation of dev BLEU with the paper's:" in text
  assert 'dev_bleu_std' in (tmp_path / 'table3.csv').read_text().splitlines()[0]


def test_recipes_differ_from_the_rows_files_reference_row(tmp_path):
  """configs/multi30k_recipes.py names 'paper' its REFERENCE: every candidate's difference is from it."""
  from configs import multi30k_recipes  # pylint: disable=g-import-not-at-top
  for seed, bleu in enumerate((40.0, 41.0, 42.0)):
    run = tmp_path / ('paper' if seed == 0 else f'paper.seed{seed}')
    run.mkdir()
    (run / 'config.json').write_text(multi30k_recipes.get_config('paper').to_json())
    (run / 'final_metrics.json').write_text(json.dumps(finished(5.1) | {'validation_bleu': bleu}))
  (tmp_path / 'lr_high').mkdir()
  (tmp_path / 'lr_high' / 'config.json').write_text(multi30k_recipes.get_config('lr_high').to_json())
  (tmp_path / 'lr_high' / 'final_metrics.json').write_text(json.dumps(finished(5.0) | {'validation_bleu': 43.5}))
  report.write_report(tmp_path, REPO_ROOT / 'configs' / 'multi30k_recipes.py')
  records = {r['row']: r for r in json.loads((tmp_path / 'table3.json').read_text())['rows']}
  assert records['lr_high']['dev_bleu_delta'] == pytest.approx(2.5)
  assert records['lr_high']['dev_perplexity_delta'] == pytest.approx(-0.1)
  assert records['paper']['dev_bleu_delta'] is None and records['modern']['dev_bleu_delta'] is None
  assert 'Δ: the row minus paper' in (tmp_path / 'table3.md').read_text()
  # --reference: the Δ columns compare with another row; the findings keep the reference they name.
  default = json.loads((tmp_path / 'table3.json').read_text())
  report.write_report(tmp_path, REPO_ROOT / 'configs' / 'multi30k_recipes.py', tmp_path / 'against_lr_high',
                      reference='lr_high')
  written = json.loads((tmp_path / 'against_lr_high' / 'table3.json').read_text())
  records = {r['row']: r for r in written['rows']}
  assert records['paper']['dev_bleu_delta'] == pytest.approx(-2.5) and records['lr_high']['dev_bleu_delta'] is None
  assert records['paper']['dev_perplexity_delta'] == pytest.approx(0.1)
  assert written['reference'] == 'lr_high' and default['reference'] == 'paper'
  assert 'Δ: the row minus lr_high' in (tmp_path / 'against_lr_high' / 'table3.md').read_text()
  assert written['verdicts'] == default['verdicts'] and default['verdicts']
  with pytest.raises(ValueError, match=r"--reference: 'lr_hihg' is not one of the ROWS of .*multi30k_recipes.py"):
    report.write_report(tmp_path, REPO_ROOT / 'configs' / 'multi30k_recipes.py', tmp_path / 'typo',
                        archive_dir=tmp_path / 'typo_archive', reference='lr_hihg')
  assert not (tmp_path / 'typo').exists() and not (tmp_path / 'typo_archive').exists()
  rows_file = tmp_path / 'configs' / 'typo.py'  # A REFERENCE that names no row is refused, not ignored.
  rows_file.parent.mkdir()
  rows_file.write_text("ROWS = {'base': {}, 'A1': {}}\nNOTES = {}\nPAPER = {}\nREFERENCE = 'bsae'\n")
  with pytest.raises(ValueError, match=r"REFERENCE = 'bsae' is not one of its ROWS \(base, A1\)"):
    report.load_rows_module(rows_file)


def test_archive_keeps_what_the_report_reads_and_the_curves(tmp_path):
  import tensorboardX  # pylint: disable=g-import-not-at-top
  runs = tmp_path / 'runs'
  fake_run(runs / 'base', 'base', finished(9.0))
  fake_run(runs / 'A1', 'A1')  # Unfinished: archived as it is.
  writer = tensorboardX.SummaryWriter(str(runs / 'base'))
  for step, perplexity in ((250, 60.0), (500, 20.0)):
    writer.add_scalar('eval/perplexity', perplexity, step)
  for step in range(100, 800, 100):  # Seven progress lines: the report averages the last five.
    writer.add_scalar('train/nll', step / 100, step)
  writer.close()
  (runs / 'base' / 'checkpoints' / '500').mkdir(parents=True)
  evaluations = runs / 'base' / 'evaluations'
  for name, record in (('20261205-051359', 'decoding_sweep.json'), ('20261205-060000', 'final_metrics.json'),
                       ('20261205-070000', None)):  # A --mode=tune_decoding, a --mode=evaluate, one interrupted.
    (evaluations / name).mkdir(parents=True)
    (evaluations / name / 'validation.hyp.de').write_text('Ein Hund.\n')  # Hypotheses stay behind.
    if record:
      (evaluations / name / record).write_text('{"rows": []}')
  assert report.archive(runs, tmp_path / 'archive') == ['base']  # A1 could not resume without checkpoints.
  archived = tmp_path / 'archive' / 'base' / 'evaluations'
  assert sorted(str(p.relative_to(archived)) for p in archived.rglob('*')) == [
      '20261205-051359', '20261205-051359/decoding_sweep.json', '20261205-060000',
      '20261205-060000/final_metrics.json']
  curves = json.loads((tmp_path / 'archive' / 'base' / 'curves.json').read_text())
  assert curves['eval/perplexity'] == [[250, 60.0], [500, 20.0]] and len(curves['train/nll']) == 7
  assert not (tmp_path / 'archive' / 'base' / 'checkpoints').exists()
  report.write_report(runs, ROWS_FILE)
  report.write_report(tmp_path / 'archive', ROWS_FILE)
  rows = lambda d: [r for r in json.loads((d / 'table3.json').read_text())['rows'] if r['status'] == 'finished']
  assert rows(runs) == rows(tmp_path / 'archive')  # The same lines from kilobytes.
  # The curves print the same from the events and from the archive: a line per run, a column per step.
  table = report.curve_table(tmp_path / 'archive', 'eval/perplexity')
  assert table == report.curve_table(runs, 'eval/perplexity')
  (tmp_path / 'archive' / 'C1').mkdir()  # A second run evaluated at other steps: '–' where it has none.
  (tmp_path / 'archive' / 'C1' / 'curves.json').write_text(json.dumps({'eval/perplexity': [[500, 30.0], [750, 25.0]]}))
  cells = lambda line: [cell.strip() for cell in line.split('|')[1:-1]]
  lines = report.curve_table(tmp_path / 'archive', 'eval/perplexity').splitlines()
  assert [cells(line) for line in lines if not line.startswith('|-')] == [
      ['eval/perplexity at step', '250', '500', '750'], ['C1', '–', '30.00', '25.00'],
      ['base', '60.00', '20.00', '–']]
  assert cells(report.curve_table(tmp_path / 'archive', 'eval/perplexity', every=500).splitlines()[0])[1:] == ['500']
  with pytest.raises(ValueError, match="no run has the curve 'eval/bleu'"):
    report.curve_table(runs, 'eval/bleu')
  with pytest.raises(ValueError, match='at a multiple of --curve_every=1000'):
    report.curve_table(runs, 'eval/perplexity', every=1000)
  # exp of the mean nll of the last five progress lines (3..7), from the events and from curves.json alike.
  assert rows(runs)[0]['train_perplexity'] == pytest.approx(np.exp(5.0))
  # Copied back into a sweep (a new machine) and archived again with the sweep's next run: curves kept.
  resumed = tmp_path / 'resumed'
  (resumed / 'base').mkdir(parents=True)
  for name in (*report.ARCHIVED_FILES, report.CURVES_FILE):
    if (tmp_path / 'archive' / 'base' / name).is_file():
      (resumed / 'base' / name).write_bytes((tmp_path / 'archive' / 'base' / name).read_bytes())
  assert report.archive(resumed, tmp_path / 'archive') == ['base']
  assert json.loads((tmp_path / 'archive' / 'base' / 'curves.json').read_text()) == curves
  # A run with events and a stale copied-back curves.json (rerun in place): the events count.
  (runs / 'base' / 'curves.json').write_text(json.dumps({'train/nll': [[700, 100.0]]}))
  assert report.train_perplexity(runs / 'base') == pytest.approx(np.exp(5.0))
  # Events without a tag that curves.json has (an archived run copied back and evaluated): curves.json's counts.
  (runs / 'base' / 'curves.json').write_text(json.dumps({'train/nll': [[700, 4.0]], 'eval/perplexity': [[1, 9.0]]}))
  for event_file in (runs / 'base').glob('events.out.tfevents.*'):
    event_file.unlink()
  writer = tensorboardX.SummaryWriter(str(runs / 'base'))
  writer.add_scalar('eval/perplexity', 7.0, 800)
  writer.close()
  assert report.train_perplexity(runs / 'base') == pytest.approx(np.exp(4.0))
  assert report.run_curves(runs / 'base')['eval/perplexity'] == [(800, 7.0)]
  (runs / 'base' / 'curves.json').write_text('[1, 2]')
  with pytest.raises(ValueError, match=r'curves.json: not a curves file'):
    report.run_curves(runs / 'base')


def test_archive_refuses_runs_without_curves(tmp_path):
  runs = tmp_path / 'runs'
  fake_run(runs / 'base', 'base', finished(9.0))
  (runs / 'base' / 'curves.json').write_text(json.dumps({'train/nll': [[100, 5.0]], 'eval/perplexity': [[250, 9.0]]}))
  fake_run(runs / 'A1', 'A1', finished(9.5))
  (runs / 'A1' / 'curves.json').write_text('{}')  # As 16 runs of the first round were archived.
  with pytest.raises(ValueError, match=r'no training or validation curve .* in A1; nothing archived'):
    report.archive(runs, tmp_path / 'archive')
  assert not (tmp_path / 'archive').exists()
  (runs / 'A1' / 'curves.json').write_text(json.dumps({'train/nll': [[100, 5.0]], 'eval/perplexity': [[250, 9.5]]}))
  assert report.archive(runs, tmp_path / 'archive') == ['A1', 'base']


def test_train_perplexity_averages_the_last_progress_lines_and_the_seeds(tmp_path):
  for name, offset in (('base', 0.0), ('base.seed1', 0.2)):
    fake_run(tmp_path / name, 'base', finished(9.0))
    curve = [[step, 9.0 - step / 1000 + offset] for step in range(100, 2100, 100)]  # nll 8.9 .. 7.0 (+ offset).
    (tmp_path / name / 'curves.json').write_text(json.dumps({'train/nll': curve}))
  fake_run(tmp_path / 'A1', 'A1', finished(9.5))  # No curve: no train perplexity, the rest of the line stands.
  text = report.write_report(tmp_path, ROWS_FILE)
  records = {r['row']: r for r in json.loads((tmp_path / 'table3.json').read_text())['rows']}
  seeds = [np.exp(np.mean([9.0 - s / 1000 + offset for s in range(1600, 2100, 100)])) for offset in (0.0, 0.2)]
  assert records['base']['train_perplexity'] == pytest.approx(np.mean(seeds))  # exp(7.2) and exp(7.4), averaged.
  assert records['base']['train_perplexity_std'] == pytest.approx(np.std(seeds, ddof=1))
  assert records['A1']['train_perplexity'] is None and records['A1']['dev_perplexity'] == 9.5
  assert 'train PPL' in text.splitlines()[0]


def test_findings_get_an_interval_a_holm_p_and_a_verdict_that_needs_three_seeds(tmp_path):
  for seed, (perplexity, bleu) in enumerate(((9.0, 30.0), (9.2, 31.0), (9.4, 32.0))):  # sigma: 0.2 and 1.0.
    fake_run(tmp_path / ('base' if seed == 0 else f'base.seed{seed}'), 'base', finished(perplexity) | {
        'validation_bleu': bleu})
  for seed, bleu in enumerate((24.0, 25.0, 26.0)):  # One head: 6 BLEU below base over three seeds.
    fake_run(tmp_path / ('A1' if seed == 0 else f'A1.seed{seed}'), 'A1', finished(9.5) | {'validation_bleu': bleu})
  for row, perplexity, bleu in (('B1', 9.3, 30.5), ('C1', 12.0, 31.0), ('E', 9.1, 31.5), ('F3', 9.0, 34.0)):
    fake_run(tmp_path / row, row, finished(perplexity) | {'validation_bleu': bleu})
  text = report.write_report(tmp_path, ROWS_FILE)
  written = json.loads((tmp_path / 'table3.json').read_text())
  results = {(r['row'], r['metric']): r for r in written['verdicts']}
  one_head = results[('A1', 'dev_bleu')]  # 25 against base's 31 (A2-A4 not run), Welch over 3 and 3 seeds.
  assert one_head['reference'] == 'base' and one_head['test'] == 'welch' and one_head['difference'] == -6.0
  assert one_head['high'] < 0 and one_head['p_holm'] <= 0.05 and one_head['verdict'] == 'holds'
  assert one_head['paired']['difference'] == -6.0
  b1 = results[('B1', 'dev_bleu')]  # 0.5 below, one seed against three: pooled sigma, inconclusive.
  assert b1['test'] == 'pooled' and b1['low'] < 0 < b1['high'] and b1['verdict'] == 'inconclusive'
  c1 = results[('C1', 'dev_perplexity')]  # 2.8 worse, far beyond the noise, but one seed.
  assert c1['p_holm'] < 0.05 and c1['verdict'] == 'inconclusive (holds at 1 vs 3 seeds)'
  assert results[('E', 'dev_bleu')]['verdict'] == 'inconclusive'  # 'The same': the interval is wider than 0.4.
  assert results[('E', 'dev_bleu')]['margin'] == table3_multi30k.EQUIVALENCE_MARGINS['dev_bleu']
  assert results[('F3', 'dev_bleu')]['family'] == 'variants' and results[('C1', 'dev_perplexity')]['family'] == 'paper'
  assert results[('F1', 'dev_bleu')]['verdict'] == 'not run'
  families = {f['family']: f for f in written['families']}
  assert families['paper']['expected_false_positives_unadjusted'] == pytest.approx(0.05 * families['paper']['checks'])
  assert 'The findings, tested' in text and '| A (§6.2) ' in text and 'false positives are expected' in text


def test_compare_to_lists_the_verdicts_that_changed_since_an_earlier_report(tmp_path):
  runs, earlier = tmp_path / 'runs', tmp_path / 'round1'
  for name, bleu in (('base', 31.0), ('A1', 25.0)):
    fake_run(runs / name, name, finished(9.0) | {'validation_bleu': bleu})
  report.write_report(runs, ROWS_FILE, earlier)  # One seed a side: every verdict inconclusive or not run.
  for seed in (1, 2):  # Two more seeds of base and A1: 'one head is worse' now holds.
    fake_run(runs / f'base.seed{seed}', 'base', finished(9.0 + seed / 10) | {'validation_bleu': 31.0 + seed / 2})
    fake_run(runs / f'A1.seed{seed}', 'A1', finished(9.5) | {'validation_bleu': 25.0 + seed / 2})
  text = report.write_report(runs, ROWS_FILE, compare_to=earlier / 'table3.json')
  changes = json.loads((runs / 'table3.json').read_text())['changes']
  checks = sum(len(finding['checks']) for finding in table3_multi30k.FINDINGS)
  assert len(changes) == checks and all(c['before'] is not None for c in changes)  # The same rows file.
  assert [(c['row'], c['metric'], c['before'], c['after']) for c in changes if c['changed']] == [
      ('A1', 'dev_bleu', 'inconclusive', 'holds')]
  assert f'1 of {checks} verdicts differ from {earlier / "table3.json"}: 1 in their conclusion, 0 only' in text
  assert '| A         | one head is worse than the best setting | A1    | dev bleu | inconclusive' in text

  # A check the earlier report has and this one lacks is listed as no longer checked; a note is not a conclusion.
  verdicts = json.loads((earlier / 'table3.json').read_text())['verdicts']
  noted = next(i for i, v in enumerate(verdicts) if v['row'] == 'C1')  # Not run in either report.
  verdicts[noted]['verdict'] = 'not run (a note)'
  verdicts.append(verdicts[0] | {'claim': 'a claim since reworded'})
  changes = report.findings_lib.verdict_changes(verdicts, json.loads((runs / 'table3.json').read_text())['verdicts'])
  assert changes[-1]['claim'] == 'a claim since reworded' and changes[-1]['after'] is None and changes[-1]['changed']
  assert changes[noted]['changed'] and not changes[noted]['conclusion_changed']


@pytest.mark.parametrize('content, message', [
    ('{"rows": []}', 'has no verdicts'), ('{"verdicts": []}', 'has no verdicts'), ('[1, 2]', 'has no verdicts'),
    ('{"verdicts": [{"verdict": "holds"}]}', 'has no verdicts'), ('not json', 'is not JSON')])
def test_compare_to_refuses_what_is_not_a_report_before_writing(tmp_path, content, message):
  fake_run(tmp_path / 'runs' / 'base', 'base', finished(9.0))
  (tmp_path / 'earlier.json').write_text(content)
  with pytest.raises(ValueError, match=f'earlier.json {message}'):
    report.write_report(tmp_path / 'runs', ROWS_FILE, tmp_path / 'out', compare_to=tmp_path / 'earlier.json')
  with pytest.raises(ValueError, match='table3.py has no FINDINGS'):
    report.check_inputs(tmp_path / 'runs', REPO_ROOT / 'configs' / 'table3.py', tmp_path / 'earlier.json')
  result = subprocess.run([sys.executable, '-m', 'transformer_jax.report', str(tmp_path / 'runs'),
                           f'--rows={ROWS_FILE}', f'--archive={tmp_path / "archive"}',
                           f'--compare_to={tmp_path / "earlier.json"}'], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
  assert result.returncode != 0 and message in result.stderr and 'Traceback' not in result.stderr
  assert not (tmp_path / 'out').exists() and not (tmp_path / 'archive').exists()


@pytest.mark.parametrize('rows_file', ['table3_multi30k.py', 'multi30k_recipes.py'])
def test_findings_name_rows_of_the_table(rows_file):
  rows_module = report.load_rows_module(REPO_ROOT / 'configs' / rows_file)
  assert rows_module.FINDINGS
  for finding in rows_module.FINDINGS:
    for _, row, references, metric, expected in finding['checks']:
      assert {row, *references} <= set(rows_module.ROWS) and row not in references
      assert metric in ('dev_bleu', 'dev_perplexity') and expected in ('worse', 'better', 'same', 'not worse')


def test_archived_recipes_keep_their_verdicts_under_holm(tmp_path):
  """The committed recipe archive, re-tested as one Holm family: two checks (validation BLEU and perplexity) for
  each archived candidate, less vocab10k's perplexity and both of lowercase's (at least 21: the 12 candidates
  archived by 2026-12-06), and none for a candidate not run yet. Rotary positions' lower
  perplexity (4.81 against 5.10, three seeds a side) holds after the correction; no BLEU difference does."""
  archive = REPO_ROOT / 'docs' / 'multi30k_recipes' / 'runs'
  report.write_report(archive, REPO_ROOT / 'configs' / 'multi30k_recipes.py', tmp_path)
  verdicts = {(v['row'], v['metric']): v for v in json.loads((tmp_path / 'table3.json').read_text())['verdicts']}
  assert {v['family'] for v in verdicts.values()} == {'candidates'}
  assert ('vocab10k', 'dev_perplexity') not in verdicts  # Another vocabulary's pieces: not comparable.
  assert not any(row == 'lowercase' for row, _ in verdicts)  # Cased BLEU of lowercased output: not comparable.
  tested = [v for v in verdicts.values() if v['p'] is not None]
  archived = {run.name.split('.seed')[0] for run in archive.iterdir()}
  candidates = archived - {'paper'}
  assert len(tested) == 2 * len(candidates) - 3 and {v['row'] for v in tested} <= archived
  assert len(tested) >= 21  # The 12 candidates archived by 2026-12-06.
  assert all(v['p'] is None for v in verdicts.values() if v['row'] not in archived)
  smallest = min(tested, key=lambda v: v['p'])  # Holm's first step: the smallest p times the family's size.
  assert smallest['p_holm'] == pytest.approx(min(1.0, smallest['p'] * len(tested)))
  modern = verdicts['modern', 'dev_perplexity']
  assert modern['verdict'] == 'holds' and modern['seeds'] == modern['reference_seeds'] == 3
  assert modern['value'] == pytest.approx(4.81, abs=0.005)
  assert modern['reference_value'] == pytest.approx(5.10, abs=0.005)
  assert modern['difference'] == pytest.approx(-0.29, abs=0.005) and modern['high'] < 0
  bleu = [v for (_, metric), v in verdicts.items() if metric == 'dev_bleu' and v['p'] is not None]
  assert all(v['p_holm'] > 0.05 and v['verdict'] == 'inconclusive' for v in bleu)


def test_rank_correlation_reverses_with_the_order():
  records = [dict(dev_perplexity=p, paper_ppl_dev=q) for p, q in ((1, 3), (2, 2), (3, 1), (None, 5))]
  rho, count, p, _, _ = report.rank_correlation(records)
  assert count == 3 and rho == pytest.approx(-1.0) and p == pytest.approx(0.0)
  assert np.isnan(report.rank_correlation(records[:2])[0])


def run_sweep(tmp_path, *args, python=sys.executable):
  env = dict(os.environ, PYTHON=str(python))
  return subprocess.run(['bash', 'launch/sweep_table3.sh', '--table=multi30k', f'--workdir-root={tmp_path}',
                         *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_sweep_skips_finished_rows_and_records_failures(tmp_path):
  fake_run(tmp_path / 'base', 'base', finished(9.0))
  dry = run_sweep(tmp_path, '--dry-run', 'base', 'A1')
  assert dry.returncode == 0 and 'row base: finished' in dry.stderr
  assert [line.split('--workdir=')[1].strip() for line in dry.stdout.splitlines()] == [str(tmp_path / 'A1')]
  assert len(run_sweep(tmp_path, '--dry-run', '--rerun', 'base').stdout.splitlines()) == 1

  # A stand-in interpreter whose training runs fail with status 3 after creating their workdir.
  fake_python = tmp_path / 'python'
  fake_python.write_text('#!/usr/bin/env bash\nif [[ "$2" == transformer_jax.main ]]; then\n'
                         '  for a in "$@"; do [[ $a == --workdir=* ]] && mkdir -p "${a#--workdir=}"; done; exit 3\n'
                         f'fi\nexec {sys.executable} "$@"\n')
  fake_python.chmod(0o755)
  result = run_sweep(tmp_path, 'base', 'A1', python=fake_python)
  assert result.returncode == 1 and 'row A1 failed (exit status 3)' in result.stderr
  assert json.loads((tmp_path / 'A1' / 'sweep_status.json').read_text())['exit_status'] == 3
  records = {r['row']: r for r in json.loads((tmp_path / 'table3.json').read_text())['rows']}
  assert records['A1']['status'] == 'failed (exit 3)' and records['base']['status'] == 'finished'


def test_sweep_seeds_train_a_row_again_in_its_own_workdir(tmp_path):
  fake_run(tmp_path / 'base', 'base', finished(9.0))
  dry = run_sweep(tmp_path, '--dry-run', '--seeds=0,1,2', 'base')
  assert 'row base: finished' in dry.stderr
  lines = dry.stdout.splitlines()
  assert len(lines) == 2
  for seed, line in zip((1, 2), lines):
    assert f'--workdir={tmp_path}/base.seed{seed} ' in line
    assert f'--config.train.seed={seed} --config.data.shuffle_seed={seed} ' in line
  for seeds, message in (('1,x', 'takes non-negative integers'), ('1,01', 'names seed 1 twice'), ('', 'is empty')):
    bad = run_sweep(tmp_path, '--dry-run', f'--seeds={seeds}', 'base')
    assert bad.returncode == 2 and f'--seeds {message}' in bad.stderr
  tpu = run_sweep(tmp_path, '--dry-run', '--launcher=tpu', '--skip-compile-check', '--seeds=2', 'base').stdout
  assert tpu.startswith('env TPU_NAME=table3-base-seed2 launch/tpu_vm.sh run ')  # No dot in a TPU name.


@pytest.mark.parametrize('row', list(table3_multi30k.ROWS))
def test_multi30k_rows_differ_from_their_base_in_exactly_the_named_fields(row):
  base = table3_multi30k.base_config().to_dict()
  config = table3_multi30k.get_config(row).to_dict()
  changed = {f'{section}.{key}' for section in base for key in base[section]
             if base[section][key] != config[section][key]}
  assert changed == set(table3_multi30k.ROWS[row])
  assert set(config['model']) == set(base_config.get_config().model)  # No misspelt field added.
  model = config['model']
  if row.startswith('A'):  # Constant computation: h * d_k = h * d_v = d_model (§3.2.2).
    assert model['num_heads'] * model['d_k'] == model['num_heads'] * model['d_v'] == 256


def test_train_perplexity_leaves_out_the_lines_logged_by_time(tmp_path):
  # A loaded machine logs extra lines (train.log_every_secs, and 10 steps after a resume) between the 100-step
  # ones; how many depends on the load, so only the lines at multiples of train.log_every_steps count.
  fake_run(tmp_path / 'base', 'base', finished(9.0))
  curve = [[step, 9.0 - step / 1000] for step in range(100, 2100, 100)]
  curve += [[step, 1.0] for step in (1837, 1873, 1905, 1936, 1974, 424)]  # Low values: they would pull it down.
  (tmp_path / 'base' / 'curves.json').write_text(json.dumps({'train/nll': sorted(curve)}))
  assert report.train_perplexity(tmp_path / 'base') == pytest.approx(np.exp(np.mean([7.4, 7.3, 7.2, 7.1, 7.0])))
