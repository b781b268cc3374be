"""The run's data: where sentence pairs come from, their tokenisation, and the splits a run reads.

Data sources (`data.dataset`): any TFDS translate dataset (e.g. 'wmt14_translate/de-en', whose validation split
is newstest2013 and test split newstest2014; feature names are language codes), 'multi30k' (`multi30k.py`,
files from `data.manual_dir` or downloaded), or 'text' (`data.{train,eval,test}_files` = 'SOURCE,TARGET').

This module owns, for every mode: reading a split (`load_split`), the vocabulary (`get_tokenizer`), tokenising
(`encode`, `encode_split`), evaluation batches of a split (`split_eval_batches`), BPE-dropout resampling
(`bpe_dropout_resegmenter`, broadcast from process 0 on multi-host runs), and everything a training run reads
before its first step (`load_run_data`). Its functions take the data config (`config.data`), the tokenizer and
the batch row multiple, not the run's `Setup`. Turning token ids into batches is `batching.py`'s and
`train_iterator.py`'s.
"""
from collections.abc import Callable, Sequence
import itertools
import os
import time
from typing import Any, NamedTuple

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np
import tensorflow_datasets as tfds

from transformer_jax import errors
from transformer_jax.data import batching
from transformer_jax.data import multi30k
from transformer_jax.data import tfds_downloads
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.data import train_iterator
from transformer_jax.data import treebank
from transformer_jax.data.batching import Ragged


def load_split(data_config: Any, split: str) -> tuple[list[str], list[str]]:
  """Reads one split as (source sentences, target sentences), aligned, in the dataset's order.

  Logs what was read: the files ('text'; Multi30k: the files, sizes and the prepared folder, which is tied to
  them, see `multi30k.builder_config`) or the TFDS folder, and the number of pairs.

  Args:
    data_config: `config.data` (configs/base.py).
    split: a TFDS split name such as data_config.train_split; for dataset 'text' one of data_config.train_split,
      eval_split or test_split, which select train_files, eval_files or test_files.

  Returns:
    Source and target sentences (str), in data_config.source_lang and target_lang.

  Raises:
    errors.ConfigError: for unknown languages or splits, or a Multi30k manual_dir that lacks a file of the
      language pair.
    errors.DamagedFileError: for unaligned files or invalid UTF-8.
    FileNotFoundError: for a missing text file.
    tfds_downloads.DownloadError: within seconds, when TFDS cannot download or verify a file it needs; the
      message names the file and the ways to prepare the data by hand.
  """
  langs = (data_config.source_lang, data_config.target_lang)
  if data_config.dataset == 'treebank':  # Words -> linearised trees (§6.3, data/treebank.py).
    source, target = treebank.split_pairs(data_config.treebank_dir, split, data_config.treebank_target)
    _log_once(f'Read {len(source)} trees of split {split!r} from data.treebank_dir={data_config.treebank_dir}.')
    return source, target
  if data_config.dataset == 'text':
    _, paths = text_files(data_config, split)
    source, target = multi30k.read_parallel(paths)
    _log_once(f'Read {len(source)} pairs of split {split!r} from {", ".join(map(os.path.abspath, paths))}.')
    return source, target
  with tfds_downloads.fail_fast(data_config.dataset, data_config.tfds_data_dir or None):
    dataset, info = tfds.load(data_config.dataset, split=split, data_dir=data_config.tfds_data_dir or None,
                              batch_size=65536, shuffle_files=False, with_info=True, **_tfds_kwargs(data_config))
  if not set(langs) <= set(info.features.keys()):
    raise errors.ConfigError(f'{data_config.dataset} has languages {sorted(info.features.keys())}, not {langs}.')
  columns = ([], [])
  for examples in tfds.as_numpy(dataset):
    for column, lang in zip(columns, langs):
      column.extend(text.decode('utf-8') for text in examples[lang])
  files = f'the files in {os.path.abspath(data_config.manual_dir)}; ' if data_config.manual_dir else ''
  _log_once(f'Read {len(columns[0])} pairs of split {split!r} of {data_config.dataset} ({files}TFDS cache '
            f'{info.data_dir}).')
  return columns


_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
  """Logs `message` the first time this process sees it (a split is read for the vocabulary, a check and
  training: one line says it)."""
  if message not in _LOGGED:
    _LOGGED.add(message)
    logging.info(message)


