"""Tests for transformer_jax.decoding (beam, greedy, search) against exhaustive search over a toy second-order model.

The toy model scores the next token from the last two tokens and a per-sentence bias:
logits = t1[prev1] + t2[prev2] + bias[sentence]. step_fn reads prev2 from a per-row token history
kept in the cache, so a cache row that is not reordered with its beam changes the scores; every
returned hypothesis is rescored in NumPy to catch that.
"""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.decoding import beam
from transformer_jax.decoding import greedy
from transformer_jax.decoding import search

PAD, BOS, EOS = 0, 1, 2
VOCAB = 6
WORDS = (3, 4, 5)


def make_model(seed, batch, eos_logit=0.0):
  rng = np.random.default_rng(seed)
  t1 = rng.normal(0.0, 2.0, (VOCAB, VOCAB)).astype(np.float32)
  t1[:, EOS] += eos_logit
  t2 = rng.normal(0.0, 1.0, (VOCAB, VOCAB)).astype(np.float32)
  bias = rng.normal(0.0, 1.0, (batch, VOCAB)).astype(np.float32)
  return t1, t2, bias


def make_step_fn(t1, t2, calls=None):
  t1, t2 = jnp.asarray(t1), jnp.asarray(t2)

  def step_fn(last_tokens, cache):
    step = cache['step']
    history = cache['history'].at[:, step].set(last_tokens)  # [rows, max_steps]
    prev2 = jnp.where(step > 0, history[:, jnp.maximum(step - 1, 0)], PAD)
    if calls is not None:
      jax.debug.callback(lambda: calls.append(1))
    logits = t1[last_tokens] + t2[prev2] + cache['bias']
    return logits, dict(step=step + 1, history=history, bias=cache['bias'])
  return step_fn


def make_cache(bias, beam_size, max_steps):
  rows = bias.shape[0] * beam_size
  return dict(step=jnp.zeros((), jnp.int32),
              history=jnp.zeros((rows, max_steps), jnp.int32),
              bias=beam.expand_to_beams(jnp.asarray(bias), beam_size))


def np_log_probs(model, b, prev2, prev1):
  t1, t2, bias = model
  logits = (t1[prev1] + t2[prev2] + bias[b]).astype(np.float64)
  logits[[PAD, BOS]] = -np.inf
  return logits - np.logaddexp.reduce(logits[np.isfinite(logits)])


def np_score(model, b, seq, alpha):
  history = [PAD, BOS] + list(seq)
  log_prob = sum(np_log_probs(model, b, history[i], history[i + 1])[history[i + 2]]
                 for i in range(len(seq)))
  return log_prob / ((5.0 + len(seq)) / 6.0) ** alpha


def all_outputs(max_length):
  """Every output the search may return: EOS-ended up to max_length, or max_length words."""
  for n in range(max_length):
    for words in itertools.product(WORDS, repeat=n):
      yield words + (EOS,)
  yield from itertools.product(WORDS, repeat=max_length)


def brute_force(model, b, max_length, alpha):
  scored = sorted(((np_score(model, b, seq, alpha), seq) for seq in all_outputs(max_length)),
                  reverse=True)
  return [seq for _, seq in scored], np.array([score for score, _ in scored])


def strip(row):
  return tuple(int(t) for t in row if t != PAD)


def grow_history(cache, length):
  """grow_cache for the toy model: the token history holds `length` positions."""
  history = cache['history']
  return dict(cache, history=jnp.pad(history, ((0, 0), (0, length - history.shape[1]))))


def staging(cache_stages, max_steps):
  """(initial cache length, search kwargs): staged searches start from an empty history."""
  if not cache_stages:
    return max_steps, {}
  return 0, dict(cache_stages=cache_stages, grow_cache=grow_history)


