"""Translation with the decoding cache (§6.1): the encoder once, then cached beam search, detokenised.

`decode_batch` is one jitted search over a batch; `decode_all` runs it over a split's batches (multi-host:
every process gets every row back); `translate` detokenises. Which checkpoints to decode and what to do with
the output is `evaluate.py`'s.
"""
import functools
import time
from typing import Any, Iterable

from absl import logging
import flax
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np

from transformer_jax import decoding
from transformer_jax import model as model_lib
from transformer_jax import tokenizer as tokenizer_lib

Array = jax.Array


# Decoding grows the self-attention cache through these lengths (decoding.beam_search's cache_stages).
CACHE_STAGES = (16, 32, 64, 128, 256)


@functools.partial(jax.jit, static_argnames=('model', 'beam_size', 'alpha', 'extra_length', 'cache_stages',
                                             'with_scores', 'early_stopping'))
def decode_batch(params: Any, source_tokens: Array, *, model: model_lib.Transformer, beam_size: int,
                 alpha: float, extra_length: int, cache_stages: tuple[int, ...] = CACHE_STAGES,
                 with_scores: bool = False, early_stopping: str = 'bound') -> Array | tuple[Array, Array]:
  """Translates one batch: encoder once, then cached beam search (or greedy when beam_size is 1).

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
    early_stopping: when a sentence's beam search stops (`decoding.beam_search`): 'bound' or 'finished'.

  Returns:
    int32 [batch, src_len + extra_length]: the best hypothesis, PAD after EOS. With with_scores, the
    `decoding.beam_search` pair: tokens [batch, beam_size, src_len + extra_length], scores [batch, beam_size].

  Raises:
    ValueError: with learned positions, if src_len + extra_length exceeds model.max_length; for an
      early_stopping not in `decoding.EARLY_STOPPING`.
  """
  if early_stopping not in decoding.EARLY_STOPPING:  # Also where greedy search ignores it.
    raise ValueError(f'early_stopping must be one of {decoding.EARLY_STOPPING}, got {early_stopping!r}')
  batch_size, source_length = source_tokens.shape
  source_segment_ids = model_lib.segment_ids_from_tokens(source_tokens)
  memory = model.apply({'params': params}, source_tokens, source_segment_ids, method='encode')
  max_steps = source_length + extra_length
  if model.cfg.position_embedding == 'learned' and max_steps > model.cfg.max_length:  # Else silent NaN.
    raise ValueError(f'decoding {source_length} source positions + decode.extra_length={extra_length} needs '
                     f'{max_steps} rows of the learned position table; model.max_length={model.cfg.max_length}')
  max_decode_lengths = jnp.sum(source_segment_ids, axis=-1) + extra_length  # [batch]
  cache_stages = tuple(n for n in cache_stages if n < max_steps)
  _, variables = model.apply({'params': params}, memory, source_segment_ids, min(cache_stages or (max_steps,)),
                             beam_size, method='init_cache', mutable=['cache'])
  # The encoder-decoder attention K/V never change: keep them out of the search's cache, which beam
  # search reorders (copies) at every step.
  fixed, cache = _split_cache(variables['cache'])

  def step_fn(last_tokens, cache):
    logits, new_variables = model.apply(
        {'params': params, 'cache': flax.traverse_util.unflatten_dict(fixed | _flat(cache))},
        last_tokens[:, None], memory, source_segment_ids, use_cache=True, method='decode', mutable=['cache'])
    return logits[:, 0, :], _split_cache(new_variables['cache'])[1]

  common = dict(batch_size=batch_size, max_decode_lengths=max_decode_lengths, max_steps=max_steps,
                eos_id=tokenizer_lib.EOS_ID, bos_id=tokenizer_lib.BOS_ID, pad_id=tokenizer_lib.PAD_ID,
                cache_stages=cache_stages, grow_cache=model_lib.grow_decoding_cache)
  if beam_size == 1 and not with_scores:
    return decoding.greedy_search(step_fn, cache, **common)
  tokens, scores = decoding.beam_search(step_fn, cache, beam_size=beam_size, alpha=alpha,
                                        early_stopping=early_stopping, **common)
  return (tokens, scores) if with_scores else tokens[:, 0, :]


