"""Decoding through the model's cache (§6.1) against uncached teacher-forced decoding, and translate()."""
import os
import threading
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import tiny_runs
from transformer_jax.data import batching
from transformer_jax.data import input_pipeline
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.decoding import beam
from transformer_jax.decoding import translate
from transformer_jax.model import transformer as model_lib

EOS, BOS = tokenizer_lib.EOS_ID, tokenizer_lib.BOS_ID
VOCAB = 24
# Two sentences of different lengths (EOS included), 0-padded.
SOURCE = np.array([[5, 9, 7, 11, EOS], [8, 6, EOS, 0, 0]], np.int32)


def make_model(**overrides):
  cfg = dict(vocab_size=VOCAB, num_layers=2, d_model=16, d_ff=32, num_heads=2, d_k=8, d_v=8, dropout_rate=0.0)
  return model_lib.Transformer(model_lib.ModelConfig(**(cfg | overrides)))


def init_params(model, seed=0):
  """Random parameters (EOS logits lowered, so sentences run to different lengths)."""
  params = nn.unbox(model.init(jax.random.key(seed), jnp.asarray(SOURCE), jnp.ones((2, 3), jnp.int32)))['params']
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  return treedef.unflatten([0.5 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


def uncached_greedy(model, params, source, extra_length):
  """Greedy decoding by re-running the full teacher-forced model on the growing prefix (no cache).

  The prefix is padded to its final length so that one compiled apply serves every step: the decoder is causal
  (test_model.py), so the padding after the prefix cannot change the logits at its last position.
  """
  apply = jax.jit(lambda params, source, target: model.apply({'params': params}, source, target))
  outputs = []
  for row in source:
    length = int(np.count_nonzero(row))
    prefix = [BOS]
    target = np.zeros((1, length + extra_length + 1), np.int32)
    for _ in range(length + extra_length):
      target[0, :len(prefix)] = prefix
      logits = np.asarray(apply(params, jnp.asarray(row[None, :length]), jnp.asarray(target))[0, len(prefix) - 1])
      logits = logits.copy()
      logits[[tokenizer_lib.PAD_ID, BOS]] = -np.inf
      prefix.append(int(np.argmax(logits)))
      if prefix[-1] == EOS:
        break
    outputs.append(prefix[1:])
  return outputs


def strip(tokens):
  tokens = list(np.asarray(tokens))
  return tokens[:tokens.index(0)] if 0 in tokens else tokens


@pytest.mark.integration
@pytest.mark.parametrize('layer_norm_position', ['post', 'pre'])
def test_cached_greedy_equals_uncached_greedy(layer_norm_position):
  model = make_model(layer_norm_position=layer_norm_position)
  params = init_params(model)
  cached = translate.decode_batch(params, jnp.asarray(SOURCE), model=model, beam_size=1, alpha=0.6,
                                  extra_length=4)
  expected = uncached_greedy(model, params, SOURCE, extra_length=4)
  assert [strip(row) for row in cached] == expected
  assert {len(e) for e in expected} != {1}  # Not trivially EOS at once.


@pytest.mark.integration
def test_beam_one_with_alpha_zero_equals_greedy_and_lengths_are_bounded():
  model = make_model()
  params = init_params(model, seed=3)
  greedy_tokens = np.asarray(translate.decode_batch(params, jnp.asarray(SOURCE), model=model, beam_size=1,
                                                    alpha=0.0, extra_length=6))
  # beam.beam_search with one hypothesis per sentence and no length penalty is greedy search.
  beam_one = np.asarray(beam_search_with_memory_per_beam(model, params, jnp.asarray(SOURCE), 1, 0.0, 6))
  np.testing.assert_array_equal(beam_one, greedy_tokens)
  assert len({len(strip(row)) for row in greedy_tokens}) > 1  # Sentences end at different steps: not trivially equal.
  beamed = translate.decode_batch(params, jnp.asarray(SOURCE), model=model, beam_size=4, alpha=0.6,
                                  extra_length=6)
  assert greedy_tokens.shape == beamed.shape == (2, SOURCE.shape[1] + 6)
  for rows in (np.asarray(beamed), greedy_tokens):
    for row, source in zip(rows, SOURCE):
      assert len(strip(row)) <= np.count_nonzero(source) + 6  # §6.1: input length + extra_length.


def beam_search_with_memory_per_beam(model, params, source, beam_size, alpha, extra_length):
  """Reference: the encoder output copied for every beam, whole cache from the start (no stages)."""
  memory = model.apply({'params': params}, source, method='encode')
  segment_ids = model_lib.segment_ids_from_tokens(source)
  memory, segment_ids = beam.expand_to_beams((memory, segment_ids), beam_size)
  max_steps = source.shape[1] + extra_length
  _, variables = model.apply({'params': params}, memory, segment_ids, max_steps, method='init_cache',
                             mutable=['cache'])

  def step_fn(tokens, cache):
    logits, variables = model.apply({'params': params, 'cache': cache}, tokens[:, None], memory, segment_ids,
                                    use_cache=True, method='decode', mutable=['cache'])
    return logits[:, 0], variables['cache']

  tokens, _ = beam.beam_search(
      step_fn, variables['cache'], batch_size=source.shape[0], beam_size=beam_size, alpha=alpha,
      max_decode_lengths=jnp.sum(source != 0, axis=1) + extra_length, max_steps=max_steps, eos_id=EOS,
      bos_id=BOS, pad_id=tokenizer_lib.PAD_ID)
  return tokens[:, 0]


@pytest.mark.integration
@pytest.mark.parametrize('beam_size', [1, 3])
def test_shared_memory_rows_and_cache_stages_give_the_reference_search(beam_size):
  model = make_model()
  params = init_params(model, seed=5)
  source = jnp.asarray(SOURCE)
  decode = lambda stages: np.asarray(translate.decode_batch(
      params, source, model=model, beam_size=beam_size, alpha=0.6, extra_length=6, cache_stages=stages))
  whole = decode(())
  np.testing.assert_array_equal(decode((2, 4, 8)), whole)  # 11 steps in 4 stages.
  if beam_size > 1:
    reference = beam_search_with_memory_per_beam(model, params, source, beam_size, 0.6, 6)
    np.testing.assert_array_equal(whole, reference)
  else:
    assert [strip(row) for row in whole] == uncached_greedy(model, params, SOURCE, extra_length=6)
  assert len({len(strip(row)) for row in whole}) > 1  # Sentences end at different steps.


@pytest.mark.integration
@pytest.mark.parametrize('beam_size, with_scores', [(1, False), (3, True)])
def test_compacted_decoding_drops_done_sentences_and_gives_decode_batch_output(beam_size, with_scores, monkeypatch):
  model = make_model()
  params = init_params(model, seed=5)
  rng = np.random.default_rng(0)
  lengths = [1, 7, 3, 5, 2, 6, 4, 7]
  source = np.array([list(rng.integers(3, VOCAB, n - 1)) + [EOS] + [0] * (7 - n) for n in lengths], np.int32)
  kwargs = dict(model=model, beam_size=beam_size, alpha=0.6, extra_length=6, cache_stages=(2, 4, 8),
                with_scores=with_scores)
  want = jax.tree.map(np.asarray, translate.decode_batch(params, jnp.asarray(source), **kwargs))
  # Same tokens; scores to float32 rounding (a row's sums are computed in a smaller batch).
  same = lambda x, y: (np.testing.assert_array_equal(x, y) if x.dtype == np.int32 else
                       np.testing.assert_allclose(x, y, rtol=1e-6))
  batches = []
  take = translate._take_sentences
  monkeypatch.setattr(translate, '_take_sentences',
                      lambda state, context, index: (batches.append(len(index)), take(state, context, index))[1])
  for compact_every_steps in (1, 3):
    batches.clear()
    got = translate.decode_batch_compacted(params, source, compact_every_steps=compact_every_steps, min_size=1,
                                           **kwargs)
    jax.tree.map(same, got, want)
    assert batches and batches == sorted(batches, reverse=True) and batches[-1] < len(source), batches
  # Rows to skip are dropped at the first look; the other rows' output is unchanged.
  skip = np.array([False, True, False, True, False, True, False, True])
  batches.clear()
  got = translate.decode_batch_compacted(params, source, compact_every_steps=1, skip_rows=skip, min_size=1, **kwargs)
  jax.tree.map(lambda x, y: same(x[~skip], y[~skip]), got, want)
  assert batches[0] == 4
  with pytest.raises(ValueError, match='compact_every_steps must be >= 1'):
    translate.decode_batch_compacted(params, source, compact_every_steps=0, **kwargs)


def test_concurrent_decoding_runs_calls_at_once_keeps_the_order_and_raises_what_a_batch_raised():
  running, peak, lock = [0], [0], threading.Lock()

  def calls(barrier):
    def call(item):  # The first three meet at the barrier: one after another they never would.
      with lock:
        running[0] += 1
        peak[0] = max(peak[0], running[0])
      if item < 3:
        barrier.wait()
      time.sleep(0.2 if item == 0 else 0.01)  # Then the first ends last.
      with lock:
        running[0] -= 1
      if item == 5:
        raise ValueError('batch 5')
      return item * 10
    return call
  assert list(translate._map_in_order(calls(threading.Barrier(3, timeout=10)), range(5), 3)) == [0, 10, 20, 30, 40]
  assert peak[0] == 3  # At most `workers` at once.
  with pytest.raises(threading.BrokenBarrierError):
    list(translate._map_in_order(calls(threading.Barrier(3, timeout=0.5)), range(5), 1))
  with pytest.raises(ValueError, match='batch 5'):
    list(translate._map_in_order(calls(threading.Barrier(3, timeout=10)), range(8), 3))
  assert list(translate._map_in_order(calls(threading.Barrier(3, timeout=10)), [], 3)) == []


def test_concurrent_batches_automatic_choice(monkeypatch):
  assert translate.concurrent_batches_for(3) == 3
  with pytest.raises(ValueError, match='concurrent_batches must be >= 0'):
    translate.concurrent_batches_for(-1)
  with pytest.raises(ValueError, match='concurrent_batches must be >= 0'):
    translate.decode_all({}, [], 0, model=None, beam_size=1, alpha=0.0, extra_length=1, concurrent_batches=-1)
  monkeypatch.setattr(jax, 'default_backend', lambda: 'cpu')
  for cores, expected in ((1, 1), (2, 2), (16, 4)):
    monkeypatch.setattr(os, 'sched_getaffinity', lambda pid, cores=cores: set(range(cores)), raising=False)
    assert translate.concurrent_batches_for(0) == expected
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  assert translate.concurrent_batches_for(0) == 1


def test_concurrent_decoding_runs_under_the_callers_mesh_and_axis_rules(monkeypatch):
  seen = []

  def fake_decode_batch(params, source, **kwargs):  # Records what the pool thread sees.
    del params, kwargs
    seen.append((jax.sharding.get_mesh(), nn.get_logical_axis_rules()))
    return np.zeros((source.shape[0], 3), np.int32)
  monkeypatch.setattr(translate, 'decode_batch', fake_decode_batch)
  batches = [{'source_tokens': np.ones((2, 4), np.int32), 'example_index': np.array([2 * i, 2 * i + 1])}
             for i in range(4)]
  mesh, rules = jax.make_mesh((1,), ('data',)), (('batch', 'data'),)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    outputs = translate.decode_all({}, batches, 8, model=make_model(), beam_size=1, alpha=0.0, extra_length=1,
                                   concurrent_batches=2)
  assert len(outputs) == 8 and len(seen) == 4
  assert all(got_mesh == mesh and tuple(got_rules) == rules for got_mesh, got_rules in seen), seen


def test_compacted_size_is_a_power_of_two_at_most_half_the_batch():
  sizes = [translate.compacted_size(alive, 32, 1) for alive in (0, 1, 3, 8, 9, 16, 17, 32)]
  assert sizes == [1, 1, 4, 8, 16, 16, 32, 32]
  assert translate.compacted_size(5, 10, 1) == 10 and translate.compacted_size(4, 10, 1) == 4
  assert [translate.compacted_size(alive, 32) for alive in (1, 3, 8, 9)] == [8, 8, 8, 16]  # min_size 8.
  assert translate.compacted_size(3, 12) == 12  # 8 is more than half of 12.


def test_translate_keeps_every_line_in_order_with_blank_lines(tmp_path):
  # The tests' synthetic corpus (tiny_runs.py) is enough: the vocabulary is not the point.
  lines = ['a man runs on the street', '', 'two dogs play in the snow', '', 'a child']
  english = [pair[0] for pair in tiny_runs.synthetic_pairs(200, seed=0)]
  tokenizer = tokenizer_lib.train_or_load(tmp_path / f'spm_{tiny_runs.VOCAB_SIZE}.model', lambda: english,
                                          vocab_size=tiny_runs.VOCAB_SIZE)
  model = model_lib.Transformer(model_lib.ModelConfig(
      vocab_size=tokenizer.vocab_size, num_layers=1, d_model=16, d_ff=32, num_heads=2, d_k=8, d_v=8))
  params = nn.unbox(model.init(jax.random.key(0), jnp.ones((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32)))['params']
  source = input_pipeline.encode(tokenizer, lines)
  batches = batching.eval_batches(source, batching.Ragged.from_lists([[]] * len(lines)),
                                        tokens_per_batch=32, max_length=16, bucket_lengths=(4, 8, 16))
  assert sum(int(np.sum(b['example_index'] >= 0)) for b in batches) == len(lines)
  outputs = translate.translate(params, batches, tokenizer, len(lines), model=model, beam_size=2, alpha=0.6,
                                extra_length=3)
  assert len(outputs) == len(lines) and all(isinstance(o, str) for o in outputs)
  # Dropping done sentences every step (the padding rows of the last batch from the start) changes nothing.
  assert translate.translate(params, batches, tokenizer, len(lines), model=model, beam_size=2, alpha=0.6,
                             extra_length=3, compact_every_steps=1) == outputs
  # One batch at a time (the outputs above: automatic, several at once on this CPU) or three, with compaction
  # or without: the same.
  for concurrent_batches, compact_every_steps in ((1, 0), (3, 0), (3, 1)):
    assert translate.translate(params, batches, tokenizer, len(lines), model=model, beam_size=2, alpha=0.6,
                               extra_length=3, concurrent_batches=concurrent_batches,
                               compact_every_steps=compact_every_steps) == outputs
  # Each line's output is its own: decoding a line alone gives the same text as in the batch.
  alone = batching.eval_batches(input_pipeline.encode(tokenizer, [lines[2]]),
                                      batching.Ragged.from_lists([[]]), tokens_per_batch=32,
                                      max_length=16, bucket_lengths=(4, 8, 16))
  assert translate.translate(params, alone, tokenizer, 1, model=model, beam_size=2, alpha=0.6,
                             extra_length=3) == [outputs[2]]
