"""Token ids to token-budget batches of numpy arrays (§5.1): the batches, their buckets, evaluation batches.

§5.1: "Sentence pairs were batched together by approximate sequence length. Each training batch contained a
set of sentence pairs containing approximately 25000 source tokens and 25000 target tokens." Here a pair goes to
the smallest bucket length L >= max(source length, target length), EOS included, among `data.bucket_lengths`
(capped at, and completed with, `data.max_length`); a bucket's batch holds tokens_per_batch // L rows (rounded
down to a multiple of `batch_size_multiple`, 1 in training). Training batches are then completed with empty rows
(weight 0) to a multiple of `pad_rows_to` (data shards x train.grad_accum_steps), so the sentences of every
global batch are a function of the config alone, whatever the mesh or process count. So every batch has at most
tokens_per_batch slots per side and one of a few fixed shapes, which bounds recompilation. Training pairs longer
than max_length or with an empty side are skipped (counts logged). Every pair is used once per epoch: the pairs
that do not fill a last batch of their bucket move up to the next bucket, and only the largest bucket's last batch
is completed with padding rows. tokens_per_batch counts slots, padding included: on Multi30k (vocabulary 8000) a
25000-slot batch holds about 19,700 real tokens per side bucketed and 22,600 packed (`python
benchmarks/input_throughput.py --config=configs/base.py --workdir=DIR` prints such figures for a config). Not in
the paper: optional packing of several pairs per row, which wastes fewer slots.

The training stream (epoch plans, packing, resuming) is `train_iterator.TrainIterator`, made of the batches built
here. Neither module knows files, tokenizers or configs beyond `TrainIterator.from_config`: their inputs are token
ids (`Ragged`); `input_pipeline` reads and tokenises the splits.

Batches are dicts of numpy arrays; the global batch is cut into contiguous per-host row slices. Both sides are
padded to the bucket (or packed row) length, so src_len == tgt_len here, though the model may not assume it:
  source_tokens: int32 [batch, src_len]; source ids, EOS_ID, then PAD_ID (0).
  target_tokens: int32 [batch, tgt_len]; target ids, EOS_ID, then PAD_ID.
  decoder_input_tokens: int32 [batch, tgt_len]; BOS_ID, then target_tokens shifted right by one (per segment when
    packed); PAD_ID where target_tokens is PAD_ID.
  With data.packing (training only), rows of one length hold several pairs:
  source_segment_ids, target_segment_ids: int32 [batch, len]; 1..n for the pairs of a row, 0 for padding. Pair k
    of a row has segment id k on both sides.
  source_positions, target_positions: int32 [batch, len]; position within the pair, restarting at 0.
  Evaluation batches (never packed) also have:
  example_index: int32 [batch]; the row of the example in the lists `input_pipeline.load_split` returns (the
    line of the file for 'text' and 'multi30k'); -1 for padding rows.
Padding rows are all PAD_ID (0).
"""
from collections.abc import Iterator, Sequence
import dataclasses
import itertools
import time

from absl import logging
import numpy as np

from transformer_jax import errors
from transformer_jax.data import tokenizer as tokenizer_lib

Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Ragged:
  """Sequences of ids stored flat: sequence i is values[offsets[i]:offsets[i + 1]]. Memory: 4 bytes a token."""
  values: np.ndarray  # int32 [total_tokens]
  offsets: np.ndarray  # int64 [num_sequences + 1]

  @classmethod
  def from_lists(cls, sequences: Sequence[Sequence[int]]) -> 'Ragged':
    """Packs Python sequences of token ids into one int32 array and their offsets."""
    offsets = offsets_of(np.fromiter((len(s) for s in sequences), np.int64, len(sequences)))
    return cls(np.fromiter(itertools.chain.from_iterable(sequences), np.int32, offsets[-1]), offsets)

  @property
  def lengths(self) -> np.ndarray:
    """int64 [num_sequences]: the length of each sequence, in tokens."""
    return np.diff(self.offsets)

  def __len__(self) -> int:
    return len(self.offsets) - 1

  def __getitem__(self, index: int) -> np.ndarray:
    return self.values[self.offsets[index]:self.offsets[index + 1]]

  def select(self, keep: np.ndarray) -> 'Ragged':
    """The same sequences, with those where bool `keep` [num_sequences] is False made empty."""
    lengths = np.where(keep, self.lengths, 0)
    values = self.values[np.repeat(keep, self.lengths)]
    return Ragged(values, offsets_of(lengths))

  def where(self, condition: np.ndarray, other: 'Ragged') -> 'Ragged':
    """Sequence i of self where condition[i], else sequence i of `other`.

    Args:
      condition: bool [num_sequences].
      other: as many sequences as self.

    Raises:
      ValueError: if condition is not bool, or condition, self and other differ in length.
    """
    condition = np.asarray(condition)
    if condition.dtype != bool or not len(condition) == len(self) == len(other):
      raise ValueError(f'Ragged.where needs a bool condition and as many sequences on both sides, got '
                       f'{condition.dtype} [{len(condition)}], {len(self)} and {len(other)} sequences.')
    lengths = np.where(condition, self.lengths, other.lengths)
    offsets = offsets_of(lengths)
    from_self = np.repeat(condition, lengths)
    values = np.empty(offsets[-1], np.int32)
    values[from_self] = self.values[np.repeat(condition, self.lengths)]
    values[~from_self] = other.values[np.repeat(~condition, other.lengths)]
    return Ragged(values, offsets)

  def truncate(self, max_tokens: int) -> 'Ragged':
    """Keeps the first max_tokens ids of every sequence."""
    lengths = self.lengths
    position = np.arange(len(self.values)) - np.repeat(self.offsets[:-1], lengths)
    kept = np.minimum(lengths, max_tokens)
    return Ragged(self.values[position < np.repeat(kept, lengths)], offsets_of(kept))


