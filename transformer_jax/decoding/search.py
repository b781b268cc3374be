"""What beam and greedy search share (§6.1): the step function's contract, argument checks, and the loop.

Conventions of both searches (`beam.beam_search`, `greedy.greedy_search`):
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
leaf with ndim >= 1 has leading dimension rows.

Both searches can grow the cache in stages (`cache_stages`, `grow_cache`): a cache that holds only the
positions decoded so far makes every step read and reorder less, at the price of compiling the loop once
per stage (docs/performance.md has the figures). `run_stages` runs a search's step that way.
"""
from typing import Any, Callable, Sequence, TypeVar

import jax
import jax.numpy as jnp

StepFn = Callable[[jax.Array, Any], tuple[jax.Array, Any]]
GrowFn = Callable[[Any, int], Any]
# A search's loop carry: `beam.BeamState` or `greedy.GreedyState`, NamedTuples with `step`, `done` and `cache`.
State = TypeVar('State')


def check_args(cache: Any, rows: int, max_decode_lengths: Any, batch_size: int, max_steps: int,
               special_ids: tuple[int, int, int]) -> jax.Array:
  """Validates a search's static arguments; returns L_b, int32 [batch], clipped to [1, max_steps].

  Raises:
    ValueError: on a size below 1, eos_id equal to bos_id or pad_id, a cache leaf without leading dimension
      `rows`, or max_decode_lengths of another shape than [batch_size] or [].
  """
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


def stage_ends(max_steps: int, cache_stages: Sequence[int]) -> list[int]:
  """The step counts at which the stages of a search end: the sorted `cache_stages` in (0, max_steps), then
  max_steps. Before the stage that ends at e, the cache is grown to hold e positions (`run_stages`)."""
  return sorted({int(end) for end in cache_stages if 0 < end < max_steps} | {max_steps})


def run_until(state: State, step: Callable[[State], State], until: int | jax.Array) -> State:
  """`step` while state.step < until and some sentence is not done: one `jax.lax.while_loop`."""
  return jax.lax.while_loop(lambda s: (s.step < until) & ~jnp.all(s.done), step, state)


def run_stages(state: State, step: Callable[[State], State], max_steps: int, cache_stages: Sequence[int],
               grow_cache: GrowFn | None) -> State:
  """Runs `step` while state.step < max_steps and some sentence is not done, one while-loop per stage.

  Stage i ends at step e_i (`stage_ends`). Before stage i, grow_cache(cache, e_i) makes the cache hold e_i
  positions (the steps that stage can reach).

  Raises:
    ValueError: if cache_stages is given without grow_cache.
  """
  if cache_stages and grow_cache is None:
    raise ValueError('cache_stages needs grow_cache')
  for end in stage_ends(max_steps, cache_stages):
    if grow_cache is not None:
      state = state._replace(cache=grow_cache(state.cache, end))
    state = run_until(state, step, end)
  return state


def take_sentences(state: State, index: jax.Array) -> State:
  """The state of the sentences `index` only, in that order: a smaller batch that goes on as they would have.

  Args:
    state: a `beam.BeamState` or `greedy.GreedyState`.
    index: int [n], indices of sentences in [0, batch) (repeats allowed, e.g. a done sentence as filler).

  Returns:
    The same type with batch n: every per-sentence leaf gathered along axis 0, cache rows (beam_size per
    sentence in beam search) gathered with them, the step count unchanged.
  """
  index = jnp.asarray(index, jnp.int32)
  batch_size = state.done.shape[0]

  def take_rows(x):
    if jnp.ndim(x) == 0:
      return x
    per_sentence = x.shape[0] // batch_size
    rows = (index[:, None] * per_sentence + jnp.arange(per_sentence)[None, :]).reshape(-1)
    return x[rows]

  fields = {name: (value if name == 'step' else jax.tree.map(take_rows, value))
            for name, value in state._asdict().items()}
  return type(state)(**fields)
