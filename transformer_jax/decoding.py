"""Beam search and greedy decoding (Sec. 6.1), driven by a `step_fn(last_tokens, cache)` callback.

Conventions shared by both searches:
  * The first call of `step_fn` receives `bos_id` in every row. PAD (`pad_id`, 0) and BOS are never
    generated: their logits are masked to -inf before the softmax.
  * The length |Y| of a hypothesis is its number of generated tokens, the final EOS included and
    BOS excluded.
  * Sentence b is decoded to at most L_b = clip(max_decode_lengths[b], 1, max_steps) tokens. A
    hypothesis that reaches L_b tokens without EOS is finished there and returned whole: L_b tokens,
    no EOS. Nothing longer than L_b is returned; positions after a hypothesis's last token hold PAD.
  * Shapes are static and the loop is a `jax.lax.while_loop` with no host syncs, so both searches run
    under `jax.jit` with `step_fn` closed over and `batch_size`, `beam_size`, `max_steps`, `eos_id`,
    `bos_id`, `pad_id` static.

`step_fn(last_tokens, cache) -> (logits, new_cache)` takes int32 [rows] and returns logits float32
[rows, vocab], where rows is batch_size * beam_size (beam search) or batch_size (greedy). Every cache
leaf with ndim >= 1 has leading dimension rows; in beam search rows b*beam .. b*beam+beam-1 belong to
sentence b (see `expand_to_beams`) and are reordered whenever beams are reselected. Leaves with ndim 0
(e.g. a cache index) are passed through unchanged.
"""
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

StepFn = Callable[[jax.Array, Any], tuple[jax.Array, Any]]


class BeamState(NamedTuple):
  """The loop carry of `beam_search`."""
  step: jax.Array             # int32 []; tokens generated so far by every live hypothesis.
  live_seqs: jax.Array        # int32 [batch, beam, max_steps]; PAD from position `step` on.
  live_log_probs: jax.Array   # float32 [batch, beam]; sum of token log-probs, -inf for an empty slot.
  finished_seqs: jax.Array    # int32 [batch, beam, max_steps]; PAD after the last token.
  finished_scores: jax.Array  # float32 [batch, beam]; log-prob / lp(|Y|), best-first, -inf if empty.
  done: jax.Array             # bool [batch]; the sentence's finished hypotheses can no longer change.
  cache: Any                  # step_fn's pytree; leaves with ndim >= 1 have leading dim batch*beam.


class _GreedyState(NamedTuple):
  step: jax.Array         # int32 [].
  tokens: jax.Array       # int32 [batch, max_steps]; PAD after EOS or the length limit.
  last_tokens: jax.Array  # int32 [batch]; fed to step_fn next.
  done: jax.Array         # bool [batch].
  cache: Any


def expand_to_beams(x: Any, beam_size: int) -> Any:
  """Repeats each batch row `beam_size` times along axis 0, e.g. to tile `memory` and masks.

  Args:
    x: an array or pytree of arrays, each [batch, ...].
    beam_size: number of copies of each row.

  Returns:
    The same structure with leaves [batch * beam_size, ...]; rows b*beam_size .. b*beam_size +
    beam_size - 1 are copies of row b, the layout `beam_search` expects of its cache.
  """
  return jax.tree.map(lambda leaf: jnp.repeat(leaf, beam_size, axis=0), x)


def length_penalty(length: jax.Array, alpha: float) -> jax.Array:
  """lp(Y) = ((5 + |Y|) / 6)^alpha of Wu et al. (2016), used by Sec. 6.1 with alpha = 0.6.

  Args:
    length: int [...], number of generated tokens, EOS included.
    alpha: length penalty exponent; 0 gives lp = 1 (plain log-probability).

  Returns:
    float32 [...], positive and non-decreasing in length for alpha >= 0.
  """
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def _check_args(cache: Any, rows: int, max_decode_lengths: Any, batch_size: int, max_steps: int,
                special_ids: tuple[int, int, int]) -> jax.Array:
  """Validates static arguments and returns L_b, int32 [batch], clipped to [1, max_steps]."""
  if batch_size < 1 or max_steps < 1:
    raise ValueError(f'batch_size and max_steps must be >= 1, got {batch_size} and {max_steps}')
  eos_id, bos_id, pad_id = special_ids
  if eos_id in (bos_id, pad_id):
    raise ValueError(f'eos_id {eos_id} must differ from bos_id {bos_id} and pad_id {pad_id}')
  for path, leaf in jax.tree_util.tree_flatten_with_path(cache)[0]:
    if jnp.ndim(leaf) >= 1 and jnp.shape(leaf)[0] != rows:
      raise ValueError(f'cache leaf {jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}; '
                       f'expected leading dimension {rows}')
  lengths = jnp.asarray(max_decode_lengths, jnp.int32)
  if lengths.ndim == 0:
    lengths = jnp.broadcast_to(lengths, (batch_size,))
  if lengths.shape != (batch_size,):
    raise ValueError(f'max_decode_lengths has shape {lengths.shape}; expected ({batch_size},)')
  return jnp.clip(lengths, 1, max_steps)


