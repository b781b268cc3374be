"""Command line: train, evaluate, translate, summarise or benchmark a Transformer.

  python -m transformer_jax.main --config=configs/base.py --workdir=runs/base [--config.train.warmup_steps=8000]
  python -m transformer_jax.main --config=configs/table3.py:B1 --mode=summary
"""
import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # TensorFlow (tf.data, TFDS) is chatty on import.

import logging as python_logging  # pylint: disable=g-import-not-at-top

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

MODES = ('train', 'evaluate', 'translate', 'summary', 'benchmark', 'compile')

config_flags.DEFINE_config_file('config', None, 'Configuration file (configs/*.py).', lock_config=True)
flags.DEFINE_string('workdir', None, 'Directory for the vocabulary, checkpoints, TensorBoard events and outputs.')
flags.DEFINE_enum('mode', 'train', MODES, 'What to do.')
flags.DEFINE_string('input', None, 'translate mode: input file, one sentence per line (stdin if omitted).')
flags.DEFINE_string('output', None, 'translate mode: output file (stdout if omitted).')
flags.DEFINE_boolean('multihost', None, 'Join the other processes through jax.distributed.initialize() before any '
                     'JAX use. Unset: only when a multi-process launcher is detected (JAX_COORDINATOR_ADDRESS with '
                     'JAX_NUM_PROCESSES and JAX_PROCESS_ID, an srun step of several tasks, mpirun with several '
                     'ranks, a multi-worker Cloud TPU slice; distributed.distributed_environment). --multihost forces '
                     'it (launch/tpu_vm.sh run passes it), --nomultihost forbids it.')
flags.DEFINE_integer('initialization_timeout_secs', None, 'Multi-host: seconds to wait for every process to join '
                     "jax.distributed before stopping with the expected and actual process counts (unset: JAX's "
                     'default, 300).')
flags.mark_flags_as_required(['config'])


class _QuietLibraries(python_logging.Filter):
  """Drops orbax's and TFDS's INFO records (dozens per checkpoint); keeps their warnings and our logs."""
  _NOISY = (f'{os.sep}orbax{os.sep}', f'{os.sep}tensorflow_datasets{os.sep}')

  def filter(self, record):
    return record.levelno > python_logging.INFO or not any(p in record.pathname for p in self._NOISY)


def main(argv):
  logging.get_absl_handler().addFilter(_QuietLibraries())
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  config, mode, workdir = flags.FLAGS.config, flags.FLAGS.mode, flags.FLAGS.workdir
  if mode == 'summary':
    from transformer_jax import model as model_lib  # pylint: disable=g-import-not-at-top
    from transformer_jax import summary  # pylint: disable=g-import-not-at-top
    print(summary.summarize(model_lib.ModelConfig(vocab_size=config.data.vocab_size, **config.model)))
    return
  if mode == 'benchmark':
    from transformer_jax import benchmark  # pylint: disable=g-import-not-at-top
    benchmark.run(config)
    return
  if workdir is None:
    raise app.UsageError(f'--workdir is required for --mode={mode}')
  from transformer_jax import distributed  # pylint: disable=g-import-not-at-top
  distributed.start(flags.FLAGS.multihost, flags.FLAGS.initialization_timeout_secs)  # Before other JAX use.
  from transformer_jax import train  # pylint: disable=g-import-not-at-top
  if mode == 'train':
    train.train_and_evaluate(config, workdir)
  elif mode == 'evaluate':
    train.evaluate_checkpoint(config, workdir)
  elif mode == 'translate':
    train.translate_file(config, workdir, flags.FLAGS.input, flags.FLAGS.output)
  elif mode == 'compile':
    from transformer_jax import aot  # pylint: disable=g-import-not-at-top
    aot.compile_only(config, workdir)


if __name__ == '__main__':
  jax.config.config_with_absl()
  app.run(main)