def offsets_of(lengths: np.ndarray) -> np.ndarray:
  """int64 [num_sequences + 1]: Ragged.offsets of sequences of these int lengths [num_sequences]."""
  return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


Ids = Ragged | Sequence[Sequence[int]]  # Token ids of a split: a Ragged, or one list of ids per sentence.


def as_ragged(ids: Ids) -> Ragged:
  """`ids` as a Ragged (lists of ids are converted)."""
  return ids if isinstance(ids, Ragged) else Ragged.from_lists(ids)


def bucket_lengths_for(bucket_lengths: Sequence[int], max_length: int) -> np.ndarray:
  """The sorted bucket lengths in use: data.bucket_lengths capped at max_length, plus max_length itself."""
  return np.array(sorted({min(int(length), max_length) for length in bucket_lengths} | {max_length}))


def batch_size_for(length: int, tokens_per_batch: int, batch_size_multiple: int, process_count: int = 1) -> int:
  """Rows of a batch of length `length`: tokens_per_batch // length, rounded down to batch_size_multiple.

  Raises:
    errors.ConfigError: if not one row of that length fits (naming tokens_per_batch).
    ValueError: if the rows do not divide by process_count.
  """
  batch_size = tokens_per_batch // length // batch_size_multiple * batch_size_multiple
  if batch_size == 0:
    raise errors.ConfigError(f'tokens_per_batch={tokens_per_batch} is too small for length {length} with '
                             f'batch_size_multiple={batch_size_multiple}: the batch size rounds down to 0.')
  if batch_size % process_count:
    raise ValueError(f'Batch size {batch_size} (length {length}) does not divide by process_count={process_count}; '
                     'batch_size_multiple should be a multiple of it.')
  return batch_size


