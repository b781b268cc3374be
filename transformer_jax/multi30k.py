"""Multi30k (Elliott et al., 2016) task 1 as a TFDS dataset, and strict readers for parallel text files.

Multi30k is not in the paper; it is a small English-German-French corpus (29,000 training sentences) for fast
end-to-end runs of the Sec. 5.1 pipeline. The builder is defined here, inside the package, because TFDS only
finds the module of a custom `GeneratorBasedBuilder` offline when it lives in a package (see ENVIRONMENT.md).
Importing this module registers the name 'multi30k' with TFDS.

Features: {'en', 'de', 'fr'}: tfds.features.Text, one sentence each. Splits:
  train: train.{lang}.gz (29,000 lines); validation: val.{lang}.gz (1,014); test: test_2016_flickr.{lang}.gz (1,000).
Examples keep the order of the files (shuffling is disabled), so example i is line i + 1 of every file.

The raw files are downloaded from the multi30k/dataset GitHub repository, or read from a manual folder holding the
nine {split}.{lang}.gz files: `tfds.load('multi30k', download_and_prepare_kwargs={'download_config':
tfds.download.DownloadConfig(manual_dir=FOLDER)})`. `input_pipeline.load_split` does this from `data.manual_dir`.
"""
from collections.abc import Sequence
import gzip
import os

from etils import epath
import tensorflow_datasets as tfds

LANGUAGES = ('en', 'de', 'fr')
SPLIT_STEMS = {'train': 'train', 'validation': 'val', 'test': 'test_2016_flickr'}  # TFDS split -> file stem.
URL = 'https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/{name}'
_GZIP_MAGIC = b'\x1f\x8b'
_CITATION = """@inproceedings{elliott-etal-2016-multi30k,
  title = {Multi30{K}: Multilingual {E}nglish-{G}erman Image Descriptions},
  author = {Elliott, Desmond and Frank, Stella and Sima'an, Khalil and Specia, Lucia},
  booktitle = {Proceedings of the 5th Workshop on Vision and Language},
  year = {2016},
  pages = {70--74}}"""


def file_names() -> list[str]:
  """The nine raw file names the builder needs, e.g. 'train.en.gz'."""
  return [f'{stem}.{lang}.gz' for stem in SPLIT_STEMS.values() for lang in LANGUAGES]


def read_lines(path: str | os.PathLike[str]) -> list[str]:
  """Reads a UTF-8 text file, plain or gzip (detected from its first bytes), one sentence per line.

  Lines are split at '\\n' only (not at other Unicode line breaks, which can occur inside sentences); a trailing
  '\\r' is removed. Empty lines are kept.

  Args:
    path: a local path or any path `etils.epath` reads (e.g. gs://).

  Returns:
    The lines, without line terminators.

  Raises:
    FileNotFoundError: if the file does not exist (the message names the path).
    ValueError: if the file is not valid UTF-8, naming the file and the 1-based line number.
  """
  path = epath.Path(path)
  data = path.read_bytes()
  if data[:2] == _GZIP_MAGIC:
    data = gzip.decompress(data)
  try:
    text = data.decode('utf-8')
  except UnicodeDecodeError as e:
    line = data.count(b'\n', 0, e.start) + 1
    column = e.start - (data.rfind(b'\n', 0, e.start) + 1)
    raise ValueError(f'{path}: line {line} is not valid UTF-8 ({e.reason} at byte {column} of the line).') from None
  lines = text.split('\n')
  if lines[-1] == '':  # The newline that ends the last line; also turns an empty file into no lines.
    lines.pop()
  return [line[:-1] if line.endswith('\r') else line for line in lines]


def read_parallel(paths: Sequence[str | os.PathLike[str]]) -> list[list[str]]:
  """Reads line-aligned files (one per language) with `read_lines`.

  Args:
    paths: one file per language.

  Returns:
    One list of lines per path, all of the same length.

  Raises:
    ValueError: if the files have different numbers of lines (naming every file and its count), or as `read_lines`.
    FileNotFoundError: as `read_lines`.
  """
  columns = [read_lines(path) for path in paths]
  counts = [len(column) for column in columns]
  if len(set(counts)) > 1:
    listing = ', '.join(f'{path} has {count}' for path, count in zip(paths, counts))
    raise ValueError(f'Parallel files must have the same number of lines: {listing}.')
  return columns


def check_manual_dir(manual_dir: str | os.PathLike[str]) -> None:
  """Raises ValueError, listing the file names needed and those missing, if `manual_dir` lacks any of them."""
  manual_dir = epath.Path(manual_dir)
  missing = [name for name in file_names() if not (manual_dir / name).exists()]
  if missing:
    raise ValueError(f'Multi30k manual_dir {manual_dir} lacks {", ".join(missing)}. '
                     f'It needs these files: {", ".join(file_names())}.')


def _manual_dir(dl_manager: tfds.download.DownloadManager) -> epath.Path | None:
  """The manual folder, or None when none was given (then the files are downloaded)."""
  try:
    return dl_manager.manual_dir
  except AssertionError:
    # TFDS raises AssertionError when no manual_dir was given, and also when it is missing or empty;
    # input_pipeline.load_split runs check_manual_dir on a given folder first, which names the files needed.
    return None


class Multi30k(tfds.core.GeneratorBasedBuilder):
  """Multi30k task 1: aligned English, German and French image descriptions."""

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Task 1 raw text: en, de, fr; train, validation (val), test (test_2016_flickr).'}
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
      f'Optional. Put these files from https://github.com/multi30k/dataset/tree/master/data/task1/raw in '
      f'manual_dir: {", ".join(file_names())}. Without manual_dir they are downloaded.')

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict({lang: tfds.features.Text() for lang in LANGUAGES}),
        homepage='https://github.com/multi30k/dataset',
        citation=_CITATION,
        disable_shuffling=True)

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    manual_dir = _manual_dir(dl_manager)
    if manual_dir is None:
      paths = dl_manager.download({name: URL.format(name=name) for name in file_names()})
    else:
      check_manual_dir(manual_dir)
      paths = {name: manual_dir / name for name in file_names()}
    return {split: self._generate_examples({lang: paths[f'{stem}.{lang}.gz'] for lang in LANGUAGES})
            for split, stem in SPLIT_STEMS.items()}

  def _generate_examples(self, paths: dict[str, epath.Path]):
    """Yields (line index, {lang: sentence}) in file order."""
    columns = read_parallel(list(paths.values()))
    for index, sentences in enumerate(zip(*columns)):
      yield index, dict(zip(paths, sentences))
