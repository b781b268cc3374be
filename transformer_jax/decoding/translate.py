"""Translation with the decoding cache (§6.1): the encoder once, then cached beam search, detokenised.

`decode_batch` is one jitted search over a batch; `decode_batch_compacted` the same search driven from the host,
which drops the sentences that are done as it goes; `decode_all` runs either over a split's batches (on one
device, `decode.concurrent_batches` of them at once; multi-host: every process gets every row back);
`translate` detokenises. Which checkpoints to decode and what to do with the output is `evaluation/evaluate.py`'s
(during and after training) and `run/evaluate.py`'s (--mode=evaluate and --mode=translate).

Every search runs its steps on a decoding backend (`backends.DecodingBackend`), chosen on the host before the
search is traced (`backends.decoding_backend`, from `model.decoding_kernel`).
"""
import collections
import concurrent.futures
import contextlib
import functools
import os
from typing import Any, Callable, Iterable, Iterator, TypeVar

from absl import logging
import flax
import flax.linen as nn
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np

from transformer_jax import logs
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.decoding import backends
from transformer_jax.decoding import beam
from transformer_jax.decoding import greedy
from transformer_jax.decoding import search
from transformer_jax.model import transformer as model_lib

Array = jax.Array


# Decoding grows the self-attention cache through these lengths (`beam.beam_search`'s cache_stages).
CACHE_STAGES = (16, 32, 64, 128, 256)


_SPECIAL_IDS = dict(eos_id=tokenizer_lib.EOS_ID, bos_id=tokenizer_lib.BOS_ID, pad_id=tokenizer_lib.PAD_ID)


def _check(model: model_lib.Transformer, source_length: int, extra_length: int, early_stopping: str) -> int:
  """Validates decode_batch's arguments; returns max_steps, the output width."""
  if early_stopping not in beam.EARLY_STOPPING:  # Also where greedy search ignores it.
    raise ValueError(f'early_stopping must be one of {beam.EARLY_STOPPING}, got {early_stopping!r}')
  max_steps = source_length + extra_length
  if model.cfg.position_embedding == 'learned' and max_steps > model.cfg.max_length:  # Else silent NaN.
    raise ValueError(f'decoding {source_length} source positions + decode.extra_length={extra_length} needs '
                     f'{max_steps} rows of the learned position table; model.max_length={model.cfg.max_length}')
  return max_steps


def _start(params: Any, source_tokens: Array, *, model: model_lib.Transformer, backend: backends.DecodingBackend,
           beam_size: int, extra_length: int, max_steps: int, cache_length: int, is_greedy: bool,
           context_length: int | None = None) -> tuple[Any, tuple[Array, Array, dict]]:
  """The encoder, then the search's first state with a self-attention cache of cache_length positions.

  context_length, where larger than src_len, pads the memory (masked) to that many positions, so that the
  decoding loop of every source length up to it is one compiled program (encoder-decoder attention over a few
  more masked keys costs little next to the step's products). max_steps (>= src_len + extra_length) is the
  width of the state's token arrays and the last step the search may reach.

  Returns:
    (state, context): a `beam.BeamState` (or `greedy.GreedyState` when is_greedy) and the per-sentence arrays
    the decoder reads at every step (memory [batch, m, d_model] and source segment ids [batch, m], with m =
    max(src_len, context_length), and the encoder-decoder attention K/V), each with leading dimension batch.
  """
  batch_size, source_length = source_tokens.shape
  source_segment_ids = model_lib.segment_ids_from_tokens(source_tokens)
  memory = model.apply({'params': params}, source_tokens, source_segment_ids, method='encode')
  if context_length is not None and context_length > source_length:
    pad = context_length - source_length
    memory = jnp.pad(memory, ((0, 0), (0, pad), (0, 0)))
    source_segment_ids = jnp.pad(source_segment_ids, ((0, 0), (0, pad)))
  max_decode_lengths = jnp.sum(source_segment_ids, axis=-1) + extra_length  # [batch]
  with backend.attention():
    _, variables = model.apply({'params': params}, memory, source_segment_ids, cache_length, beam_size,
                               method='init_cache', mutable=['cache'])
  # The encoder-decoder attention K/V never change: keep them out of the search's cache, which beam
  # search reorders (copies) at every step.
  fixed, cache = _split_cache(variables['cache'])
  common = dict(batch_size=batch_size, max_decode_lengths=max_decode_lengths, max_steps=max_steps, **_SPECIAL_IDS)
  if is_greedy:
    state = greedy.init_greedy_search(cache, **common)
  else:
    state = beam.init_beam_search(cache, beam_size=beam_size, **common)
  return state, (memory, source_segment_ids, fixed)


