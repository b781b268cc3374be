"""Claims tested on a sweep's rows (Table 3's findings, or candidate recipes' gains): a difference, its 95% interval,
a p-value and a Holm verdict each.

A rows file lists FINDINGS, each as checks (claim, row, reference rows, metric, expected) with expected 'better',
'worse', 'same' or 'not worse': configs/table3_multi30k.py the paper's claims (§5.4, §6.2) and the later
variants' (rows F), configs/multi30k_recipes.py each candidate recipe's gain over the main job's. `verdicts`
tests each check on the per-seed values that `transformer_jax.tools.report` collected:

* The difference row - reference (the reference: the best of the check's reference rows by its mean) gets a t
  interval (`significance`): Welch's where both sides have two seeds or more, else one run's standard deviation
  pooled within the rows of the table that have several seeds, with its degrees of freedom. Beside it, where
  both sides share two seeds or more, the seed-paired interval (seed k of both trained on the same data order);
  the verdict uses the first, chosen before looking at the data.
* The p-values of one family (a finding's `family`: 'paper' by default; table3_multi30k's variants are
  'variants', the recipes' candidates 'candidates') are adjusted by Holm's procedure at ALPHA: the chance of
  any false "holds", "reversed" or "differs" in a family is at most 5%.
* 'better' / 'worse': `holds` or `reversed` when Holm rejects "no difference", by the sign; else `inconclusive`.
  'same': `differs` when Holm rejects; `equivalent` when the whole interval lies inside ±margin
  (EQUIVALENCE_MARGINS of the rows file); else `inconclusive`. 'not worse': `reversed` when Holm rejects
  and the row is worse, `holds` when it rejects and the row is better, `no worse` when the interval's worse
  end is inside the margin; else `inconclusive`.
* A conclusive verdict needs MIN_SEEDS seeds on each side; with fewer, the verdict is `inconclusive` and
  its reason says so. Taking the best of several reference rows favours the reference, so a 'worse'
  verdict against it is easier to reach than against one chosen in advance.
"""
import math
from typing import Any, Sequence

import tabulate

from transformer_jax.tools import significance

ALPHA = 0.05  # Family-wise error rate of each family's verdicts (Holm).
MIN_SEEDS = 3  # On each side, for a conclusive verdict.
# Where a rows file defines none: the smallest differences the paper reads as effects in §6.2 (row B2, d_k=32:
# 25.4 BLEU against base's 25.8, perplexity 5.01 against 4.92, +1.8%). Perplexity's margin is relative to the
# reference's mean.
EQUIVALENCE_MARGINS = {'dev_bleu': 0.4, 'dev_perplexity': 0.018}
RELATIVE_MARGINS = ('dev_perplexity',)


def _values(record: dict[str, Any], metric: str) -> list[float]:
  return [v for v in record.get(f'{metric}_values') or () if v is not None]


def pooled(records: Sequence[dict[str, Any]], metric: str) -> tuple[float, int]:
  """One run's standard deviation of `metric`, pooled within the rows that have two seeds or more, and its
  degrees of freedom (`significance.pooled_sigma`)."""
  return significance.pooled_sigma([_values(r, metric) for r in records])


def difference(row: dict[str, Any], reference: dict[str, Any], metric: str,
               sigma: tuple[float, int]) -> significance.Difference | None:
  """row - reference on `metric`: Welch's interval where both have two seeds, else one with the pooled `sigma`
  (sigma, df); None without values or without a noise estimate."""
  a, b = _values(row, metric), _values(reference, metric)
  if not a or not b:
    return None
  if len(a) >= 2 and len(b) >= 2:
    return significance.welch(a, b)
  if sigma[1] < 1:
    return None
  return significance.with_pooled_sigma(a, b, *sigma)


def paired_difference(row: dict[str, Any], reference: dict[str, Any],
                      metric: str) -> significance.Difference | None:
  """The seed-paired interval of row - reference over the seeds both have (two or more), else None."""
  pairs = {}
  for record, side in ((row, 0), (reference, 1)):
    for seed, value in zip(record.get('seed_ids') or (), record.get(f'{metric}_values') or ()):
      if value is not None:
        pairs.setdefault(seed, [None, None])[side] = value
  both = [pair for _, pair in sorted(pairs.items()) if None not in pair]
  if len(both) < 2:
    return None
  return significance.paired([a for a, _ in both], [b for _, b in both])