def _tfds_kwargs(data_config: Any) -> dict[str, Any]:
  """tfds.load's builder and preparation arguments: Multi30k's builder config (tied to its files)."""
  if data_config.dataset != 'multi30k':
    return {}
  manual_dir = data_config.manual_dir or None
  kwargs = {'builder_kwargs': {'config': multi30k.builder_config(
      (data_config.source_lang, data_config.target_lang), manual_dir)}}
  if manual_dir:
    kwargs['download_and_prepare_kwargs'] = {'download_config': tfds.download.DownloadConfig(manual_dir=manual_dir)}
  return kwargs


def prepare_dataset(data_config: Any) -> None:
  """Downloads and prepares a TFDS dataset (data.dataset) unless prepared already; nothing for dataset 'text'.

  Called before anything is written to the workdir, so that an offline machine stops with the download error
  alone, not with an empty run folder beside it.

  Raises:
    tfds_downloads.DownloadError: as `load_split`.
    ValueError: for a Multi30k manual_dir that lacks a file of the language pair.
  """
  if data_config.dataset in ('text', 'treebank'):
    return
  kwargs = _tfds_kwargs(data_config)
  with tfds_downloads.fail_fast(data_config.dataset, data_config.tfds_data_dir or None):
    builder = tfds.builder(data_config.dataset, data_dir=data_config.tfds_data_dir or None,
                           **kwargs.get('builder_kwargs', {}))
    builder.download_and_prepare(**kwargs.get('download_and_prepare_kwargs', {}))


def text_files(data_config: Any, split: str) -> tuple[str, list[str]]:
  """(the config key, [source path, target path]) of a split of dataset 'text': data.train_files, eval_files or
  test_files, each 'SOURCE_PATH,TARGET_PATH'.

  Raises:
    errors.ConfigError: naming the key, for a value that is not two comma-separated paths, or a split that is
      none of data.train_split, eval_split and test_split.
  """
  for name, key in ((data_config.train_split, 'train_files'), (data_config.eval_split, 'eval_files'),
                    (data_config.test_split, 'test_files')):
    if split == name:
      paths = [path.strip() for path in data_config[key].split(',')]
      if len(paths) != 2 or not all(paths):
        raise errors.ConfigError(
            f"Split {split!r} of dataset 'text' needs files 'SOURCE_PATH,TARGET_PATH' in data.{key}, "
            f'got {data_config[key]!r}.')
      return key, paths
  raise errors.ConfigError(f"Split {split!r} is none of the train, eval and test splits of dataset 'text'.")


def split_source(data_config: Any, split: str) -> str:
  """Where a split comes from, for messages: its data.*_files for dataset='text', else the dataset's name."""
  if data_config.dataset == 'treebank':
    return f'data.treebank_dir={data_config.treebank_dir}'
  if data_config.dataset != 'text':
    return f'data.dataset={data_config.dataset}'
  key = {data_config.train_split: 'train_files', data_config.eval_split: 'eval_files'}.get(split, 'test_files')
  return f'data.{key}={data_config[key]}'


def get_tokenizer(data_config: Any, path: str, process_index: int = 0) -> tokenizer_lib.Tokenizer:
  """The shared vocabulary (Sec. 5.1) in the SentencePiece model file `path` (a run's
  `<workdir>/spm_<vocab_size>.model`), trained on the train split's sources and targets if missing.

  After training it logs how many validation target lines (data.eval_split) the vocabulary's normalisation
  changes (encode -> decode != line; `tokenizer.round_trip`): BLEU scores the raw references.

  Raises:
    errors.ConfigError: naming the split, when it has no non-empty line to train a vocabulary on.
  """
  def sentences():
    source, target = load_split(data_config, data_config.train_split)
    if not any(line.strip() for line in itertools.chain(source, target)):
      raise errors.ConfigError(
          f'The {data_config.train_split!r} split has no non-empty line to train the vocabulary on '
          f'({split_source(data_config, data_config.train_split)}).')
    return itertools.chain(source, target)
  # A treebank's output tokens ('(NP', ')NP', 'XX') stay single pieces, so that outputs can be de-linearised.
  symbols = (treebank.output_symbols(treebank.split_trees(data_config.treebank_dir, data_config.train_split))
             if data_config.dataset == 'treebank' else ())
  return tokenizer_lib.train_or_load(
      path, sentences, data_config.vocab_size, model_type=data_config.tokenizer_model_type,
      max_sentences=data_config.tokenizer_train_sentences, seed=data_config.tokenizer_seed,
      normalization=data_config.tokenizer_normalization, user_defined_symbols=symbols,
      on_trained=lambda tokenizer: log_round_trip(tokenizer, data_config), process_index=process_index)


