"""Tests for transformer_jax.data.batching: token-budget buckets, packing, the resumable training iterator, BPE-dropout
resampling slots, host slices and evaluation batches, on synthetic token ids (no corpus needed)."""
import collections
import json
import logging

import numpy as np
import pytest

from configs import base
from transformer_jax.data import batching
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.data import train_iterator

EOS, BOS = tokenizer_lib.EOS_ID, tokenizer_lib.BOS_ID
BUCKETS = base.get_config().data.bucket_lengths


def unpack(batch):
  """(source, target) token tuples of every segment of a packed batch, checking positions and decoder inputs."""
  pairs = []
  for row in range(len(batch['source_tokens'])):
    source_segments, target_segments = batch['source_segment_ids'][row], batch['target_segment_ids'][row]
    for side in ('source', 'target'):
      used = batch[f'{side}_segment_ids'][row] != 0
      assert np.all(np.diff(used.astype(int)) <= 0)  # Padding only at the end of the row.
      np.testing.assert_array_equal(used, batch[f'{side}_tokens'][row] != 0)
    for segment in range(1, source_segments.max() + 1):
      source = batch['source_tokens'][row][source_segments == segment]
      target = batch['target_tokens'][row][target_segments == segment]
      decoder_input = batch['decoder_input_tokens'][row][target_segments == segment]
      np.testing.assert_array_equal(batch['source_positions'][row][source_segments == segment],
                                    np.arange(len(source)))
      np.testing.assert_array_equal(batch['target_positions'][row][target_segments == segment],
                                    np.arange(len(target)))
      np.testing.assert_array_equal(decoder_input, np.concatenate([[BOS], target[:-1]]))
      pairs.append((tuple(source), tuple(target)))
    assert set(target_segments) - {0} == set(source_segments) - {0}
  return pairs


def finer(ids, epoch):
  """A stand-in for BPE-dropout: every other id of each sequence split in two (the same id twice), the ids
  chosen by the epoch, so that sampled sides are longer and some no longer fit their slot."""
  return batching.Ragged.from_lists(
      [[token for j, token in enumerate(ids[i]) for _ in range(1 + (j + epoch) % 2)] for i in range(len(ids))])


@pytest.fixture(scope='module')
def train_ids():
  """(source, target) token ids as Ragged of 8,000 synthetic pairs whose lengths resemble Multi30k's (BPE 8k:
  about 14 source tokens, targets a little longer, 2 to 60); the batching logic needs no real corpus."""
  rng = np.random.default_rng(0)
  source_lengths = np.clip(np.round(rng.normal(14, 5, 8000)), 2, 60).astype(int)
  source_lengths[:6000:500] = rng.integers(38, 46, 12)  # A tail of long sentences, as in the real corpus; the
  source_lengths[6000::100] = rng.integers(50, 61, 20)  # longest (bucket 64) after the first 6,000 pairs.
  target_lengths = np.clip(source_lengths + np.round(rng.normal(1, 3, 8000)).astype(int), 2, 60)
  target_lengths[:6000] = np.minimum(target_lengths[:6000], 46)
  make = lambda lengths: batching.Ragged.from_lists([rng.integers(4, 8000, n).tolist() for n in lengths])
  return make(source_lengths), make(target_lengths)


def make_iterator(train_ids, **kwargs):
  kwargs = {'tokens_per_batch': 25_000, 'max_length': 256, 'bucket_lengths': BUCKETS, **kwargs}
  return train_iterator.TrainIterator(*train_ids, **kwargs)


def one_epoch(iterator):
  """The batches of the iterator's current epoch, the state at its end, and the first batch of the next."""
  batches = []
  while True:
    state = iterator.get_state()
    batch = next(iterator)
    if iterator.get_state()['epoch'] != state['epoch']:
      return batches, state, batch
    batches.append(batch)


def row_pairs(batch):
  """(source tokens, target tokens) of every row that holds a pair, as tuples without padding."""
  return [(tuple(s[s != 0]), tuple(t[t != 0])) for s, t in zip(batch['source_tokens'], batch['target_tokens'])
          if s.any()]


