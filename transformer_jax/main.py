"""Command line: train, evaluate, translate, summarise or benchmark a Transformer, or list its config.

  python -m transformer_jax.main --config=configs/base.py --workdir=runs/base [--config.train.warmup_steps=8000]
  python -m transformer_jax.main --workdir=runs/base --mode=evaluate [--config.decode.beam_size=5]
  python -m transformer_jax.main --workdir=runs/base --mode=translate --input=en.txt --output=de.txt
  python -m transformer_jax.main --workdir=runs/base --mode=tune_decoding --beam_sizes=4,6 --alphas=0.6,1.0
  python -m transformer_jax.main --config=configs/table3.py:B1 --mode=summary
  python -m transformer_jax.main --config=configs/multi30k.py --mode=config   # Every field, default, meaning.
  python -m transformer_jax.main --config=configs/big.py --mode=compile --config.compile.topology=v5e-8

--config may be left out when --workdir holds a run: its config.json is the config then. --mode=evaluate,
--mode=translate and --mode=tune_decoding always start from the run's config.json; the command line may change
only decoding and evaluation fields (`config_checks.config_for_mode`). Config files load from any working directory.
"""
import os
import pathlib
import re
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # TensorFlow (tf.data, TFDS) is chatty on import.
# TensorFlow only reads data here: its oneDNN kernels (and their start-up notice) are of no use.
os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')

from transformer_jax.cpu import host_allocator  # pylint: disable=g-import-not-at-top,wrong-import-position

# Before JAX starts: runs the command under tcmalloc where it is installed (re-executing it), else tunes
# glibc's malloc; a quarter of a CPU train step went to page faults without (host_allocator).
if __name__ == '__main__':
  try:
    host_allocator.use_fast_allocator()
  except (ValueError, FileNotFoundError) as e:  # A bad TRANSFORMER_JAX_ALLOCATOR: one line, exit status 1.
    sys.exit(str(e))

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from transformer_jax import errors
from transformer_jax import logs


MODES = ('train', 'evaluate', 'translate', 'tune_decoding', 'summary', 'benchmark', 'compile', 'config',
         'export')

config_flags.DEFINE_config_file('config', None, 'Configuration file (configs/*.py[:argument]); default: the '
                                '<workdir>/config.json of an existing run. --mode=config lists every field.',
                                lock_config=True)
flags.DEFINE_string('workdir', None, 'Directory for the vocabulary, checkpoints, TensorBoard events and outputs.')
flags.DEFINE_enum('mode', 'train', MODES, 'What to do (config: print every config field, its value, default '
                  'and meaning, and exit).')
flags.DEFINE_string('input', None, 'translate mode: input file, one sentence per line (stdin if omitted).')
flags.DEFINE_string('output', None, 'translate mode: output file (stdout if omitted); export mode: the new '
                    'folder of the CTranslate2 model; evaluate and tune_decoding modes: a new folder for their '
                    'outputs (default: <workdir>/evaluations/<time>; with --output the run is only read).')
flags.DEFINE_list('beam_sizes', ['4'], 'tune_decoding mode: beam sizes to decode the validation split with.')
flags.DEFINE_list('alphas', ['0.6', '0.8', '1.0', '1.2'], 'tune_decoding mode: length penalty exponents to try.')
flags.DEFINE_list('average_windows', [], "tune_decoding mode: checkpoint windows to average (§6.1), each 'N' (the "
                  "last N kept) or 'N@STEP' (the last N up to STEP); default: eval.checkpoint_selection's.")
flags.DEFINE_boolean('multihost', None, 'Join the other processes through jax.distributed.initialize() before any '
                     'JAX use. Unset: only when a multi-process launcher is detected (JAX_COORDINATOR_ADDRESS with '
                     'JAX_NUM_PROCESSES and JAX_PROCESS_ID, an srun step of several tasks, mpirun with several '
                     'ranks, a multi-worker Cloud TPU slice; distributed.distributed_environment). --multihost forces '
                     'it (launch/tpu_vm.sh run passes it), --nomultihost forbids it.')
