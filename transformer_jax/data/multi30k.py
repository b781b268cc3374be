"""Multi30k (Elliott et al., 2016) task 1 as a TFDS dataset, and strict readers for parallel text files.

Multi30k is not in the paper; it is a small English-German-French corpus (29,000 training sentences) for fast
end-to-end runs of the Sec. 5.1 pipeline. The builder is defined here, inside the package, because TFDS only
finds the module of a custom `GeneratorBasedBuilder` offline when it lives in a package (see ENVIRONMENT.md).
Importing this module registers the name 'multi30k' with TFDS.

Features: one tfds.features.Text per language of the config (all of 'en', 'de', 'fr' without one), one sentence
each. Splits:
  train: train.{lang}.gz (29,000 lines); validation: val.{lang}.gz (1,014); test: test_2016_flickr.{lang}.gz (1,000).
Examples keep the order of the files (shuffling is disabled), so example i is line i + 1 of every file.

The raw files are downloaded from the multi30k/dataset GitHub repository, or read from a manual folder holding the
{split}.{lang}.gz files of the languages asked for. Each preparation is tied to what it was made from: the builder
config (`builder_config`) names the languages and, for a manual folder, a digest of the files' names, sizes and
SHA-256 hashes, and TFDS prepares every config into its own folder (<data_dir>/multi30k/<config name>/1.0.0). So a
folder with other files (a training file cut to 500 lines, say) prepares anew instead of reading data prepared
from another folder; the builder refuses a manual folder whose files no longer match its config. A downloaded
preparation ('<langs>-download') is tied to the URLs only: delete its folder to download the files again.

  config = multi30k.builder_config(('de', 'en'), manual_dir=FOLDER)
  tfds.load('multi30k', builder_kwargs={'config': config}, download_and_prepare_kwargs={'download_config':
            tfds.download.DownloadConfig(manual_dir=FOLDER)})

`input_pipeline.load_split` does this from `data.manual_dir`, `data.source_lang` and `data.target_lang`.
"""
from collections.abc import Sequence
import dataclasses
import gzip
import hashlib
import logging
import os
import zlib

from etils import epath
import tensorflow_datasets as tfds

from transformer_jax import errors

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


def file_names(languages: Sequence[str] = LANGUAGES) -> list[str]:
  """The raw file names the builder needs for `languages` (by default all nine), e.g. 'train.en.gz'."""
  return [f'{stem}.{lang}.gz' for stem in SPLIT_STEMS.values() for lang in languages]


