"""Cached beam search through the model (translate.decode_batch) against a search without any cache.

The reference below is written independently of transformer_jax.decoding: plain Python lists of hypotheses, one sentence at
a time, and for every step one full teacher-forced forward pass of the model over each live prefix (BOS +
tokens so far), so there is no K/V cache to reorder. It follows the search's rules (Sec. 6.1 as decoding/beam.py
documents them): each step extends every live hypothesis by its beam_size best non-EOS tokens and by EOS; an
EOS extension finishes if it ranks among the beam_size most probable extensions of the sentence, every
extension finishes at the length limit L_b = source length + extra_length; scores are log P / lp(|Y|). It has
no early stop: it runs every sentence to L_b, which also checks that decoding/beam.py's early stop loses nothing.

It also covers issue #16 class 3 (batch composition): the same sentence alone, beside much longer ones and at
other batch sizes decodes to the same tokens and scores.
"""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.decoding import translate
from transformer_jax.model import transformer as model_lib

PAD, EOS, BOS = tokenizer_lib.PAD_ID, tokenizer_lib.EOS_ID, tokenizer_lib.BOS_ID
VOCAB = 24


def make_model(**overrides):
  cfg = dict(vocab_size=VOCAB, num_layers=2, d_model=16, d_ff=32, num_heads=2, d_k=8, d_v=8, dropout_rate=0.0)
  return model_lib.Transformer(model_lib.ModelConfig(**(cfg | overrides)))


