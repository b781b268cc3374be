"""Table 3 as a result: reads a sweep's runs (one workdir per row) and writes the paper's table of them.

  python -m transformer_jax.report runs/table3_multi30k --rows=configs/table3_multi30k.py

Every row of the rows file (ROWS, NOTES and PAPER of configs/table3.py or configs/table3_multi30k.py) gets a
line, in the file's order, whatever state its workdir `<DIR>/<row>` is in: `finished` (it holds
`final_metrics.json`, written by the final evaluation), `failed` (`launch/sweep_table3.sh` recorded a non-zero
exit status in `sweep_status.json`), `unfinished` (it exists, but neither), or `not run`. Workdirs under DIR
that name no row are listed after the rows. Numbers come only from what each run wrote (`config.json`,
`final_metrics.json`, and the training curve: `curves.json` where `archive` wrote one, else the TensorBoard
events); nothing is recomputed. Writes `table3.md`, `table3.csv`, `table3.json` and `table3.png`
(dev perplexity and BLEU per row) into DIR (or --output_dir) and prints the Markdown. With `--curve=eval/bleu`
(and `--curve_every=1000`) it prints that curve of every run under DIR instead, live or archived (`curve_table`).

Seeds: `<DIR>/<row>.seed<k>` holds the same row trained with another seed (`launch/sweep_table3.sh --seeds`:
train.seed and data.shuffle_seed = k; `<DIR>/<row>` is seed 0). A row with several finished seeds shows their
mean ± sample standard deviation (with the count where a figure exists for fewer of its seeds, e.g. a train
perplexity from runs without a curve), and every row's difference from the reference row (the rows file's
REFERENCE, 'base' where it has none; configs/multi30k_recipes.py compares with 'paper'; `--reference=ROW` picks
another) with its 95% interval (`findings.difference`: Welch's, or one run's standard deviation pooled within the
rows that have seeds). A rows file's FINDINGS are tested by `findings.verdicts` (Holm-adjusted p-values, verdicts
that need three seeds a side); `--compare_to=<earlier table3.json>` lists the verdicts that changed since that
report, e.g. a round of seeds.

The paper's figures (newstest2013 perplexity per word piece and BLEU, parameters) stand beside ours; the
Spearman rank correlations of the perplexity and BLEU columns with the paper's, over the rows that have both,
with their p-values and 95% intervals, close the table.
"""
import csv
import importlib.util
import io
import json
import math
import os
import pathlib
import re
import statistics
import sys
from typing import Any, Sequence

from absl import app
from absl import flags
import scipy.stats
import tabulate

from transformer_jax.storage import workdir as workdir_lib
from transformer_jax.tools import findings as findings_lib
from transformer_jax.tools import significance

_DEFAULT_ROWS = pathlib.Path(__file__).resolve().parents[2] / 'configs' / 'table3.py'
CONFIG_FILE = workdir_lib.CONFIG
METRICS_FILE = workdir_lib.FINAL_METRICS
SWEEP_STATUS_FILE = 'sweep_status.json'
CURVES_FILE = 'curves.json'
# What `archive` keeps of a run: what the report reads, and the curves that show how it got there.
ARCHIVED_FILES = (CONFIG_FILE, METRICS_FILE, SWEEP_STATUS_FILE)
ARCHIVED_CURVES = ('eval/perplexity', 'eval/nll', 'eval/bleu', 'train/nll', 'train/loss')
# And of each `evaluations/<time>/` (a later --mode=evaluate or --mode=tune_decoding): these JSON records.
ARCHIVED_EVALUATION_FILES = (METRICS_FILE, workdir_lib.DECODING_SWEEP)
SEED_SUFFIX = '.seed'  # <row>.seed<k>: the row trained with seed k.
# Figures averaged over a row's seeds; each also gets '<key>_std' (None below two values), '<key>_n' (how many
# seeds have it) and '<key>_values' (per seed, in the order of 'seed_ids').
SEED_METRICS = ('train_perplexity', 'dev_perplexity', 'dev_bleu', 'test_bleu', 'train_tflop')
# Train perplexity: exp of the mean training nll per target token over the last this many progress lines at
# multiples of train.log_every_steps (the steps whose checkpoints are averaged, at the Multi30k table's 100-step
# logging), measured with dropout on. Lines logged by time (train.log_every_secs) or right after a resume cover
# other spans, and how many there are depends on the machine's load: they are left out.
TRAIN_PERPLEXITY_POINTS = 5

