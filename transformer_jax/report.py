"""Table 3 as a result: reads a sweep's runs (one workdir per row) and writes the paper's table of them.

  python -m transformer_jax.report runs/table3_multi30k --rows=configs/table3_multi30k.py

Every row of the rows file (ROWS, NOTES and PAPER of configs/table3.py or configs/table3_multi30k.py) gets a
line, in the file's order, whatever state its workdir `<DIR>/<row>` is in: `finished` (it holds
`final_metrics.json`, written by the final evaluation), `failed` (`launch/sweep_table3.sh` recorded a non-zero
exit status in `sweep_status.json`), `unfinished` (it exists, but neither), or `not run`. Workdirs under DIR
that name no row are listed after the rows. Numbers come only from what each run wrote (`config.json`,
`final_metrics.json`); nothing is recomputed. Writes `table3.md`, `table3.csv`, `table3.json` and
`table3_perplexity.png` into DIR (or --output_dir) and prints the Markdown.

The paper's figures (newstest2013 perplexity per word piece and BLEU, parameters) stand beside ours; the
Spearman rank correlation of the two perplexity columns, over the rows that have both, closes the table.
"""
import csv
import importlib.util
import io
import json
import math
import os
import pathlib
import sys
from typing import Any, Sequence

from absl import app
from absl import flags
import scipy.stats
import tabulate

from transformer_jax import workdir as workdir_lib

_DEFAULT_ROWS = pathlib.Path(__file__).resolve().parents[1] / 'configs' / 'table3.py'
CONFIG_FILE = workdir_lib.CONFIG
METRICS_FILE = workdir_lib.FINAL_METRICS
SWEEP_STATUS_FILE = 'sweep_status.json'

# (column header, key of a row record).
COLUMNS = (
    ('row', 'row'), ('change', 'change'), ('status', 'status'), ('N', 'num_layers'), ('d_model', 'd_model'),
    ('d_ff', 'd_ff'), ('h', 'num_heads'), ('d_k', 'd_k'), ('d_v', 'd_v'), ('P_drop', 'dropout_rate'),
    ('ε_ls', 'label_smoothing'), ('train steps', 'train_steps'), ('dev PPL', 'dev_perplexity'),
    ('dev BLEU', 'dev_bleu'), ('test BLEU', 'test_bleu'), ('params ×10⁶', 'params_millions'),
    ('train min', 'train_minutes'), ('paper PPL', 'paper_ppl_dev'), ('paper BLEU', 'paper_bleu_dev'),
    ('paper params', 'paper_params_millions'),
)


def load_rows_module(path: str | os.PathLike[str]):
  """Imports a Table 3 rows file (configs/table3*.py) by path; it needs ROWS, NOTES and PAPER.

  Raises:
    FileNotFoundError: if the file does not exist.
    ValueError: if it lacks ROWS, NOTES or PAPER.
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
  return module


def _read_json(path: pathlib.Path) -> dict | None:
  """The JSON object in `path`, or None if it is absent or unreadable (a run killed while writing it)."""
  try:
    return json.loads(path.read_text(encoding='utf-8'))
  except (OSError, ValueError):
    return None


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
      'test_bleu': metrics.get('bleu'),
      'params_millions': None if metrics.get('num_params') is None else metrics['num_params'] / 1e6,
      'train_minutes': None if metrics.get('train_wall_seconds') is None else metrics['train_wall_seconds'] / 60}
  return record


def collect(directory: str | os.PathLike[str], rows_module) -> list[dict[str, Any]]:
  """Records of every row of `rows_module`, in its order, then of any other workdir under `directory`."""
  directory = pathlib.Path(directory)
  records = [run_record(row, directory / row, rows_module.NOTES.get(row, ''), rows_module.PAPER.get(row))
             for row in rows_module.ROWS]
  others = sorted(p.name for p in directory.iterdir() if p.is_dir() and p.name not in rows_module.ROWS) if (
      directory.is_dir()) else []
  return records + [run_record(name, directory / name, '(not a row of the rows file)', None) for name in others]


def rank_correlation(records: Sequence[dict[str, Any]]) -> tuple[float, int]:
  """(Spearman's rho between our and the paper's dev perplexities, number of rows with both); nan if < 3."""
  pairs = [(r['dev_perplexity'], r['paper_ppl_dev']) for r in records
           if r['dev_perplexity'] is not None and r['paper_ppl_dev'] is not None]
  if len(pairs) < 3:
    return math.nan, len(pairs)
  rho = scipy.stats.spearmanr([p[0] for p in pairs], [p[1] for p in pairs]).statistic
  return float(rho), len(pairs)


def _cell(value: Any) -> str:
  if value is None:
    return '–'
  if isinstance(value, float):
    return f'{value:.2f}' if abs(value) < 1000 else f'{value:.0f}'
  return str(value)


def markdown(records: Sequence[dict[str, Any]]) -> str:
  """Table 3's layout as a GitHub Markdown table, then the rank-correlation line."""
  table = tabulate.tabulate([[_cell(r[key]) for _, key in COLUMNS] for r in records],
                            headers=[header for header, _ in COLUMNS], tablefmt='github', disable_numparse=True)
  rho, count = rank_correlation(records)
  return (f'{table}\n\nSpearman rank correlation of dev perplexity with the paper\'s: '
          f'{_cell(rho) if not math.isnan(rho) else "n/a"} over {count} rows.\n')


