"""Tests for transformer_jax.data.tfds_downloads: TFDS download failures, injected below TFDS; never the network.

Each test prepares 'wmt14_translate/de-en' (configs/base.py's dataset) into tmp_path through TFDS's real download
manager and downloader, with the failure injected at requests' transport adapter or at the downloader's file
transfer, and socket.connect forbidden.
"""
import importlib.util
import pathlib
import socket
import time

import pytest
import requests
import tensorflow_datasets as tfds
from tensorflow_datasets.core.download import downloader as downloader_lib

from transformer_jax.data import input_pipeline
from transformer_jax.data import tfds_downloads

tfds.disable_progress_bar()
EUROPARL = 'http://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz'


def data_config(tfds_data_dir):
  spec = importlib.util.spec_from_file_location('base', pathlib.Path(__file__).parents[1] / 'configs' / 'base.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  data = module.get_config().data
  data.tfds_data_dir = str(tfds_data_dir)
  return data


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
  def connect(*args):
    raise AssertionError(f'network access: {args}')
  monkeypatch.setattr(socket.socket, 'connect', connect)


def load_train(tmp_path):
  start = time.perf_counter()
  with pytest.raises(tfds_downloads.DownloadError) as error:
    input_pipeline.load_split(data_config(tmp_path / 'tfds'), 'train')
  return str(error.value), time.perf_counter() - start


def assert_names_the_routes(message, tmp_path):
  assert "Preparing TFDS dataset 'wmt14_translate/de-en' (data.dataset; 1.58 GiB to download in all)" in message
  assert '--config.data.tfds_data_dir=DIR' in message
  assert f'{tmp_path / "tfds" / "downloads" / "manual"}' in message
  assert '--config.data.dataset=text --config.data.train_files=SOURCE,TARGET' in message


@pytest.mark.parametrize('failure', [
    requests.exceptions.ConnectionError("Failed to resolve 'www.statmt.org' (no internet)"),
    requests.exceptions.RetryError('Max retries exceeded (too many 503 error responses)'),
])
def test_offline_or_http_5xx_fails_within_seconds_naming_the_file(monkeypatch, tmp_path, failure):
  calls = []

  def send(self, request, **kwargs):
    calls.append(request.url)
    raise failure
  monkeypatch.setattr(requests.adapters.HTTPAdapter, 'send', send)
  message, seconds = load_train(tmp_path)
  assert seconds < 10
  assert 'downloading http://www.statmt.org/' in message or 'downloading http://data.statmt.org/' in message
  assert ' MiB registered)' in message and type(failure).__name__ in message
  assert_names_the_routes(message, tmp_path)
  assert downloader_lib.MAX_RETRIES == 10  # TFDS's own setting is back after the load.


def test_fewer_retries_while_loading(monkeypatch, tmp_path):
  seen = []

  def send(self, request, **kwargs):
    seen.append(downloader_lib.MAX_RETRIES)
    raise requests.exceptions.ConnectionError('offline')
  monkeypatch.setattr(requests.adapters.HTTPAdapter, 'send', send)
  load_train(tmp_path)
  assert seen and set(seen) == {tfds_downloads.RETRIES}


def test_truncated_archive_is_named_and_downloaded_again_next_run(monkeypatch, tmp_path):
  """A file shorter than its registered size fails the checksum; it is not kept as the cached download."""
  downloads = []

  def truncated(self, url, destination_path, verify=True):
    downloads.append(url)
    path = destination_path / url.rsplit('/', 1)[-1]
    path.write_bytes(b'\x1f\x8b truncated')
    return downloader_lib.DownloadResult(
        path=path, url_info=tfds.core.download.checksums.compute_url_info(path))
  monkeypatch.setattr(downloader_lib._Downloader, '_sync_download', truncated)
  message, seconds = load_train(tmp_path)
  assert seconds < 10
  assert 'does not match its registered size and SHA-256' in message and 'has wrong checksum' in message
  assert 'statmt.org' in message
  assert_names_the_routes(message, tmp_path)
  first = set(downloads)
  downloads.clear()
  load_train(tmp_path)  # The next run: the truncated files were not taken for complete downloads.
  assert first and first <= set(downloads)
  download_dir = tmp_path / 'tfds' / 'downloads'
  kept = [p for p in download_dir.iterdir() if p.is_file() and not p.name.endswith('.INFO')]
  assert not kept, kept  # Only the '<name>.tmp.<uuid>' folders TFDS downloads into.


def test_an_offline_training_run_stops_before_its_workdir_is_made(monkeypatch, tmp_path):
  """The download error comes before experiment.setup writes anything (no empty run folder, no checkpoints/)."""
  from transformer_jax.run import experiment  # pylint: disable=g-import-not-at-top

  def send(self, request, **kwargs):
    raise requests.exceptions.ConnectionError(f'no internet: {request.url}')
  monkeypatch.setattr(requests.adapters.HTTPAdapter, 'send', send)
  spec = importlib.util.spec_from_file_location('base', pathlib.Path(__file__).parents[1] / 'configs' / 'base.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.data.tfds_data_dir = str(tmp_path / 'tfds')
  config.model.update(num_layers=1, d_model=32, d_ff=64, num_heads=2, d_k=16, d_v=16)
  with pytest.raises(tfds_downloads.DownloadError, match='wmt14_translate/de-en'):
    experiment.setup(config, str(tmp_path / 'run'), data_splits=(config.data.train_split, config.data.eval_split))
  assert not (tmp_path / 'run').exists()
