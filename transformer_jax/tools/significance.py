"""Differences between training runs over seeds, with confidence intervals: the statistics of Table 3's verdicts.

A row of Table 3 trained with several seeds gives a few values of a metric (dev perplexity or dev BLEU, one per
seed). Comparing two rows is comparing two small samples, so every difference here comes with a t interval:

* `welch`: both sides have two seeds or more. The difference of the means, its standard error from each side's
  own sample variance, and Welch-Satterthwaite degrees of freedom (no equal-variance assumption).
* `pooled`: a side has one seed, so it has no variance of its own. The standard deviation of one run is then the
  within-row standard deviation pooled over every row that has several seeds (`pooled_sigma`, with
  sum(n_i - 1) degrees of freedom): the training noise is taken to be alike across rows of one table.
* `paired`: both sides trained with the same seeds (seed k of a row and seed k of base share the data order,
  `data.shuffle_seed`); the t interval of the mean of the per-seed differences.

Over a family of checks, `holm` controls the chance of any false claim (Holm, 1979, "A simple sequentially
rejective multiple test procedure"); `spearman` gives a rank correlation with its p-value and a Fisher-z interval.
Everything is plain floats; scipy gives the t and normal quantiles.
"""
import dataclasses
import math
import statistics
from typing import Sequence

import scipy.stats

LEVEL = 0.95  # Of every confidence interval here.


@dataclasses.dataclass(frozen=True)
class Difference:
  """mean(row) - mean(reference) of one metric, with its t interval.

  Attributes:
    difference: the difference of the means, in the metric's unit.
    standard_error: of the difference.
    df: degrees of freedom of the t reference (Welch's is fractional).
    low, high: the LEVEL confidence interval of the difference.
    t: difference / standard_error.
    p: two-sided p-value of "no difference".
    test: 'welch', 'pooled' or 'paired'.
  """
  difference: float
  standard_error: float
  df: float
  low: float
  high: float
  t: float
  p: float
  test: str


def _difference(difference: float, standard_error: float, df: float, test: str,
                level: float = LEVEL) -> Difference:
  half = scipy.stats.t.ppf(0.5 + level / 2, df) * standard_error
  t = difference / standard_error if standard_error > 0 else math.copysign(math.inf, difference or 1.0)
  p = float(2 * scipy.stats.t.sf(abs(t), df)) if standard_error > 0 else float(difference == 0)
  return Difference(difference, standard_error, df, difference - half, difference + half, t, p, test)


def welch(row: Sequence[float], reference: Sequence[float], level: float = LEVEL) -> Difference:
  """Welch's t interval of mean(row) - mean(reference).

  Raises:
    ValueError: if a side has fewer than two values.
  """
  if len(row) < 2 or len(reference) < 2:
    raise ValueError(f"Welch's test needs two values a side, got {len(row)} and {len(reference)}")
  a, b = statistics.variance(row) / len(row), statistics.variance(reference) / len(reference)
  standard_error = math.sqrt(a + b)
  df = (a + b) ** 2 / (a ** 2 / (len(row) - 1) + b ** 2 / (len(reference) - 1)) if a + b > 0 else math.inf
  return _difference(statistics.fmean(row) - statistics.fmean(reference), standard_error, df, 'welch', level)


def pooled_sigma(groups: Sequence[Sequence[float]]) -> tuple[float, int]:
  """The within-group standard deviation pooled over the groups with two values or more, and its degrees of
  freedom, sum(n_i - 1); (nan, 0) where no group has two values."""
  df = sum(len(g) - 1 for g in groups if len(g) >= 2)
  if df == 0:
    return math.nan, 0
  squares = sum(statistics.variance(g) * (len(g) - 1) for g in groups if len(g) >= 2)
  return math.sqrt(squares / df), df


def with_pooled_sigma(row: Sequence[float], reference: Sequence[float], sigma: float, df: int,
                      level: float = LEVEL) -> Difference:
  """The t interval of mean(row) - mean(reference) when one run's standard deviation is `sigma`, estimated
  with `df` degrees of freedom elsewhere (`pooled_sigma`).

  Raises:
    ValueError: for an empty side, or no degrees of freedom.
  """
  if not row or not reference or df < 1:
    raise ValueError(f'needs a value a side and df >= 1, got {len(row)}, {len(reference)} and df={df}')
  standard_error = sigma * math.sqrt(1 / len(row) + 1 / len(reference))
  return _difference(statistics.fmean(row) - statistics.fmean(reference), standard_error, df, 'pooled', level)


def paired(row: Sequence[float], reference: Sequence[float], level: float = LEVEL) -> Difference:
  """The t interval of the mean per-pair difference row[i] - reference[i] (the same seed on both sides).

  Raises:
    ValueError: for sides of different lengths or fewer than two pairs.
  """
  if len(row) != len(reference) or len(row) < 2:
    raise ValueError(f'a paired test needs two pairs or more, got {len(row)} and {len(reference)} values')
  differences = [a - b for a, b in zip(row, reference)]
  standard_error = statistics.stdev(differences) / math.sqrt(len(differences))
  return _difference(statistics.fmean(differences), standard_error, len(differences) - 1, 'paired', level)


def holm(p_values: Sequence[float], alpha: float = 0.05) -> tuple[list[bool], list[float]]:
  """Holm's step-down procedure over one family of tests.

  The smallest p is compared with alpha / m, the next with alpha / (m - 1), ..., stopping at the first that
  fails; the chance of rejecting any true null hypothesis is at most alpha, whatever their dependence.

  Returns:
    (rejected, adjusted p-values), in the order given; adjusted p = max over the earlier steps of
    (m - rank) * p, capped at 1.
  """
  order = sorted(range(len(p_values)), key=lambda i: p_values[i])
  rejected, adjusted = [False] * len(p_values), [1.0] * len(p_values)
  running, still_rejecting = 0.0, True
  for rank, i in enumerate(order):
    running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
    adjusted[i] = running
    still_rejecting = still_rejecting and p_values[i] <= alpha / (len(p_values) - rank)
    rejected[i] = still_rejecting
  return rejected, adjusted


def spearman(x: Sequence[float], y: Sequence[float], level: float = LEVEL) -> tuple[float, float, float, float]:
  """Spearman's rank correlation of x and y: (rho, two-sided p, interval low, interval high).

  The interval is Fisher's z-transform of rho with the standard error 1.06 / sqrt(n - 3) of Fieller, Hartley and
  Pearson (1957); nan for fewer than 4 pairs (the interval) or 3 (everything), or a constant side.
  """
  if len(x) < 3 or len(set(x)) < 2 or len(set(y)) < 2:
    return math.nan, math.nan, math.nan, math.nan
  result = scipy.stats.spearmanr(x, y)
  rho, p = float(result.statistic), float(result.pvalue)
  if len(x) < 4 or abs(rho) == 1.0:
    return rho, p, math.nan, math.nan
  half = scipy.stats.norm.ppf(0.5 + level / 2) * 1.06 / math.sqrt(len(x) - 3)
  return rho, p, math.tanh(math.atanh(rho) - half), math.tanh(math.atanh(rho) + half)