def _continue(params: Any, state: Any, context: tuple[Array, Array, dict], until: int | Array, *,
              model: model_lib.Transformer, backend: backends.DecodingBackend, alpha: float, early_stopping: str,
              cache_length: int) -> Any:
  """The search's steps until `until` (or every sentence done), the cache grown to cache_length first."""
  memory, source_segment_ids, fixed = context

  def step_fn(last_tokens, cache):
    with backend.attention():
      logits, new_variables = model.apply(
          {'params': params, 'cache': flax.traverse_util.unflatten_dict(fixed | _flat(cache))},
          last_tokens[:, None], memory, source_segment_ids, use_cache=True, method='decode', mutable=['cache'])
    return logits[:, 0, :], _split_cache(new_variables['cache'])[1]

  state = state._replace(cache=backend.grow_cache(state.cache, cache_length))
  if isinstance(state, greedy.GreedyState):
    return greedy.continue_greedy_search(state, step_fn, until=until, **_SPECIAL_IDS)
  return beam.continue_beam_search(state, step_fn, until=until, alpha=alpha, early_stopping=early_stopping,
                                   scores_fn=backend.extension_scores, reorder_cache=backend.reorder_cache,
                                   **_SPECIAL_IDS)


def _output(state: Any, with_scores: bool) -> tuple[Array] | tuple[Array, Array]:
  """(best tokens,) or, with_scores, (tokens of every hypothesis, scores): see `decode_batch`."""
  if isinstance(state, greedy.GreedyState):
    return (state.tokens,)
  tokens, scores = beam.beam_search_output(state, tokenizer_lib.PAD_ID)
  return (tokens, scores) if with_scores else (tokens[:, 0, :],)


def decode_batch(params: Any, source_tokens: Array, *, model: model_lib.Transformer, beam_size: int,
                 alpha: float, extra_length: int, cache_stages: tuple[int, ...] = CACHE_STAGES,
                 with_scores: bool = False, early_stopping: str = 'bound',
                 backend: backends.DecodingBackend | None = None) -> Array | tuple[Array, Array]:
  """Translates one batch: encoder once, then cached beam search (or greedy when beam_size is 1).

  One compiled program with no host syncs (compiled once per shape, model and backend); `decode_batch_compacted`
  gives the same output and drops the sentences that are done as it goes.

  The maximum output length is the source length (tokens, EOS included) + extra_length (§6.1: +50).

  Args:
    params: model parameters.
    source_tokens: int32 [batch, src_len], 0-padded.
    model: the Transformer.
    beam_size: hypotheses kept per sentence; 1 runs greedy decoding.
    alpha: length penalty exponent.
    extra_length: extra output tokens allowed beyond the source length.
    cache_stages: decoded lengths at which the self-attention cache grows (the search compiles one loop
      per stage below the maximum length); () keeps the whole length from the start. Same output.
    with_scores: return every hypothesis with its score (beam search even at beam_size 1).
    early_stopping: when a sentence's beam search stops (`beam.beam_search`): 'bound' or 'finished'.
    backend: what the steps run on; None: `backends.decoding_backend(model.cfg)`, chosen here on the host.

  Returns:
    int32 [batch, src_len + extra_length]: the best hypothesis, PAD after EOS. With with_scores, the
    `beam.beam_search` pair: tokens [batch, beam_size, src_len + extra_length], scores [batch, beam_size].

  Raises:
    ValueError: with learned positions, if src_len + extra_length exceeds model.max_length; for an
      early_stopping not in `beam.EARLY_STOPPING`; as `backends.decoding_backend`.
  """
  backend = backend or backends.decoding_backend(model.cfg)
  return _decode_batch_jit(params, source_tokens, model=model, backend=backend,
                           beam_size=beam_size, alpha=alpha, extra_length=extra_length, cache_stages=cache_stages,
                           with_scores=with_scores, early_stopping=early_stopping)