def _log_probs(step_fn: StepFn, last_tokens: jax.Array, cache: Any, bos_id: int,
               pad_id: int) -> tuple[jax.Array, Any]:
  """Calls step_fn; returns float32 log-probs [rows, vocab] with PAD and BOS at -inf, new cache."""
  logits, cache = step_fn(last_tokens, cache)
  vocab = jnp.arange(logits.shape[-1])
  banned = ((vocab == pad_id) | (vocab == bos_id))[None, :]  # [1, vocab]
  logits = jnp.where(banned, -jnp.inf, logits.astype(jnp.float32))
  return jax.nn.log_softmax(logits, axis=-1), cache


def _top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """lax.top_k behind an optimisation barrier.

  XLA:CPU turns top_k into a fast TopK call only when the sort it starts from is used through plain slices;
  fused into the surrounding beam-step arithmetic it stays a full stable sort of [batch, beam*vocab]
  (~90 ms per call at beam 4 and vocabulary 8000, 100x the TopK call). The barrier keeps it unfused.
  """
  return jax.lax.optimization_barrier(jax.lax.top_k(jax.lax.optimization_barrier(x), k))


def _init_beam_state(cache: Any, batch_size: int, beam_size: int, max_steps: int,
                     pad_id: int) -> BeamState:
  seqs = jnp.full((batch_size, beam_size, max_steps), pad_id, jnp.int32)
  # Only beam 0 starts live, so that the beam_size copies of BOS do not yield duplicate hypotheses.
  first = jnp.where(jnp.arange(beam_size) == 0, 0.0, -jnp.inf).astype(jnp.float32)
  return BeamState(
      step=jnp.zeros((), jnp.int32),
      live_seqs=seqs,
      live_log_probs=jnp.broadcast_to(first[None, :], (batch_size, beam_size)),
      finished_seqs=seqs,
      finished_scores=jnp.full((batch_size, beam_size), -jnp.inf, jnp.float32),
      done=jnp.zeros((batch_size,), bool),
      cache=cache)