flags.DEFINE_integer('initialization_timeout_secs', None, 'Multi-host: seconds to wait for every process to join '
                     "jax.distributed before stopping with the expected and actual process counts (unset: JAX's "
                     'default, 300).')


flags.DEFINE_string('compilation_cache_dir',
                    os.environ.get('TRANSFORMER_JAX_COMPILATION_CACHE', '~/.cache/transformer_jax/xla'),
                    "JAX's persistent compilation cache for train, evaluate, translate and tune_decoding: a rerun, "
                    'a resumed run or an evaluation of the same shapes loads each compiled step (6-16 s of '
                    'compilation on a 2-core CPU) instead of compiling it (every program; not capped in size: '
                    'delete the folder to empty it). Empty: no cache. Default: '
                    '$TRANSFORMER_JAX_COMPILATION_CACHE, else ~/.cache/transformer_jax/xla.')


def use_compilation_cache(directory: str) -> None:
  """JAX's persistent compilation cache in `directory` (`~` expanded), for every program.

  Every program, not only those over JAX's default 1 s of compilation: decoding compiles tens of short loops
  (one per batch size and cache length), which a later run then loads instead of compiling. The size is not
  capped (JAX's default; delete the folder to empty it): JAX's cap needs `filelock` and an access-time file
  beside every entry, without which the cache loads nothing. Measured effect: docs/performance.md.
  """
  jax.config.update('jax_compilation_cache_dir', os.path.expanduser(directory))
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)


def main(argv):
  """Runs --mode on --config (see the module docstring).

  Raises:
    app.UsageError: for positional arguments.
    SystemExit: naming the flag, for a mode that needs --workdir without one.
  """
  logs.quiet_libraries()
  logs.quiet_libtpu()
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  config, mode, workdir = flags.FLAGS.config, flags.FLAGS.mode, flags.FLAGS.workdir
  if mode == 'config':
    from transformer_jax.tools import config_doc  # pylint: disable=g-import-not-at-top
    print(config_doc.describe(config), end='')
    return
  if mode == 'summary':
    from transformer_jax.run import config_checks  # pylint: disable=g-import-not-at-top
    from transformer_jax.tools import summary  # pylint: disable=g-import-not-at-top
    print(summary.summarize(config_checks.model_config(config)))
    return
  if mode == 'benchmark':
    _log_start(mode, workdir)
    from transformer_jax.tools import benchmark  # pylint: disable=g-import-not-at-top
    benchmark.run(config)
    return
  if mode == 'compile':  # --workdir is optional: it only receives compile.json.
    _log_start(mode, workdir)
    from transformer_jax.tools import aot  # pylint: disable=g-import-not-at-top
    aot.compile_only(config, workdir)
    return
  if workdir is None:
    sys.exit(f'--workdir is required for --mode={mode} (the run\'s folder; --help for usage)')
  _log_start(mode, workdir)
  from transformer_jax.run import config_checks  # pylint: disable=g-import-not-at-top
  from transformer_jax.training import distributed  # pylint: disable=g-import-not-at-top
  from transformer_jax.run import experiment  # pylint: disable=g-import-not-at-top
  if flags.FLAGS.compilation_cache_dir:
    use_compilation_cache(flags.FLAGS.compilation_cache_dir)
  from transformer_jax.storage import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  config = workdir_lib.absolute_paths(config)  # config.json stores paths that work from any directory.
  if mode in ('evaluate', 'translate', 'tune_decoding', 'export'):
    config = config_checks.config_for_mode(config, workdir, mode)  # Reads only; fails before any JAX work.
  distributed.start(flags.FLAGS.multihost, flags.FLAGS.initialization_timeout_secs)  # Before other JAX use.
  experiment.log_backend(config)
  from transformer_jax.run import evaluate  # pylint: disable=g-import-not-at-top
  from transformer_jax.run import train  # pylint: disable=g-import-not-at-top
  if not sys.stderr.isatty():  # TFDS's progress bars would fill a redirected log with carriage returns.
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    tfds.disable_progress_bar()
  if mode == 'train':
    train.train_and_evaluate(config, workdir)
  elif mode == 'evaluate':
    evaluate.evaluate_checkpoint(config, workdir, flags.FLAGS.output)
  elif mode == 'translate':
    evaluate.translate_file(config, workdir, flags.FLAGS.input, flags.FLAGS.output)
  elif mode == 'tune_decoding':
    from transformer_jax.run import tune_decoding  # pylint: disable=g-import-not-at-top
    tune_decoding.tune_decoding(config, workdir, *_decoding_grid(), output_dir=flags.FLAGS.output)  # It checks the ranges first.
  elif mode == 'export':
    from transformer_jax.tools import export  # pylint: disable=g-import-not-at-top
    export.export_run(config, workdir, flags.FLAGS.output)