@functools.partial(jax.jit, static_argnames=('model', 'backend', 'beam_size', 'alpha', 'extra_length',
                                             'cache_stages', 'with_scores', 'early_stopping'))
def _decode_batch_jit(params: Any, source_tokens: Array, *, model: model_lib.Transformer,
                      backend: backends.DecodingBackend, beam_size: int, alpha: float, extra_length: int,
                      cache_stages: tuple[int, ...], with_scores: bool,
                      early_stopping: str) -> Array | tuple[Array, Array]:
  """`decode_batch` with its backend chosen."""
  max_steps = _check(model, source_tokens.shape[1], extra_length, early_stopping)
  ends = search.stage_ends(max_steps, cache_stages)
  state, context = _start(params, source_tokens, model=model, backend=backend, beam_size=beam_size,
                          extra_length=extra_length, max_steps=max_steps, cache_length=ends[0],
                          is_greedy=beam_size == 1 and not with_scores)
  for end in ends:
    state = _continue(params, state, context, end, model=model, backend=backend, alpha=alpha,
                      early_stopping=early_stopping, cache_length=end)
  output = _output(state, with_scores)
  return output if with_scores else output[0]


_start_jit = jax.jit(_start, static_argnames=('model', 'backend', 'beam_size', 'extra_length', 'max_steps',
                                             'cache_length', 'is_greedy', 'context_length'))
_continue_jit = jax.jit(_continue, static_argnames=('model', 'backend', 'alpha', 'early_stopping', 'cache_length'))
_output_jit = jax.jit(_output, static_argnames=('with_scores',))  # Given states without their cache.


@jax.jit
def _take_sentences(state: Any, context: Any, index: Array) -> tuple[Any, Any]:
  return search.take_sentences(state, index), jax.tree.map(lambda x: x[index], context)


def compacted_size(alive: int, batch_size: int, min_size: int = 8) -> int:
  """The batch a search of batch_size sentences, `alive` of them not done, goes on with.

  n = max(the smallest power of two >= alive, min_size); n where 2 n <= batch_size, else batch_size (no
  compaction). Powers of two and a floor keep the distinct shapes, and so the compilations (~0.7 s each for the
  decoding loop on a 2-vCPU Xeon), few; a step of 8 sentences x beam 4 took 2.6 ms there, of 16 sentences 4.1 ms.
  """
  size = max(1 << max(alive - 1, 0).bit_length(), min_size)
  return size if 2 * size <= batch_size else batch_size


def context_length_for(source_length: int) -> int:
  """The source positions `decode_batch_compacted` decodes src_len ones as: a power of two, at least 64, so
  that one compiled loop serves every source bucket up to 64 positions (each distinct shape is compiled)."""
  return max(64, 1 << (source_length - 1).bit_length())