def random_params(model, seed, scale=0.5):
  """Random parameters of a larger scale than the initialiser's, so that distributions are peaked enough for
  hypotheses to end at different lengths and beams to reorder."""
  params = nn.unbox(model.init(jax.random.key(seed), jnp.ones((1, 3), jnp.int32), jnp.ones((1, 3), jnp.int32)))
  leaves, treedef = jax.tree.flatten(params['params'])
  keys = jax.random.split(jax.random.key(seed + 1000), len(leaves))
  return treedef.unflatten([scale * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


def random_source(rng, lengths):
  """int32 [batch, max(lengths)]: random words then EOS, 0-padded; lengths count EOS."""
  source = np.zeros((len(lengths), max(lengths)), np.int32)
  for row, length in enumerate(lengths):
    source[row, :length - 1] = rng.integers(3, VOCAB, length - 1)
    source[row, length - 1] = EOS
  return source


def length_penalty(length, alpha):
  return ((5.0 + length) / 6.0) ** alpha


def uncached_beam_search(model, params, source_row, beam_size, alpha, extra_length):
  """One sentence, no cache: ([(tokens, score)] best first, number of parent crossings seen).

  A parent crossing is a step where a surviving hypothesis descends from a parent in another beam slot, which
  is when a cache must be reordered.
  """
  source = np.asarray(source_row)[None, :np.count_nonzero(source_row)]  # Unpadded.
  max_length = source.shape[1] + extra_length
  live = [(0.0, ())]  # (log-prob, tokens) in slot order.
  finished = []  # (score, tokens), best first.
  crossings = 0
  for step in range(max_length):
    length = step + 1
    # BOS + prefix, PAD after: the causal mask keeps the padding out of position `step`. A fixed shape
    # [beam_size, max_length] compiles once per sentence.
    prefixes = np.zeros((beam_size, max_length), np.int32)
    prefixes[:, 0] = BOS
    for slot, (_, tokens) in enumerate(live):
      prefixes[slot, 1:length] = tokens
    logits = np.array(_forward(model, params, source, prefixes))[:len(live), step]
    logits[:, [PAD, BOS]] = -np.inf
    log_probs = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    candidates = []  # (log-prob, parent slot, tokens, is_eos), in the search's candidate order.
    for slot, (log_prob, tokens) in enumerate(live):
      words = np.where(np.arange(VOCAB) == EOS, -np.inf, log_probs[slot])
      for token in np.argsort(-words, kind='stable')[:beam_size]:
        candidates.append((log_prob + log_probs[slot, token], slot, tokens + (int(token),), False))
      candidates.append((log_prob + log_probs[slot, EOS], slot, tokens + (EOS,), True))
    ranked = sorted((c[0] for c in candidates), reverse=True)
    kth_best = ranked[beam_size - 1] if len(ranked) >= beam_size else -np.inf
    at_limit = length >= max_length
    new = [(c[0] / length_penalty(length, alpha), c[2]) for c in candidates
           if (c[3] and c[0] >= kth_best) or at_limit]
    new = sorted(new, key=lambda x: -x[0])[:beam_size]  # Stable: earlier candidates win ties.
    finished = sorted(finished + new, key=lambda x: -x[0])[:beam_size]  # Older entries win ties.
    if at_limit:
      break
    survivors = sorted((c for c in candidates if not c[3]), key=lambda c: -c[0])[:beam_size]
    crossings += sum(parent != slot for slot, (_, parent, _, _) in enumerate(survivors))
    live = [(c[0], c[2]) for c in survivors]
  return [(tokens, score) for score, tokens in finished], crossings


@functools.partial(jax.jit, static_argnames='model')
def _forward(model, params, source, prefixes):
  """Teacher-forced logits float32 [rows, tgt_len, vocab] of one source [1, src_len] for each prefix row."""
  return model.apply({'params': params}, jnp.repeat(source, prefixes.shape[0], 0), prefixes)


def strip(row):
  return tuple(int(t) for t in row if t != PAD)


def cached(model, params, source, beam_size, alpha, extra_length, cache_stages=translate.CACHE_STAGES):
  tokens, scores = translate.decode_batch(params, jnp.asarray(source), model=model, beam_size=beam_size,
                                         alpha=alpha, extra_length=extra_length, cache_stages=cache_stages,
                                         with_scores=True)
  return np.asarray(tokens), np.asarray(scores)


@pytest.mark.parametrize('seed, model_overrides', [
    (0, {}),
    pytest.param(1, {'layer_norm_position': 'pre'}, marks=pytest.mark.slow),
    pytest.param(2, {'position_embedding': 'learned'}, marks=pytest.mark.slow),
    pytest.param(3, {'position_embedding': 'rope', 'num_kv_heads': 1}, marks=pytest.mark.slow)])
def test_cached_beam_search_equals_uncached_search(seed, model_overrides):
  model = make_model(**model_overrides)
  params = random_params(model, seed)
  beam_size, alpha, extra_length = 4, 0.6, 4
  source = random_source(np.random.default_rng(seed), [6, 3, 5])
  tokens, scores = cached(model, params, source, beam_size, alpha, extra_length, cache_stages=(2, 4))
  total_crossings, lengths = 0, set()
  for b, row in enumerate(source):
    want, crossings = uncached_beam_search(model, params, row, beam_size, alpha, extra_length)
    total_crossings += crossings
    assert [strip(t) for t in tokens[b]] == [t for t, _ in want], f'sentence {b}'
    np.testing.assert_allclose(scores[b], [s for _, s in want], rtol=1e-5, atol=1e-5)
    lengths |= {len(t) for t, _ in want}
  assert total_crossings >= 3  # Beams did change parents, so the cache had to follow them.
  assert len(lengths) > 1  # Hypotheses of different lengths (EOS at different steps).


@pytest.mark.integration
def test_batch_composition_does_not_change_a_sentence():
  """The same sentence alone, beside much longer ones (more padding, a longer search) and at other batch sizes
  and rows gives the same tokens and scores: padding reaches no mask, position or length penalty."""
  model = make_model(position_embedding='learned')
  params = random_params(model, seed=7)
  rng = np.random.default_rng(7)
  sentence = random_source(rng, [4])[0]
  long = random_source(rng, [15, 12, 14])
  pad = lambda row, width: np.pad(row, (0, width - len(row)))
  batches = {
      'alone': sentence[None],
      'first beside longer': np.stack([pad(sentence, 15), *long]),
      'last of 5': np.stack([*long, pad(sentence, 15), long[0]]),
      'twice in 2': np.stack([sentence, sentence]),
  }
  rows = {'alone': 0, 'first beside longer': 0, 'last of 5': 3, 'twice in 2': 1}
  results = {name: cached(model, params, batch, 4, 0.6, 5) for name, batch in batches.items()}
  want_tokens, want_scores = results['alone'][0][0], results['alone'][1][0]
  for name, (tokens, scores) in results.items():
    assert [strip(t) for t in tokens[rows[name]]] == [strip(t) for t in want_tokens], name
    np.testing.assert_allclose(scores[rows[name]], want_scores, rtol=1e-6, atol=1e-6, err_msg=name)
  want, _ = uncached_beam_search(model, params, sentence, 4, 0.6, 5)
  assert [strip(t) for t in want_tokens] == [t for t, _ in want]
