"""§6.1's "chosen after experimentation on the development set": beam size and length penalty, on validation.

  python -m transformer_jax.main --workdir=runs/multi30k --mode=tune_decoding --beam_sizes=4,6 \
      --alphas=0.6,1.0,1.4 [--config.eval.average_last_n=20] [--average_windows=1,5,10,20,10@6000]

Decodes the validation split (data.eval_split) once per (beam size, alpha) pair with the parameters that
eval.checkpoint_selection chooses (averaged once), scores every output with the three BLEUs of `bleu.all_bleu`
and sacreBLEU's length ratio, prints a table and the overrides of the best pair by sacreBLEU, and writes every
row to `<workdir>/evaluations/<time>/decoding_sweep.json`. The test split is never read: constants chosen on
it would overstate its BLEU.

§6.1's averaging is such a constant too ("how many checkpoints, from which steps"): `--average_windows` takes
windows `N` (the last N checkpoints the run kept) or `N@STEP` (the last N up to STEP), and the grid is decoded
once per window, each row naming its window and checkpoint steps. `1` is the newest single checkpoint.
"""
import dataclasses
import json
from typing import Any, Sequence

from absl import logging
from etils import epath
import jax

from transformer_jax import errors
from transformer_jax.data import input_pipeline
from transformer_jax.evaluation import evaluate
from transformer_jax.evaluation import selection
from transformer_jax.run import evaluate as evaluate_mode
from transformer_jax.run import experiment
from transformer_jax.storage import workdir as workdir_lib

SWEEP_FILE = workdir_lib.DECODING_SWEEP


def check_grid(beam_sizes: Sequence[int], alphas: Sequence[float]) -> None:
  """Raises errors.ConfigError (naming the flag) for an empty grid, a beam size below 1 or a negative alpha."""
  if not beam_sizes or not alphas:
    raise errors.ConfigError('--mode=tune_decoding needs at least one --beam_sizes and one --alphas value, e.g. '
                             '--beam_sizes=4,6 --alphas=0.6,1.0')
  if any(b < 1 for b in beam_sizes):
    raise errors.ConfigError(f'--beam_sizes={",".join(map(str, beam_sizes))}: every beam size must be at least 1')
  if any(a < 0 for a in alphas):
    raise errors.ConfigError(f'--alphas={",".join(map(str, alphas))}: every length penalty alpha must be >= 0')


@dataclasses.dataclass(frozen=True)
class Window:
  """The last `count` checkpoints the run kept, up to step `until` (None: the newest), averaged (§6.1)."""
  count: int
  until: int | None = None

  def __str__(self) -> str:
    return str(self.count) if self.until is None else f'{self.count}@{self.until}'

  def steps(self, kept: Sequence[int]) -> list[int]:
    """The window's steps among `kept`.

    Raises:
      errors.ConfigError: if the run kept fewer than `count` checkpoints up to `until`.
    """
    eligible = [step for step in sorted(kept) if self.until is None or step <= self.until]
    if len(eligible) < self.count:
      raise errors.ConfigError(f'--average_windows={self}: the run kept {len(eligible)} checkpoints'
                               f'{"" if self.until is None else f" up to step {self.until}"} ({list(kept)}); keep '
                               'more with train.max_checkpoints_to_keep when training')
    return eligible[-self.count:]


def parse_windows(values: Sequence[str]) -> list[Window]:
  """`--average_windows` values ('N' or 'N@STEP') as Windows.

  Raises:
    errors.ConfigError: naming the flag, for a value that is not N or N@STEP with N >= 1.
  """
  windows = []
  for value in values:
    count, at, until = value.partition('@')
    try:
      window = Window(int(count), int(until) if at else None)
    except ValueError:
      window = None
    if window is None or window.count < 1:
      raise errors.ConfigError(f'--average_windows={",".join(values)}: {value!r} is not N or N@STEP with N >= 1, '
                               'e.g. 10 or 10@6000')
    windows.append(window)
  return windows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
  """The sweep as an aligned text table, one line per (window, beam size, alpha), the best sacreBLEU marked
  '*'."""
  best = max(range(len(rows)), key=lambda i: rows[i]['bleu'])
  lines = ['window  beam  alpha  bleu    lc-tok  tokenized  length ratio  seconds']
  for i, row in enumerate(rows):
    lines.append(f'{row.get("window") or "-":>6}  {row["beam_size"]:>4}  {row["alpha"]:>5.2f}  {row["bleu"]:>5.2f}'
                 f'{"*" if i == best else " "}  {row["lowercased_tokenized_bleu"]:>6.2f}  '
                 f'{row["tokenized_bleu"]:>9.2f}  {row["length_ratio"]:>12.3f}  {row["seconds"]:>7.1f}')
  return '\n'.join(lines)


