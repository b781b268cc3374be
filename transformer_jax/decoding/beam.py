"""Beam search with a length penalty (§6.1), driven by a `step_fn(last_tokens, cache)` callback.

The step function's contract, the conventions on lengths and special ids, and the loop are `search`'s. Here
rows = batch_size * beam_size: rows b*beam .. b*beam+beam-1 of every cache leaf belong to sentence b (see
`expand_to_beams`) and are reordered whenever beams are reselected: by default every leaf's rows are gathered
(`reorder_cache`; leaves with ndim 0, e.g. a cache index, pass unchanged), and a caller whose cache has another
layout passes its own `reorder_cache` (e.g. `transformer_jax.cpu.backend`, whose caches stay in place while a
small index of rows moves).
"""
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from transformer_jax.decoding import search

# When a sentence's beam search stops (`beam_search`'s early_stopping).
EARLY_STOPPING = ('bound', 'finished')
# (cache, parent int32 [batch, beam], beam_size) -> the cache of the chosen beams: `reorder_cache`.
ReorderFn = Callable[[Any, jax.Array, int], Any]
# (logits [rows, vocab], k, *, eos_id, bos_id, pad_id) -> (lse, top_logits, top_tokens, eos_logit): `extension_scores`.
ScoresFn = Callable[..., tuple[jax.Array, jax.Array, jax.Array, jax.Array]]


class BeamState(NamedTuple):
  """The loop carry of `beam_search`."""
  step: jax.Array             # int32 []; tokens generated so far by every live hypothesis.
  live_seqs: jax.Array        # int32 [batch, beam, max_steps]; PAD from position `step` on.
  live_log_probs: jax.Array   # float32 [batch, beam]; sum of token log-probs, -inf for an empty slot.
  finished_seqs: jax.Array    # int32 [batch, beam, max_steps]; PAD after the last token.
  finished_scores: jax.Array  # float32 [batch, beam]; log-prob / lp(|Y|), best-first, -inf if empty.
  done: jax.Array             # bool [batch]; the sentence's finished hypotheses are final (frozen).
  cache: Any                  # step_fn's pytree; leaves with ndim >= 1 have leading dim batch*beam.
  max_lengths: jax.Array      # int32 [batch]; L_b.


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