def decode_batch_compacted(params: Any, source_tokens: Array | np.ndarray, *, model: model_lib.Transformer,
                           beam_size: int, alpha: float, extra_length: int,
                           cache_stages: tuple[int, ...] = CACHE_STAGES, with_scores: bool = False,
                           early_stopping: str = 'bound', compact_every_steps: int,
                           skip_rows: np.ndarray | None = None, context_length: int | None = None,
                           min_size: int = 8,
                           backend: backends.DecodingBackend | None = None
                           ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
  """`decode_batch`, stopping every compact_every_steps steps to drop the sentences that are done.

  A sentence's search ends at its own step, but a batch runs until its slowest sentence ends, and the rows
  of the others are computed all along. Here the host reads which sentences are done every
  compact_every_steps steps within each cache stage and at every stage's end, and goes on with the sentences
  left in a smaller batch where `compacted_size` gives one (a power of two at most half the batch, filled up
  with done sentences, which are frozen). Done sentences' output is final, so the result equals
  `decode_batch`'s (the batch a row is computed in changes, so with bfloat16 products a near-tie can rarely
  resolve differently). Costs: a host sync at every look, and a compilation of the loop for every batch size
  and cache stage reached, and of the gather and output for every batch size (`python -m transformer_jax.main`
  keeps them all in JAX's persistent compilation cache). Greedy and beam search alike. One device: the
  gathers do not keep a sharding over several.

  Args:
    params, source_tokens, model, beam_size, alpha, extra_length, cache_stages, with_scores,
      early_stopping, backend: as in `decode_batch`.
    compact_every_steps: steps between the host's looks at which sentences are done (>= 1).
    skip_rows: bool [batch], rows that need no output (e.g. padding rows of a split's last batch): they count
      as done from the start (left out when the batch is compacted); their output is unspecified.
    context_length: decode as if the sources were padded to this many positions (where longer than src_len):
      the loop is then compiled once for all the source lengths up to it rather than once per length (the
      encoder still runs at src_len). The output is as without it (to float32 rounding in the masked sums).
      None: `context_length_for(src_len)`.
    min_size: the smallest batch the search is compacted to (`compacted_size`).

  Returns:
    As `decode_batch`, as numpy arrays.

  Raises:
    ValueError: as `decode_batch`; if compact_every_steps < 1.
  """
  if compact_every_steps < 1:
    raise ValueError(f'compact_every_steps must be >= 1, got {compact_every_steps}')
  batch_size, source_length = source_tokens.shape
  width = _check(model, source_length, extra_length, early_stopping)  # The output's, as decode_batch's.
  backend = backend or backends.decoding_backend(model.cfg)
  if context_length is None:
    context_length = context_length_for(source_length)
  max_steps = max(width, context_length + extra_length)
  if model.cfg.position_embedding == 'learned':  # Steps past L_b <= width are never taken.
    max_steps = max(width, min(max_steps, model.cfg.max_length))
  ends = search.stage_ends(max_steps, cache_stages)
  state, context = _start_jit(params, jnp.asarray(source_tokens), model=model, backend=backend, beam_size=beam_size,
                              extra_length=extra_length, max_steps=max_steps, cache_length=ends[0],
                              is_greedy=beam_size == 1 and not with_scores, context_length=context_length)
  if skip_rows is not None:
    state = state._replace(done=state.done | jnp.asarray(skip_rows, bool))
  rows = np.arange(batch_size)  # The input row of each row of the state.
  output = lambda state: [np.asarray(x) for x in _output_jit(state._replace(cache=None), with_scores)]
  pieces = []  # (input rows, their outputs) of the sentences dropped along the way.
  # Looks: every compact_every_steps steps from each stage's start, and at each stage's end.
  looks = sorted({until for start, end in zip([0] + ends, ends)
                  for until in range(start + compact_every_steps, end, compact_every_steps)} | set(ends))
  for until in looks:
    cache_length = next(end for end in ends if end >= until)
    state = _continue_jit(params, state, context, until, model=model, backend=backend, alpha=alpha,
                          early_stopping=early_stopping, cache_length=cache_length)
    done = np.asarray(state.done)
    alive = int(np.sum(~done))
    if alive == 0:
      break
    size = compacted_size(alive, len(done), min_size)
    if size < len(done):
      finished = np.flatnonzero(done)
      pieces.append((rows[finished], [x[finished] for x in output(state)]))
      keep = np.concatenate([np.flatnonzero(~done), finished[:size - alive]])
      state, context = _take_sentences(state, context, jnp.asarray(keep, jnp.int32))
      rows = rows[keep]
  pieces.append((rows, output(state)))
  outputs = [np.zeros((batch_size, *x.shape[1:]), x.dtype) for x in pieces[-1][1]]
  for index, values in pieces:
    for array, value in zip(outputs, values):
      array[index] = value
  outputs[0] = outputs[0][..., :width]  # PAD from L_b <= width on.
  return tuple(outputs) if with_scores else outputs[0]


def _flat(tree) -> dict:
  return flax.traverse_util.flatten_dict(flax.core.unfreeze(tree))


def _split_cache(cache) -> tuple[dict, Any]:
  """(flat dict of the encoder-decoder attention entries, the rest of the cache as a nested dict)."""
  flat = _flat(cache)
  fixed = {path: value for path, value in flat.items() if 'encoder_decoder_attention' in path}
  rest = {path: value for path, value in flat.items() if path not in fixed}
  return fixed, flax.traverse_util.unflatten_dict(rest)


_T = TypeVar('_T')
_R = TypeVar('_R')


def concurrent_batches_for(concurrent_batches: int) -> int:
  """decode.concurrent_batches resolved to the batches `decode_all` decodes at once on one device.

  Args:
    concurrent_batches: a positive count, kept; or 0 (automatic): on the CPU backend the cores this process
      may use, at most 4 (measured on 2 vCPUs only, docs/performance.md), and 1 on accelerators (not measured
      there).

  Returns:
    The count, >= 1.

  Raises:
    ValueError: if concurrent_batches is negative.
  """
  if concurrent_batches < 0:
    raise ValueError(f'concurrent_batches must be >= 0 (0: automatic), got {concurrent_batches}')
  if concurrent_batches:
    return concurrent_batches
  if jax.default_backend() != 'cpu':
    return 1
  cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else (os.cpu_count() or 1)
  return min(cores, 4)


def _map_in_order(fn: Callable[[_T], _R], items: Iterable[_T], workers: int) -> Iterator[_R]:
  """fn over items on a pool of `workers` threads, the results in the items' order.

  At most `workers` calls run at once and at most 2 x workers are submitted ahead of the result awaited, so
  that a thread whose call has ended goes on with the next item while an earlier, slower one still runs.

  Args:
    fn: called once per item, on a pool thread (here, in order, when workers is 1).
    items: consumed as the results are awaited, not all at once.
    workers: threads.

  Yields:
    fn(item) for each item, in order.

  Raises:
    What fn raised, when its result is reached (the calls under way end first); what iterating `items`
    raised, which then takes the place of an exception of fn not yet reached. Closing the generator early
    waits for the calls under way and starts no others.
  """
  if workers <= 1:
    yield from map(fn, items)
    return
  with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix='decode') as pool:
    pending = collections.deque()
    for item in items:
      pending.append(pool.submit(fn, item))
      if len(pending) == 2 * workers:
        yield pending.popleft().result()
    while pending:
      yield pending.popleft().result()


