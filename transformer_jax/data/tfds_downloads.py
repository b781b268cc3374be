"""TFDS downloads that fail within seconds, with one message that says what to do instead.

TFDS downloads each archive with requests and urllib3's Retry(total=10, backoff doubling from 0.2 s): without
internet that is about 200 s of retries, then a ConnectionError deep in a long traceback. `fail_fast` lowers
TFDS's retry count while a dataset loads and turns the first failed download into one `DownloadError` that
names the file, its size (from TFDS's registered checksums) and the routes that need no download here:
  * no connection, or an HTTP error (5xx once the few retries are spent);
  * an archive whose size or SHA-256 is not the registered one (a truncated or damaged download);
  * an archive that does not extract.

Partial downloads are never taken for complete ones: TFDS writes each download into a `<name>.tmp.<uuid>` folder
beside its final path and moves it there only once its size and SHA-256 match the registered ones, so the next
run downloads again (tests/test_tfds_downloads.py checks this with injected failures).

This module imports TFDS only inside `fail_fast`; `main` prints a `DownloadError` as its message alone.
"""
from collections.abc import Iterator
import contextlib
import os
from typing import Any

from transformer_jax import errors

# From TFDS's catalog documentation (docs/catalog/wmt14_translate.md): the archives a dataset downloads in all.
CATALOG_DOWNLOAD_SIZES = {'wmt14_translate/de-en': '1.58 GiB', 'wmt14_translate/fr-en': '6.20 GiB'}
RETRIES = 1  # urllib3 retries per request inside fail_fast (TFDS: 10, about 200 s offline).


class DownloadError(errors.UserError, RuntimeError):
  """A TFDS download or its preparation failed; the message names the file and the offline routes."""


def offline_routes(dataset: str, data_dir: str, manual_dir: str, archives: str = '') -> str:
  """The three ways to run without downloading here, as lines of text.

  Args:
    dataset: the TFDS name, e.g. 'wmt14_translate/de-en' (data.dataset).
    data_dir: the TFDS data folder in use (data.tfds_data_dir or TFDS's default).
    manual_dir: TFDS's manual download folder for this data_dir.
    archives: the archives TFDS registers for the dataset, e.g. 'dev.tgz (36.86 MiB, URL), ...', or ''.
  """
  listing = f' (TFDS registers {archives}; the error names any other)' if archives else ''
  return (
      f'To run without downloading here, either\n'
      f'  1. prepare it on a machine with internet: python -c "import tensorflow_datasets as tfds; '
      f"tfds.builder('{dataset}', data_dir='DIR').download_and_prepare()\", copy DIR here and pass "
      f'--config.data.tfds_data_dir=DIR;\n'
      f'  2. or download the archives by hand{listing} into TFDS\'s manual download folder {manual_dir} under '
      f'their own file names; TFDS uses a file there when its size and SHA-256 match;\n'
      f'  3. or use plain text files: --config.data.dataset=text --config.data.train_files=SOURCE,TARGET '
      f'--config.data.eval_files=... --config.data.test_files=... (e.g. WMT14: the training corpora, '
      f'newstest2013 and newstest2014, one sentence per line).')


def _size_text(url_info: Any) -> str:
  return f'{url_info.size} registered' if url_info is not None else 'size not registered with TFDS'


@contextlib.contextmanager
def fail_fast(dataset: str, data_dir: str | None = None) -> Iterator[None]:
  """While active, TFDS retries a download at most RETRIES times and failures raise `DownloadError`.

  Args:
    dataset: the TFDS name being loaded (for the message), e.g. 'wmt14_translate/de-en'.
    data_dir: data.tfds_data_dir, or None for TFDS's default folder.

  Raises:
    DownloadError: for a failed download, a file that does not match TFDS's registered size and checksum, or an
      archive that does not extract. The message names the file, its size, the dataset's download size and
      `offline_routes`.
  """
  # pylint: disable=g-import-not-at-top
  import tensorflow_datasets as tfds
  from tensorflow_datasets.core.download import checksums as checksums_lib
  from tensorflow_datasets.core.download import download_manager as download_manager_lib
  from tensorflow_datasets.core.download import downloader as downloader_lib
  from tensorflow_datasets.core.download import extractor as extractor_lib
  # pylint: enable=g-import-not-at-top
  data_dir = data_dir or tfds.core.constants.DATA_DIR
  manual_dir = os.path.join(data_dir, 'downloads', 'manual')
  total = CATALOG_DOWNLOAD_SIZES.get(dataset, 'see its TFDS catalog page for the total')
  url_infos = checksums_lib.get_all_url_infos()
  try:
    registered = tfds.builder(dataset, data_dir=data_dir).url_infos or {}
  except Exception:  # pylint: disable=broad-except
    registered = {}  # Only the message loses its list; tfds.load reports an unknown dataset itself.
  archives = ', '.join(f'{info.filename or url} ({info.size}, {url})' for url, info in registered.items())

  def message(what: str, cause: BaseException) -> str:
    return (f'Preparing TFDS dataset {dataset!r} (data.dataset; {total} to download in all) into {data_dir} '
            f'failed: {what}: {type(cause).__name__}: {cause}\n'
            f'{offline_routes(dataset, data_dir, manual_dir, archives)}')

  original = downloader_lib._Downloader._sync_download  # pylint: disable=protected-access

  def sync_download(self, url, destination_path, verify=True):
    try:
      return original(self, url, destination_path, verify)
    except Exception as e:  # Whatever requests or urllib3 raised: the message keeps its type and text.
      raise DownloadError(message(f'downloading {url} ({_size_text(url_infos.get(url))})', e)) from e

  retries = downloader_lib.MAX_RETRIES
  downloader_lib.MAX_RETRIES = RETRIES
  downloader_lib._Downloader._sync_download = sync_download  # pylint: disable=protected-access
  try:
    yield
  except download_manager_lib.NonMatchingChecksumError as e:
    raise DownloadError(message('a downloaded file does not match its registered size and SHA-256 (truncated '
                        'or damaged; it was not kept, the next run downloads it again)', e)) from e
  except extractor_lib.ExtractError as e:
    raise DownloadError(message('an archive does not extract (truncated or damaged)', e)) from e
  finally:
    downloader_lib.MAX_RETRIES = retries
    downloader_lib._Downloader._sync_download = original  # pylint: disable=protected-access