def _top_k(x: jax.Array, k: int, block: int = 64) -> tuple[jax.Array, jax.Array]:
  """lax.top_k over the last axis (same values, indices and lowest-index tie order), faster on a CPU.

  XLA:CPU's TopK call costs ~3 ns per element (1.5 ms for [64, 8000] at k=4), and fused into
  surrounding arithmetic it becomes a full sort of the row (~100x more). For long rows this takes the
  maximum of every `block` consecutive elements, keeps the k blocks with the largest maxima (the k largest
  elements can lie in no other block), and runs top_k on those k*block elements only: one fused reduction
  over the row (0.3 ms at [64, 8000]). The optimisation barriers keep every top_k unfused.

  Args:
    x: float [..., n].
    k: number of elements to return, 1 <= k <= n.
    block: elements per block.

  Returns:
    (values [..., k] descending, int32 indices [..., k] into the last axis of x).
  """
  top_k = lambda y: jax.lax.optimization_barrier(jax.lax.top_k(jax.lax.optimization_barrier(y), k))
  n = x.shape[-1]
  num_blocks = -(-n // block)
  if num_blocks <= 2 * k:
    return top_k(x)
  padding = [(0, 0)] * (x.ndim - 1) + [(0, num_blocks * block - n)]
  blocks = jnp.pad(x, padding, constant_values=-jnp.inf).reshape(*x.shape[:-1], num_blocks, block)
  _, chosen = top_k(jnp.max(blocks, axis=-1))  # [..., k]
  chosen = jnp.sort(chosen, axis=-1)  # In index order, so that ties still go to the lowest index.
  candidates = jnp.take_along_axis(blocks, chosen[..., None], axis=-2).reshape(*x.shape[:-1], k * block)
  values, index = top_k(candidates)
  return values, jnp.take_along_axis(chosen, index // block, axis=-1) * block + index % block


class _Candidates(NamedTuple):
  """Extensions of the live hypotheses of each sentence, [batch, n] each."""
  log_probs: jax.Array  # float32: log-prob of the extended hypothesis.
  parent: jax.Array     # int32 in [0, beam): the live hypothesis extended.
  token: jax.Array      # int32: the token appended.

  def take(self, index: jax.Array) -> '_Candidates':
    return _Candidates(*(jnp.take_along_axis(x, index, axis=1) for x in self))


def extension_scores(logits: jax.Array, k: int, *, eos_id: int, bos_id: int,
                     pad_id: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """What a beam step reads of step_fn's logits (§6.1 beam search): the contract of `beam_search`'s scores_fn.

  Args:
    logits: [rows, vocab], float32 or bfloat16.
    k: how many of the best tokens to return, 1 <= k <= vocab.
    eos_id, bos_id, pad_id: the special ids; PAD and BOS are never generated.

  Returns:
    (lse float32 [rows], the log-sum-exp over the tokens other than PAD and BOS; float32 [rows, k] the largest
    logits of the tokens other than PAD, BOS and EOS, best first, and int32 [rows, k] their ids, ties to the
    lowest id as `jax.lax.top_k`; float32 [rows] the EOS logit). Log-probabilities are logits - lse, never
    materialised over the vocabulary.
  """
  vocab = jnp.arange(logits.shape[-1])
  logits = jnp.where(((vocab == pad_id) | (vocab == bos_id))[None, :], -jnp.inf, logits.astype(jnp.float32))
  top_logits, top_tokens = _top_k(jnp.where((vocab == eos_id)[None, :], -jnp.inf, logits), k)
  return jax.nn.logsumexp(logits, axis=-1), top_logits, top_tokens, logits[:, eos_id]


def _candidates(live_log_probs: jax.Array, lse: jax.Array, top_logits: jax.Array, top_tokens: jax.Array,
                eos_logit: jax.Array, eos_id: int) -> _Candidates:
  """The extensions a beam step can select from: per live hypothesis, its beam_size most probable non-EOS
  extensions and its EOS extension.

  Among them are the beam_size most probable extensions of the sentence and its beam_size most probable
  non-EOS extensions (each of those ranks among its parent's beam_size best), which is all that a step
  reads, so that no [batch, beam * vocab] array is ever built or searched.

  Args:
    live_log_probs: float32 [batch, beam].
    lse, top_logits, top_tokens, eos_logit: of the batch * beam rows, from `extension_scores` with
      k = min(beam, vocab).
    eos_id: end-of-sentence id.

  Returns:
    [batch, beam * (k + 1)] candidates, ordered by parent, then the parent's extensions best-first, then its
    EOS extension.
  """
  batch_size, beam_size = live_log_probs.shape
  k = top_logits.shape[-1]
  logits = jnp.concatenate([top_logits, eos_logit[:, None]], axis=1)  # [rows, k + 1]
  tokens = jnp.concatenate([top_tokens, jnp.full_like(top_tokens[:, :1], eos_id)], axis=1)
  log_probs = live_log_probs[:, :, None] + (logits - lse[:, None]).reshape(batch_size, beam_size, k + 1)
  parent = jnp.broadcast_to(jnp.arange(beam_size, dtype=jnp.int32)[None, :, None], log_probs.shape)
  flat = lambda x: x.reshape(batch_size, beam_size * (k + 1))
  return _Candidates(flat(log_probs), flat(parent), flat(tokens.reshape(batch_size, beam_size, k + 1)))


def _extend(live_seqs: jax.Array, chosen: _Candidates, step: jax.Array) -> jax.Array:
  """Sequences of the chosen candidates [batch, n]: the parent's tokens, then the new token at `step`."""
  seqs = jnp.take_along_axis(live_seqs, chosen.parent[:, :, None], axis=1)  # [batch, n, max_steps]
  return seqs.at[:, :, step].set(chosen.token)


def parent_rows(parent: jax.Array, beam_size: int) -> jax.Array:
  """The cache row each row of a beam step continues: parent int [batch, beam] in [0, beam) -> [batch * beam]."""
  return (jnp.arange(parent.shape[0])[:, None] * beam_size + parent).reshape(-1)


def gather_rows(x: Any, rows: jax.Array) -> Any:
  """x[rows] along the leading axis (an array of ndim 0 is returned as it is); rows must be in bounds."""
  return x if jnp.ndim(x) == 0 else x.at[rows].get(mode='promise_in_bounds')


def reorder_cache(cache: Any, parent: jax.Array, beam_size: int) -> Any:
  """The default reorder of a beam step: every leaf's rows gathered for the chosen beams' parents.

  Args:
    cache: step_fn's pytree; leaves with ndim >= 1 have leading dimension batch * beam_size.
    parent: int [batch, beam_size] in [0, beam_size): the live hypothesis each new one extends.
    beam_size: hypotheses per sentence.

  Returns:
    The same structure, row b * beam_size + i holding what row b * beam_size + parent[b, i] held.
  """
  rows = parent_rows(parent, beam_size)
  return jax.tree.map(lambda x: gather_rows(x, rows), cache)


def _update_finished(state: BeamState, candidates: _Candidates, finishing: jax.Array,
                     alpha: float) -> tuple[jax.Array, jax.Array]:
  """Merges the finishing candidates into the beam_size best finished hypotheses."""
  beam_size = state.finished_scores.shape[1]
  scores = candidates.log_probs / length_penalty(state.step + 1, alpha)
  scores = jnp.where(finishing, scores, -jnp.inf)
  new_scores, new_index = _top_k(scores, beam_size)  # [batch, beam]
  new_seqs = _extend(state.live_seqs, candidates.take(new_index), state.step)
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


def _beam_step(state: BeamState, step_fn: search.StepFn, alpha: float, special_ids: tuple[int, int, int],
               early_stopping: str, scores_fn: ScoresFn | None, reorder: ReorderFn | None) -> BeamState:
  """Extends every live hypothesis by one token and reselects the live and finished beams."""
  eos_id, bos_id, pad_id = special_ids
  max_lengths = state.max_lengths
  beam_size = state.live_log_probs.shape[1]
  last = jnp.where(state.step > 0, state.live_seqs[:, :, jnp.maximum(state.step - 1, 0)], bos_id)
  logits, cache = step_fn(last.reshape(-1), state.cache)
  scores = (scores_fn or extension_scores)(logits, min(beam_size, logits.shape[-1]), eos_id=eos_id, bos_id=bos_id,
                                           pad_id=pad_id)
  candidates = _candidates(state.live_log_probs, *scores, eos_id)  # [batch, n] each
  length = state.step + 1  # |Y| of every candidate.
  is_eos = candidates.token == eos_id
  at_limit = (length >= max_lengths)[:, None]  # [batch, 1]
  active = ~state.done[:, None]  # [batch, 1]; finished beams of done sentences are frozen.
  # As in fairseq: an extension ending in EOS finishes only if it ranks among the beam_size most
  # probable extensions, so beam_size 1 with alpha 0 is greedy decoding.
  kth_best = _top_k(candidates.log_probs, beam_size)[0][:, -1:]  # [batch, 1]
  finishing = ((is_eos & (candidates.log_probs >= kth_best)) | at_limit) & active
  finished_seqs, finished_scores = _update_finished(state, candidates, finishing, alpha)
  live_candidates = jnp.where(is_eos | at_limit | ~active, -jnp.inf, candidates.log_probs)
  live_log_probs, live_index = _top_k(live_candidates, beam_size)
  chosen = candidates.take(live_index)
  done = state.done | (length >= max_lengths) | _no_live_can_win(
      live_log_probs, finished_scores, length, max_lengths, alpha)
  if early_stopping == 'finished':
    done = done | ~jnp.isneginf(finished_scores[:, -1])  # beam_size hypotheses have finished.
  return BeamState(length, _extend(state.live_seqs, chosen, state.step), live_log_probs, finished_seqs,
                   finished_scores, done, (reorder or reorder_cache)(cache, chosen.parent, beam_size), max_lengths)


def init_beam_search(cache: Any, *, batch_size: int, beam_size: int, max_decode_lengths: jax.Array,
                     max_steps: int, eos_id: int, bos_id: int, pad_id: int = 0) -> BeamState:
  """The state of `beam_search` before its first step (arguments as there).

  `beam_search` is init_beam_search, then continue_beam_search once per stage (`search.stage_ends`, growing the
  cache before each), then beam_search_output. A caller that drives those steps itself can stop the
  search at any step, e.g. to drop the sentences that are done (`search.take_sentences`) and go on with fewer.

  Raises:
    ValueError: as `beam_search`.
  """
  if beam_size < 1:
    raise ValueError(f'beam_size must be >= 1, got {beam_size}')
  max_lengths = search.check_args(cache, batch_size * beam_size, max_decode_lengths, batch_size, max_steps,
                                  (eos_id, bos_id, pad_id))
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
      cache=cache,
      max_lengths=max_lengths)


def continue_beam_search(state: BeamState, step_fn: search.StepFn, *, until: int | jax.Array, alpha: float,
                         eos_id: int, bos_id: int, pad_id: int = 0, early_stopping: str = 'bound',
                         scores_fn: ScoresFn | None = None, reorder_cache: ReorderFn | None = None) -> BeamState:
  """Beam steps while state.step < until and some sentence is not done (one `jax.lax.while_loop`).

  Args:
    state: from `init_beam_search`, a previous call, or `search.take_sentences`. Where step_fn's cache has a fixed
      number of positions (the model's self-attention cache), it must hold at least `until` of them.
    step_fn, alpha, eos_id, bos_id, pad_id, early_stopping, scores_fn, reorder_cache: as in `beam_search`.
    until: int32 [] step count to stop at (at most the max_steps of `init_beam_search`); it may be traced,
      so that one compiled loop stops at any step.

  Returns:
    The state after the last step taken.

  Raises:
    ValueError: for an unknown early_stopping.
  """
  if early_stopping not in EARLY_STOPPING:
    raise ValueError(f'early_stopping must be one of {EARLY_STOPPING}, got {early_stopping!r}')
  return search.run_until(state, lambda s: _beam_step(s, step_fn, alpha, (eos_id, bos_id, pad_id), early_stopping,
                                                      scores_fn, reorder_cache),
                    until)


def beam_search_output(state: BeamState, pad_id: int = 0) -> tuple[jax.Array, jax.Array]:
  """`beam_search`'s output from a state: its finished hypotheses, final for the sentences that are done.

  Returns:
    tokens: int32 [batch, beam_size, max_steps], best-first, PAD after the last token; an empty slot is all PAD.
    scores: float32 [batch, beam_size], log P(Y) / lp(Y), sorted descending; -inf for empty slots.
  """
  empty = jnp.isneginf(state.finished_scores)[:, :, None]  # [batch, beam, 1]
  return jnp.where(empty, pad_id, state.finished_seqs), state.finished_scores


def beam_search(step_fn: search.StepFn, cache: Any, *, batch_size: int, beam_size: int, alpha: float,
                max_decode_lengths: jax.Array, max_steps: int, eos_id: int, bos_id: int,
                pad_id: int = 0, cache_stages: Sequence[int] = (),
                grow_cache: search.GrowFn | None = None, early_stopping: str = 'bound',
                scores_fn: ScoresFn | None = None,
                reorder_cache: ReorderFn | None = None) -> tuple[jax.Array, jax.Array]:
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
  to L_b, so the current lp(n) would stop too early; derivation in `_no_live_can_win`). That bound
  (early_stopping='bound', as tensor2tensor and the Flax WMT example) returns what a search without
  early stop would; with a large alpha it rarely fires before L_b. early_stopping='finished' also
  stops a sentence as soon as beam_size hypotheses have finished (fairseq's and CTranslate2's rule):
  a live hypothesis that the length penalty would have ranked higher later is given up. Finished
  hypotheses of a done sentence are frozen. The loop stops when every sentence is done, which
  happens after at most max_steps steps.

  Args:
    step_fn: see `search`; called with int32 [batch*beam_size].
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
    cache_stages: step counts at which the cache grows, e.g. (16, 32, 64); empty for one stage.
    grow_cache: grow_cache(cache, n) returns the cache enlarged to hold n positions (called with each
      stage's last step count, the first stage's included); needed when cache_stages is given.
    early_stopping: 'bound' or 'finished' (EARLY_STOPPING), see above.
    scores_fn: what a step reads of the logits, with `extension_scores`' signature and results (e.g. the CPU
      kernels' one pass over the vocabulary, `transformer_jax.cpu.kernels.beam_scores`); None: `extension_scores`.
    reorder_cache: how a step moves the cache to the chosen beams, with `reorder_cache`'s signature and
      result (e.g. `transformer_jax.cpu.backend.CpuDecoding.reorder_cache`); None: `reorder_cache`.

  Returns:
    tokens: int32 [batch, beam_size, max_steps], best-first; EOS-ended or exactly L_b tokens, PAD
      after. A slot left empty (fewer than beam_size distinct outputs exist) is all PAD.
    scores: float32 [batch, beam_size], log P(Y) / lp(Y), sorted descending; -inf for empty slots.

  Raises:
    ValueError: on a bad size, a cache leaf without leading dim batch*beam_size, a
      max_decode_lengths of the wrong shape, eos_id equal to bos_id or pad_id, or an unknown early_stopping.
  """
  if early_stopping not in EARLY_STOPPING:  # Before any tracing.
    raise ValueError(f'early_stopping must be one of {EARLY_STOPPING}, got {early_stopping!r}')
  special = dict(eos_id=eos_id, bos_id=bos_id, pad_id=pad_id)
  state = init_beam_search(cache, batch_size=batch_size, beam_size=beam_size, max_decode_lengths=max_decode_lengths,
                           max_steps=max_steps, **special)
  step = lambda s: _beam_step(s, step_fn, alpha, (eos_id, bos_id, pad_id), early_stopping, scores_fn, reorder_cache)
  return beam_search_output(search.run_stages(state, step, max_steps, cache_stages, grow_cache), pad_id)