# (column header, key of a row record).
COLUMNS = (
    ('row', 'row'), ('change', 'change'), ('status', 'status'), ('N', 'num_layers'), ('d_model', 'd_model'),
    ('d_ff', 'd_ff'), ('h', 'num_heads'), ('d_k', 'd_k'), ('d_v', 'd_v'), ('P_drop', 'dropout_rate'),
    ('ε_ls', 'label_smoothing'), ('peak lr', 'peak_learning_rate'), ('train steps', 'train_steps'), ('seeds', 'seeds'),
    ('train PPL', 'train_perplexity'), ('dev PPL', 'dev_perplexity'),
    ('dev BLEU', 'dev_bleu'), ('test BLEU', 'test_bleu'), ('Δ dev PPL [95% CI]', 'dev_perplexity_delta'),
    ('Δ dev BLEU [95% CI]', 'dev_bleu_delta'), ('params ×10⁶', 'params_millions'),
    ('train TFLOP', 'train_tflop'), ('paper PPL', 'paper_ppl_dev'), ('paper BLEU', 'paper_bleu_dev'),
    ('paper params', 'paper_params_millions'),
)
CSV_KEYS = ([key for _, key in COLUMNS] + [f'{key}_std' for key in SEED_METRICS] + [f'{key}_n' for key in SEED_METRICS]
            + [f'{metric}_delta_{end}' for metric in ('dev_perplexity', 'dev_bleu') for end in ('low', 'high')])