def _decode_one(batch: dict[str, np.ndarray], *, params: Any, batch_sharding: jax.sharding.Sharding | None,
                one_device: bool, compact_every_steps: int, mesh: jax.sharding.Mesh, rules: Any,
                **kwargs) -> tuple[np.ndarray, np.ndarray]:
  """One batch of `decode_all`: (tokens int32 [rows, src_len + extra_length], example_index int [rows]) on the
  host. Traced and run under the caller's mesh and logical axis rules (`mesh`, `rules`), which a pool thread
  does not inherit."""
  with jax.set_mesh(mesh) if not mesh.empty else contextlib.nullcontext(), nn.logical_axis_rules(rules):
    if one_device and compact_every_steps:
      index = batch['example_index']
      return decode_batch_compacted(params, batch['source_tokens'], compact_every_steps=compact_every_steps,
                                    skip_rows=index < 0, **kwargs), index
    if one_device:
      return np.asarray(decode_batch(params, jnp.asarray(batch['source_tokens']), **kwargs)), batch['example_index']
    source, index = (jax.make_array_from_process_local_data(batch_sharding, batch[key])
                     for key in ('source_tokens', 'example_index'))
    tokens = decode_batch(params, source, **kwargs)
    # Every row, on every process, in the same global order for the tokens and their sentence indices.
    return tuple(np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in (tokens, index))


def params_in_compute_dtype(params: Any, cfg: model_lib.ModelConfig) -> Any:
  """The parameters with two or more dimensions (projection kernels, embedding tables) in the compute dtype.

  Every use of those casts them to cfg.compute_dtype, so the model computes the same with either; norm
  scales and biases (1-D) stay float32. For the searches of `decode_all`: XLA:CPU does not hoist
  the casts out of a search's while loop, which cast every weight at every step (docs/performance.md).

  Args:
    params: the model's parameter tree, float32.
    cfg: its config.

  Returns:
    The same tree, leaves of ndim >= 2 in cfg.compute_dtype.
  """
  return jax.tree.map(lambda p: p.astype(cfg.compute_dtype) if jnp.ndim(p) >= 2 else p, params)


