"""Tests for transformer_jax.data.input_pipeline: reading splits (text files, Multi30k, TFDS mock data), the
vocabulary, and the evaluation batches of a real split (Multi30k en -> de, vocabulary 8000, where the corpus is the
point)."""
import gzip
import importlib.util
import logging
import os
import pathlib
import shutil
import socket

import pytest
import tensorflow_datasets as tfds

from transformer_jax.data import batching
from transformer_jax.data import input_pipeline
from transformer_jax.data import multi30k
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.run import config_checks

tfds.disable_progress_bar()


EOS, BOS = tokenizer_lib.EOS_ID, tokenizer_lib.BOS_ID


def base_config():
  """configs/base.py's get_config(), loaded by path: the repository root need not be on sys.path."""
  spec = importlib.util.spec_from_file_location('base', pathlib.Path(__file__).parents[1] / 'configs' / 'base.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


BUCKETS = base_config().data.bucket_lengths


def data_config(**overrides):
  data = base_config().data
  for key, value in overrides.items():
    data[key] = value
  return data


@pytest.fixture(scope='module')
def tokenizer(multi30k_dir, tmp_path_factory):
  def sentences():
    return [line for lang in ('en', 'de') for line in multi30k.read_lines(multi30k_dir / f'train.{lang}.gz')]
  return tokenizer_lib.train_or_load(tmp_path_factory.mktemp('vocab') / 'spm_8000.model', sentences, 8000)


def test_eval_batches_keep_every_line(tokenizer, multi30k_dir, caplog):
  source_text, target_text = (multi30k.read_lines(multi30k_dir / f'val.{lang}.gz') for lang in ('en', 'de'))
  source_text[5] = target_text[5] = ''
  source_text[10] = ' '.join(['horse'] * 100)
  target_text[20] = ' '.join(['Pferd'] * 100)
  source, target = tokenizer.encode(source_text), tokenizer.encode(target_text)
  with caplog.at_level(logging.WARNING):
    batches = batching.eval_batches(source, target, tokens_per_batch=2000, max_length=64,
                                          bucket_lengths=BUCKETS, batch_size_multiple=4)
  assert 'Truncated 1 of 1014 source sentences to max_length=64 tokens (EOS included); lines [11]' in caplog.text
  assert ('1 of 1014 evaluation lines longer than data.max_length=64 (EOS included) on the target side'
          in caplog.text and 'Lines [21].' in caplog.text)
  rows = {}
  for batch in batches:
    size, length = batch['source_tokens'].shape
    assert size * length <= 2000 and size % 4 == 0
    for index, row in zip(batch['example_index'], zip(*(batch[key] for key in (
        'source_tokens', 'target_tokens', 'decoder_input_tokens')))):
      if index < 0:
        assert not any(part.any() for part in row)
      else:
        assert index not in rows
        rows[int(index)] = [tuple(part[part != 0]) for part in row]
  assert sorted(rows) == list(range(1014))
  for index in set(range(1014)) - {20}:
    expected_source = tuple(source[index][:63]) + (EOS,)
    expected_target = tuple(target[index]) + (EOS,)
    assert rows[index] == [expected_source, expected_target, (BOS,) + expected_target[:-1]]
  assert rows[5] == [(EOS,), (EOS,), (BOS,)]
  assert len(rows[10][0]) == 64
  assert rows[20] == [tuple(source[20]) + (EOS,), (), ()]  # Too long a target: not cut, left out of the loss.


def write_text(path: pathlib.Path, text: bytes) -> str:
  path.write_bytes(gzip.compress(text) if path.suffix == '.gz' else text)
  return str(path)


def test_load_split_text_files(tmp_path, caplog):
  train = write_text(tmp_path / 'train.en', 'A dog.\n\nA café.\n'.encode())
  train_de = write_text(tmp_path / 'train.de.gz', 'Ein Hund.\n\nEin Café.\n'.encode())
  eval_en, eval_de = write_text(tmp_path / 'e.en', b'x\n'), write_text(tmp_path / 'e.de', b'y\n')
  data = data_config(dataset='text', train_files=f'{train},{train_de}', eval_files=f'{eval_en}, {eval_de}')
  with caplog.at_level(logging.INFO):
    assert input_pipeline.load_split(data, 'train') == (['A dog.', '', 'A café.'], ['Ein Hund.', '', 'Ein Café.'])
  assert f"Read 3 pairs of split 'train' from {train}, {train_de}." in caplog.text
  with caplog.at_level(logging.INFO):
    input_pipeline.load_split(data, 'train')  # Read again (vocabulary, checks, training): logged once.
  assert caplog.text.count("Read 3 pairs of split 'train'") == 1
  assert input_pipeline.load_split(data, 'validation') == (['x'], ['y'])
  with pytest.raises(ValueError, match="Split 'test' of dataset 'text' needs files 'SOURCE_PATH,TARGET_PATH' in "
                     'data.test_files'):
    input_pipeline.load_split(data, 'test')
  with pytest.raises(ValueError, match='in data.test_files'):  # The start-up check parses it the same way.
    config_checks.check_data_files(data, (data.test_split,))
  with pytest.raises(ValueError, match="Split 'dev' is none of"):
    input_pipeline.load_split(data, 'dev')


def test_load_split_text_errors(tmp_path):
  en = write_text(tmp_path / 'a.en', b'one\ntwo\nthree\n')
  de = write_text(tmp_path / 'a.de', b'eins\nzwei\n')
  bad = write_text(tmp_path / 'bad.de.gz', b'eins\nzwei\ndr\xe4i\n')
  with pytest.raises(ValueError, match=f'{en} has 3, {de} has 2'):
    input_pipeline.load_split(data_config(dataset='text', train_files=f'{en},{de}'), 'train')
  with pytest.raises(ValueError, match=r'bad\.de\.gz: line 3 is not valid UTF-8'):
    input_pipeline.load_split(data_config(dataset='text', train_files=f'{en},{bad}'), 'train')
  with pytest.raises(FileNotFoundError, match='missing.de'):
    input_pipeline.load_split(data_config(dataset='text', train_files=f'{en},{tmp_path}/missing.de'), 'train')


def test_load_split_multi30k(tmp_path, multi30k_dir):
  manual_dir = tmp_path / 'manual'  # The real validation files, and two training lines so that preparing is fast.
  manual_dir.mkdir()
  for name in multi30k.file_names():
    if name.startswith('train'):
      write_text(manual_dir / name, b'a\nb\n')
    else:
      shutil.copy(multi30k_dir / name, manual_dir / name)
  data = data_config(dataset='multi30k', manual_dir=str(manual_dir), tfds_data_dir=str(tmp_path / 'tfds'),
                     source_lang='fr', target_lang='en')
  source, target = input_pipeline.load_split(data, 'validation')
  assert source == multi30k.read_lines(multi30k_dir / 'val.fr.gz')
  assert target == multi30k.read_lines(multi30k_dir / 'val.en.gz')
  data.target_lang = 'cs'
  with pytest.raises(ValueError, match=r"multi30k has languages \['de', 'en', 'fr'\], not \('fr', 'cs'\)"):
    input_pipeline.load_split(data, 'validation')


def cut_corpus(folder: pathlib.Path, multi30k_dir: pathlib.Path, train_lines: int, languages=('en', 'de', 'fr')):
  """A copy of the corpus for `languages` with the training files cut to their first `train_lines` lines."""
  folder.mkdir()
  for name in multi30k.file_names(languages):
    if name.startswith('train'):
      lines = multi30k.read_lines(multi30k_dir / name)[:train_lines]
      write_text(folder / name, ''.join(f'{line}\n' for line in lines).encode())
    else:
      shutil.copy(multi30k_dir / name, folder / name)
  return folder


def test_load_split_multi30k_reads_the_manual_dir_given(tmp_path, multi30k_dir, caplog):
  """A second manual_dir with other files is prepared anew, not read from the first one's cache (#14 item 1)."""
  tfds_dir = tmp_path / 'tfds'
  for folder, lines in (('first', 1000), ('cut', 500)):
    manual_dir = cut_corpus(tmp_path / folder, multi30k_dir, lines)
    data = data_config(dataset='multi30k', manual_dir=str(manual_dir), tfds_data_dir=str(tfds_dir))
    caplog.clear()
    with caplog.at_level(logging.INFO):
      source, target = input_pipeline.load_split(data, 'train')
    assert len(source) == len(target) == lines
    assert source == multi30k.read_lines(multi30k_dir / 'train.en.gz')[:lines]
    # The folder given, absolute, and the cache TFDS prepared from it (one per set of files).
    assert (f"Read {lines} pairs of split 'train' of multi30k (the files in {manual_dir}; TFDS cache "
            f"{tfds_dir}/multi30k/de-en-files-") in caplog.text
  # A slice of a split (README: evaluating or tuning on part of a split) reads its first pairs.
  assert input_pipeline.load_split(data, 'train[:7]')[0] == source[:7]
  # The same files in another folder are the same data (same config), prepared once per tfds_data_dir.
  copy = shutil.copytree(tmp_path / 'cut', tmp_path / 'copy')
  other_tfds = tmp_path / 'other_tfds'
  for tfds_data_dir in (tfds_dir, other_tfds):
    caplog.clear()
    data = data_config(dataset='multi30k', manual_dir=str(copy), tfds_data_dir=str(tfds_data_dir))
    with caplog.at_level(logging.INFO):
      assert len(input_pipeline.load_split(data, 'train')[0]) == 500
    assert f'of multi30k (the files in {copy}; TFDS cache {tfds_data_dir}/multi30k/de-en-files-' in caplog.text
  assert len(list((tfds_dir / 'multi30k').iterdir())) == 2
  # A folder whose English training file alone was cut is prepared, so the line-count check sees it.
  mismatched = shutil.copytree(tmp_path / 'first', tmp_path / 'mismatched')
  shutil.copy(tmp_path / 'cut' / 'train.en.gz', mismatched / 'train.en.gz')
  data = data_config(dataset='multi30k', manual_dir=str(mismatched), tfds_data_dir=str(tfds_dir))
  with pytest.raises(ValueError, match=r'train\.de\.gz has 1000, .*train\.en\.gz has 500'):
    input_pipeline.load_split(data, 'train')


def test_multi30k_needs_only_the_language_pair(tmp_path, multi30k_dir):
  """An en->de run reads a folder without the French files; a missing file of the pair is named (#14 item 15)."""
  manual_dir = cut_corpus(tmp_path / 'manual', multi30k_dir, 20, languages=('en', 'de'))
  data = data_config(dataset='multi30k', manual_dir=str(manual_dir), tfds_data_dir=str(tmp_path / 'tfds'))
  source, target = input_pipeline.load_split(data, 'validation')
  assert target == multi30k.read_lines(multi30k_dir / 'val.de.gz') and len(source) == 1014
  (manual_dir / 'test_2016_flickr.de.gz').unlink()
  for load in (lambda: input_pipeline.load_split(data, 'test'), lambda: multi30k.check_manual_dir(manual_dir, ('en', 'de'))):
    with pytest.raises(ValueError, match=r'lacks test_2016_flickr\.de\.gz\. For languages en-de it needs: ') as error:
      load()
    assert 'fr' not in str(error.value)
  data.target_lang = 'fr'
  with pytest.raises(ValueError, match=r'lacks train\.fr\.gz, val\.fr\.gz, test_2016_flickr\.fr\.gz'):
    input_pipeline.load_split(data, 'train')


def test_load_split_multi30k_manual_dir_lacks_files(tmp_path):
  data = data_config(dataset='multi30k', manual_dir=str(tmp_path), tfds_data_dir=str(tmp_path / 'tfds'))
  with pytest.raises(ValueError, match='lacks train.en.gz, train.de.gz'):
    input_pipeline.load_split(data, 'train')


def test_load_split_wmt14_mock(monkeypatch):
  def no_network(*args):
    raise AssertionError(f'network access: {args}')
  monkeypatch.setattr(socket.socket, 'connect', no_network)
  with tfds.testing.mock_data(num_examples=12):
    for split in ('validation', 'test'):
      source, target = input_pipeline.load_split(data_config(), split)
      assert len(source) == len(target) == 12
      assert all(isinstance(text, str) for text in source + target)


def test_tests_never_use_the_home_tfds_folder():
  assert tfds.core.constants.DATA_DIR == os.environ['TFDS_DATA_DIR']
  assert not pathlib.Path(os.environ['TFDS_DATA_DIR']).is_relative_to(pathlib.Path.home() / 'tensorflow_datasets')


def test_get_tokenizer_logs_validation_lines_that_do_not_round_trip(tmp_path, multi30k_dir, caplog):
  en, de = (multi30k.read_lines(multi30k_dir / f'train.{lang}.gz')[:2000] for lang in ('en', 'de'))
  files = {}
  for split, (source, target) in {'train': (en, de), 'eval': (['a', 'b', 'c', 'd'],
                                                               ['Er wartet…', 'gut', 'Nummer １２', 'ok'])}.items():
    files[f'{split}_files'] = ','.join(write_text(tmp_path / f'{split}.{lang}', ''.join(f'{x}\n' for x in lines).encode())
                                       for lang, lines in (('en', source), ('de', target)))
  data = data_config(dataset='text', vocab_size=1000, **files)
  with caplog.at_level(logging.INFO):
    tokenizer = input_pipeline.get_tokenizer(data, str(tmp_path / 'run' / f'spm_{data.vocab_size}.model'))
  assert tokenizer.normalization == 'nmt_nfkc'
  assert ("Normalisation 'nmt_nfkc': 2 of 4 validation target lines (50.00%) do not round-trip" in caplog.text)
  assert "line 1: 'Er wartet…' -> 'Er wartet...'" in caplog.text and "line 3: 'Nummer １２' -> 'Nummer 12'" in caplog.text
  data.tokenizer_normalization = 'identity'
  caplog.clear()
  with caplog.at_level(logging.INFO):
    input_pipeline.get_tokenizer(data, str(tmp_path / 'identity' / f'spm_{data.vocab_size}.model'))
  assert "Normalisation 'identity': 0 of 4 validation target lines (0.00%) do not round-trip" in caplog.text