def _log_start(mode: str, workdir: str | None) -> None:
  """The command's first line, before the imports and the backend's start-up (seconds on a busy 2-core CPU);
  the next names the backend and devices."""
  logging.info('transformer_jax --mode=%s%s: starting (imports and the backend take a few seconds).', mode,
               f' --workdir={workdir}' if workdir else '')


def _decoding_grid() -> tuple[list[int], list[float], list]:
  """--beam_sizes and --alphas as numbers (their range is `tune_decoding.check_grid`'s), and --average_windows.

  Raises:
    app.UsageError: naming the flags, for a value that is not a number or not a window.
  """
  from transformer_jax.run import tune_decoding  # pylint: disable=g-import-not-at-top
  try:
    beam_sizes = [int(b) for b in flags.FLAGS.beam_sizes]
    alphas = [float(a) for a in flags.FLAGS.alphas]
  except ValueError as error:
    raise app.UsageError(f'--beam_sizes={",".join(flags.FLAGS.beam_sizes)} --alphas={",".join(flags.FLAGS.alphas)}'
                         f': {error}') from None
  try:
    windows = tune_decoding.parse_windows(flags.FLAGS.average_windows)
  except ValueError as error:
    raise app.UsageError(str(error)) from None
  return beam_sizes, alphas, windows


def _flag_value(argv: list[str], name: str) -> str | None:
  """The value of --name=VALUE or --name VALUE in argv (the last one), or None."""
  value = None
  for i, arg in enumerate(argv):
    if arg.startswith(f'--{name}='):
      value = arg.split('=', 1)[1]
    elif arg == f'--{name}' and i + 1 < len(argv):
      value = argv[i + 1]
  return value


def prepare_argv(argv: list[str]) -> list[str]:
  """What runs before absl parses the flags (a config file is loaded while parsing).

  Puts the repository root, and the folder above each --config file's, on sys.path (configs do `from configs
  import base`), so configs load from any working directory; with no --config, points it at the run in
  --workdir (`workdir.get_config`), so that `--config.<field>=...` overrides still parse.

  Returns:
    argv, with `--config=<...>/workdir.py:<workdir>` inserted first when --config is left out and the workdir
    has a config.json.

  Raises:
    SystemExit: with a message, when --config is left out and the workdir holds no run, or a damaged
      config.json or config_changes.json (one line naming the file).
    errors.MissingFileError: when the --config file does not exist, naming it and the configs there are.
  """
  from transformer_jax.storage import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  roots = [pathlib.Path(__file__).resolve().parents[1]]
  config = _flag_value(argv, 'config')
  if config:
    _check_config_file(config.split(':')[0], roots[0] / 'configs')
    roots.append(pathlib.Path(config.split(':')[0]).resolve().parents[1])
  for root in roots:
    if str(root) not in sys.path:
      sys.path.insert(0, str(root))
  workdir = _flag_value(argv, 'workdir')
  if config is None and workdir and pathlib.Path(workdir_lib.path(workdir, workdir_lib.CONFIG)).is_file():
    try:  # A damaged config.json or config_changes.json: one line, not absl's "FATAL Flags parsing error".
      workdir_lib.load_run_config(workdir)
    except errors.UserError as error:
      sys.exit(errors.one_line(error))
    # Before every other flag: absl defines the --config.<field> override flags when it parses --config.
    argv = [argv[0], f'--config={workdir_lib.__file__}:{workdir}', *argv[1:]]
  elif config is None and not any(arg.startswith('--helpfull') or arg == '--helpxml' for arg in argv):
    sys.exit('--config is required' + (f': --workdir={workdir} holds no run (no config.json)' if workdir else '')
             + '; e.g. --config=configs/multi30k.py (--help for usage)')
  return argv