def run_beam(model, lengths, beam_size, alpha, max_steps, calls=None, jit=True, cache_stages=(),
             early_stopping='bound'):
  t1, t2, bias = model
  cache_length, stage_kwargs = staging(cache_stages, max_steps)
  run = functools.partial(
      beam.beam_search, make_step_fn(t1, t2, calls), batch_size=bias.shape[0],
      beam_size=beam_size, alpha=alpha, max_steps=max_steps, eos_id=EOS, bos_id=BOS,
      early_stopping=early_stopping, **stage_kwargs)
  if jit:
    run = jax.jit(run)
  tokens, scores = run(make_cache(bias, beam_size, cache_length),
                       max_decode_lengths=jnp.asarray(lengths, jnp.int32))
  return np.asarray(tokens), np.asarray(scores)


def run_greedy(model, lengths, max_steps, cache_stages=()):
  t1, t2, bias = model
  cache_length, stage_kwargs = staging(cache_stages, max_steps)
  run = jax.jit(functools.partial(
      greedy.greedy_search, make_step_fn(t1, t2), batch_size=bias.shape[0],
      max_steps=max_steps, eos_id=EOS, bos_id=BOS, **stage_kwargs))
  return np.asarray(run(make_cache(bias, 1, cache_length),
                        max_decode_lengths=jnp.asarray(lengths, jnp.int32)))


def check_well_formed(tokens, scores, lengths):
  """EOS only last, PAD only after the end, never BOS, at most L_b tokens, whole if no EOS."""
  for b, length in enumerate(lengths):
    for row, score in zip(tokens[b], scores[b]):
      seq = strip(row)
      if np.isneginf(score):  # An empty slot.
        assert not seq
        continue
      assert row[len(seq):].tolist() == [PAD] * (len(row) - len(seq))
      assert BOS not in seq and EOS not in seq[:-1]
      assert 1 <= len(seq) <= length
      assert seq[-1] == EOS or len(seq) == length


@pytest.mark.parametrize('alpha', [0.0, 0.6])
def test_wide_beam_finds_exhaustive_optimum_per_sentence_lengths(alpha):
  lengths = [4, 1, 3]
  model = make_model(seed=0, batch=3)
  tokens, scores = run_beam(model, lengths, beam_size=27, alpha=alpha, max_steps=6)
  check_well_formed(tokens, scores, lengths)
  for b, length in enumerate(lengths):
    want_seqs, want_scores = brute_force(model, b, length, alpha)
    k = min(27, len(want_seqs))  # L=1 has only 4 outputs: the other slots are empty.
    assert [strip(row) for row in tokens[b, :k]] == want_seqs[:k]
    np.testing.assert_allclose(scores[b, :k], want_scores[:k], rtol=1e-5, atol=1e-5)
    assert np.all(np.isneginf(scores[b, k:])) and np.all(tokens[b, k:] == PAD)


def test_hypotheses_sorted_and_rescore_exactly():
  lengths = [5, 3]
  model = make_model(seed=1, batch=2)
  tokens, scores = run_beam(model, lengths, beam_size=4, alpha=0.6, max_steps=7)
  check_well_formed(tokens, scores, lengths)
  assert np.all(np.diff(scores, axis=1) <= 0)
  for b in range(2):
    # A cache row not moved with its beam would have scored a different history.
    want = [np_score(model, b, strip(row), 0.6) for row in tokens[b]]
    np.testing.assert_allclose(scores[b], want, rtol=1e-5, atol=1e-5)


def test_hypotheses_without_eos_returned_whole():
  lengths = [5, 2, 4]
  model = make_model(seed=2, batch=3, eos_logit=-40.0)
  tokens, scores = run_beam(model, lengths, beam_size=4, alpha=0.6, max_steps=8)
  check_well_formed(tokens, scores, lengths)
  for b, length in enumerate(lengths):
    for row in tokens[b]:
      assert len(strip(row)) == length and EOS not in row
  greedy_tokens = run_greedy(model, lengths, max_steps=8)
  assert [len(strip(row)) for row in greedy_tokens] == lengths


def bigram_model(from_bos, from_word, rows=None):
  """Probabilities over (EOS, 3, 4, 5) from BOS, from any word, or from the words in rows."""
  t1 = np.full((VOCAB, VOCAB), -30.0, np.float32)
  outputs = np.array([EOS, *WORDS])
  t1[BOS, outputs] = np.log(from_bos)
  t1[np.array(WORDS)[:, None], outputs[None, :]] = np.log(from_word)
  for word, probs in (rows or {}).items():
    t1[word, outputs] = np.log(probs)
  return t1, np.zeros_like(t1), np.zeros((1, VOCAB), np.float32)