def _margin(metric: str, reference_value: float, margins: dict[str, float]) -> float:
  margin = margins.get(metric, EQUIVALENCE_MARGINS.get(metric, 0.0))
  return margin * reference_value if metric in RELATIVE_MARGINS else margin


def verdicts(records: Sequence[dict[str, Any]], findings: Sequence[dict[str, Any]],
             margins: dict[str, float] | None = None) -> list[dict[str, Any]]:
  """Tests each check of `findings` on `records` (the report's rows, seeds merged; see the module docstring).

  Args:
    records: rows with '<metric>', '<metric>_values' (per seed) and 'seed_ids'.
    findings: the rows file's FINDINGS; a finding's 'family' (default 'paper') names its Holm family.
    margins: equivalence margins by metric (a fraction of the reference for RELATIVE_MARGINS), default
      EQUIVALENCE_MARGINS.

  Returns:
    One dict per check: finding, section, quote, family, claim, row, reference, metric, expected, value,
    reference_value, seeds, reference_seeds, difference, low, high (the 95% interval), standard_error, df, test,
    t (signed: positive is better), p, p_holm, margin, verdict and reason; beside them, not read by the verdict,
    paired ({difference, low, high, p, df}: seed-paired, or None) and pooled ({low, high, p, df}: the interval
    with the pooled sigma whatever the seeds, a check of Welch's few degrees of freedom).
  """
  margins = margins or EQUIVALENCE_MARGINS
  by_row = {r['row']: r for r in records}
  sigmas = {metric: pooled(records, metric) for metric in ('dev_bleu', 'dev_perplexity')}
  out = []
  for finding in findings:
    for claim, row, references, metric, expected in finding['checks']:
      sign = -1.0 if metric == 'dev_perplexity' else 1.0  # Lower perplexity is better.
      known = [r for r in references if by_row.get(r, {}).get(metric) is not None]
      best = max(known, key=lambda r: sign * by_row[r][metric]) if known else None
      record, reference = by_row.get(row, {}), by_row.get(best, {})
      result = dict(finding=finding['finding'], section=finding['section'], quote=finding['quote'],
                    family=finding.get('family', 'paper'), claim=claim, row=row, reference=best, metric=metric,
                    expected=expected, value=record.get(metric), reference_value=reference.get(metric),
                    seeds=len(_values(record, metric)), reference_seeds=len(_values(reference, metric)),
                    difference=None, low=None, high=None, standard_error=None, df=None, test=None, t=None, p=None,
                    p_holm=None, margin=None, paired=None, pooled=None, verdict='not run',
                    reason='a row has no result')
      found = difference(record, reference, metric, sigmas[metric]) if best else None
      if found is None:
        if result['value'] is not None and best:
          result |= {'verdict': 'inconclusive', 'reason': 'no noise estimate (no row has two seeds)'}
        out.append(result)
        continue
      paired = paired_difference(record, reference, metric)
      a, b = _values(record, metric), _values(reference, metric)
      pooled_found = significance.with_pooled_sigma(a, b, *sigmas[metric]) if sigmas[metric][1] >= 1 else None
      result |= {'difference': found.difference, 'low': found.low, 'high': found.high,
                 'standard_error': found.standard_error, 'df': found.df, 'test': found.test, 't': sign * found.t,
                 'p': found.p, 'margin': _margin(metric, reference[metric], margins),
                 'paired': paired and {'difference': paired.difference, 'low': paired.low, 'high': paired.high,
                                       'p': paired.p, 'df': paired.df},
                 'pooled': pooled_found and {'low': pooled_found.low, 'high': pooled_found.high, 'p': pooled_found.p,
                                             'df': pooled_found.df}}
      out.append(result)
  for family in sorted({r['family'] for r in out}):
    tested = [r for r in out if r['family'] == family and r['p'] is not None]
    rejected, adjusted = significance.holm([r['p'] for r in tested], ALPHA)
    for result, reject, p_holm in zip(tested, rejected, adjusted):
      result['p_holm'] = p_holm
      result['verdict'], result['reason'] = _verdict(result, reject)
  return out


