"""Token ids to token-budget batches of numpy arrays (§5.1): bucketing, packing, the training iterator.

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

This module knows nothing of files, tokenizers or configs beyond `TrainIterator.from_config`: its inputs are
token ids (`Ragged`); `input_pipeline` reads and tokenises the splits.

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
from collections.abc import Callable, Iterator, Sequence
import dataclasses
import itertools
import time
from typing import Any

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


def _make_batch(source: Ragged, target: Ragged, pairs: np.ndarray, placement: tuple[np.ndarray, ...],
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


def _unpacked(num_pairs: int) -> tuple[np.ndarray, ...]:
  """Placement of one pair per row from column 0."""
  zeros = np.zeros(num_pairs, np.int64)
  return np.arange(num_pairs), zeros, zeros, zeros + 1


def _host_slice(batch: Batch, process_index: int, process_count: int) -> Batch:
  """This host's contiguous rows of a global batch."""
  rows = len(batch['source_tokens']) // process_count
  return {key: value[process_index * rows:(process_index + 1) * rows] for key, value in batch.items()}


def _kept_pairs(source_lengths: np.ndarray, target_lengths: np.ndarray, max_length: int) -> np.ndarray:
  """Indices of the training pairs with two non-empty sides of at most max_length tokens (EOS included)."""
  empty = (source_lengths == 0) | (target_lengths == 0)
  too_long = ~empty & (np.maximum(source_lengths, target_lengths) + 1 > max_length)
  logging.info('Training pairs: %d kept; skipped %d with an empty side and %d longer than max_length=%d.',
               np.sum(~empty & ~too_long), np.sum(empty), np.sum(too_long), max_length)
  return np.flatnonzero(~empty & ~too_long)



def _pack(lengths: np.ndarray, order: np.ndarray, cursor: int, shape: tuple[int, int]):
  """First-fit packing of pairs order[cursor:] into shape[0] rows of shape[1] slots, until a pair fits nowhere.

  Args:
    lengths: int [2, num_pairs]; source and target lengths, EOS included.
    order: pair indices in the order to pack.
    cursor: the first position of `order` to pack; it must fit an empty row.
    shape: (rows, row length).

  Returns:
    (pairs, placement, new cursor); placement as in `_make_batch`.
  """
  num_rows, row_length = shape
  fill = np.zeros((2, num_rows), np.int64)  # Slots used per row: source, target.
  count = np.zeros(num_rows, np.int64)  # Pairs per row so far.
  placed = []  # (pair, row, source start, target start, segment id)
  while cursor < len(order):
    pair = order[cursor]
    need = lengths[:, pair]
    fits = (fill[0] <= row_length - need[0]) & (fill[1] <= row_length - need[1])
    row = int(fits.argmax())
    if not fits[row]:
      break
    count[row] += 1
    placed.append((pair, row, fill[0, row], fill[1, row], count[row]))
    fill[:, row] += need
    cursor += 1
  pairs, *placement = (np.array(column, np.int64) for column in zip(*placed))
  return pairs, tuple(placement), cursor


def _bucketed_plan(rng: np.random.Generator, pairs: np.ndarray, bucket_of: np.ndarray,
                   shapes: dict[int, tuple[int, int]]) -> list[tuple[int, np.ndarray]]:
  """One epoch of (bucket, pair indices) batches: pairs shuffled within buckets, then batches shuffled.

  The pairs left over after a bucket's full batches move up to the next bucket in use (where they fit too), so
  that only the largest bucket's last batch has padding rows.
  """
  batches, carried = [], np.zeros(0, np.int64)
  for bucket, (batch_size, _) in sorted(shapes.items()):
    members = np.concatenate([carried, rng.permutation(pairs[bucket_of[pairs] == bucket])])
    full = len(members) // batch_size * batch_size
    batches += [(bucket, members[i:i + batch_size]) for i in range(0, full, batch_size)]
    carried = members[full:]
  if len(carried):
    batches.append((bucket, carried))
  return [batches[i] for i in rng.permutation(len(batches))]