def _flat(tree) -> dict:
  return flax.traverse_util.flatten_dict(flax.core.unfreeze(tree))


def _split_cache(cache) -> tuple[dict, Any]:
  """(flat dict of the encoder-decoder attention entries, the rest of the cache as a nested dict)."""
  flat = _flat(cache)
  fixed = {path: value for path, value in flat.items() if 'encoder_decoder_attention' in path}
  rest = {path: value for path, value in flat.items() if path not in fixed}
  return fixed, flax.traverse_util.unflatten_dict(rest)


def decode_all(params: Any, batches: Iterable[dict[str, np.ndarray]], num_sentences: int, *,
               model: model_lib.Transformer, beam_size: int, alpha: float, extra_length: int,
               batch_sharding: jax.sharding.Sharding | None = None, early_stopping: str = 'bound',
               log_every_seconds: float = 20.0) -> list[np.ndarray]:
  """The best hypothesis of every sentence of `batches`, in the original order.

  With `batch_sharding`, each batch holds this process's rows of a global batch (`batching.eval_batches`
  with process_index/process_count): the rows become one global array split over the devices of every
  process, the search runs on all of them together, and every process receives every row back. Without it,
  the batch is decoded on the default device (one process).

  Args:
    params: model parameters (e.g. an average of checkpoints), placed or sharded as for training.
    batches: eval batches with `source_tokens` and `example_index` (-1 on padding rows).
    num_sentences: number of sentences; every one must receive an output.
    model, beam_size, alpha, extra_length, early_stopping: see `decode_batch`.
    batch_sharding: the sharding of a global batch over the data axes (`sharding.batch_sharding`), or None.
    log_every_seconds: how often a progress line (sentences done, rate, time left) is logged.

  Returns:
    num_sentences int32 arrays [src_len + extra_length] of token ids, PAD after EOS.

  Raises:
    ValueError: if some sentence received no output (a batching bug, never silently tolerated); as
      `decode_batch` for a bad argument.
  """
  outputs: list[np.ndarray | None] = [None] * num_sentences
  start = last_log = time.perf_counter()
  for batch in batches:
    if batch_sharding is None:
      source, index = jnp.asarray(batch['source_tokens']), batch['example_index']
    else:
      source, index = (jax.make_array_from_process_local_data(batch_sharding, batch[key])
                       for key in ('source_tokens', 'example_index'))
    tokens = decode_batch(params, source, model=model, beam_size=beam_size, alpha=alpha,
                          extra_length=extra_length, early_stopping=early_stopping)
    # Every row, on every process, in the same global order for the tokens and their sentence indices.
    tokens, index = (np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in (tokens, index))
    for row in np.flatnonzero(index >= 0):
      outputs[int(index[row])] = tokens[row]
    if jax.process_index() == 0 and time.perf_counter() - last_log > log_every_seconds:
      done, seconds = sum(x is not None for x in outputs), time.perf_counter() - start
      logging.info('Decoded %d of %d sentences in %.0f s (%.1f sentences/s, about %.0f s left).', done,
                   num_sentences, seconds, done / seconds, (num_sentences - done) * seconds / max(done, 1))
      last_log = time.perf_counter()
  missing = [i for i, tokens in enumerate(outputs) if tokens is None]
  if missing:
    raise ValueError(f'{len(missing)} sentences got no translation, first at line {missing[0] + 1}')
  return outputs


def translate(params: Any, batches: Iterable[dict[str, np.ndarray]], tokenizer: tokenizer_lib.Tokenizer,
              num_sentences: int, **kwargs) -> list[str]:
  """`decode_all` (same arguments after `tokenizer`), detokenised: num_sentences strings.

  An empty source is translated like any other (from EOS alone); `evaluate.translate_file` is what maps
  blank input lines to blank output lines.

  Raises:
    ValueError: if some line received no translation; as `decode_batch` for a bad argument.
  """
  return tokenizer.decode(decode_all(params, batches, num_sentences, **kwargs))