def padded_rows(rows: int, multiple: int) -> int:
  """rows rounded up to a multiple of `multiple` (the training batch's rows, completed with empty ones)."""
  return -(-rows // multiple) * multiple


def _fill(ids: Ragged, pairs: np.ndarray, rows: np.ndarray, starts: np.ndarray, segments: np.ndarray,
          shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Writes ids[pairs[i]] + EOS into row rows[i] from column starts[i], with segment id segments[i].

  Returns:
    tokens, positions and segment ids, each int32 [shape], 0 where nothing was written.
  """
  tokens, positions, segment_ids = (np.zeros(shape, np.int32) for _ in range(3))
  lengths = ids.lengths[pairs] + 1  # EOS included.
  sequence = np.repeat(np.arange(len(pairs)), lengths)  # [tokens written]: which pair.
  position = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
  row, column = rows[sequence], starts[sequence] + position
  is_id = position < lengths[sequence] - 1
  tokens[row, column] = tokenizer_lib.EOS_ID
  tokens[row[is_id], column[is_id]] = ids.values[ids.offsets[pairs][sequence[is_id]] + position[is_id]]
  positions[row, column] = position
  segment_ids[row, column] = segments[sequence]
  return tokens, positions, segment_ids


def make_batch(source: Ragged, target: Ragged, pairs: np.ndarray, placement: tuple[np.ndarray, ...],
                shape: tuple[int, int], packed: bool) -> Batch:
  """The global batch (module docstring); placement = (rows, source starts, target starts, segment ids)."""
  rows, source_starts, target_starts, segments = placement
  source_tokens, source_positions, source_segment_ids = _fill(source, pairs, rows, source_starts, segments, shape)
  target_tokens, target_positions, target_segment_ids = _fill(target, pairs, rows, target_starts, segments, shape)
  shifted = np.where(target_positions == 0, tokenizer_lib.BOS_ID, np.roll(target_tokens, 1, axis=1))
  batch = {'source_tokens': source_tokens, 'target_tokens': target_tokens,
           'decoder_input_tokens': np.where(target_tokens != tokenizer_lib.PAD_ID, shifted, 0).astype(np.int32)}
  if packed:
    batch.update(source_segment_ids=source_segment_ids, target_segment_ids=target_segment_ids,
                 source_positions=source_positions, target_positions=target_positions)
  return batch


def unpacked(num_pairs: int) -> tuple[np.ndarray, ...]:
  """Placement of one pair per row from column 0."""
  zeros = np.zeros(num_pairs, np.int64)
  return np.arange(num_pairs), zeros, zeros, zeros + 1


def host_slice(batch: Batch, process_index: int, process_count: int) -> Batch:
  """This host's contiguous rows of a global batch."""
  rows = len(batch['source_tokens']) // process_count
  return {key: value[process_index * rows:(process_index + 1) * rows] for key, value in batch.items()}


def _few(lines: np.ndarray, shown: int = 5) -> str:
  """1-based line numbers, the first few then a count: '[3, 9]' or '[3, 9, 12, 20, 41] and 7 more'."""
  more = f' and {len(lines) - shown} more' if len(lines) > shown else ''
  return f'{lines[:shown].tolist()}{more}'


def _truncate(ids: Ragged, max_length: int, side: str) -> Ragged:
  """Cuts sequences to max_length - 1 ids (max_length with EOS), logging how many (and the first lines) it cut."""
  lines = np.flatnonzero(ids.lengths > max_length - 1) + 1
  if len(lines):
    logging.warning('Truncated %d of %d %s sentences to max_length=%d tokens (EOS included); lines %s.',
                    len(lines), len(ids), side, max_length, _few(lines))
  return ids.truncate(max_length - 1)


def _without_long_targets(target: Ragged, max_length: int) -> tuple[Ragged, np.ndarray]:
  """(target with the sequences longer than max_length - 1 ids emptied, bool [num_sequences]: which).

  Cut to max_length, such a target would end in an EOS the reference does not have there, and its loss would
  score that premature EOS. `eval_batches` gives its row no target token (not even EOS), so it weighs 0 in the
  loss; its source is still batched, so translation and BLEU keep every line.
  """
  long = target.lengths > max_length - 1
  if not long.any():
    return target, long
  logging.warning('%d of %d evaluation lines longer than data.max_length=%d (EOS included) on the target side: '
                  'left out of the validation loss (a cut target would score a premature EOS); their sources '
                  'are still translated. Lines %s.', long.sum(), len(target), max_length,
                  _few(np.flatnonzero(long) + 1))
  return target.select(~long), long


def eval_batches(source: Ids, target: Ids, *, tokens_per_batch: int, max_length: int,
                 bucket_lengths: Sequence[int], batch_size_multiple: int = 1, process_index: int = 0,
                 process_count: int = 1) -> list[Batch]:
  """Evaluation batches of a whole split: every pair once, empty ones included, none packed.

  Pairs are grouped by bucket (as in training) in their original order; example_index gives each row's index in
  `source` (-1 for the padding rows that complete a bucket's last batch). Sources longer than max_length tokens
  (EOS included) are cut to it, keeping EOS last. Targets longer than that are left out of the teacher-forced
  loss rather than cut (cut, they would end in a premature EOS): their rows get an empty target (all PAD_ID,
  no EOS), which weighs 0, while the source stays, so every line is still translated. Both counts are logged
  ("N of M evaluation lines longer than data.max_length=..."). Arguments as for `train_iterator.TrainIterator`.

  Returns:
    This host's rows of each global batch.

  Raises:
    ValueError: if source and target hold different numbers of sentences.
  """
  source, target = as_ragged(source), as_ragged(target)
  if len(source) != len(target):
    raise ValueError(f'{len(source)} source sentences but {len(target)} target sentences.')
  source = _truncate(source, max_length, 'source')
  target, long_target = _without_long_targets(target, max_length)
  buckets = bucket_lengths_for(bucket_lengths, max_length)
  bucket_of = np.searchsorted(buckets, np.maximum(source.lengths, target.lengths) + 1)
  batches = []
  for bucket in np.unique(bucket_of):
    length = int(buckets[bucket])
    batch_size = batch_size_for(length, tokens_per_batch, batch_size_multiple, process_count)
    members = np.flatnonzero(bucket_of == bucket)
    for pairs in np.split(members, np.arange(batch_size, len(members), batch_size)):
      batch = make_batch(source, target, pairs, unpacked(len(pairs)), (batch_size, length), packed=False)
      for key in ('target_tokens', 'decoder_input_tokens'):  # No EOS either: these rows weigh 0 in the loss.
        batch[key][:len(pairs)][long_target[pairs]] = 0
      batch['example_index'] = np.pad(pairs, (0, batch_size - len(pairs)), constant_values=-1).astype(np.int32)
      batches.append(host_slice(batch, process_index, process_count))
  return batches


def measure_throughput(batches: Iterator[Batch], num_batches: int) -> dict[str, float]:
  """Times `num_batches` batches: batches/s, tokens/s (non-padding, source + target), padding fraction, shapes."""
  shapes, tokens, slots = set(), 0, 0
  start = time.perf_counter()
  for batch in itertools.islice(batches, num_batches):
    shapes.add((batch['source_tokens'].shape, batch['target_tokens'].shape))
    for key in ('source_tokens', 'target_tokens'):
      tokens += np.count_nonzero(batch[key])
      slots += batch[key].size
  seconds = time.perf_counter() - start
  return {'batches_per_sec': num_batches / seconds, 'tokens_per_sec': tokens / seconds,
          'padding_fraction': 1 - tokens / slots, 'distinct_shapes': len(shapes)}