def load_rows_module(path: str | os.PathLike[str]):
  """Imports a Table 3 rows file (configs/table3*.py) by path; it needs ROWS, NOTES and PAPER, and may name
  REFERENCE, the row the others are compared with ('base' where it does not).

  Raises:
    FileNotFoundError: if the file does not exist.
    ValueError: if it lacks ROWS, NOTES or PAPER, or names a REFERENCE that is not one of its ROWS.
  """
  path = pathlib.Path(path).resolve()
  if not path.is_file():
    raise FileNotFoundError(f'--rows: {path} does not exist')
  root = str(path.parents[1])
  if root not in sys.path:
    sys.path.insert(0, root)  # The rows files import `configs.base`.
  spec = importlib.util.spec_from_file_location(f'_rows_{path.stem}', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  missing = [name for name in ('ROWS', 'NOTES', 'PAPER') if not hasattr(module, name)]
  if missing:
    raise ValueError(f'--rows: {path} defines no {", ".join(missing)}')
  if (reference := reference_row(module)) not in module.ROWS:
    raise ValueError(f'--rows: {path}: REFERENCE = {reference!r} is not one of its ROWS '
                     f'({", ".join(module.ROWS)})')
  return module


def _read_json(path: pathlib.Path) -> dict | None:
  """The JSON object in `path`, or None if it is absent or unreadable (a run killed while writing it)."""
  try:
    return json.loads(path.read_text(encoding='utf-8'))
  except (OSError, ValueError):
    return None


def run_curves(workdir: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
  """The run's curves of ARCHIVED_CURVES, {tag: [(training step, value), ...]}, each value in its tag's unit
  ('eval/bleu': validation BLEU 0-100 at eval.bleu_beam_size, every train.eval_bleu_every_steps; 'eval/perplexity';
  'train/nll': nats per target token, ...). Read from its `curves.json` (an archived run), with every tag its
  TensorBoard events hold read from them instead (a live run, or one copied back and trained on); {} without
  either.

  Raises:
    ValueError: naming a `curves.json` that is not {tag: [[step, value], ...]}, or an event file's damaged record.
  """
  path = workdir / CURVES_FILE
  try:
    curves = {tag: [(int(step), float(value)) for step, value in points]
              for tag, points in (_read_json(path) or {}).items()}
  except (AttributeError, TypeError, ValueError) as e:
    raise ValueError(f'{path}: not a curves file ({{tag: [[step, value], ...]}}): {e}') from e
  if any(p.name.startswith('events.out.tfevents.') for p in workdir.iterdir()):
    from transformer_jax.tools import inspection  # pylint: disable=g-import-not-at-top  (JAX: only for live runs)
    scalars = inspection.read_scalars(workdir)
    curves |= {tag: [(int(step), float(value)) for step, value in zip(*scalars[tag])]
               for tag in ARCHIVED_CURVES if tag in scalars}
  return curves


def curve_table(directory: str | os.PathLike[str], tag: str, every: int = 0) -> str:
  """A Markdown table of one curve (a tag of ARCHIVED_CURVES) for every run under `directory` that has it: a line
  per run (its workdir's name), a column per step of any run (only multiples of `every` when it is positive; '–'
  where a run has no value), values to 2 decimals.

  Raises:
    FileNotFoundError: if `directory` is not a directory.
    ValueError: for a negative `every`, if no run under it has the curve `tag`, or none has it at a multiple of
      `every`; and as `run_curves`.
  """
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    raise FileNotFoundError(f'{directory} is not a directory of runs')
  if every < 0:
    raise ValueError(f'--curve_every={every}: a number of steps, 0 for every step')
  found = {run.name: run_curves(run).get(tag, []) for run in sorted(p for p in directory.iterdir() if p.is_dir())}
  if not any(found.values()):
    raise ValueError(f'{directory}: no run has the curve {tag!r} (tags: {", ".join(ARCHIVED_CURVES)})')
  curves = {name: kept for name, points in found.items()
            if (kept := {step: value for step, value in points if every == 0 or step % every == 0})}
  if not curves:
    raise ValueError(f'{directory}: no run has the curve {tag!r} at a multiple of --curve_every={every}')
  steps = sorted(set().union(*curves.values()))
  rows = [[name] + [f'{points[step]:.2f}' if step in points else '–' for step in steps]
          for name, points in curves.items()]
  return tabulate.tabulate(rows, headers=[f'{tag} at step'] + [f'{step:,}' for step in steps], tablefmt='github',
                           disable_numparse=True) + '\n'


def train_perplexity(workdir: pathlib.Path) -> float | None:
  """exp(mean 'train/nll') over the run's last TRAIN_PERPLEXITY_POINTS progress lines at multiples of its
  train.log_every_steps (every line when its config does not say), or None without a curve.

  Read from the run's TensorBoard events, or else its `curves.json` (an archived run). It is measured on training
  batches with dropout on, so it sits above what the same parameters score without dropout: compare it across
  rows of one dropout rate, or its gap to dev perplexity, not its level with dev perplexity's (§5.4, over-fitting
  shows as a train perplexity that falls while dev perplexity does not).
  """
  points = run_curves(workdir).get('train/nll', [])
  every = ((_read_json(workdir / CONFIG_FILE) or {}).get('train') or {}).get('log_every_steps')
  if isinstance(every, int) and every > 0:
    points = [(step, value) for step, value in points if step % every == 0]
  tail = [value for _, value in points[-TRAIN_PERPLEXITY_POINTS:]]
  return math.exp(statistics.fmean(tail)) if tail else None


def run_record(row: str, workdir: pathlib.Path, note: str, paper: dict | None) -> dict[str, Any]:
  """One line of the table from what the run in `workdir` wrote (see the module docstring).

  Returns:
    A dict with the keys of COLUMNS; None where a figure is unknown.
  """
  record: dict[str, Any] = {key: None for _, key in COLUMNS} | {'row': row, 'change': note}
  paper = paper or {}
  record |= {'paper_ppl_dev': paper.get('ppl_dev'), 'paper_bleu_dev': paper.get('bleu_dev'),
             'paper_params_millions': paper.get('params_millions')}
  if not workdir.is_dir():
    return record | {'status': 'not run'}
  config = _read_json(workdir / CONFIG_FILE) or {}
  model, train = config.get('model', {}), config.get('train', {})
  for key in ('num_layers', 'd_model', 'd_ff', 'num_heads', 'd_k', 'd_v', 'dropout_rate'):
    record[key] = model.get(key)
  record['label_smoothing'] = train.get('label_smoothing')
  if model.get('d_model') and train.get('warmup_steps'):  # §5.3's peak: scale * d_model^-0.5 * warmup^-0.5.
    record['peak_learning_rate'] = (train.get('learning_rate_scale', 1.0) * model['d_model'] ** -0.5
                                    * train['warmup_steps'] ** -0.5)
  metrics = _read_json(workdir / METRICS_FILE)
  sweep = _read_json(workdir / SWEEP_STATUS_FILE) or {}
  if metrics is None:  # Unfinished or failed: the steps trained so far (the newest checkpoint), not the goal.
    failed = sweep.get('exit_status', 0) != 0
    checkpoints = workdir / 'checkpoints'
    trained = [int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()] if checkpoints.is_dir() else []
    return record | {'status': f'failed (exit {sweep["exit_status"]})' if failed else 'unfinished',
                     'train_steps': max(trained, default=0)}
  steps = metrics.get('checkpoint_steps') or [None]
  record |= {
      'status': 'finished', 'train_steps': metrics.get('train_steps', steps[-1]),
      'dev_perplexity': metrics.get('perplexity'), 'dev_bleu': metrics.get('validation_bleu'),
      'test_bleu': metrics.get('bleu'), 'train_perplexity': train_perplexity(workdir),
      'params_millions': None if metrics.get('num_params') is None else metrics['num_params'] / 1e6,
      'train_tflop': train_tflop(metrics)}
  return record


def train_tflop(metrics: dict[str, Any]) -> float | None:
  """The model FLOPs of a run's training, in TFLOP, from its final_metrics.json.

  MFU x seconds of training steps x peak is the FLOP count of the steps the last invocation trained
  (`flops.train_step_flops` over its batches) whatever the seconds were: time paused or beside other work does not
  change it, where wall time would. Records with `first_step` (the step that invocation resumed from) are scaled to
  the whole run; older ones count only the last invocation's steps (a lower bound, which `merge_seeds` resolves
  by taking a row's largest). None when the last invocation trained no step (mfu 0).
  """
  mfu, seconds, peak = (metrics.get(key) for key in ('mfu', 'train_steps_seconds', 'peak_flops'))
  if not mfu or not seconds or not peak:
    return None
  trained, first = metrics.get('train_steps'), metrics.get('first_step')
  scale = trained / (trained - first) if trained and first is not None and trained > first else 1.0
  return mfu * seconds * peak / 1e12 * scale


def seed_of(name: str, row: str) -> int | None:
  """The seed of workdir `name` for `row` (0 for `<row>`, k > 0 for `<row>.seed<k>`, written without leading
  zeros as the sweep writes it), or None if not that row's."""
  if name == row:
    return 0
  match = re.fullmatch(re.escape(row + SEED_SUFFIX) + r'([1-9]\d*)', name)
  return int(match[1]) if match else None


def merge_seeds(records: Sequence[dict[str, Any]], seeds: Sequence[int] | None = None) -> dict[str, Any]:
  """One line for a row from its seeds' records (seed 0 first; `seeds` their seed numbers, default 0, 1, ...):
  SEED_METRICS averaged over the finished seeds that have them, with '<key>_std' (sample standard deviation,
  None below two values), '<key>_n' and '<key>_values' (per finished seed, None where a seed lacks the figure);
  'seeds' counts the finished seeds and 'seed_ids' names them.
  """
  seeds = list(seeds) if seeds is not None else list(range(len(records)))
  finished = [(seed, r) for seed, r in zip(seeds, records) if r['status'] == 'finished']
  merged = dict(finished[0][1] if finished else records[0])
  merged['seeds'], merged['seed_ids'] = len(finished), [seed for seed, _ in finished]
  for key in SEED_METRICS:
    merged[f'{key}_values'] = [r[key] for _, r in finished]
    values = [r[key] for _, r in finished if r[key] is not None]
    merged[key] = statistics.fmean(values) if values else merged[key]
    merged[f'{key}_std'] = statistics.stdev(values) if len(values) >= 2 else None
    merged[f'{key}_n'] = len(values)
  if merged['train_tflop_n']:  # One seed's cost, not a mean: seeds of a row train the same FLOPs (`train_tflop`).
    merged.update(train_tflop=max(merged['train_tflop_values'], key=lambda v: v or 0.0), train_tflop_std=None,
                  train_tflop_n=1)
  if finished and len(finished) < len(records):
    merged['status'] = f'finished {len(finished)} of {len(records)} seeds'
  return merged


def collect(directory: str | os.PathLike[str], rows_module, reference: str | None = None) -> list[dict[str, Any]]:
  """Records of every row of `rows_module`, in its order (seeds merged), then of any other workdir under
  `directory`; each row's difference is from `reference` (default: `reference_row(rows_module)`)."""
  directory = pathlib.Path(directory)
  names = sorted(p.name for p in directory.iterdir() if p.is_dir()) if directory.is_dir() else []
  records, claimed = [], set()
  for row in rows_module.ROWS:
    seeds = sorted((seed, name) for name in names if (seed := seed_of(name, row)) is not None)
    claimed |= {name for _, name in seeds}
    workdirs = [directory / name for _, name in seeds] or [directory / row]
    records.append(merge_seeds([run_record(row, workdir, rows_module.NOTES.get(row, ''),
                                           rows_module.PAPER.get(row)) for workdir in workdirs],
                               [seed for seed, _ in seeds] or [0]))
  records += [merge_seeds([run_record(name, directory / name, '(not a row of the rows file)', None)])
              for name in names if name not in claimed]
  findings_lib.row_differences(records, reference_row(rows_module) if reference is None else reference)
  return records


def reference_row(rows_module) -> str:
  """Returns the name of the row every other row is compared with: the rows file's REFERENCE, or 'base'."""
  return getattr(rows_module, 'REFERENCE', 'base')


def rank_correlation(records: Sequence[dict[str, Any]], ours: str = 'dev_perplexity',
                     paper: str = 'paper_ppl_dev') -> tuple[float, int, float, float, float]:
  """Spearman's rho between our and the paper's column: (rho, rows with both, two-sided p, 95% interval low,
  high; `significance.spearman`); nan where undefined (fewer than 3 rows, a constant column).

  The default compares dev perplexities; `ours='dev_bleu', paper='paper_bleu_dev'` compares BLEUs.
  """
  pairs = [(r[ours], r[paper]) for r in records if r[ours] is not None and r[paper] is not None]
  rho, p, low, high = significance.spearman([p[0] for p in pairs], [p[1] for p in pairs])
  return rho, len(pairs), p, low, high


def _cell(value: Any, std: float | None = None, count: int | None = None, seeds: int | None = None) -> str:
  if value is None:
    return '–'
  if isinstance(value, float):
    text = f'{value:.2f}' if 0.01 <= abs(value) < 1000 or value == 0 else f'{value:.3g}'
    text = text if std is None else f'{text} ± {std:.2f}'
    return text if count is None or count == seeds or count < 2 else f'{text} ({count} seeds)'
  return str(value)


def _record_cell(record: dict[str, Any], key: str) -> str:
  if key.endswith('_delta'):
    value = record.get(key)
    return '–' if value is None else f'{value:+.2f} [{record[key + "_low"]:+.2f}, {record[key + "_high"]:+.2f}]'
  return _cell(record[key], record.get(f'{key}_std'), record.get(f'{key}_n'), record.get('seeds'))


def _correlation_line(records: Sequence[dict[str, Any]], what: str, ours: str, paper: str) -> str:
  rho, count, p, low, high = rank_correlation(records, ours, paper)
  if math.isnan(rho):
    return f"Spearman rank correlation of {what} with the paper's: n/a over {count} rows."
  interval = '' if math.isnan(low) else f', 95% interval [{low:.2f}, {high:.2f}]'
  return f"Spearman rank correlation of {what} with the paper's: {rho:.2f} over {count} rows (p = {p:.3f}{interval})."


def markdown(records: Sequence[dict[str, Any]], reference: str = 'base') -> str:
  """Table 3's layout as a GitHub Markdown table (means ± standard deviations over seeds; each row's difference
  from the `reference` row, the rows file's `reference_row` or `--reference`, with its 95% interval), then the
  rank-correlation lines."""
  table = tabulate.tabulate([[_record_cell(r, key) for _, key in COLUMNS] for r in records],
                            headers=[header for header, _ in COLUMNS], tablefmt='github', disable_numparse=True)
  return (f'{table}\n\nΔ: the row minus {reference}, with the 95% interval of the difference.\n'
          f'{_correlation_line(records, "dev perplexity", "dev_perplexity", "paper_ppl_dev")}\n'
          f'{_correlation_line(records, "dev BLEU", "dev_bleu", "paper_bleu_dev")}\n')


def to_csv(records: Sequence[dict[str, Any]]) -> str:
  """The report's rows as CSV text: one column per entry of COLUMNS, then the standard deviations."""
  out = io.StringIO()
  writer = csv.DictWriter(out, fieldnames=CSV_KEYS, extrasaction='ignore')
  writer.writeheader()
  writer.writerows(records)
  return out.getvalue()


def plot_rows(records: Sequence[dict[str, Any]], path: str | os.PathLike[str], reference: str = 'base') -> None:
  """Two panels by row on one axis each: dev perplexity and dev BLEU, ours and the paper's each divided by its own
  reference row's (`reference`: base in Table 3; the corpora differ, so levels do not compare; relative changes
  do), called base below. Ours are means with error bars of one standard deviation over seeds; the shaded band
  is base's ± the half-width of the 95% interval of a one-seed row's difference from it (one run's standard
  deviation pooled within the rows that have seeds, `findings.pooled`), so a one-seed row inside it does not
  differ from base at the 5% level (before any correction for the many rows). Without a base row (ours or the
  paper's) that side is not drawn."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  rows = [r for r in records if r['dev_perplexity'] is not None or r['paper_ppl_dev'] is not None]
  positions = list(range(len(rows)))
  base = next((r for r in rows if r['row'] == reference), None)
  figure, axes = plt.subplots(2, 1, figsize=(max(6.0, 0.45 * len(rows)), 7.0), sharex=True)
  panels = (('dev_perplexity', 'paper_ppl_dev', 'dev perplexity'), ('dev_bleu', 'paper_bleu_dev', 'dev BLEU'))
  for axis, (ours, paper, label) in zip(axes, panels):
    ours_base = base[ours] if base is not None else None
    if ours_base:
      done = [(p, r) for p, r in zip(positions, rows) if r[ours] is not None]
      axis.errorbar([p for p, _ in done], [r[ours] / ours_base for _, r in done],
                    yerr=[(r.get(f'{ours}_std') or 0.0) / ours_base for _, r in done], fmt='o', capsize=3,
                    color='tab:blue', label='ours (Multi30k val), ± std over seeds')
      sigma, df = findings_lib.pooled(records, ours)
      if df >= 1:
        half = scipy.stats.t.ppf(0.975, df) * sigma * math.sqrt(1 + 1 / max(base.get(f'{ours}_n') or 1, 1))
        axis.axhspan(1 - half / ours_base, 1 + half / ours_base, color='tab:blue', alpha=0.12,
                     label=f"our {reference} row ± 95% interval of a one-seed row's difference")
    paper_base = base[paper] if base is not None else None
    if paper_base:
      known = [(p, r) for p, r in zip(positions, rows) if r[paper] is not None]
      axis.plot([p for p, _ in known], [r[paper] / paper_base for _, r in known], 'D', color='tab:orange',
                label='paper (newstest2013)')
    axis.axhline(1.0, color='grey', linewidth=0.8)
    axis.set_ylabel(f"{label} / {reference}'s")
    if axis is axes[0]:
      axis.legend(loc='lower left', bbox_to_anchor=(0.0, 1.02), ncol=2, fontsize='small', frameon=False)
  axes[1].set_xticks(positions, [r['row'] for r in rows], rotation=90)
  figure.tight_layout()
  figure.savefig(path, dpi=120, bbox_inches='tight')
  plt.close(figure)


def write_report(directory: str | os.PathLike[str], rows_path: str | os.PathLike[str],
                 output_dir: str | os.PathLike[str] | None = None,
                 compare_to: str | os.PathLike[str] | None = None,
                 archive_dir: str | os.PathLike[str] | None = None, reference: str | None = None) -> str:
  """Writes table3.{md,csv,json,png} into output_dir (default: directory).

  Args:
    directory: the runs (a sweep's directory, or an archive of one).
    rows_path: the rows file (ROWS, NOTES, PAPER; optionally FINDINGS, EQUIVALENCE_MARGINS, REFERENCE).
    output_dir: where to write; default `directory`.
    compare_to: an earlier report's table3.json: the verdicts that differ from its are listed after the
      verdicts (`findings.verdict_changes`), and table3.json keeps them under 'changes'.
    archive_dir: also `archive` the finished runs there, before the report is written.
    reference: the row the Δ columns (table3.md, the '_delta' fields of table3.csv and table3.json, which
      records it under 'reference') and the plot compare every row with, one of the rows file's ROWS; default
      its REFERENCE (`reference_row`). The findings keep the references they name.

  Returns:
    The Markdown table.

  Raises:
    What `check_inputs` raises, before anything is written; what `archive` raises, before the report is.
  """
  rows_module, earlier = check_inputs(directory, rows_path, compare_to, reference)
  if archive_dir is not None:
    archive(directory, archive_dir)
  reference = reference_row(rows_module) if reference is None else reference
  records = collect(directory, rows_module, reference)
  output = pathlib.Path(output_dir or directory)
  output.mkdir(parents=True, exist_ok=True)
  text = markdown(records, reference)
  results = findings_lib.verdicts(records, getattr(rows_module, 'FINDINGS', ()),
                                  getattr(rows_module, 'EQUIVALENCE_MARGINS', None))
  if results:
    text += ('\nThe findings, tested (each by its source: a section of the paper, or the paper a variant comes from; '
             'the difference is row minus reference with its 95% interval; p two-sided; Holm p adjusted within '
             'its family; transformer_jax.tools.findings):\n\n'
             f'{findings_lib.markdown(results)}')
  changes = None
  if earlier is not None:
    changes = findings_lib.verdict_changes(earlier, results)
    text += '\n' + findings_lib.changes_markdown(changes, str(compare_to))
  nan_to_none = lambda x: None if isinstance(x, float) and math.isnan(x) else x
  correlations = {}
  for name, ours, paper in (('dev_perplexity', 'dev_perplexity', 'paper_ppl_dev'),
                            ('dev_bleu', 'dev_bleu', 'paper_bleu_dev')):
    rho, count, p, low, high = rank_correlation(records, ours, paper)
    correlations[name] = {'spearman': nan_to_none(rho), 'rows': count, 'p': nan_to_none(p),
                          'low': nan_to_none(low), 'high': nan_to_none(high)}
  (output / 'table3.md').write_text(text, encoding='utf-8')
  (output / 'table3.csv').write_text(to_csv(records), encoding='utf-8')
  (output / 'table3.json').write_text(json.dumps(
      {'reference': reference, 'rows': records, 'verdicts': results, 'families': findings_lib.family_summary(results),
       'rank_correlations': correlations,
       **({'changes': changes} if changes is not None else {})}, indent=2, ensure_ascii=False), encoding='utf-8')
  plot_rows(records, output / 'table3.png', reference)
  return text


def check_inputs(directory: str | os.PathLike[str], rows_path: str | os.PathLike[str],
                 compare_to: str | os.PathLike[str] | None = None,
                 reference: str | None = None) -> tuple[Any, list[dict[str, Any]] | None]:
  """Checks a report's inputs, before anything is written: the runs' directory, the rows file, the reference
  row, and the earlier report that `compare_to` names.

  Returns:
    The rows module, and the earlier report's verdicts (None without `compare_to`).

  Raises:
    FileNotFoundError: if `directory` is not a directory, or the rows file does not exist.
    OSError: if `compare_to` cannot be read (missing, a directory).
    ValueError: what `load_rows_module` refuses; for a `reference` that is not a row of the rows file; for a
      `compare_to` that is not a table3.json with verdicts (each naming the file), or `compare_to` with a rows
      file without FINDINGS.
  """
  if not pathlib.Path(directory).is_dir():
    raise FileNotFoundError(f'{directory} is not a directory of runs')
  rows_module = load_rows_module(rows_path)
  if reference is not None and reference not in rows_module.ROWS:
    raise ValueError(f'--reference: {reference!r} is not one of the ROWS of {rows_path} '
                     f'({", ".join(rows_module.ROWS)})')
  if compare_to is None:
    return rows_module, None
  if not getattr(rows_module, 'FINDINGS', ()):
    raise ValueError(f'--compare_to: {rows_path} has no FINDINGS, so there are no verdicts to compare')
  try:
    written = json.loads(pathlib.Path(compare_to).read_text(encoding='utf-8'))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f'--compare_to: {compare_to} is not JSON ({e}); it takes a table3.json a report wrote') from e
  verdicts = written.get('verdicts') if isinstance(written, dict) else None
  keys = {'finding', 'claim', 'row', 'metric', 'verdict'}
  if not verdicts or not isinstance(verdicts, list) or not all(
      isinstance(v, dict) and keys <= v.keys() for v in verdicts):
    raise ValueError(f"--compare_to: {compare_to} has no verdicts (a non-empty list under 'verdicts', each with "
                     f'{", ".join(sorted(keys))}); it takes a table3.json a report wrote from a rows file with '
                     'FINDINGS')
  return rows_module, verdicts


def archive(directory: str | os.PathLike[str], archive_dir: str | os.PathLike[str]) -> list[str]:
  """Copies each finished run's record under `directory` into `archive_dir/<run>/`: the files the report reads,
  a `curves.json` ({tag: [[step, value], ...]}) of its TensorBoard curves, and the JSON records of its later
  evaluations and decoding sweeps (`evaluations/<time>/`), kilobytes per run instead of its checkpoints. A report
  of `archive_dir` gives the same lines for those runs; copied back into a sweep's directory, they are skipped
  (`launch/sweep_table3.sh` resumes from `final_metrics.json`), and archived again they keep their `curves.json`
  (they have no events to read it from). Unfinished runs are left out: without
  their checkpoints they could not resume. Every run must have its curves: a figure the report or its doc quotes
  (train perplexity, a curve's shape) has to be recomputable from the archive.

  Returns:
    The names of the runs archived (those with a final_metrics.json).

  Raises:
    ValueError: naming every finished run without a training curve ('train/nll') or a validation curve
      ('eval/perplexity'); nothing is written then.
  """
  runs = {run: run_curves(run) for run in sorted(p for p in pathlib.Path(directory).iterdir()
                                                 if (p / METRICS_FILE).is_file())}
  empty = [run.name for run, curves in runs.items() if not curves.get('train/nll') or not curves.get('eval/perplexity')]
  if empty:
    raise ValueError(f'{directory}: no training or validation curve (TensorBoard events or {CURVES_FILE}) in '
                     f'{", ".join(empty)}; nothing archived: retrain these runs, or move them out of {directory}')
  for run, curves in runs.items():
    target = pathlib.Path(archive_dir) / run.name
    target.mkdir(parents=True, exist_ok=True)
    kept = [pathlib.Path(name) for name in ARCHIVED_FILES] + [
        evaluation.relative_to(run) / name for evaluation in sorted((run / workdir_lib.EVALUATIONS).glob('*/'))
        for name in ARCHIVED_EVALUATION_FILES]
    for name in kept:
      if (run / name).is_file():
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        (target / name).write_bytes((run / name).read_bytes())
    (target / CURVES_FILE).write_text(json.dumps(curves), encoding='utf-8')
  return [run.name for run in runs]


_ROWS = flags.DEFINE_string('rows', str(_DEFAULT_ROWS), 'The rows file: configs/table3.py or '
                            'configs/table3_multi30k.py (ROWS, NOTES, PAPER).')
_OUTPUT_DIR = flags.DEFINE_string('output_dir', None, 'Where to write the report files; default: DIR.')
_ARCHIVE = flags.DEFINE_string('archive', None, "Also copy every run's record (config, final metrics, curves; no "
                               'checkpoints) into this folder, e.g. to commit a sweep in progress (`archive`).')
_CURVE = flags.DEFINE_string('curve', None, 'Instead of the report, print this curve of every run under DIR as a '
                             "table (`curve_table`), e.g. 'eval/bleu' (validation BLEU at eval.bleu_beam_size: "
                             "greedy in the Multi30k configs) or 'eval/perplexity'.")
_CURVE_EVERY = flags.DEFINE_integer('curve_every', 0, "With --curve: only the steps that are multiples of this.")
_COMPARE_TO = flags.DEFINE_string('compare_to', None, "An earlier report's table3.json: list the verdicts that "
                                  'differ from it after the verdicts (e.g. a round of seeds against the last).')
_REFERENCE = flags.DEFINE_string('reference', None, "The row (one of --rows' ROWS) that the Δ columns, their "
                                 "'_delta' fields in table3.csv and table3.json, and the plot compare every row "
                                 "with, instead of the rows file's REFERENCE; the findings keep theirs.")


def main(argv: Sequence[str]) -> None:
  """`python -m transformer_jax.report DIR`: writes the report files and prints the Markdown table (with --curve,
  prints that curve of every run instead and writes nothing).

  Raises:
    app.UsageError: unless exactly one DIR is given; for --curve_every without --curve, or --curve with
      --archive, --output_dir, --compare_to or --reference; and for what `write_report` or `curve_table` refuses.
  """
  if len(argv) != 2:
    raise app.UsageError('usage: python -m transformer_jax.report DIR [--rows=FILE] [--output_dir=DIR] '
                         '[--archive=DIR] [--compare_to=JSON] [--reference=ROW] [--curve=TAG [--curve_every=STEPS]]')
  if not _CURVE.value and _CURVE_EVERY.value:
    raise app.UsageError('--curve_every needs --curve')
  if _CURVE.value and (_ARCHIVE.value or _OUTPUT_DIR.value or _COMPARE_TO.value or _REFERENCE.value):
    raise app.UsageError('--curve prints a table and writes nothing: leave out --archive, --output_dir, '
                         '--compare_to and --reference')
  if _CURVE.value:
    try:
      print(curve_table(argv[1], _CURVE.value, _CURVE_EVERY.value), end='')
    except (OSError, ValueError) as e:
      raise app.UsageError(str(e)) from e
    return
  try:
    print(write_report(argv[1], _ROWS.value, output_dir=_OUTPUT_DIR.value, compare_to=_COMPARE_TO.value,
                       archive_dir=_ARCHIVE.value, reference=_REFERENCE.value), end='')
  except (OSError, ValueError) as e:
    raise app.UsageError(str(e)) from e


if __name__ == '__main__':
  if {'--help', '-h', '--helpshort'} & set(sys.argv[1:]):  # absl's --help exits with status 1.
    print(__doc__)
    print(flags.FLAGS.module_help(sys.modules[__name__]))
    sys.exit(0)
  app.run(main)