def test_finished_short_hypothesis_does_not_stop_a_longer_winner():
  # [EOS] scores log 0.4 = -0.916 at step 1. Live [3] has log-prob log 0.35 = -1.050: below -0.916
  # divided by lp(1) = 1 or by lp(2) = 1.097 (the penalty of its shortest completion), but
  # [3, 4, EOS] scores log(0.35 * 0.999^2) / lp(3) = -0.885 with alpha = 0.6, so the bound must use
  # lp(max length).
  model = bigram_model([0.4, 0.35, 0.125, 0.125], [0.25] * 4,
                       rows={3: [0.0005, 0.0003, 0.999, 0.0002], 4: [0.999, 0.0005, 0.0003, 0.0002]})
  tokens, scores = run_beam(model, [10], beam_size=1, alpha=0.6, max_steps=10)
  assert strip(tokens[0, 0]) == (3, 4, EOS)
  np.testing.assert_allclose(scores[0, 0], np.log(0.35 * 0.999**2) / (8 / 6) ** 0.6, rtol=1e-5)
  tokens, _ = run_beam(model, [10], beam_size=1, alpha=0.0, max_steps=10)
  assert strip(tokens[0, 0]) == (EOS,)


def test_finished_early_stopping_stops_once_the_beam_has_finished():
  # The model above: with early_stopping='finished' (fairseq, CTranslate2) the sentence is done as soon as
  # beam_size (1) hypotheses have finished, at step 1 with [EOS], and the better [3, 4, EOS] is given up.
  model = bigram_model([0.4, 0.35, 0.125, 0.125], [0.25] * 4,
                       rows={3: [0.0005, 0.0003, 0.999, 0.0002], 4: [0.999, 0.0005, 0.0003, 0.0002]})
  calls = []
  tokens, scores = run_beam(model, [10], beam_size=1, alpha=0.6, max_steps=10, calls=calls,
                            early_stopping='finished')
  jax.effects_barrier()
  assert strip(tokens[0, 0]) == (EOS,) and len(calls) == 1
  np.testing.assert_allclose(scores[0, 0], np.log(0.4), rtol=1e-5)
  # Two beams: [EOS] finishes at step 1, [4, EOS] (live [4] extended by EOS, among the two best extensions)
  # at step 2, which fills the beam and ends the search before [3, 4, EOS], the best, can finish at step 3.
  calls = []
  tokens, _ = run_beam(model, [10], beam_size=2, alpha=0.6, max_steps=10, calls=calls, early_stopping='finished')
  jax.effects_barrier()
  assert [strip(row) for row in tokens[0]] == [(EOS,), (4, EOS)] and len(calls) == 2
  tokens, _ = run_beam(model, [10], beam_size=2, alpha=0.6, max_steps=10)
  assert strip(tokens[0, 0]) == (3, 4, EOS)


def test_stops_early_once_no_live_hypothesis_can_win():
  # [EOS] scores log 0.9; live [3] is at most log(0.04) / lp(10) = -1.86 afterwards: one step.
  model = bigram_model([0.9, 0.04, 0.03, 0.03], [0.25, 0.25, 0.25, 0.25])
  calls = []
  tokens, _ = run_beam(model, [10], beam_size=1, alpha=0.6, max_steps=10, calls=calls)
  jax.effects_barrier()
  assert strip(tokens[0, 0]) == (EOS,)
  assert len(calls) == 1


def test_beam_size_one_equals_greedy():
  # EOS is only likely after word 5, so hypotheses end at different steps.
  model = make_model(seed=3, batch=4, eos_logit=-30.0)
  t1 = model[0]
  t1[5, EOS] = 10.0
  lengths = [6, 3, 6, 2]
  greedy_tokens = run_greedy(model, lengths, max_steps=6)
  tokens, _ = run_beam(model, lengths, beam_size=1, alpha=0.0, max_steps=6)
  np.testing.assert_array_equal(tokens[:, 0], greedy_tokens)