def expected_pairs(train_ids, max_length=256):
  source, target = train_ids
  return collections.Counter(
      (tuple(source[i]) + (EOS,), tuple(target[i]) + (EOS,)) for i in range(len(source))
      if 0 < len(source[i]) < max_length and 0 < len(target[i]) < max_length)


def assert_batches_equal(first, second):
  assert first.keys() == second.keys()
  for key in first:
    np.testing.assert_array_equal(first[key], second[key], err_msg=key)


def test_bucketed_epoch_respects_budget_and_uses_every_pair_once(train_ids):
  iterator = make_iterator(train_ids, batch_size_multiple=8)
  batches, _, _ = one_epoch(iterator)
  shapes = {batch['source_tokens'].shape for batch in batches}
  assert shapes == set(iterator.shapes) and 4 <= len(shapes) <= 9  # Multi30k pairs need buckets 8 to 64.
  lengths = sorted(length for _, length in shapes)
  moved_up = 0
  for batch in batches:
    rows, length = batch['source_tokens'].shape
    assert rows * length <= 25_000 and rows % 8 == 0
    assert batch['target_tokens'].shape == batch['decoder_input_tokens'].shape == (rows, length)
    assert all(value.dtype == np.int32 for value in batch.values())
    smaller = max([0] + [l for l in lengths if l < length])
    for source, target in row_pairs(batch):
      assert max(len(source), len(target)) <= length
      moved_up += max(len(source), len(target)) <= smaller  # Not in the smallest bucket that fits.
      assert source[-1] == EOS and target[-1] == EOS and EOS not in source[:-1] + target[:-1]
    shifted = np.where(batch['target_tokens'] != 0, np.roll(batch['target_tokens'], 1, axis=1), 0)
    shifted[:, 0] = np.where(batch['target_tokens'][:, 0] != 0, BOS, 0)
    np.testing.assert_array_equal(batch['decoder_input_tokens'], shifted)
  assert moved_up < sum(rows for rows, _ in shapes)  # Only leftovers, less than one batch per bucket, move up.
  assert sum(not batch['source_tokens'][-1].any() for batch in batches) == 1  # One batch has padding rows.
  seen = collections.Counter(pair for batch in batches for pair in row_pairs(batch))
  assert seen == expected_pairs(train_ids)


def test_packing_keeps_every_token_exactly_once(train_ids):
  iterator = make_iterator(train_ids, packing=True, batch_size_multiple=8)
  assert iterator.shapes == [(384, 64)]  # 25000 // 64 = 390 rows, rounded down to a multiple of 8.
  first_pairs = tuple(batching.Ragged.from_lists([ids[i] for i in range(6000)]) for ids in train_ids)
  iterator = make_iterator(first_pairs, packing=True, tokens_per_batch=8000)  # Fewer segments to check: faster.
  batches, _, _ = one_epoch(iterator)
  assert iterator.shapes == [(166, 48)]  # These pairs need at most 48 slots; 8000 // 48 = 166 rows.
  assert {batch['source_tokens'].shape for batch in batches} == {(166, 48)}
  assert all(len(batch) == 7 for batch in batches)
  seen = collections.Counter(pair for batch in batches for pair in unpack(batch))
  assert seen == expected_pairs(first_pairs)


