"""Tests for transformer_jax.data.multi30k: the strict text readers and the TFDS builder on the real corpus."""
import gzip
import pathlib
import shutil

import pytest
import tensorflow_datasets as tfds

from transformer_jax.data import multi30k

tfds.disable_progress_bar()


def write(path: pathlib.Path, data: bytes) -> pathlib.Path:
  path.write_bytes(gzip.compress(data) if path.suffix == '.gz' else data)
  return path


def prepare(data_dir: pathlib.Path, manual_dir: pathlib.Path, languages=multi30k.LANGUAGES) -> tfds.core.DatasetBuilder:
  builder = tfds.builder('multi30k', data_dir=str(data_dir), config=multi30k.builder_config(languages, manual_dir))
  builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=str(manual_dir)))
  return builder


def small_manual_dir(folder: pathlib.Path, **overrides: bytes) -> pathlib.Path:
  """All nine files with two lines each; overrides replaces the content of some, e.g. {'val_de': b'...'}."""
  folder.mkdir()
  for name in multi30k.file_names():
    key = name.removesuffix('.gz').replace('.', '_')
    write(folder / name, overrides.get(key, f'{name} one\n{name} two\n'.encode()))
  return folder


def test_read_lines_plain_and_gzip(tmp_path):
  data = 'Ein Mann\r\n\nzwei\u2028Zeilen? nein\nletzte ohne Zeilenende'.encode()
  expected = ['Ein Mann', '', 'zwei\u2028Zeilen? nein', 'letzte ohne Zeilenende']
  assert multi30k.read_lines(write(tmp_path / 'a.txt', data)) == expected
  assert multi30k.read_lines(write(tmp_path / 'a.gz', data)) == expected
  assert multi30k.read_lines(write(tmp_path / 'b.txt', b'x\n\n')) == ['x', '']
  assert not multi30k.read_lines(write(tmp_path / 'empty.txt', b''))


def test_read_lines_invalid_utf8_names_file_and_line(tmp_path):
  path = write(tmp_path / 'bad.de.gz', b'gut\nauch gut\nschlecht \xff\xfe hier\n')
  with pytest.raises(ValueError, match=r'bad\.de\.gz: line 3 is not valid UTF-8') as error:
    multi30k.read_lines(path)
  assert 'byte 9' in str(error.value)


def test_read_lines_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match='nowhere.en'):
    multi30k.read_lines(tmp_path / 'nowhere.en')


def test_read_parallel_unequal_names_files_and_counts(tmp_path):
  en = write(tmp_path / 'x.en', b'a\nb\nc\n')
  de = write(tmp_path / 'x.de.gz', b'a\nb\n')
  with pytest.raises(ValueError, match='same number of lines') as error:
    multi30k.read_parallel([en, de])
  assert f'{en} has 3' in str(error.value) and f'{de} has 2' in str(error.value)


def test_check_manual_dir_lists_needed_files(tmp_path):
  (tmp_path / 'train.en.gz').write_bytes(b'')
  with pytest.raises(ValueError) as error:
    multi30k.check_manual_dir(tmp_path)
  message = str(error.value)
  assert 'lacks train.de.gz, train.fr.gz, val.en.gz' in message
  assert 'test_2016_flickr.fr.gz' in message and str(tmp_path) in message


def test_a_missing_manual_dir_names_the_folder_and_the_files_it_must_hold(tmp_path):
  with pytest.raises(FileNotFoundError) as error:
    multi30k.check_manual_dir(tmp_path / 'typo', ('en', 'fr'))
  assert str(error.value) == (f'data.manual_dir: the folder {tmp_path}/typo does not exist; for en-fr it must hold '
                              'train.en.gz, train.fr.gz, val.en.gz, val.fr.gz, test_2016_flickr.en.gz, '
                              'test_2016_flickr.fr.gz.')


def test_builder_manual_dir_missing_files(tmp_path):
  manual_dir = tmp_path / 'manual'
  manual_dir.mkdir()
  write(manual_dir / 'train.en.gz', b'a\n')
  with pytest.raises(ValueError, match='lacks train.de.gz') as error:
    prepare(tmp_path / 'tfds', manual_dir)
  assert 'For languages en-de-fr it needs: train.en.gz, train.de.gz' in str(error.value)