def decode_all(params: Any, batches: Iterable[dict[str, np.ndarray]], num_sentences: int, *,
               model: model_lib.Transformer, beam_size: int, alpha: float, extra_length: int,
               batch_sharding: jax.sharding.Sharding | None = None, early_stopping: str = 'bound',
               compact_every_steps: int = 0, concurrent_batches: int = 0,
               log_every_seconds: float = 20.0) -> list[np.ndarray]:
  """The best hypothesis of every sentence of `batches`, in the original order.

  With `batch_sharding` over several devices, each batch holds this process's rows of a global batch
  (`batching.eval_batches` with process_index/process_count): the rows become one global array split over the
  devices of every process, the search runs on all of them together, and every process receives every row
  back, one batch after another. Otherwise each batch is decoded on one device, with `decode_batch_compacted`
  when compact_every_steps > 0, and `concurrent_batches` batches at once: on a CPU a search keeps the cores
  only partly busy (its step is many small operations), and XLA:CPU runs searches called from several threads
  at the same time (docs/performance.md has the gain on two cores). Each batch in flight holds its own decoding
  cache: peak memory grows with the count.

  Args:
    params: model parameters (e.g. an average of checkpoints), placed or sharded as for training.
    batches: eval batches with `source_tokens` and `example_index` (-1 on padding rows).
    num_sentences: number of sentences; every one must receive an output.
    model, beam_size, alpha, extra_length, early_stopping: see `decode_batch`.
    batch_sharding: the sharding of a global batch over the data axes (`sharding.batch_sharding`), or None.
    compact_every_steps: on one device, drop the sentences that are done every this many steps
      (`decode_batch_compacted`, same output); 0: one compiled search per batch (`decode_batch`).
    concurrent_batches: on one device, batches decoded at once (each on its own thread; the output is the
      same); 0: `concurrent_batches_for`'s choice. Over several devices batches go one at a time.
    log_every_seconds: how often a progress line (sentences done, rate, time left) is logged while decoding
      (from a thread, whether or not a batch has finished); the rate leaves out the first batch's compilation.

  Returns:
    num_sentences int32 arrays [src_len + extra_length] of token ids, PAD after EOS.

  Raises:
    ValueError: if some sentence received no output (a batching bug, never silently tolerated); for a negative
      concurrent_batches; as `decode_batch` for a bad argument or backend.
  """
  workers = concurrent_batches_for(concurrent_batches)
  one_device = batch_sharding is None or len(batch_sharding.device_set) == 1
  if not one_device:
    # Every process must build and gather the global batches in the same order: threads would reorder them.
    workers = 1
    if compact_every_steps:
      logging.info('decode.compact_every_steps=%d is ignored over %d devices: each batch is one compiled search.',
                   compact_every_steps, len(batch_sharding.device_set))
  backend = backends.decoding_backend(model.cfg)  # Once, on the host, for every batch.
  logging.info('Decoding %d batch(es) at once on %s.', workers, type(backend).__name__)
  params = params_in_compute_dtype(params, model.cfg)  # Once, not in every decoding step.
  decode_one = functools.partial(
      _decode_one, params=params, batch_sharding=batch_sharding, one_device=one_device,
      compact_every_steps=compact_every_steps, mesh=jax.sharding.get_mesh(), rules=nn.get_logical_axis_rules(),
      model=model, beam_size=beam_size, alpha=alpha, extra_length=extra_length, early_stopping=early_stopping,
      backend=backend)
  outputs: list[np.ndarray | None] = [None] * num_sentences
  countdown = logs.Countdown(num_sentences, 'sentences')
  with logs.heartbeat(lambda _: f'Decoded {countdown.line()}.', log_every_seconds, jax.process_index() == 0):
    for tokens, index in _map_in_order(decode_one, batches, workers):
      rows = np.flatnonzero(index >= 0)
      for row in rows:
        outputs[int(index[row])] = tokens[row]
      countdown.add(len(rows))
  missing = [i for i, tokens in enumerate(outputs) if tokens is None]
  if missing:
    raise ValueError(f'{len(missing)} sentences got no translation, first at line {missing[0] + 1}')
  return outputs


def translate(params: Any, batches: Iterable[dict[str, np.ndarray]], tokenizer: tokenizer_lib.Tokenizer,
              num_sentences: int, **kwargs) -> list[str]:
  """`decode_all` (same arguments after `tokenizer`), detokenised: num_sentences strings.

  An empty source is translated like any other (from EOS alone); `run.evaluate.translate_file` is what maps
  blank input lines to blank output lines.

  Raises:
    ValueError: if some line received no translation; as `decode_batch` for a bad argument.
  """
  outputs = decode_all(params, batches, num_sentences, **kwargs)
  return tokenizer.decode(outputs)