def _check_config_file(path: str, configs_dir: pathlib.Path) -> None:
  """Raises errors.MissingFileError naming `path` and the configs in `configs_dir` when `path` is not a file
  (ml_collections would report it as 'Failed loading config file config_config' when the config is first read)."""
  if pathlib.Path(path).is_file():
    return
  shown = os.path.relpath(configs_dir) if configs_dir.resolve().is_relative_to(pathlib.Path.cwd()) else configs_dir
  names = ', '.join(sorted(p.name for p in configs_dir.glob('*.py') if not p.name.startswith('_')))
  raise errors.MissingFileError(f'--config={path}: no such file (from {os.getcwd()}); the configs in {shown}: '
                                f'{names or "none"}')


def _print_help_and_exit(argv: list[str]) -> None:
  """`--help` / `-h`: this module's usage and flags (not JAX's 700 lines), exit status 0."""
  if not {'--help', '-h', '--helpshort'} & set(argv[1:]):
    return
  print(__doc__)
  print(flags.FLAGS.module_help(sys.modules[__name__]))
  print('\nEvery config field, its default and meaning: --config=<file> --mode=config. JAX flags: --helpfull.')
  sys.exit(0)


def _unknown_field_message(error: AttributeError, argv: list[str]) -> str | None:
  """The one line for a misspelt `--config.<section>.<field>` (ml_collections raises AttributeError while the
  flags parse), or None when the error is not that."""
  text = str(error)
  name = re.search(r'instead of "(\w+)"', text) or re.search(r"'(\w+)'", text)
  if name is None or flags.FLAGS.is_parsed():
    return None
  given = [arg.split('=', 1)[0][2:] for arg in argv
           if arg.startswith('--config.') and arg.split('=', 1)[0].split('.')[-1] == name[1]]
  if not given:
    return None
  key = given[0].removeprefix('config.')
  suggestion = re.search(r'Did you mean "(\w+)"', text)
  closest = f'; did you mean {key.rsplit(".", 1)[0]}.{suggestion[1]}?' if suggestion else ''
  return f'--{given[0]}: {key} is not a config field{closest} (--mode=config lists every field)'


def _run(argv: list[str]) -> None:
  """app.run(main) with a mistake the user can fix (`errors.UserError`, a misspelt config field) as one line on
  stderr (exit status 1; --verbosity=1 for the traceback) and Ctrl-C as a quiet stop (exit status 130). Any other
  exception is a bug: it keeps its traceback."""
  try:
    app.run(main, argv=prepare_argv(argv))
  except KeyboardInterrupt:
    print('Interrupted.', file=sys.stderr)
    sys.exit(130)
  except AttributeError as error:
    message = _unknown_field_message(error, argv)
    if message is None:
      raise
    sys.exit(message)
  except errors.UserError as error:
    if flags.FLAGS.is_parsed() and flags.FLAGS.verbosity >= 1:
      raise
    sys.exit(f'{errors.one_line(error)}\n(--verbosity=1 shows the traceback)')


if __name__ == '__main__':
  _print_help_and_exit(sys.argv)
  jax.config.config_with_absl()
  _run(sys.argv)