class TrainIterator:
  """Endless training batches (Sec. 5.1), bucketed by length or packed, deterministic and resumable.

  Epoch e is shuffled by numpy's Generator seeded with (shuffle_seed, e): pairs within buckets and the order of
  the batches (bucketed), or the order of the pairs (packed). Every host builds the same global batch and keeps its
  contiguous rows. Packing: rows have the length of the largest bucket any kept pair needs; a batch has
  tokens_per_batch // row_length rows (rounded as for buckets); pairs are placed first-fit in shuffled order until
  one fits nowhere, which starts the next batch. An epoch's last batch may have empty rows.

  BPE-dropout (data.bpe_dropout_rate; Provilkov et al., 2020, not in the paper): `resegment(epoch)` gives each
  epoch its own segmentations of the training pairs. The pairs kept, the buckets, the batch shapes and every
  epoch's plan come from the deterministic ids, so they do not change; a sampled side is used where it fits the
  slot planned for the deterministic one (its bucket's length, or the packed row length, EOS included), else
  that side keeps its deterministic ids. Bucketed batches fall back to the deterministic ids far more often
  than packed ones (a pair at the top of its bucket has no room for a longer sample), so the share of sampled
  sides depends on data.bucket_lengths; packing suits BPE-dropout better. Each epoch's share of sampled sides
  and mean lengths are logged. SentencePiece's samples are not reproducible (`tokenizer.Tokenizer.encode`): a
  resumed run trains the rest of its epoch on a new sample, the same pairs (none repeated or skipped) in other
  segmentations, packed anew.
  """

  def __init__(self, source: Ids, target: Ids, *, tokens_per_batch: int, max_length: int,
               bucket_lengths: Sequence[int], packing: bool = False, batch_size_multiple: int = 1,
               shuffle_seed: int = 0, process_index: int = 0, process_count: int = 1, pad_rows_to: int = 1,
               resegment: Callable[[int], Sequence[Ids]] | None = None):
    """Filters the pairs and fixes the batch shapes.

    Args:
      source, target: token ids without EOS (`input_pipeline.encode`, or lists of ids), aligned.
      tokens_per_batch: slots per side and batch (Sec. 5.1: 25000), padding included.
      max_length: longest pair kept, EOS included.
      bucket_lengths: bucket lengths, capped at max_length.
      packing: pack several pairs per row (not in the paper).
      batch_size_multiple: the planned rows of a batch are rounded down to a multiple of this. Training keeps 1
        and pads instead (pad_rows_to), so that the batches do not depend on the mesh.
      shuffle_seed: seeds every epoch's shuffle.
      process_index, process_count: this host and the number of hosts.
      pad_rows_to: every global batch is completed with empty rows (all PAD, weight 0) to a multiple of this
        (data shards x train.grad_accum_steps); the planned sentences do not depend on it.
      resegment: BPE-dropout, or None: epoch -> [source ids, target ids] of every pair for that epoch, aligned
        with `source` and `target` (which stay the deterministic ids). Called once per epoch, by the first
        batch of the epoch; it must give every host the same ids.

    Raises:
      errors.ConfigError: if no pair is left (naming max_length), or a batch size rounds down to 0.
      ValueError: if source and target differ in length, or a batch (padded) does not divide by process_count.
        From `next`: if resegment gives other than two sides of len(source) sequences.
    """
    source, target = as_ragged(source), as_ragged(target)
    if len(source) != len(target):
      raise ValueError(f'{len(source)} source sentences but {len(target)} target sentences.')
    self._source, self._target, self._packing = source, target, packing
    self._seed, self._process = shuffle_seed, (process_index, process_count)
    self._tokens_per_batch, self._batch_size_multiple = tokens_per_batch, batch_size_multiple
    self._lengths = np.stack([source.lengths, target.lengths]) + 1  # [2, num_pairs], EOS included.
    self._pairs = _kept_pairs(source.lengths, target.lengths, max_length)
    if not len(self._pairs):
      raise errors.ConfigError(f'No training pair is left of {len(source)} after filtering (max_length={max_length}).')
    buckets = bucket_lengths_for(bucket_lengths, max_length)
    bucket_of = np.zeros(len(source), np.int64)
    bucket_of[self._pairs] = np.searchsorted(buckets, self._lengths[:, self._pairs].max(axis=0))
    used = [int(bucket_of[self._pairs].max())] if packing else np.unique(bucket_of[self._pairs]).tolist()
    self._bucket_of = bucket_of
    self._shapes = {b: (batch_size_for(int(buckets[b]), tokens_per_batch, batch_size_multiple), int(buckets[b]))
                    for b in used}
    # The global batch shapes: the planned rows, padded with empty rows to a multiple of pad_rows_to.
    self._padded = {b: (padded_rows(rows, pad_rows_to), length) for b, (rows, length) in self._shapes.items()}
    for rows, length in self._padded.values():
      if rows % process_count:
        raise ValueError(f'Batch size {rows} (length {length}) does not divide by process_count={process_count}; '
                         'pad_rows_to or batch_size_multiple should be a multiple of it.')
    self._epoch, self._position, self._plan = 0, 0, (-1, [])
    # The slot of each kept pair's sides (0 for the others): its bucket's length, or the packed row length.
    self._slot_length = np.zeros(len(source), np.int64)
    self._slot_length[self._pairs] = (max(length for _, length in self._shapes.values()) if packing
                                      else buckets[bucket_of[self._pairs]])
    self._resegment, self._epoch_ids = resegment, (-1, source, target, self._lengths)
    # Every epoch has the same shapes: how many pairs move up from a bucket depends only on the bucket sizes.
    self._shapes_used = sorted(self._padded.values() if packing else {self._padded[b] for b, _ in self._epoch_plan()})
    logging.info('%d distinct global batch shapes [batch, length] (%s): %s', len(self._shapes_used),
                 'packed' if packing else 'bucketed', self._shapes_used)

  @property
  def shapes(self) -> list[tuple[int, int]]:
    """The global [batch, length] shapes of the batches, sorted (source and target share one)."""
    return self._shapes_used

  def get_state(self) -> dict[str, int]:
    """{'epoch', 'position', 'tokens_per_batch'}: a global position, whatever the mesh or process count.

    position is the next batch (bucketed) or pair (packed) of the epoch's plan, which depends on the config
    only (`pad_rows_to` adds empty rows, never sentences); tokens_per_batch says which batches it counts.
    """
    return {'epoch': self._epoch, 'position': self._position, 'tokens_per_batch': self._tokens_per_batch}

  def set_state(self, state: dict[str, int]) -> None:
    """Restores `get_state()`, so that the next batch is the one that followed it (on any topology).

    A state saved with another tokens_per_batch (bucketed batches) continues the same epoch: the pairs its
    first `position` batches held are left out, and the rest of the epoch is batched anew at this
    tokens_per_batch (logged), so that no pair is seen twice or skipped. Packed positions count pairs, which
    any tokens_per_batch continues. States without tokens_per_batch (older checkpoints) mean this one.

    Raises:
      ValueError: for other keys.
    """
    if set(state) not in ({'epoch', 'position'}, {'epoch', 'position', 'tokens_per_batch'}):
      raise ValueError(f"State must have keys 'epoch' and 'position' (and 'tokens_per_batch'), got {sorted(state)}.")
    self._epoch, self._position = int(state['epoch']), int(state['position'])
    saved = int(state.get('tokens_per_batch', self._tokens_per_batch))
    if saved == self._tokens_per_batch or self._packing:
      return
    old_shapes = {b: (batch_size_for(length, saved, self._batch_size_multiple), length)
                  for b, (_, length) in self._shapes.items()}
    old_plan = _bucketed_plan(np.random.default_rng([self._seed, self._epoch]), self._pairs, self._bucket_of,
                              old_shapes)
    seen = np.concatenate([pairs for _, pairs in old_plan[:self._position]] or [np.zeros(0, np.int64)])
    rest = np.setdiff1d(self._pairs, seen)
    plan = _bucketed_plan(np.random.default_rng([self._seed, self._epoch, 1]), rest, self._bucket_of,
                          self._shapes)
    self._plan, self._position = (self._epoch, plan), 0
    logging.warning('The data position was saved with data.tokens_per_batch=%d, this run has %d: the %d pairs '
                    'left of epoch %d are batched anew at %d (none repeated, none skipped). Each step is still one '
                    'update, so train.num_train_steps and the learning-rate schedule (warmup_steps) now count '
                    'updates of the new batch size.', saved, self._tokens_per_batch, len(rest), self._epoch,
                    self._tokens_per_batch)

  def _ids(self) -> tuple[Ragged, Ragged, np.ndarray]:
    """The current epoch's (source, target, [2, num_pairs] lengths with EOS): resegmented, or the deterministic."""
    if self._resegment is None:
      return self._source, self._target, self._lengths
    if self._epoch_ids[0] != self._epoch:
      resegmented = [as_ragged(ids) for ids in self._resegment(self._epoch)]
      if [len(ids) for ids in resegmented] != [len(self._source)] * 2:
        raise ValueError(f'resegment({self._epoch}) must give [source ids, target ids] of {len(self._source)} '
                         f'sequences each, got {[len(ids) for ids in resegmented]}.')
      sides = []
      for deterministic, sampled in zip((self._source, self._target), resegmented):
        fits = sampled.lengths + 1 <= self._slot_length
        sides.append((sampled.where(fits, deterministic), fits[self._pairs].mean()))
      (source, source_share), (target, target_share) = sides
      lengths = np.stack([source.lengths, target.lengths]) + 1
      self._epoch_ids = (self._epoch, source, target, lengths)
      logging.info('Epoch %d: BPE-dropout segmentations for %.1f%% of the sources and %.1f%% of the targets (the '
                   'rest too long for their slot); %.1f source and %.1f target tokens per pair (EOS included), '
                   'deterministic %.1f and %.1f.', self._epoch, 100 * source_share, 100 * target_share,
                   *lengths[:, self._pairs].mean(axis=1), *self._lengths[:, self._pairs].mean(axis=1))
    return self._epoch_ids[1:]

  def _epoch_plan(self) -> list[tuple[int, np.ndarray]] | np.ndarray:
    if self._plan[0] != self._epoch:
      rng = np.random.default_rng([self._seed, self._epoch])
      plan = (rng.permutation(self._pairs) if self._packing
              else _bucketed_plan(rng, self._pairs, self._bucket_of, self._shapes))
      self._plan = (self._epoch, plan)
    return self._plan[1]

  def __iter__(self) -> 'TrainIterator':
    return self

  def __next__(self) -> Batch:
    if self._position >= len(self._epoch_plan()):
      self._epoch, self._position = self._epoch + 1, 0
    plan = self._epoch_plan()
    source, target, lengths = self._ids()
    if self._packing:
      bucket = next(iter(self._shapes))
      pairs, placement, self._position = _pack(lengths, plan, self._position, self._shapes[bucket])
    else:
      bucket, pairs = plan[self._position]
      placement = _unpacked(len(pairs))
      self._position += 1
    batch = _make_batch(source, target, pairs, placement, self._padded[bucket], self._packing)
    return _host_slice(batch, *self._process)

  @classmethod
  def from_config(cls, data_config: Any, source: Ids, target: Ids, **kwargs) -> 'TrainIterator':
    """Takes the batching fields of `config.data`; kwargs: pad_rows_to, batch_size_multiple, process_index,
    process_count, resegment."""
    return cls(source, target, tokens_per_batch=data_config.tokens_per_batch, max_length=data_config.max_length,
               bucket_lengths=data_config.bucket_lengths, packing=data_config.packing,
               shuffle_seed=data_config.shuffle_seed, **kwargs)


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
  ("N of M evaluation lines longer than data.max_length=..."). Arguments as for `TrainIterator`.

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
      batch = _make_batch(source, target, pairs, _unpacked(len(pairs)), (batch_size, length), packed=False)
      for key in ('target_tokens', 'decoder_input_tokens'):  # No EOS either: these rows weigh 0 in the loss.
        batch[key][:len(pairs)][long_target[pairs]] = 0
      batch['example_index'] = np.pad(pairs, (0, batch_size - len(pairs)), constant_values=-1).astype(np.int32)
      batches.append(_host_slice(batch, process_index, process_count))
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