def _extend(live_seqs: jax.Array, flat_index: jax.Array, vocab_size: int,
            step: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Builds candidates: flat_index [batch, k] in [0, beam*vocab) -> seqs [batch, k, T], parent."""
  parent = flat_index // vocab_size  # [batch, k]
  token = (flat_index % vocab_size).astype(jnp.int32)
  seqs = jnp.take_along_axis(live_seqs, parent[:, :, None], axis=1)  # [batch, k, max_steps]
  return seqs.at[:, :, step].set(token), parent


def _reorder_cache(cache: Any, parent: jax.Array, beam_size: int) -> Any:
  """Gathers the cache rows of the parent beams; parent is int [batch, beam] in [0, beam)."""
  rows = (jnp.arange(parent.shape[0])[:, None] * beam_size + parent).reshape(-1)  # [batch*beam]
  return jax.tree.map(lambda x: x if jnp.ndim(x) == 0 else jnp.take(x, rows, axis=0), cache)


def _update_finished(state: BeamState, candidates: jax.Array, finishing: jax.Array,
                     alpha: float, vocab_size: int) -> tuple[jax.Array, jax.Array]:
  """Merges the finishing candidates [batch, beam*vocab] into the beam_size best finished ones."""
  beam_size = state.finished_scores.shape[1]
  scores = candidates / length_penalty(state.step + 1, alpha)
  scores = jnp.where(finishing, scores, -jnp.inf)
  new_scores, new_index = _top_k(scores, beam_size)  # [batch, beam]
  new_seqs, _ = _extend(state.live_seqs, new_index, vocab_size, state.step)
  all_scores = jnp.concatenate([state.finished_scores, new_scores], axis=1)  # [batch, 2*beam]
  all_seqs = jnp.concatenate([state.finished_seqs, new_seqs], axis=1)
  scores, index = _top_k(all_scores, beam_size)  # Ties keep the older (lower index) entry.
  return jnp.take_along_axis(all_seqs, index[:, :, None], axis=1), scores


def _no_live_can_win(live_log_probs: jax.Array, finished_scores: jax.Array, length: jax.Array,
                     max_lengths: jax.Array, alpha: float) -> jax.Array:
  """Whether no live hypothesis can still beat the worst of the beam_size finished ones.

  A live hypothesis of length n = `length` with log-prob s <= 0 can only finish at some length m in
  [n+1, L_b], with log-prob s' <= s (each token adds a log-prob <= 0). Its score is then
  s'/lp(m) <= s/lp(m) <= s / max(lp(n+1), lp(L_b)), since lp > 0 is monotonic in m. For alpha > 0 the
  maximum is lp(L_b), not the current lp(n): a longer hypothesis can still gain from the penalty.
  The bound of the best live hypothesis (largest s, live beams are sorted) bounds them all; a
  sentence without live hypotheses (s = -inf) or whose bound is <= its worst finished score is done.

  Args:
    live_log_probs: float32 [batch, beam], sorted descending, -inf for empty slots.
    finished_scores: float32 [batch, beam], sorted descending, -inf for empty slots.
    length: int32 [], length of the live hypotheses.
    max_lengths: int32 [batch], L_b.
    alpha: length penalty exponent.

  Returns:
    bool [batch].
  """
  best_lp = jnp.maximum(length_penalty(length + 1, alpha), length_penalty(max_lengths, alpha))
  return live_log_probs[:, 0] / best_lp <= finished_scores[:, -1]


def _beam_step(state: BeamState, step_fn: StepFn, max_lengths: jax.Array, alpha: float,
               special_ids: tuple[int, int, int]) -> BeamState:
  """Extends every live hypothesis by one token and reselects the live and finished beams."""
  eos_id, bos_id, pad_id = special_ids
  batch_size, beam_size = state.live_log_probs.shape
  last = jnp.where(state.step > 0, state.live_seqs[:, :, jnp.maximum(state.step - 1, 0)], bos_id)
  log_probs, cache = _log_probs(step_fn, last.reshape(-1), state.cache, bos_id, pad_id)
  vocab_size = log_probs.shape[-1]
  candidates = state.live_log_probs[:, :, None] + log_probs.reshape(batch_size, beam_size, -1)
  candidates = candidates.reshape(batch_size, beam_size * vocab_size)  # [batch, beam*vocab]
  length = state.step + 1  # |Y| of every candidate.
  is_eos = (jnp.arange(beam_size * vocab_size) % vocab_size == eos_id)[None, :]  # [1, beam*vocab]
  at_limit = (length >= max_lengths)[:, None]  # [batch, 1]
  active = ~state.done[:, None]  # [batch, 1]; finished beams of done sentences are frozen.
  # As in fairseq: an extension ending in EOS finishes only if it ranks among the beam_size most
  # probable extensions, so beam_size 1 with alpha 0 is greedy decoding.
  kth_best = _top_k(candidates, beam_size)[0][:, -1:]  # [batch, 1]
  finishing = ((is_eos & (candidates >= kth_best)) | at_limit) & active
  finished_seqs, finished_scores = _update_finished(state, candidates, finishing, alpha, vocab_size)
  live_candidates = jnp.where(is_eos | at_limit | ~active, -jnp.inf, candidates)
  live_log_probs, live_index = _top_k(live_candidates, beam_size)
  live_seqs, parent = _extend(state.live_seqs, live_index, vocab_size, state.step)
  done = state.done | (length >= max_lengths) | _no_live_can_win(
      live_log_probs, finished_scores, length, max_lengths, alpha)
  return BeamState(length, live_seqs, live_log_probs, finished_seqs, finished_scores, done,
                   _reorder_cache(cache, parent, beam_size))


def beam_search(step_fn: StepFn, cache: Any, *, batch_size: int, beam_size: int, alpha: float,
                max_decode_lengths: jax.Array, max_steps: int, eos_id: int, bos_id: int,
                pad_id: int = 0) -> tuple[jax.Array, jax.Array]:
  """Beam search with length penalty (Sec. 6.1: beam 4, alpha 0.6, max length = input length + 50).

  The paper takes the length penalty from Wu et al. (2016, GNMT): a hypothesis Y is scored
  log P(Y) / lp(Y) with lp(Y) = ((5 + |Y|) / 6)^alpha (`length_penalty`), |Y| counting EOS. Each step
  keeps the beam_size most probable (by log-prob) live extensions that are not EOS, and merges the
  extensions ending in EOS that rank among the beam_size most probable extensions (as fairseq does),
  or reaching L_b tokens, into the beam_size best finished hypotheses. With beam_size 1 and alpha 0
  this is greedy decoding.

  Early stop: sentence b is done when it reaches L_b, or when no live hypothesis can beat the worst
  of its beam_size finished ones: with s the best live log-prob at length n, every completion scores
  at most s / max(lp(n+1), lp(L_b)) (log-probs only decrease, but for alpha > 0 lp keeps growing up
  to L_b, so the current lp(n) would stop too early; derivation in `_no_live_can_win`). Finished
  hypotheses of a done sentence are frozen. The loop stops when every sentence is done, which
  happens after at most max_steps steps.

  Args:
    step_fn: see the module docstring; called with int32 [batch*beam_size].
    cache: step_fn's initial pytree; leaves with ndim >= 1 have leading dim batch*beam_size.
    batch_size: number of sentences (static).
    beam_size: hypotheses kept per sentence (static).
    alpha: length penalty exponent (0.6 in Sec. 6.1).
    max_decode_lengths: int32 [batch] (or a scalar): L_b, the most tokens of sentence b, EOS
      included; clipped to [1, max_steps].
    max_steps: width of the returned token array (static).
    eos_id: end-of-sentence id.
    bos_id: id fed at the first step; never generated.
    pad_id: id written after a hypothesis's last token; never generated.

  Returns:
    tokens: int32 [batch, beam_size, max_steps], best-first; EOS-ended or exactly L_b tokens, PAD
      after. A slot left empty (fewer than beam_size distinct outputs exist) is all PAD.
    scores: float32 [batch, beam_size], log P(Y) / lp(Y), sorted descending; -inf for empty slots.

  Raises:
    ValueError: on a bad size, a cache leaf without leading dim batch*beam_size, a
      max_decode_lengths of the wrong shape, or eos_id equal to bos_id or pad_id.
  """
  if beam_size < 1:
    raise ValueError(f'beam_size must be >= 1, got {beam_size}')
  special_ids = (eos_id, bos_id, pad_id)
  max_lengths = _check_args(cache, batch_size * beam_size, max_decode_lengths, batch_size,
                            max_steps, special_ids)
  state = _init_beam_state(cache, batch_size, beam_size, max_steps, pad_id)
  state = jax.lax.while_loop(
      lambda s: (s.step < max_steps) & ~jnp.all(s.done),
      lambda s: _beam_step(s, step_fn, max_lengths, alpha, special_ids),
      state)
  empty = jnp.isneginf(state.finished_scores)[:, :, None]  # [batch, beam, 1]
  return jnp.where(empty, pad_id, state.finished_seqs), state.finished_scores


def _greedy_step(state: _GreedyState, step_fn: StepFn, max_lengths: jax.Array,
                 special_ids: tuple[int, int, int]) -> _GreedyState:
  eos_id, bos_id, pad_id = special_ids
  log_probs, cache = _log_probs(step_fn, state.last_tokens, state.cache, bos_id, pad_id)
  token = jnp.where(state.done, pad_id, jnp.argmax(log_probs, axis=-1).astype(jnp.int32))
  tokens = state.tokens.at[:, state.step].set(token)
  length = state.step + 1
  done = state.done | (token == eos_id) | (length >= max_lengths)
  return _GreedyState(length, tokens, token, done, cache)


def greedy_search(step_fn: StepFn, cache: Any, *, batch_size: int, max_decode_lengths: jax.Array,
                  max_steps: int, eos_id: int, bos_id: int, pad_id: int = 0) -> jax.Array:
  """Greedy decoding: the most probable token at every step, until EOS or L_b tokens.

  Args:
    step_fn: see the module docstring; called with int32 [batch].
    cache: step_fn's initial pytree; leaves with ndim >= 1 have leading dim batch.
    batch_size: number of sentences (static).
    max_decode_lengths: int32 [batch] (or a scalar): the most tokens of sentence b, EOS included;
      clipped to [1, max_steps].
    max_steps: width of the returned token array (static).
    eos_id: end-of-sentence id.
    bos_id: id fed at the first step; never generated.
    pad_id: id written after the last token; never generated.

  Returns:
    int32 [batch, max_steps]: tokens up to and including EOS (or exactly L_b tokens), PAD after.

  Raises:
    ValueError: as `beam_search`, with batch in place of batch*beam_size.
  """
  special_ids = (eos_id, bos_id, pad_id)
  max_lengths = _check_args(cache, batch_size, max_decode_lengths, batch_size, max_steps,
                            special_ids)
  state = _GreedyState(
      step=jnp.zeros((), jnp.int32),
      tokens=jnp.full((batch_size, max_steps), pad_id, jnp.int32),
      last_tokens=jnp.full((batch_size,), bos_id, jnp.int32),
      done=jnp.zeros((batch_size,), bool),
      cache=cache)
  state = jax.lax.while_loop(
      lambda s: (s.step < max_steps) & ~jnp.all(s.done),
      lambda s: _greedy_step(s, step_fn, max_lengths, special_ids),
      state)
  return state.tokens