def test_beam_size_one_equals_greedy_even_where_a_passed_over_eos_scores_better():
  # EOS ranks second at the first step: as in fairseq, only EOS extensions among the beam_size best
  # may finish, so beam 1 follows greedy to [3, EOS] although [EOS] alone is more probable.
  model = bigram_model([0.4, 0.5, 0.05, 0.05], [0.6, 0.2, 0.1, 0.1])
  greedy_tokens = run_greedy(model, [5], max_steps=5)
  tokens, _ = run_beam(model, [5], beam_size=1, alpha=0.0, max_steps=5)
  assert strip(greedy_tokens[0]) == (3, EOS)
  assert strip(tokens[0, 0]) == (3, EOS)  # Not (EOS,), although log 0.4 > log(0.5 * 0.6).
  wide, _ = run_beam(model, [5], beam_size=2, alpha=0.0, max_steps=5)
  assert strip(wide[0, 0]) == (EOS,)  # A beam of 2 keeps the EOS ending and finds the better one.


def test_greedy_matches_numpy():
  lengths = [5, 2, 4]
  model = make_model(seed=4, batch=3)
  greedy_tokens = run_greedy(model, lengths, max_steps=6)
  for b, length in enumerate(lengths):
    history = [PAD, BOS]
    while len(history) - 2 < length and history[-1] != EOS:
      history.append(int(np.argmax(np_log_probs(model, b, history[-2], history[-1]))))
    assert strip(greedy_tokens[b]) == tuple(history[2:])


@pytest.mark.integration
def test_jit_and_eager_trace_agree():
  # Under disable_jit the search's lax.while_loop / fori_loop run as Python loops, op by op: a genuinely
  # different execution of the same program (without it, the loops would be compiled in both runs).
  model = make_model(seed=5, batch=2)
  jitted = run_beam(model, [4, 3], beam_size=3, alpha=0.6, max_steps=5, jit=True)
  with jax.disable_jit():
    eager = run_beam(model, [4, 3], beam_size=3, alpha=0.6, max_steps=5, jit=False)
  np.testing.assert_array_equal(jitted[0], eager[0])
  np.testing.assert_allclose(jitted[1], eager[1], rtol=1e-6)


@pytest.mark.parametrize('cache_stages', [(1, 2, 4), (3,), (2, 5, 99)])
def test_staged_cache_gives_the_same_search(cache_stages):
  # The toy step_fn writes its history at column `step`: a history that did not grow in time would drop
  # the write (JAX drops out-of-range scatters) and change every later score.
  lengths = [5, 2, 4]
  model = make_model(seed=7, batch=3)
  tokens, scores = run_beam(model, lengths, beam_size=3, alpha=0.6, max_steps=5)
  staged_tokens, staged_scores = run_beam(model, lengths, beam_size=3, alpha=0.6, max_steps=5,
                                          cache_stages=cache_stages)
  np.testing.assert_array_equal(staged_tokens, tokens)
  np.testing.assert_array_equal(staged_scores, scores)
  np.testing.assert_array_equal(run_greedy(model, lengths, max_steps=5, cache_stages=cache_stages),
                                run_greedy(model, lengths, max_steps=5))