def to_csv(records: Sequence[dict[str, Any]]) -> str:
  """The report's rows as CSV text, one column per entry of COLUMNS (header first)."""
  out = io.StringIO()
  writer = csv.DictWriter(out, fieldnames=[key for _, key in COLUMNS])
  writer.writeheader()
  writer.writerows(records)
  return out.getvalue()


def plot_perplexity(records: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> None:
  """Bars of our dev perplexity by row (log scale) beside the paper's (its own axis: the corpora differ)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  rows = [r for r in records if r['dev_perplexity'] is not None or r['paper_ppl_dev'] is not None]
  positions = range(len(rows))
  figure, ours_axis = plt.subplots(figsize=(max(6.0, 0.45 * len(rows)), 4.0))
  paper_axis = ours_axis.twinx()
  ours_axis.bar([p - 0.2 for p in positions], [r['dev_perplexity'] or 0.0 for r in rows], width=0.4,
                color='tab:blue', label='ours (left axis)')
  paper_axis.bar([p + 0.2 for p in positions], [r['paper_ppl_dev'] or 0.0 for r in rows], width=0.4,
                 color='tab:orange', label='paper, newstest2013 (right axis)')
  ours_axis.set_xticks(list(positions), [r['row'] for r in rows], rotation=90)
  ours_axis.set_yscale('log')  # A diverged row would flatten every other bar.
  ours_axis.set_ylabel('our dev perplexity (log scale)')
  paper_axis.set_ylabel("paper's dev perplexity")
  figure.legend(loc='upper left')
  figure.tight_layout()
  figure.savefig(path, dpi=120)
  plt.close(figure)


def write_report(directory: str | os.PathLike[str], rows_path: str | os.PathLike[str],
                 output_dir: str | os.PathLike[str] | None = None) -> str:
  """Writes table3.{md,csv,json} and table3_perplexity.png into output_dir (default: directory).

  Returns:
    The Markdown table.

  Raises:
    FileNotFoundError: if `directory` or the rows file does not exist.
  """
  if not pathlib.Path(directory).is_dir():
    raise FileNotFoundError(f'{directory} is not a directory of runs')
  records = collect(directory, load_rows_module(rows_path))
  output = pathlib.Path(output_dir or directory)
  output.mkdir(parents=True, exist_ok=True)
  text = markdown(records)
  rho, count = rank_correlation(records)
  (output / 'table3.md').write_text(text, encoding='utf-8')
  (output / 'table3.csv').write_text(to_csv(records), encoding='utf-8')
  (output / 'table3.json').write_text(json.dumps(
      {'rows': records, 'spearman_dev_perplexity': None if math.isnan(rho) else rho, 'rows_compared': count},
      indent=2, ensure_ascii=False), encoding='utf-8')
  plot_perplexity(records, output / 'table3_perplexity.png')
  return text


_ROWS = flags.DEFINE_string('rows', str(_DEFAULT_ROWS), 'The rows file: configs/table3.py or '
                            'configs/table3_multi30k.py (ROWS, NOTES, PAPER).')
_OUTPUT_DIR = flags.DEFINE_string('output_dir', None, 'Where to write the report files; default: DIR.')


def main(argv: Sequence[str]) -> None:
  """`python -m transformer_jax.report DIR`: writes the report files and prints the Markdown table.

  Raises:
    app.UsageError: unless exactly one DIR is given.
  """
  if len(argv) != 2:
    raise app.UsageError('usage: python -m transformer_jax.report DIR [--rows=FILE] [--output_dir=DIR]')
  print(write_report(argv[1], _ROWS.value, _OUTPUT_DIR.value), end='')


if __name__ == '__main__':
  if {'--help', '-h', '--helpshort'} & set(sys.argv[1:]):  # absl's --help exits with status 1.
    print(__doc__)
    print(flags.FLAGS.module_help(sys.modules[__name__]))
    sys.exit(0)
  app.run(main)
