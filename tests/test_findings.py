"""Tests for transformer_jax.tools.significance and transformer_jax.tools.findings: intervals equal to the
textbook's, Holm's step-down order, and verdicts on synthetic tables whose answer is known (a true effect found,
null effects not flagged beyond the family-wise rate, too few seeds never conclusive)."""
import math

import numpy as np
import pytest
import scipy.stats

from transformer_jax.tools import findings
from transformer_jax.tools import significance


def test_welch_matches_scipy_and_the_textbook_interval():
  row, reference = [37.1, 36.4, 37.6], [36.9, 36.6, 37.2, 36.8]
  found = significance.welch(row, reference)
  expected = scipy.stats.ttest_ind(row, reference, equal_var=False)
  assert found.p == pytest.approx(expected.pvalue) and found.t == pytest.approx(expected.statistic)
  a, b = np.var(row, ddof=1) / 3, np.var(reference, ddof=1) / 4
  df = (a + b) ** 2 / (a ** 2 / 2 + b ** 2 / 3)  # Welch-Satterthwaite.
  half = scipy.stats.t.ppf(0.975, df) * math.sqrt(a + b)
  assert found.df == pytest.approx(df) and found.test == 'welch'
  assert (found.low, found.high) == pytest.approx((np.mean(row) - np.mean(reference) - half,
                                                   np.mean(row) - np.mean(reference) + half))
  with pytest.raises(ValueError, match='two values a side'):
    significance.welch([1.0], reference)


def test_pooled_sigma_weights_each_group_by_its_degrees_of_freedom():
  groups = [[1.0, 2.0, 3.0], [10.0, 14.0], [5.0]]  # Variances 1 (2 d.o.f.) and 8 (1 d.o.f.); [5.0] has none.
  sigma, df = significance.pooled_sigma(groups)
  assert df == 3 and sigma == pytest.approx(math.sqrt((1 * 2 + 8 * 1) / 3))
  assert math.isnan(significance.pooled_sigma([[1.0], [2.0]])[0])
  found = significance.with_pooled_sigma([2.0], [1.0, 1.0, 1.0], sigma=0.5, df=24)
  se = 0.5 * math.sqrt(1 + 1 / 3)
  assert found.standard_error == pytest.approx(se) and found.df == 24 and found.test == 'pooled'
  assert found.p == pytest.approx(2 * scipy.stats.t.sf(1.0 / se, 24))


def test_paired_interval_is_the_one_sample_interval_of_the_differences():
  row, reference = [6.1, 6.4, 6.0], [6.3, 6.5, 6.3]  # Differences -0.2, -0.1, -0.3.
  found = significance.paired(row, reference)
  expected = scipy.stats.ttest_rel(row, reference)
  assert found.difference == pytest.approx(-0.2) and found.df == 2
  assert found.p == pytest.approx(expected.pvalue)


def test_holm_steps_down_from_the_smallest_p_and_stops_at_the_first_failure():
  # m = 3: 0.01 <= 0.05/3 is rejected; 0.03 > 0.05/2 fails, so 0.04 is not rejected either, although
  # 0.04 <= 0.05/1 alone would be. Unadjusted, all three pass 0.05.
  rejected, adjusted = significance.holm([0.04, 0.01, 0.03])
  assert rejected == [False, True, False]
  assert adjusted == pytest.approx([0.06, 0.03, 0.06])  # max(3*0.01, 2*0.03, 1*0.04) for the last.
  assert significance.holm([0.001, 0.02, 0.04])[0] == [True, True, True]  # 0.003, 0.04, 0.04.


def test_spearman_interval_contains_rho_and_narrows_with_more_rows():
  rng = np.random.default_rng(0)
  x = rng.normal(size=40)
  rho, p, low, high = significance.spearman(x, x + 0.5 * rng.normal(size=40))
  assert low < rho < high and p < 0.01
  _, _, low_few, high_few = significance.spearman(x[:10], (x + 0.5 * rng.normal(size=40))[:10])
  assert high_few - low_few > high - low
  assert math.isnan(significance.spearman([1, 2], [2, 1])[0])


def _record(row: str, values, metric: str = 'dev_bleu') -> dict:
  return {'row': row, 'seed_ids': list(range(len(values))), f'{metric}_values': list(values),
          metric: float(np.mean(values))}


def _finding(checks, family='paper'):
  return {'finding': 'X', 'section': '§6.2', 'quote': '', 'family': family, 'checks': tuple(checks)}