@pytest.mark.parametrize('early_stopping', beam.EARLY_STOPPING)
def test_search_in_pieces_with_sentences_taken_out_equals_the_whole_search(early_stopping):
  batch, beam_size, max_steps = 5, 3, 6
  t1, t2, bias = make_model(3, batch, eos_logit=1.0)
  step_fn = make_step_fn(t1, t2)
  lengths = jnp.array([2, 6, 4, 6, 3])
  special = dict(eos_id=EOS, bos_id=BOS, pad_id=PAD)
  sizes = dict(batch_size=batch, max_decode_lengths=lengths, max_steps=max_steps)
  want_tokens, want_scores = beam.beam_search(step_fn, make_cache(bias, beam_size, max_steps), beam_size=beam_size,
                                              alpha=0.6, early_stopping=early_stopping, **sizes, **special)
  state = beam.init_beam_search(make_cache(bias, beam_size, max_steps), beam_size=beam_size, **sizes, **special)
  state = beam.continue_beam_search(state, step_fn, until=2, alpha=0.6, early_stopping=early_stopping,
                                    **special)
  assert int(state.step) == 2 and bool(state.done[0])  # Sentence 0 (L_b = 2) is done; its output is final.
  np.testing.assert_array_equal(beam.beam_search_output(state, PAD)[0][0], want_tokens[0])
  keep = jnp.array([4, 1, 3])  # Reordered; 0 and 2 leave.
  state = search.take_sentences(state, keep)
  state = beam.continue_beam_search(state, step_fn, until=max_steps, alpha=0.6, early_stopping=early_stopping,
                                    **special)
  tokens, scores = beam.beam_search_output(state, PAD)
  np.testing.assert_array_equal(tokens, want_tokens[keep])
  np.testing.assert_allclose(scores, want_scores[keep], rtol=1e-6)
  # Greedy alike.
  greedy_cache = make_cache(bias, 1, max_steps)
  want = greedy.greedy_search(step_fn, greedy_cache, **sizes, **special)
  state = greedy.init_greedy_search(greedy_cache, **sizes, **special)
  state = search.take_sentences(greedy.continue_greedy_search(state, step_fn, until=3, **special), keep)
  state = greedy.continue_greedy_search(state, step_fn, until=max_steps, **special)
  np.testing.assert_array_equal(state.tokens, want[keep])


def test_stage_ends_sorted_below_max_steps_then_max_steps():
  assert search.stage_ends(70, (64, 16, 32, 128, 0)) == [16, 32, 64, 70]
  assert search.stage_ends(16, (16, 32)) == [16] and search.stage_ends(5, ()) == [5]

@pytest.mark.parametrize('shape, k', [((3, 1000), 4), ((2, 5, 777), 1), ((4, 4000), 16), ((2, 100), 3)])
def test_top_k_matches_lax_top_k_with_ties_and_infinities(shape, k):
  rng = np.random.default_rng(k)
  x = np.round(rng.normal(size=shape) * 2) / 2  # Many ties.
  x[..., ::7] = -np.inf
  x[0, ...] = -np.inf  # A row with no finite entry.
  x = jnp.asarray(x, jnp.float32)
  want_values, want_index = jax.lax.top_k(x, k)
  values, index = jax.jit(beam._top_k, static_argnums=1)(x, k)
  np.testing.assert_array_equal(values, want_values)
  np.testing.assert_array_equal(index, want_index)


def test_expand_to_beams_is_beam_major():
  x = jnp.arange(6).reshape(2, 3)
  np.testing.assert_array_equal(beam.expand_to_beams(x, 2), [[0, 1, 2]] * 2 + [[3, 4, 5]] * 2)


def test_bad_arguments_raise():
  t1, t2, bias = make_model(seed=6, batch=2)
  kwargs = dict(batch_size=2, beam_size=3, alpha=0.6, max_steps=4, eos_id=EOS, bos_id=BOS)
  with pytest.raises(ValueError, match='leading dimension 6'):
    beam.beam_search(make_step_fn(t1, t2), make_cache(bias, 2, 4),
                     max_decode_lengths=jnp.array([4, 4]), **kwargs)
  with pytest.raises(ValueError, match='cache_stages needs grow_cache'):
    beam.beam_search(make_step_fn(t1, t2), make_cache(bias, 3, 4), max_decode_lengths=jnp.array([4, 4]),
                     cache_stages=(2,), **kwargs)
  with pytest.raises(ValueError, match=r'expected \(2,\)'):
    beam.beam_search(make_step_fn(t1, t2), make_cache(bias, 3, 4),
                     max_decode_lengths=jnp.array([4, 4, 4]), **kwargs)
  with pytest.raises(ValueError, match="early_stopping must be one of .* got 'eager'"):
    beam.beam_search(make_step_fn(t1, t2), make_cache(bias, 3, 4), max_decode_lengths=jnp.array([4, 4]),
                     early_stopping='eager', **kwargs)

