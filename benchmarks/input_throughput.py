"""Batches/s, tokens/s and padding of a config's training batches, bucketed and packed.

  python benchmarks/input_throughput.py --config=configs/base.py --workdir=DIR [--num_batches=500]

Reads the config's train split, tokenises it with the vocabulary in DIR (trained there if absent, as a run
would), and times `--num_batches` batches of `train_iterator.TrainIterator` without and with data.packing
(`batching.measure_throughput`).
"""
from collections.abc import Sequence
import pathlib
import sys
import time

from absl import app
from absl import flags
from ml_collections import config_flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # Configs import `configs.base`.
from transformer_jax.data import batching  # pylint: disable=wrong-import-position
from transformer_jax.data import input_pipeline  # pylint: disable=wrong-import-position
from transformer_jax.data import train_iterator  # pylint: disable=wrong-import-position
from transformer_jax.storage import workdir as workdir_lib  # pylint: disable=wrong-import-position

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/base.py', 'Config file (its data fields are used).')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Folder for the vocabulary.', required=True)
_NUM_BATCHES = flags.DEFINE_integer('num_batches', 500, 'Batches to time per mode.')


def main(argv: Sequence[str]) -> None:
  del argv
  data = _CONFIG.value.data
  tokenizer = input_pipeline.get_tokenizer(
      data, workdir_lib.path(_WORKDIR.value, workdir_lib.vocabulary_file(data.vocab_size)))
  texts = input_pipeline.load_split(data, data.train_split)
  start = time.perf_counter()
  source, target = (input_pipeline.encode(tokenizer, side) for side in texts)
  print(f'Encoded {len(source)} pairs in {time.perf_counter() - start:.2f} s; vocabulary {tokenizer.vocab_size}.')
  for packing in (False, True):
    with data.unlocked():
      data.packing = packing
    batches = train_iterator.TrainIterator.from_config(data, source, target)
    stats = batching.measure_throughput(batches, _NUM_BATCHES.value)
    print(f"{'packed' if packing else 'bucketed'}: {stats['batches_per_sec']:.1f} batches/s, "
          f"{stats['tokens_per_sec']:,.0f} tokens/s, padding {stats['padding_fraction']:.1%}, "
          f"{stats['distinct_shapes']} shapes ({len(batches.shapes)} possible).")


if __name__ == '__main__':
  app.run(main)