def _verdict(result: dict[str, Any], reject: bool) -> tuple[str, str]:
  """(verdict, reason) of one tested check, given whether Holm rejects "no difference" in its family."""
  better = result['t'] > 0
  worse_end = result['low'] if result['metric'] != 'dev_perplexity' else -result['high']  # Signed: better > 0.
  expected, margin = result['expected'], result['margin']
  if reject:
    conclusion = {'better': 'holds' if better else 'reversed', 'worse': 'reversed' if better else 'holds',
                  'same': 'differs', 'not worse': 'holds' if better else 'reversed'}[expected]
    reason = f'Holm rejects "no difference" at family-wise {ALPHA:g}'
  elif expected == 'same' and -margin < result['low'] and result['high'] < margin:
    conclusion, reason = 'equivalent', f'the 95% interval lies inside ±{margin:.2f}'
  elif expected == 'not worse' and worse_end > -margin:
    conclusion, reason = 'no worse', f'the 95% interval ends less than {margin:.2f} worse'
  else:
    interval = 'the 95% interval includes 0' if result['low'] <= 0 <= result['high'] else (
        f'not significant after Holm (p = {result["p"]:.3f}, adjusted {result["p_holm"]:.3f})')
    if expected in ('same', 'not worse'):
      interval += f' and reaches beyond the margin ±{margin:.2f}'
    return 'inconclusive', interval
  if min(result['seeds'], result['reference_seeds']) < MIN_SEEDS:
    return f'inconclusive ({conclusion} at {result["seeds"]} vs {result["reference_seeds"]} seeds)', (
        f'a verdict needs {MIN_SEEDS} seeds a side')
  return conclusion, reason