@pytest.mark.parametrize('packing', [False, True])
def test_bpe_dropout_resegments_every_epoch_in_the_planned_shapes(train_ids, packing):
  pairs = tuple(batching.Ragged.from_lists([ids[i] for i in range(3000)]) for ids in train_ids)
  calls = []
  def resegment(epoch):
    calls.append(epoch)
    return [finer(ids, epoch) for ids in pairs]
  deterministic = make_iterator(pairs, packing=packing, tokens_per_batch=8000)
  iterator = make_iterator(pairs, packing=packing, tokens_per_batch=8000, resegment=resegment)
  assert iterator.shapes == deterministic.shapes
  buckets = batching.bucket_lengths_for(BUCKETS, 256)
  first = []
  for epoch in (0, 1):
    batches, _, next_first = one_epoch(iterator)
    batches, first = first + batches, [next_first]
    expected, used_sampled = collections.Counter(), collections.Counter()
    for i in range(len(pairs[0])):
      sides = [(tuple(ids[i]) + (EOS,), tuple(finer(batching.Ragged.from_lists([ids[i]]), epoch)[0]) + (EOS,))
               for ids in pairs]
      # The slot planned from the deterministic ids: the packed row, or the pair's bucket.
      room = (iterator.shapes[0][1] if packing
              else buckets[np.searchsorted(buckets, max(len(side[0]) for side in sides))])
      expected[tuple(sampled if len(sampled) <= room else kept for kept, sampled in sides)] += 1
      used_sampled.update(len(sampled) <= room for _, sampled in sides)
    seen = collections.Counter(pair for batch in batches for pair in (unpack(batch) if packing else row_pairs(batch)))
    assert seen == expected
    assert used_sampled[True] > 500 and used_sampled[False] > 10  # Both cases are tested.
    assert {batch['source_tokens'].shape for batch in batches} <= set(iterator.shapes)
    if not packing:  # Each pair stays in its bucket.
      for batch in batches:
        assert all(max(len(s), len(t)) <= batch['source_tokens'].shape[1] for s, t in row_pairs(batch))
  assert calls == [0, 1, 2]  # Once per epoch (one_epoch reads the next epoch's first batch).


def test_bpe_dropout_sample_is_used_where_it_fits_the_planned_slot():
  # Buckets 4 and 8 (EOS included). [5, 6] + EOS and its sample [5, 5, 6] + EOS fit bucket 4; [5, 6, 7] + EOS
  # fits bucket 4 but its sample [5, 5, 6, 7] + EOS does not, so bucketed it keeps [5, 6, 7], while packed rows
  # (8 long: the third pair needs bucket 8) have room for it. Targets [9] and [9, 9] fit everywhere.
  source = [[5, 6], [5, 6, 7], [5, 6, 7, 8, 9]]
  sampled = [[5, 5, 6], [5, 5, 6, 7], [5, 5, 6, 7, 8, 9]]
  target, sampled_target = [[9]] * 3, [[9, 9]] * 3
  sample_of_third = ((5, 5, 6, 7, 8, 9, EOS), (9, 9, EOS))
  for packing, second in ((False, (5, 6, 7, EOS)), (True, (5, 5, 6, 7, EOS))):
    iterator = train_iterator.TrainIterator(
        source, target, tokens_per_batch=16, max_length=8, bucket_lengths=(4, 8), packing=packing,
        resegment=lambda epoch: (sampled, sampled_target))
    batches, _, _ = one_epoch(iterator)
    pairs = [pair for batch in batches for pair in (unpack(batch) if packing else row_pairs(batch))]
    assert sorted(pairs) == sorted([((5, 5, 6, EOS), (9, 9, EOS)), sample_of_third, (second, (9, 9, EOS))]), packing


def test_bpe_dropout_resumed_run_trains_every_pair_once_on_a_new_sample(train_ids):
  """A resumed run draws another sample of its epoch (SentencePiece's cannot be repeated): the pairs after the
  saved position are each trained once, packed anew."""
  pairs = tuple(batching.Ragged.from_lists([ids[i] for i in range(2000)]) for ids in train_ids)
  index = {}  # Any segmentation of a pair -> the pair.
  for i in range(len(pairs[0])):
    for source_epoch in (None, 0, 1):
      for target_epoch in (None, 0, 1):
        key = tuple(tuple(ids[i] if epoch is None else finer(batching.Ragged.from_lists([ids[i]]), epoch)[0])
                    + (EOS,) for ids, epoch in zip(pairs, (source_epoch, target_epoch)))
        index[key] = i
  for packing in (False, True):
    first = make_iterator(pairs, packing=packing, tokens_per_batch=8000,
                          resegment=lambda epoch: [finer(ids, 0) for ids in pairs])
    before = [next(first) for _ in range(3)]
    resumed = make_iterator(pairs, packing=packing, tokens_per_batch=8000,
                            resegment=lambda epoch: [finer(ids, 1) for ids in pairs])  # Another sample.
    resumed.set_state(first.get_state())
    after, _, _ = one_epoch(resumed)
    read = unpack if packing else row_pairs
    seen = collections.Counter(index[pair] for batch in before + after for pair in read(batch))
    assert seen == collections.Counter(range(len(pairs[0]))), packing  # All 2,000 kept, each once.
    assert unpack(after[0]) != unpack(next(first)) if packing else True  # Packed anew from the saved position.