def log_round_trip(tokenizer: tokenizer_lib.Tokenizer, data_config: Any) -> float:
  """Logs (and returns) the fraction of validation target lines that do not round-trip, with a few examples."""
  lines = load_split(data_config, data_config.eval_split)[1]
  changed = tokenizer_lib.round_trip(tokenizer, lines)
  fraction = len(changed) / max(len(lines), 1)
  examples = '; '.join(f'line {i + 1}: {lines[i]!r} -> {tokenizer.decode(tokenizer.encode([lines[i]]))[0]!r}'
                       for i in changed[:3])
  logging.info('Normalisation %r: %d of %d %s target lines (%.2f%%) do not round-trip (decode(encode(line)) != '
               'line; BLEU scores the raw lines)%s', tokenizer.normalization, len(changed), len(lines),
               data_config.eval_split, 100 * fraction, f', e.g. {examples}.' if changed else '.')
  return fraction


def encode(tokenizer: tokenizer_lib.Tokenizer, texts: Sequence[str], chunk_size: int = 100_000,
           bpe_dropout_rate: float = 0.0) -> Ragged:
  """Tokenises sentences (no EOS yet) in chunks, so Python lists of ids never hold the whole split.

  Args:
    tokenizer: the vocabulary.
    texts: sentences, str.
    chunk_size: sentences encoded at a time.
    bpe_dropout_rate: > 0 samples BPE-dropout segmentations (data.bpe_dropout_rate; `Tokenizer.encode`).

  Returns:
    One sequence of int32 ids per sentence.

  Raises:
    ValueError: as `Tokenizer.encode`, for a bad bpe_dropout_rate.
  """
  chunks = [Ragged.from_lists(tokenizer.encode(texts[i:i + chunk_size], bpe_dropout_rate))
            for i in range(0, len(texts), chunk_size)]
  if not chunks:
    return Ragged(np.zeros(0, np.int32), np.zeros(1, np.int64))
  ends = np.cumsum([c.offsets[-1] for c in chunks])[:-1]
  offsets = [chunks[0].offsets] + [c.offsets[1:] + end for c, end in zip(chunks[1:], ends)]
  return Ragged(np.concatenate([c.values for c in chunks]), np.concatenate(offsets))


class Split(NamedTuple):
  """One split, read and tokenised, in file order (`encode_split`)."""
  source_texts: list[str]
  target_texts: list[str]  # The references BLEU scores against.
  source_ids: Ragged
  target_ids: Ragged
  trees: tuple | None = None  # dataset='treebank': the gold trees (nltk.Tree) that F1 scores against.


def encode_split(data_config: Any, tokenizer: tokenizer_lib.Tokenizer, split: str) -> Split:
  """Reads split `split` (data.*_split's name) and tokenises both sides with `tokenizer`.

  Raises:
    ValueError, FileNotFoundError: from `load_split` (a missing or mismatched file).
  """
  source, target = load_split(data_config, split)
  trees = treebank.split_trees(data_config.treebank_dir, split) if data_config.dataset == 'treebank' else None
  return Split(source, target, encode(tokenizer, source), encode(tokenizer, target), trees)


def split_eval_batches(data_config: Any, source_ids: batching.Ids, target_ids: batching.Ids,
                       data_shards: int, tokens_per_batch: int | None = None) -> list[batching.Batch]:
  """This host's rows of the evaluation batches of a whole split (`batching.eval_batches`).

  Args:
    data_config: config.data (max_length, bucket_lengths, tokens_per_batch).
    source_ids, target_ids: the split's token ids (targets may be empty rows).
    data_shards: the devices a batch's rows are split over; every batch's row count divides by it.
    tokens_per_batch: tokens per batch; None or 0: data.tokens_per_batch (decoding passes
      decode.tokens_per_batch).

  Raises:
    ValueError: if not one row per data shard of the longest bucket fits in tokens_per_batch.
  """
  return batching.eval_batches(
      source_ids, target_ids, tokens_per_batch=tokens_per_batch or data_config.tokens_per_batch,
      max_length=data_config.max_length,
      bucket_lengths=data_config.bucket_lengths, batch_size_multiple=data_shards,
      process_index=jax.process_index(), process_count=jax.process_count())


def bpe_dropout_resegmenter(data_config: Any, tokenizer: tokenizer_lib.Tokenizer, source: list[str],
                            target: list[str]) -> Callable[[int], list[Ragged]] | None:
  """`train_iterator.TrainIterator`'s `resegment` for data.bpe_dropout_rate > 0, else None.

  Returns:
    epoch -> [source ids, target ids], a new BPE-dropout sample of every training pair at each call (~1 s per
    epoch on Multi30k, ~1 min on WMT 2014, in the training loop). SentencePiece's samples differ between
    processes whatever the seed (`tokenizer.Tokenizer.encode`), so with several processes process 0 samples
    and broadcasts them (`broadcast_ragged`), and the other processes keep no text.
  """
  rate = data_config.bpe_dropout_rate
  if not rate:
    return None
  num_pairs = len(source)
  if jax.process_index() != 0:
    source = target = None  # Only process 0 samples.

  def resegment(epoch: int) -> list[Ragged]:
    del epoch  # A new sample at every call.
    sides = [encode(tokenizer, texts, bpe_dropout_rate=rate) if texts is not None else None
             for texts in (source, target)]
    return sides if jax.process_count() == 1 else [broadcast_ragged(ids, num_pairs) for ids in sides]
  return resegment


