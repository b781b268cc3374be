"""The training batches (§5.1): an endless, shuffled, resumable stream of token-budget batches (`TrainIterator`).

Training pairs with an empty side or longer than data.max_length are skipped (counts logged). Each epoch is
planned from the config alone: bucketed, the pairs are shuffled within their buckets, cut into batches (the rest of
a bucket moves up to the next) and the batches shuffled; packed, the pairs are shuffled and placed first-fit into
rows of one length. The iterator's position (`get_state`) is global, so a run resumes with exactly the next batch
on any mesh. The batches themselves, their keys and the bucket and batch-size rules are `batching`'s.
"""
from collections.abc import Callable, Sequence
from typing import Any

from absl import logging
import numpy as np

from transformer_jax import errors
from transformer_jax.data import batching
from transformer_jax.data.batching import Batch
from transformer_jax.data.batching import Ids
from transformer_jax.data.batching import Ragged


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
    (pairs, placement, new cursor); placement as in `batching.make_batch`.
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
    source, target = batching.as_ragged(source), batching.as_ragged(target)
    if len(source) != len(target):
      raise ValueError(f'{len(source)} source sentences but {len(target)} target sentences.')
    self._source, self._target, self._packing = source, target, packing
    self._seed, self._process = shuffle_seed, (process_index, process_count)
    self._tokens_per_batch, self._batch_size_multiple = tokens_per_batch, batch_size_multiple
    self._lengths = np.stack([source.lengths, target.lengths]) + 1  # [2, num_pairs], EOS included.
    self._pairs = _kept_pairs(source.lengths, target.lengths, max_length)
    if not len(self._pairs):
      raise errors.ConfigError(f'No training pair is left of {len(source)} after filtering (max_length={max_length}).')
    buckets = batching.bucket_lengths_for(bucket_lengths, max_length)
    bucket_of = np.zeros(len(source), np.int64)
    bucket_of[self._pairs] = np.searchsorted(buckets, self._lengths[:, self._pairs].max(axis=0))
    used = [int(bucket_of[self._pairs].max())] if packing else np.unique(bucket_of[self._pairs]).tolist()
    self._bucket_of = bucket_of
    self._shapes = {b: (batching.batch_size_for(int(buckets[b]), tokens_per_batch, batch_size_multiple),
                        int(buckets[b])) for b in used}
    # The global batch shapes: the planned rows, padded with empty rows to a multiple of pad_rows_to.
    self._padded = {b: (batching.padded_rows(rows, pad_rows_to), length) for b, (rows, length) in self._shapes.items()}
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
    old_shapes = {b: (batching.batch_size_for(length, saved, self._batch_size_multiple), length)
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
      resegmented = [batching.as_ragged(ids) for ids in self._resegment(self._epoch)]
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
      placement = batching.unpacked(len(pairs))
      self._position += 1
    batch = batching.make_batch(source, target, pairs, placement, self._padded[bucket], self._packing)
    return batching.host_slice(batch, *self._process)

  @classmethod
  def from_config(cls, data_config: Any, source: Ids, target: Ids, **kwargs) -> 'TrainIterator':
    """Takes the batching fields of `config.data`; kwargs: pad_rows_to, batch_size_multiple, process_index,
    process_count, resegment."""
    return cls(source, target, tokens_per_batch=data_config.tokens_per_batch, max_length=data_config.max_length,
               bucket_lengths=data_config.bucket_lengths, packing=data_config.packing,
               shuffle_seed=data_config.shuffle_seed, **kwargs)