def test_bpe_dropout_resegment_must_give_both_sides_of_every_pair(train_ids):
  for wrong in ([train_ids[0]], [train_ids[0], train_ids[1], train_ids[1]],
                [batching.Ragged.from_lists([ids[i] for i in range(10)]) for ids in train_ids]):
    iterator = make_iterator(train_ids, packing=True, resegment=lambda epoch, wrong=wrong: wrong)
    with pytest.raises(ValueError, match=r'resegment\(0\) must give \[source ids, target ids\] of 8000 sequences'):
      next(iterator)


def test_ragged_where_takes_each_sequence_from_its_side():
  first = batching.Ragged.from_lists([[1, 2], [], [3], [4, 5, 6]])
  second = batching.Ragged.from_lists([[7], [8, 9], [], [10]])
  chosen = first.where(np.array([True, False, False, True]), second)
  assert [chosen[i].tolist() for i in range(4)] == [[1, 2], [8, 9], [], [4, 5, 6]]
  assert chosen.values.dtype == np.int32 and chosen.offsets.tolist() == [0, 2, 4, 4, 7]
  assert first.where(np.ones(4, bool), second).values.tolist() == first.values.tolist()
  assert first.where(np.zeros(4, bool), second).values.tolist() == second.values.tolist()
  with pytest.raises(ValueError, match=r'bool condition .* got int64 \[4\]'):
    first.where(np.array([1, 0, 0, 1]), second)
  with pytest.raises(ValueError, match='4 and 3 sequences'):
    first.where(np.ones(4, bool), batching.Ragged.from_lists([[1], [2], [3]]))


def test_skips_empty_and_overlong_pairs(caplog):
  source = [[5, 6], [], [5], [7] * 20, [8] * 15, [9]]
  target = [[7], [5], [], [6], [6], [9] * 16]
  with caplog.at_level(logging.INFO):
    iterator = train_iterator.TrainIterator(source, target, tokens_per_batch=64, max_length=16,
                                            bucket_lengths=(4, 8))
  assert 'skipped 2 with an empty side and 2 longer than max_length=16' in caplog.text
  assert iterator.shapes == [(4, 16)]  # The lone pair of bucket 4 moves up to bucket 16 (max_length).
  batches, _, _ = one_epoch(iterator)
  assert sorted(pair for batch in batches for pair in row_pairs(batch)) == [
      ((5, 6, EOS), (7, EOS)), ((8,) * 15 + (EOS,), (6, EOS))]


@pytest.mark.parametrize('packing', [False, True])
def test_same_seed_same_batches(train_ids, packing):
  first, second = make_iterator(train_ids, packing=packing), make_iterator(train_ids, packing=packing)
  other = make_iterator(train_ids, packing=packing, shuffle_seed=1)
  for _ in range(4):
    batch = next(first)
    assert_batches_equal(batch, next(second))
  assert not np.array_equal(next(first)['source_tokens'], next(other)['source_tokens'])


@pytest.mark.parametrize('packing', [False, True])
def test_restored_iterator_continues_identically(train_ids, packing):
  iterator = make_iterator(train_ids, packing=packing)
  for _ in range(3):
    next(iterator)
  state = json.loads(json.dumps(iterator.get_state()))  # Checkpoints store it as JSON.
  expected = [next(iterator) for _ in range(2)]
  restored = make_iterator(train_ids, packing=packing)
  restored.set_state(state)
  for batch in expected:
    assert_batches_equal(batch, next(restored))

  _, end_state, first_of_next_epoch = one_epoch(make_iterator(train_ids, packing=packing))
  restored.set_state(end_state)
  assert_batches_equal(next(restored), first_of_next_epoch)
  assert restored.get_state()['epoch'] == 1