def read_lines(path: str | os.PathLike[str]) -> list[str]:
  """Reads a UTF-8 text file, plain or gzip (detected from its first bytes), one sentence per line.

  Lines are split at '\\n' only (not at other Unicode line breaks, which can occur inside sentences); a trailing
  '\\r' is removed, and a UTF-8 byte-order mark at the start of the file. Empty lines are kept.

  Args:
    path: a local path or any path `etils.epath` reads (e.g. gs://).

  Returns:
    The lines, without line terminators.

  Raises:
    FileNotFoundError: if the file does not exist (the message names the path).
    errors.DamagedFileError: if the file is not valid UTF-8, naming the file and the 1-based line number, or a
      gzip file is truncated or damaged, naming the file.
  """
  path = epath.Path(path)
  data = path.read_bytes()
  if data[:2] == _GZIP_MAGIC:
    try:
      data = gzip.decompress(data)
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
      raise errors.DamagedFileError(f'{path} is not a complete gzip file ({e}): it was cut short or damaged; copy or '
                                    'download it again.') from None
  try:
    text = data.decode('utf-8')
  except UnicodeDecodeError as e:
    line = data.count(b'\n', 0, e.start) + 1
    column = e.start - (data.rfind(b'\n', 0, e.start) + 1)
    raise errors.DamagedFileError(
        f'{path}: line {line} is not valid UTF-8 ({e.reason} at byte {column} of the line).') from None
  text = text.removeprefix('\ufeff')  # A byte-order mark is not part of the first sentence.
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
    errors.DamagedFileError: if the files have different numbers of lines (naming every file and its count), or
      as `read_lines`.
    FileNotFoundError: as `read_lines`.
  """
  columns = [read_lines(path) for path in paths]
  counts = [len(column) for column in columns]
  if len(set(counts)) > 1:
    listing = ', '.join(f'{path} has {count}' for path, count in zip(paths, counts))
    raise errors.DamagedFileError(f'Parallel files must have the same number of lines: {listing}.')
  return columns


def check_languages(languages: Sequence[str]) -> tuple[str, ...]:
  """The distinct languages, in their order.

  Raises:
    errors.ConfigError: listing Multi30k's languages, for any other.
  """
  if not set(languages) <= set(LANGUAGES):
    raise errors.ConfigError(f'multi30k has languages {sorted(LANGUAGES)}, not {tuple(languages)}.')
  return tuple(dict.fromkeys(languages))


def check_manual_dir(manual_dir: str | os.PathLike[str], languages: Sequence[str] = LANGUAGES) -> None:
  """Raises errors.ConfigError if `manual_dir` lacks a file of `languages`, naming the missing and the needed files.

  Args:
    manual_dir: the folder (data.manual_dir).
    languages: the languages that must be there, e.g. ('en', 'de') for an English-German run.

  Raises:
    errors.MissingFileError: naming the absolute path and the files it must hold, when the folder does not exist.
    errors.ConfigError: for a missing file, or a language Multi30k does not have.
  """
  manual_dir, languages = epath.Path(manual_dir), check_languages(languages)
  if not manual_dir.is_dir():
    given = os.fspath(manual_dir)
    shown = os.path.abspath(given) if '://' not in given else given
    relative = f' (given as {given!r}, relative to {os.getcwd()})' if shown != given else ''
    raise errors.MissingFileError(f'data.manual_dir: the folder {shown} does not exist{relative}; for '
                                  f'{"-".join(languages)} it must hold {", ".join(file_names(languages))}.')
  needed = file_names(languages)
  missing = [name for name in needed if not (manual_dir / name).exists()]
  if missing:
    raise errors.ConfigError(f'Multi30k manual_dir {manual_dir} lacks {", ".join(missing)}. '
                             f'For languages {"-".join(languages)} it needs: {", ".join(needed)}.')


def files_digest(manual_dir: str | os.PathLike[str], languages: Sequence[str]) -> tuple[str, dict[str, int]]:
  """(SHA-256 hex digest over the files' names, sizes and contents, {file name: size in bytes}).

  Hashes the six (or nine) gzip files, about 2 MB for the whole corpus (milliseconds).
  """
  digest, sizes = hashlib.sha256(), {}
  for name in file_names(check_languages(languages)):
    data = (epath.Path(manual_dir) / name).read_bytes()
    sizes[name] = len(data)
    digest.update(f'{name}\0{len(data)}\0{hashlib.sha256(data).hexdigest()}\n'.encode())
  return digest.hexdigest(), sizes


@dataclasses.dataclass(eq=False)
class Multi30kConfig(tfds.core.BuilderConfig):
  """What one preparation of Multi30k is made from (see `builder_config`).

  Attributes:
    languages: language codes, e.g. ('de', 'en') (sorted by `builder_config`); the examples have these features.
    files_sha256: `files_digest` of the manual folder's files; '' when the files are downloaded.
  """
  languages: tuple[str, ...] = LANGUAGES
  files_sha256: str = ''


def builder_config(languages: Sequence[str], manual_dir: str | os.PathLike[str] | None = None) -> Multi30kConfig:
  """The builder config for `languages`, read from `manual_dir` (tied to its files' digest) or downloaded.

  The name is '<langs>-download' or '<langs>-files-<first 16 hex digits of the digest>', e.g.
  'de-en-files-3f0c9a1e5b7d2c44': TFDS prepares each name once, in its own folder.

  Args:
    languages: the languages to prepare (source and target), in any order.
    manual_dir: folder with the {split}.{lang}.gz files, or None to download them.

  Raises:
    ValueError: for a language Multi30k lacks, or a manual_dir that lacks a file of `languages`.
  """
  if manual_dir is not None:
    check_manual_dir(manual_dir, languages)
  languages = tuple(sorted(check_languages(languages)))
  if manual_dir is None:
    return Multi30kConfig(name=f'{"-".join(languages)}-download', version=Multi30k.VERSION, languages=languages,
                          description=f'{", ".join(file_names(languages))}, downloaded from {URL.format(name="")}')
  digest, sizes = files_digest(manual_dir, languages)
  listing = ', '.join(f'{name} ({size:,} bytes)' for name, size in sizes.items())
  return Multi30kConfig(name=f'{"-".join(languages)}-files-{digest[:16]}', version=Multi30k.VERSION,
                        languages=languages, files_sha256=digest, description=f'{listing} in {manual_dir}')


class _QuietCustomConfig(logging.Filter):
  """Drops TFDS's warning 'Using custom data configuration: Multi30kConfig(...)', logged at every load.

  Every Multi30k config is made at run time (`builder_config`), so the warning says nothing; load_split logs
  what was read instead.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.msg == 'Using custom data configuration: %s' and isinstance(record.args, tuple)
                and record.args and isinstance(record.args[0], Multi30kConfig))


logging.getLogger('absl').addFilter(_QuietCustomConfig())


def _manual_dir(dl_manager: tfds.download.DownloadManager) -> epath.Path | None:
  """The manual folder, or None when none was given (then the files are downloaded)."""
  try:
    return dl_manager.manual_dir
  except AssertionError:
    # TFDS raises AssertionError when no manual_dir was given, and also when it is missing or empty;
    # input_pipeline.load_split runs check_manual_dir on a given folder first, which names the files needed.
    return None


class Multi30k(tfds.core.GeneratorBasedBuilder):
  """Multi30k task 1: aligned English, German and French image descriptions.

  Without a config (`tfds.load('multi30k')`) it downloads all three languages; a manual folder needs a config
  from `builder_config(languages, manual_dir)`, which ties the prepared data to that folder's files.
  """

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Task 1 raw text: en, de, fr; train, validation (val), test (test_2016_flickr).'}
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
      f'Optional. Put the files of your languages from https://github.com/multi30k/dataset/tree/master/data/task1/raw '
      f'in manual_dir (all of them: {", ".join(file_names())}), and pass '
      f'config=multi30k.builder_config(languages, manual_dir). Without manual_dir they are downloaded.')

  @property
  def _languages(self) -> tuple[str, ...]:
    return self.builder_config.languages if self.builder_config else LANGUAGES

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict({lang: tfds.features.Text() for lang in self._languages}),
        homepage='https://github.com/multi30k/dataset',
        citation=_CITATION,
        disable_shuffling=True)

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    manual_dir, expected = _manual_dir(dl_manager), self.builder_config and self.builder_config.files_sha256
    names = file_names(self._languages)
    if manual_dir is None:
      if expected:
        raise ValueError(f'Multi30k config {self.builder_config.name} is made from manual files; pass their '
                         'folder as manual_dir.')
      paths = dl_manager.download({name: URL.format(name=name) for name in names})
    else:
      check_manual_dir(manual_dir, self._languages)
      found = files_digest(manual_dir, self._languages)[0]
      if found != expected:
        raise ValueError(f'The files in Multi30k manual_dir {manual_dir} (digest {found[:16]}) are not those of '
                         f'builder config {self.builder_config_name!r}: pass '
                         'config=multi30k.builder_config(languages, manual_dir), which names them.')
      paths = {name: manual_dir / name for name in names}
    return {split: self._generate_examples({lang: paths[f'{stem}.{lang}.gz'] for lang in self._languages})
            for split, stem in SPLIT_STEMS.items()}

  def _generate_examples(self, paths: dict[str, epath.Path]):
    """Yields (line index, {lang: sentence}) in file order."""
    columns = read_parallel(list(paths.values()))
    for index, sentences in enumerate(zip(*columns)):
      yield index, dict(zip(paths, sentences))