def family_summary(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """Per family: the checks tested, the false positives expected at an unadjusted two-sided ALPHA if no effect
  were real (checks x ALPHA), and how many verdicts are conclusive under Holm."""
  out = []
  for family in sorted({r['family'] for r in results}):
    tested = [r for r in results if r['family'] == family and r['p'] is not None]
    out.append({'family': family, 'checks': len(tested), 'expected_false_positives_unadjusted': len(tested) * ALPHA,
                'significant_unadjusted': sum(r['p'] < ALPHA for r in tested),
                'significant_holm': sum(r['p_holm'] <= ALPHA for r in tested),
                'conclusive': sum(not r['verdict'].startswith(('inconclusive', 'not run')) for r in tested)})
  return out


def _number(value: float | None, digits: int = 2) -> str:
  return '–' if value is None or (isinstance(value, float) and math.isnan(value)) else f'{value:.{digits}f}'


def _test(result: dict[str, Any]) -> str:
  if result['test'] is None:
    return '–'
  df = f'{result["df"]:.1f}' if result['test'] == 'welch' else f'{result["df"]:.0f}'
  return f'{result["test"]} (df {df}; {result["seeds"]} vs {result["reference_seeds"]} seeds)'


def markdown(results: Sequence[dict[str, Any]]) -> str:
  """The verdicts as a Markdown table, then a line per family: the checks, the false positives expected at an
  unadjusted 0.05 if no effect were real, and what survives Holm."""
  rows = [[f"{r['finding']} ({r['section']})", r['claim'],
           f"{r['row']} {_number(r['value'])} vs {r['reference'] or '–'} {_number(r['reference_value'])}",
           r['metric'].replace('_', ' '),
           '–' if r['difference'] is None else f"{r['difference']:+.2f} [{r['low']:+.2f}, {r['high']:+.2f}]",
           _test(r), _number(r['p'], 3), _number(r['p_holm'], 3), r['verdict']] for r in results]
  table = tabulate.tabulate(rows, headers=['finding', 'claim', 'figures (mean over seeds)', 'metric',
                                           'difference [95% CI]', 'test', 'p', 'Holm p', 'verdict'],
                            tablefmt='github', disable_numparse=True)
  lines = [f"{s['family']}: {s['checks']} checks; at an unadjusted p < {ALPHA:g}, {s['significant_unadjusted']} "
           f"would pass and {s['expected_false_positives_unadjusted']:.1f} false positives are expected if no "
           f"effect were real; {s['significant_holm']} {'passes' if s['significant_holm'] == 1 else 'pass'} "
           f"Holm's procedure (family-wise {ALPHA:g}), "
           f"{s['conclusive']} {'verdict is' if s['conclusive'] == 1 else 'verdicts are'} conclusive "
           f"({MIN_SEEDS} seeds a side)."
           for s in family_summary(results)]
  return table + '\n\n' + '\n'.join(lines) + '\n'


def _check_key(result: dict[str, Any]) -> tuple[str, str, str, str]:
  return result['finding'], result['claim'], result['row'], result['metric']


def _conclusion(verdict: str | None) -> str | None:
  """A verdict without its note: 'inconclusive (holds at 1 vs 3 seeds)' -> 'inconclusive'."""
  return verdict and verdict.split(' (')[0]


def verdict_changes(earlier: Sequence[dict[str, Any]], results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """Each check of `results` beside its verdict in `earlier`, matched by finding, claim, row and metric.

  Args:
    earlier: an earlier report's 'verdicts' (dicts with finding, claim, row, metric and verdict).
    results: this report's, from `verdicts`.

  Returns:
    One dict per check of `results` in its order, then one per check that only `earlier` has: finding, claim,
    row, metric, before and after (the verdicts; None where a report lacks the check), changed (before !=
    after) and conclusion_changed (the same without the verdicts' notes in parentheses, e.g. 'inconclusive
    (holds at 1 vs 3 seeds)' and 'inconclusive' differ only in their note).
  """
  before = {_check_key(r): r['verdict'] for r in earlier}
  after = {_check_key(r): r['verdict'] for r in results}
  keys = list(after) + [key for key in before if key not in after]
  return [{'finding': key[0], 'claim': key[1], 'row': key[2], 'metric': key[3], 'before': before.get(key),
           'after': after.get(key), 'changed': before.get(key) != after.get(key),
           'conclusion_changed': _conclusion(before.get(key)) != _conclusion(after.get(key))} for key in keys]


def changes_markdown(changes: Sequence[dict[str, Any]], earlier_name: str) -> str:
  """The checks whose verdict changed against `earlier_name` as a Markdown table, after a line counting them."""
  changed = [c for c in changes if c['changed']]
  rows = [[c['finding'], c['claim'], c['row'], c['metric'].replace('_', ' '), c['before'] or '(not checked)',
           c['after'] or '(no longer checked)'] for c in changed]
  table = tabulate.tabulate(rows, headers=['finding', 'claim', 'row', 'metric', f'verdict in {earlier_name}',
                                           'verdict now'], tablefmt='github', disable_numparse=True)
  concluded = sum(c['conclusion_changed'] for c in changed)
  line = (f'{len(changed)} of {len(changes)} verdicts differ from {earlier_name}: {concluded} in their '
          f'conclusion, {len(changed) - concluded} only in the note in parentheses')
  return line + (':\n\n' + table + '\n' if changed else '.\n')


def row_differences(records: Sequence[dict[str, Any]], reference_row: str = 'base') -> None:
  """Sets each record's '<metric>_delta', '_delta_low', '_delta_high' (its difference from `reference_row`
  with the 95% interval of `difference`) for dev perplexity and dev BLEU; None where unknown."""
  reference = next((r for r in records if r['row'] == reference_row), None)
  sigmas = {metric: pooled(records, metric) for metric in ('dev_bleu', 'dev_perplexity')}
  for record in records:
    for metric in ('dev_perplexity', 'dev_bleu'):
      found = None if reference is None or record is reference else difference(
          record, reference, metric, sigmas[metric])
      record[f'{metric}_delta'] = found and found.difference
      record[f'{metric}_delta_low'] = found and found.low
      record[f'{metric}_delta_high'] = found and found.high

