"""Greedy decoding (§6.1 with a beam of one): the most probable token at every step, until EOS or L_b tokens.

The step function's contract and the loop are `search`'s; `greedy_search` is `beam.beam_search` at beam_size 1
and alpha 0, without the beam bookkeeping (the validation BLEU logged during training uses it).
"""
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from transformer_jax.decoding import search


class GreedyState(NamedTuple):
  """The loop carry of `greedy_search`."""
  step: jax.Array         # int32 []; tokens generated so far.
  tokens: jax.Array       # int32 [batch, max_steps]; PAD after EOS or the length limit.
  last_tokens: jax.Array  # int32 [batch]; fed to step_fn next.
  done: jax.Array         # bool [batch]; the sentence's tokens are final.
  cache: Any              # step_fn's pytree; leaves with ndim >= 1 have leading dim batch.
  max_lengths: jax.Array  # int32 [batch]; L_b.


def _logits(step_fn: search.StepFn, last_tokens: jax.Array, cache: Any, bos_id: int,
            pad_id: int) -> tuple[jax.Array, Any]:
  """Calls step_fn; returns float32 logits [rows, vocab] with PAD and BOS at -inf, and the new cache."""
  logits, cache = step_fn(last_tokens, cache)
  vocab = jnp.arange(logits.shape[-1])
  banned = ((vocab == pad_id) | (vocab == bos_id))[None, :]  # [1, vocab]
  return jnp.where(banned, -jnp.inf, logits.astype(jnp.float32)), cache


def _greedy_step(state: GreedyState, step_fn: search.StepFn,
                 special_ids: tuple[int, int, int]) -> GreedyState:
  eos_id, bos_id, pad_id = special_ids
  logits, cache = _logits(step_fn, state.last_tokens, state.cache, bos_id, pad_id)
  token = jnp.where(state.done, pad_id, jnp.argmax(logits, axis=-1).astype(jnp.int32))
  tokens = state.tokens.at[:, state.step].set(token)
  length = state.step + 1
  done = state.done | (token == eos_id) | (length >= state.max_lengths)
  return GreedyState(length, tokens, token, done, cache, state.max_lengths)


def init_greedy_search(cache: Any, *, batch_size: int, max_decode_lengths: jax.Array, max_steps: int,
                       eos_id: int, bos_id: int, pad_id: int = 0) -> GreedyState:
  """The state of `greedy_search` before its first step (arguments as there); go on with
  `continue_greedy_search` (as `beam.init_beam_search` for beam search). Its `tokens` are the output.

  Raises:
    ValueError: as `greedy_search`.
  """
  max_lengths = search.check_args(cache, batch_size, max_decode_lengths, batch_size, max_steps,
                                  (eos_id, bos_id, pad_id))
  return GreedyState(
      step=jnp.zeros((), jnp.int32),
      tokens=jnp.full((batch_size, max_steps), pad_id, jnp.int32),
      last_tokens=jnp.full((batch_size,), bos_id, jnp.int32),
      done=jnp.zeros((batch_size,), bool),
      cache=cache,
      max_lengths=max_lengths)


def continue_greedy_search(state: GreedyState, step_fn: search.StepFn, *, until: int | jax.Array, eos_id: int,
                           bos_id: int, pad_id: int = 0) -> GreedyState:
  """Greedy steps while state.step < until and some sentence is not done (as `beam.continue_beam_search`)."""
  return search.run_until(state, lambda s: _greedy_step(s, step_fn, (eos_id, bos_id, pad_id)), until)


def greedy_search(step_fn: search.StepFn, cache: Any, *, batch_size: int, max_decode_lengths: jax.Array,
                  max_steps: int, eos_id: int, bos_id: int, pad_id: int = 0,
                  cache_stages: Sequence[int] = (), grow_cache: search.GrowFn | None = None) -> jax.Array:
  """Greedy decoding: the most probable token at every step, until EOS or L_b tokens.

  Args:
    step_fn: see `search`; called with int32 [batch].
    cache: step_fn's initial pytree; leaves with ndim >= 1 have leading dim batch.
    batch_size: number of sentences (static).
    max_decode_lengths: int32 [batch] (or a scalar): the most tokens of sentence b, EOS included;
      clipped to [1, max_steps].
    max_steps: width of the returned token array (static).
    eos_id: end-of-sentence id.
    bos_id: id fed at the first step; never generated.
    pad_id: id written after the last token; never generated.
    cache_stages, grow_cache: as in `beam.beam_search`.

  Returns:
    int32 [batch, max_steps]: tokens up to and including EOS (or exactly L_b tokens), PAD after.

  Raises:
    ValueError: as `beam.beam_search`, with batch in place of batch*beam_size.
  """
  state = init_greedy_search(cache, batch_size=batch_size, max_decode_lengths=max_decode_lengths,
                             max_steps=max_steps, eos_id=eos_id, bos_id=bos_id, pad_id=pad_id)
  step = lambda s: _greedy_step(s, step_fn, (eos_id, bos_id, pad_id))
  return search.run_stages(state, step, max_steps, cache_stages, grow_cache).tokens