_BROADCAST_CHUNK = 1 << 22  # Tokens (16 MiB of int32) per broadcast: one compiled shape, bounded device memory.


def broadcast_ragged(ids: Ragged | None, num_sequences: int) -> Ragged:
  """Process 0's `ids` on every process: a collective that every process calls at the same point.

  Args:
    ids: on process 0, num_sequences sequences of int32 ids; None on the others.
    num_sequences: the number of sequences, the same on every process.

  Returns:
    Process 0's ids, int32, in chunks of _BROADCAST_CHUNK tokens.

  Raises:
    ValueError: on process 0, if ids does not hold num_sequences sequences (before any collective).
  """
  if ids is not None and len(ids) != num_sequences:
    raise ValueError(f'Process 0 has {len(ids)} sequences to broadcast, the processes expect {num_sequences}.')
  lengths = ids.lengths if ids is not None else np.zeros(num_sequences, np.int64)
  lengths = np.asarray(multihost_utils.broadcast_one_to_all(lengths.astype(np.int32)), np.int64)
  offsets = batching.offsets_of(lengths)
  values = np.zeros(-(-offsets[-1] // _BROADCAST_CHUNK) * _BROADCAST_CHUNK, np.int32)
  if ids is not None:
    values[:offsets[-1]] = ids.values
  chunks = [np.asarray(multihost_utils.broadcast_one_to_all(values[start:start + _BROADCAST_CHUNK]))
            for start in range(0, len(values), _BROADCAST_CHUNK)]
  return Ragged(np.concatenate(chunks or [values])[:offsets[-1]].astype(np.int32), offsets)


class RunData(NamedTuple):
  """The splits a training run reads, all loaded before the first step (so that bad files fail early)."""
  train_iter: train_iterator.TrainIterator
  eval_batches: list[batching.Batch]  # This host's rows of every validation batch.
  eval_split: Split  # The validation split (its texts for validation BLEU).
  test: Split | None  # The test split when asked for, else None.


def load_run_data(data_config: Any, tokenizer: tokenizer_lib.Tokenizer, *, rows_multiple: int, data_shards: int,
                  with_test: bool) -> RunData:
  """Reads and tokenises every split a training run needs, and logs the counts and the time it took.

  Args:
    data_config: config.data.
    tokenizer: the run's vocabulary.
    rows_multiple: training batches' rows are padded to a multiple of it (data shards x grad_accum_steps).
    data_shards: evaluation batches' rows divide by it.
    with_test: also read the test split (train.translate_at_end).

  Raises:
    errors.ConfigError: if the validation split has no non-empty pair.
    ValueError: from `load_split` for a bad file.
    FileNotFoundError: from `load_split`.
  """
  start = time.perf_counter()
  train_source, train_target = load_split(data_config, data_config.train_split)
  train_iter = train_iterator.TrainIterator.from_config(
      data_config, encode(tokenizer, train_source), encode(tokenizer, train_target),
      pad_rows_to=rows_multiple, process_index=jax.process_index(), process_count=jax.process_count(),
      resegment=bpe_dropout_resegmenter(data_config, tokenizer, train_source, train_target))
  num_train = len(train_source)
  del train_source, train_target
  eval_split = encode_split(data_config, tokenizer, data_config.eval_split)
  if not any(eval_split.target_texts):
    raise errors.ConfigError(f'The validation split {data_config.eval_split!r} has no non-empty pair '
                             f'({split_source(data_config, data_config.eval_split)}): nothing to validate on.')
  test = encode_split(data_config, tokenizer, data_config.test_split) if with_test else None
  logging.info('Data: %d training pairs (%s), %d validation (%s)%s, read and tokenised in %.1f s.', num_train,
               data_config.train_split, len(eval_split.source_texts), data_config.eval_split,
               f', {len(test.source_texts)} test ({data_config.test_split})' if test else '',
               time.perf_counter() - start)
  eval_batches = split_eval_batches(data_config, eval_split.source_ids, eval_split.target_ids, data_shards)
  return RunData(train_iter, eval_batches, eval_split, test)