def test_a_true_effect_over_three_seeds_holds_and_its_reversal_is_named():
  records = [_record('base', [36.9, 36.6, 37.2]), _record('C1', [34.0, 34.4, 33.8]), _record('C5', [38.9, 39.3, 39.0])]
  results = findings.verdicts(records, [_finding([('N=1 is worse', 'C1', ('base',), 'dev_bleu', 'worse'),
                                                  ('bigger is worse', 'C5', ('base',), 'dev_bleu', 'worse')])])
  assert [r['verdict'] for r in results] == ['holds', 'reversed']
  assert '; 2 pass Holm\'s procedure (family-wise 0.05), 2 verdicts are conclusive' in findings.markdown(results)
  assert '; 1 passes Holm\'s procedure (family-wise 0.05), 1 verdict is conclusive' in findings.markdown(results[:1])
  assert results[0]['test'] == 'welch' and results[0]['high'] < 0 and results[0]['p_holm'] <= 0.05
  assert results[0]['paired']['difference'] == pytest.approx(np.mean([34.0, 34.4, 33.8]) - np.mean([36.9, 36.6, 37.2]))


def test_perplexity_checks_read_lower_as_better():
  records = [_record('base', [6.3, 6.4, 6.2], 'dev_perplexity'), _record('C7', [5.6, 5.7, 5.5], 'dev_perplexity')]
  result, = findings.verdicts(records, [_finding([('d_ff=2048 is better', 'C7', ('base',), 'dev_perplexity',
                                                    'better')])])
  assert result['verdict'] == 'holds' and result['t'] > 0 and result['difference'] < 0


def test_a_significant_difference_with_one_seed_is_inconclusive():
  # Pooled sigma from base and A2 (0.3): a one-seed row 3 BLEU lower is far beyond it, but rests on one seed.
  records = [_record('base', [36.9, 36.6, 37.2]), _record('A2', [36.0, 36.3, 36.6]), _record('C1', [33.9])]
  result, = findings.verdicts(records, [_finding([('N=1 is worse', 'C1', ('base',), 'dev_bleu', 'worse')])])
  assert result['test'] == 'pooled' and result['df'] == 4 and result['p_holm'] < 0.05
  assert result['verdict'] == 'inconclusive (holds at 1 vs 3 seeds)'


def test_same_is_equivalent_only_inside_the_margin():
  base = _record('base', [36.90, 36.95, 36.85, 36.92, 36.88])
  close = _record('E', [36.93, 36.86, 36.91, 36.90, 36.89])
  noisy = _record('E', [36.0, 37.8, 36.9])
  check = _finding([('the same BLEU', 'E', ('base',), 'dev_bleu', 'same')])
  assert findings.verdicts([base, close], [check])[0]['verdict'] == 'equivalent'
  result, = findings.verdicts([base, noisy], [check])
  assert result['verdict'] == 'inconclusive' and 'margin' in result['reason']  # Mean equal, interval too wide.
  assert result['margin'] == findings.EQUIVALENCE_MARGINS['dev_bleu']


@pytest.mark.integration  # ~15 s on 2 cores.
def test_null_effects_are_flagged_at_most_at_the_family_wise_rate():
  """400 simulated tables of 20 checks with no true effect (3 seeds a side, noise 0.4 BLEU): the share of
  tables with any conclusive 'holds' or 'reversed' stays at Holm's 5% (here within 3 standard errors); unadjusted,
  it would be 1 - 0.95^20 = 64%."""
  rng = np.random.default_rng(1)
  checks = [(f'row {i} is worse', f'R{i}', ('base',), 'dev_bleu', 'worse') for i in range(20)]
  flagged = 0
  tables = 400
  for _ in range(tables):
    records = [_record('base', rng.normal(36.9, 0.4, 3))]
    records += [_record(f'R{i}', rng.normal(36.9, 0.4, 3)) for i in range(20)]
    results = findings.verdicts(records, [_finding(checks)])
    flagged += any(r['verdict'] in ('holds', 'reversed') for r in results)
  assert flagged / tables <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / tables)


def test_each_family_is_corrected_on_its_own():
  records = [_record('base', [36.9, 36.6, 37.2]), _record('F3', [38.2, 38.0, 38.5])]
  records += [_record(f'R{i}', [36.9, 36.6, 37.2]) for i in range(30)]
  paper = _finding([(f'R{i} differs', f'R{i}', ('base',), 'dev_bleu', 'worse') for i in range(30)])
  variants = _finding([('RoPE is better', 'F3', ('base',), 'dev_bleu', 'better')], family='variants')
  results = findings.verdicts(records, [paper, variants])
  rope = results[-1]
  assert rope['p_holm'] == pytest.approx(rope['p'])  # Alone in its family: not diluted by the paper's 30 checks.
  summary = {s['family']: s for s in findings.family_summary(results)}
  assert summary['paper']['checks'] == 30 and summary['paper']['expected_false_positives_unadjusted'] == 1.5
