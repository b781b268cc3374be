"""A tiny trained run in seconds, for the notebook and tests when no real run exists.

  python -m transformer_jax.demo --workdir=runs/demo --corpus=../shared/data/multi30k

Trains configs/smoke.py on a Multi30k folder (dataset='text' reads its gzip files directly, so TFDS prepares
nothing) and leaves a workdir that `inspection.load_run` reads like any other. Unlike `inspection`, this
module writes: it is the only route from the inspection side into training.
"""
import os
import pathlib

from absl import app
from absl import flags
import ml_collections

from transformer_jax.storage import workdir as workdir_lib

# Multi30k needs at least 320 pieces beside the 256 byte pieces.
VOCAB_SIZE = 512


def tiny_config(corpus_dir: str | os.PathLike[str], num_train_steps: int = 40) -> ml_collections.ConfigDict:
  """configs/smoke.py reading Multi30k en->de from `corpus_dir`, sized to train in seconds; no beam search.

  Raises:
    FileNotFoundError: if configs/smoke.py is not beside the package (it is in a clone or editable install).
  """
  config = workdir_lib.load_config(pathlib.Path(__file__).resolve().parents[2] / 'configs' / 'smoke.py')
  files = lambda stem: f'{corpus_dir}/{stem}.en.gz,{corpus_dir}/{stem}.de.gz'
  config.data.update(dataset='text', train_files=files('train'), eval_files=files('val'),
                     test_files=files('test_2016_flickr'), vocab_size=VOCAB_SIZE, bucket_lengths=(32,))
  checkpoint_every = max(num_train_steps // 2, 1)
  config.train.update(num_train_steps=num_train_steps, warmup_steps=max(num_train_steps // 4, 1),
                      log_every_steps=max(num_train_steps // 8, 1), eval_every_steps=checkpoint_every,
                      checkpoint_every_steps=checkpoint_every, translate_at_end=False)
  return config


def train_tiny_run(workdir: str | os.PathLike[str], corpus_dir: str | os.PathLike[str],
                   num_train_steps: int = 40) -> ml_collections.ConfigDict:
  """Trains `tiny_config(corpus_dir, num_train_steps)` into `workdir` (which then holds config.json).

  Returns:
    The config it trained with.

  Raises:
    FileNotFoundError: if configs/smoke.py or a corpus file is missing.
  """
  from transformer_jax.run import train  # pylint: disable=g-import-not-at-top  (imports TensorFlow, ~4 s)
  config = tiny_config(corpus_dir, num_train_steps)
  train.train_and_evaluate(config, os.fspath(workdir))
  return config


def main(argv) -> None:
  """`python -m transformer_jax.demo`: trains the tiny run (see the module docstring), then says what next."""
  del argv
  from transformer_jax import logs  # pylint: disable=g-import-not-at-top
  logs.quiet_libraries()
  logs.quiet_libtpu()
  workdir = os.path.abspath(flags.FLAGS.workdir)
  train_tiny_run(workdir, flags.FLAGS.corpus, flags.FLAGS.num_train_steps)
  print(f'The demo run is in {workdir} ({flags.FLAGS.num_train_steps} steps of configs/smoke.py). Next:\n'
        f'  inspect it: INSPECT_WORKDIR={workdir} jupyter lab notebooks/inspect.ipynb\n'
        f'  translate:  echo "A dog runs." | python -m transformer_jax.main --workdir={workdir} --mode=translate')


if __name__ == '__main__':
  flags.DEFINE_string('workdir', 'runs/demo', 'Where the tiny run goes.')
  flags.DEFINE_string('corpus', '../shared/data/multi30k', 'A folder with Multi30k {train,val,test_2016_flickr}'
                      '.{en,de}.gz.')
  flags.DEFINE_integer('num_train_steps', 40, 'Training steps.')
  app.run(main)