def test_builder_unequal_lines(tmp_path):
  manual_dir = small_manual_dir(tmp_path / 'manual', val_de=b'nur eine Zeile\n')
  with pytest.raises(ValueError, match='same number of lines') as error:
    prepare(tmp_path / 'tfds', manual_dir)
  message = str(error.value)
  assert 'val.en.gz has 2' in message and 'val.de.gz has 1' in message


def test_builder_invalid_utf8(tmp_path):
  manual_dir = small_manual_dir(tmp_path / 'manual', test_2016_flickr_fr=b'bon\n\xc3\x28 mauvais\n')
  with pytest.raises(ValueError, match=r'test_2016_flickr\.fr\.gz: line 2 is not valid UTF-8'):
    prepare(tmp_path / 'tfds', manual_dir)


def real_eval_manual_dir(folder: pathlib.Path, multi30k_dir: pathlib.Path) -> pathlib.Path:
  """The real validation and test files, with two-line train files so that preparing takes under a second."""
  manual_dir = small_manual_dir(folder)
  for name in multi30k.file_names():
    if not name.startswith('train'):
      shutil.copy(multi30k_dir / name, manual_dir / name)
  return manual_dir


def assert_split_matches_files(builder, split, stem, multi30k_dir):
  examples = tfds.as_numpy(builder.as_dataset(split=split, batch_size=-1))
  for lang in multi30k.LANGUAGES:
    lines = multi30k.read_lines(multi30k_dir / f'{stem}.{lang}.gz')
    assert [text.decode() for text in examples[lang]] == lines, (split, lang)


def test_builder_real_eval_splits_in_file_order(tmp_path, multi30k_dir):
  builder = prepare(tmp_path / 'tfds', real_eval_manual_dir(tmp_path / 'manual', multi30k_dir))
  splits = builder.info.splits
  assert (splits['train'].num_examples, splits['validation'].num_examples, splits['test'].num_examples) == (
      2, 1014, 1000)
  assert_split_matches_files(builder, 'validation', 'val', multi30k_dir)
  assert_split_matches_files(builder, 'test', 'test_2016_flickr', multi30k_dir)


def test_builder_real_corpus(tmp_path, multi30k_dir):
  """The whole corpus (about 6 s, mostly writing 29,000 training examples)."""
  builder = prepare(tmp_path / 'tfds', multi30k_dir)
  splits = builder.info.splits
  assert (splits['train'].num_examples, splits['validation'].num_examples, splits['test'].num_examples) == (
      29000, 1014, 1000)
  assert_split_matches_files(builder, 'train', 'train', multi30k_dir)


def test_builder_config_is_tied_to_the_files(tmp_path):
  manual_dir = small_manual_dir(tmp_path / 'manual')
  config = multi30k.builder_config(('en', 'de'), manual_dir)
  assert config.name == multi30k.builder_config(('de', 'en'), manual_dir).name
  assert config.name.startswith('de-en-files-') and len(config.files_sha256) == 64
  assert 'train.en.gz (' in config.description and str(manual_dir) in config.description
  assert multi30k.builder_config(('en', 'de')).name == 'de-en-download'
  write(manual_dir / 'val.de.gz', b'eine andere Zeile\nund noch eine\n')
  changed = multi30k.builder_config(('en', 'de'), manual_dir)
  assert changed.name != config.name
  write(manual_dir / 'train.fr.gz', b'ignored\n')  # Not a file of the pair: same data.
  assert multi30k.builder_config(('en', 'de'), manual_dir).name == changed.name
  builder = tfds.builder('multi30k', data_dir=str(tmp_path / 'tfds'), config=config)  # Made for the old files.
  with pytest.raises(ValueError, match=r'are not those of builder config .de-en-files-'):
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=str(manual_dir)))


def test_no_custom_config_warning(tmp_path, caplog):
  manual_dir = small_manual_dir(tmp_path / 'manual')
  with caplog.at_level('INFO'):
    prepare(tmp_path / 'tfds', manual_dir)
  assert 'Using custom data configuration' not in caplog.text
