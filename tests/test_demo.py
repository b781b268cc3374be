"""demo.tiny_config: the notebook's tiny run is a valid config that reads the corpus folder it is given.

The tiny run itself trains in tests/test_notebook.py (integration); this checks its config without training.
"""
import pytest

from transformer_jax.tools import demo
from transformer_jax.run import config_checks


def test_tiny_config_reads_the_corpus_files_and_checkpoints_twice(multi30k_dir):
  config = demo.tiny_config(multi30k_dir, num_train_steps=40)
  data = config.data
  splits = (data.train_split, data.eval_split, data.test_split)
  config_checks.validate_config(config)
  config_checks.check_data_files(data, splits)  # Raises for a missing file.
  assert data.dataset == 'text' and data.vocab_size == demo.VOCAB_SIZE
  assert data.train_files == f'{multi30k_dir}/train.en.gz,{multi30k_dir}/train.de.gz'
  assert data.test_files == f'{multi30k_dir}/test_2016_flickr.en.gz,{multi30k_dir}/test_2016_flickr.de.gz'
  train = config.train
  assert (train.num_train_steps, train.checkpoint_every_steps, train.eval_every_steps, train.warmup_steps,
          train.log_every_steps) == (40, 20, 20, 10, 5)
  assert not train.translate_at_end  # Seconds, not minutes: no beam search at the end.


def test_tiny_config_of_a_folder_without_the_corpus_fails_the_file_check(tmp_path):
  config = demo.tiny_config(tmp_path)
  with pytest.raises(FileNotFoundError, match='train.en.gz'):
    config_checks.check_data_files(config.data, (config.data.train_split,))