def tune_decoding(config, workdir: str, beam_sizes: Sequence[int], alphas: Sequence[float],
                  windows: Sequence[Window] = (), output_dir: str | None = None) -> dict[str, Any]:
  """--mode=tune_decoding: validation BLEU for every beam size and alpha (see the module docstring).

  Args:
    config: the run's config (`config_checks.config_for_mode`); decode.extra_length and the eval.* checkpoint
      selection apply to every row.
    workdir: the trained run.
    beam_sizes: beam sizes to try (1: greedy).
    alphas: length penalty exponents to try (`decoding.beam.length_penalty`).
    windows: checkpoint windows to average, each decoded with the whole grid; empty: the parameters
      eval.checkpoint_selection chooses.
    output_dir: the folder for the sweep's record (--output); None: a new `<workdir>/evaluations/<time>/`. Made
      before anything is decoded; the run folder is otherwise only read.

  Returns:
    {'split', 'checkpoint_selection', 'checkpoint_steps', 'rows', 'best'}: rows in grid order (windows, then
    beam sizes, outer), each {'window' (None without windows), 'checkpoint_steps', 'beam_size', 'alpha',
    'bleu', 'tokenized_bleu', 'lowercased_tokenized_bleu', 'length_ratio', 'seconds'}; best is the row of the
    highest sacreBLEU, and 'checkpoint_steps' its steps.

  Raises:
    errors.ConfigError: from `check_grid` (before anything is read), for a window the run's checkpoints cannot
      fill (before anything is decoded), or from `experiment.setup`.
    errors.PathError: when the output folder cannot be created (before anything is decoded).
    FileNotFoundError: from `experiment.setup` or `evaluate.load_params`.
  """
  check_grid(beam_sizes, alphas)
  split_name = config.data.eval_split
  setup = experiment.setup(config, workdir, data_splits=(split_name,))
  try:
    kept = setup.checkpoints.all_steps()
    chosen = [(str(w), w.steps(kept)) for w in windows] or [(None, None)]  # Raises before anything is written.
    if jax.process_index() == 0:
      output_dir = epath.Path(evaluate_mode.new_evaluation_dir(workdir, output_dir))
    split = input_pipeline.encode_split(config.data, setup.tokenizer, split_name)
    rows = []
    for window, steps in chosen:
      if steps is None:
        params, steps = evaluate.load_params(config.eval, setup)
      else:
        params = selection.average_checkpoints(setup.checkpoints, steps, setup.abstract_state().params)
      with setup.mesh_context():
        for beam_size in beam_sizes:
          for alpha in alphas:
            _, scores, seconds = evaluate.translate_split(config, setup, params, split, beam_size=beam_size,
                                                          alpha=alpha)
            rows.append({'window': window, 'checkpoint_steps': list(steps), 'beam_size': int(beam_size),
                         'alpha': float(alpha), 'seconds': seconds} | {key: scores[key] for key in evaluate.SCORES})
            logging.info('%s, checkpoints %s, beam %d, alpha %g: bleu %.2f, lowercased tokenized %.2f, length '
                         'ratio %.3f (%.1f s)', split_name, steps, beam_size, alpha, scores['bleu'],
                         scores['lowercased_tokenized_bleu'], scores['length_ratio'], seconds)
  finally:
    setup.close()
  best = max(rows, key=lambda row: row['bleu'])
  result = {'split': split_name, 'checkpoint_selection': config.eval.checkpoint_selection,
            'checkpoint_steps': best['checkpoint_steps'], 'rows': rows, 'best': best}
  if jax.process_index() == 0:
    (output_dir / SWEEP_FILE).write_text(json.dumps(result, indent=2))
    print(f'{split_name} BLEU' + (f' of checkpoint steps {best["checkpoint_steps"]} '
                                  f'({config.eval.checkpoint_selection})' if not windows else '') + ':')
    print(format_table(rows))
    window = f'--average_windows={best["window"]} (steps {best["checkpoint_steps"]}) ' if windows else ''
    print(f'best by sacreBLEU on {split_name}: {window}--config.decode.beam_size={best["beam_size"]} '
          f'--config.decode.alpha={best["alpha"]:g}  (every row: {output_dir / SWEEP_FILE})')
  return result