def test_set_state_rejects_bad_keys(train_ids):
  with pytest.raises(ValueError, match=r"got \['epoch', 'step'\]"):
    make_iterator(train_ids).set_state({'epoch': 0, 'step': 3})


@pytest.mark.parametrize('packing', [False, True])
def test_host_slices_concatenate_to_global_batch(train_ids, packing):
  whole = make_iterator(train_ids, packing=packing, batch_size_multiple=2)
  hosts = [make_iterator(train_ids, packing=packing, batch_size_multiple=2, process_index=i, process_count=2)
           for i in range(2)]
  for _ in range(3):
    batch, parts = next(whole), [next(host) for host in hosts]
    assert len(parts[0]['source_tokens']) == len(batch['source_tokens']) // 2
    assert_batches_equal(batch, {key: np.concatenate([part[key] for part in parts]) for key in batch})


def test_batch_size_errors(train_ids):
  with pytest.raises(ValueError, match='tokens_per_batch=500 is too small for length 64 with batch_size_multiple=8'):
    make_iterator(train_ids, tokens_per_batch=500, batch_size_multiple=8)
  with pytest.raises(ValueError, match=r'does not divide by process_count=2'):
    make_iterator(train_ids, batch_size_multiple=3, process_count=2)


def test_measure_throughput_counts_the_batches_it_reads(train_ids):
  batches = [next(iterator) for iterator in [make_iterator(train_ids)] for _ in range(5)]
  stats = batching.measure_throughput(iter(batches), 5)
  tokens = sum(int(np.count_nonzero(b[k])) for b in batches for k in ('source_tokens', 'target_tokens'))
  slots = sum(b[k].size for b in batches for k in ('source_tokens', 'target_tokens'))
  assert stats['padding_fraction'] == pytest.approx(1 - tokens / slots)
  assert stats['tokens_per_sec'] / stats['batches_per_sec'] == pytest.approx(tokens / 5)
  assert stats['distinct_shapes'] == len({(b['source_tokens'].shape, b['target_tokens'].shape) for b in batches})


def test_overlong_evaluation_targets_are_left_out_of_the_loss_not_cut(caplog):
  """#16 item 10: cut to max_length, a target ends in an EOS the reference lacks, and the loss scores it."""
  source = [[5, 6], [7] * 20, [8, 9], [5]]
  target = [[10] * 20, [11, 12], [13], [14] * 7]  # Line 1 is too long (21 > 8 with EOS); line 4 just fits.
  with caplog.at_level(logging.WARNING):
    batches = batching.eval_batches(source, target, tokens_per_batch=64, max_length=8, bucket_lengths=(8,))
  assert '1 of 4 evaluation lines longer than data.max_length=8 (EOS included) on the target side: left out of ' \
         'the validation loss' in caplog.text and 'Lines [1].' in caplog.text
  assert 'Truncated 1 of 4 source sentences to max_length=8 tokens (EOS included); lines [2].' in caplog.text
  rows = {}
  for batch in batches:
    for index, *row in zip(batch['example_index'], batch['source_tokens'], batch['target_tokens'],
                           batch['decoder_input_tokens']):
      rows[int(index)] = [list(part[part != 0]) for part in row]
  assert rows[0] == [[5, 6, EOS], [], []]  # Still translated; no target token weighs in the loss.
  assert rows[1] == [[7] * 7 + [EOS], [11, 12, EOS], [BOS, 11, 12]]  # A long source is cut, as before.
  assert rows[3] == [[5, EOS], [14] * 7 + [EOS], [BOS] + [14] * 7]
  weights = sum(int((batch['target_tokens'] != 0).sum()) for batch in batches)
  assert weights == 3 + 2 + 8


def test_few_line_numbers_then_a_count():
  assert batching._few(np.arange(1, 3)) == '[1, 2]'
  assert batching._few(np.arange(1, 2001)) == '[1, 2, 3, 4, 5] and 1995 more'
