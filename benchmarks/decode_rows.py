"""Where beam search's rows go on a trained run: the steps a split's batches run against the steps its sentences
need, and a decoding step's time by batch size.

  python benchmarks/decode_rows.py --workdir=RUN [--split=test] [--beam_size=4 --alpha=1.4] [--tokens_per_batch=512]

1. Decodes the split as `evaluate.translate_ids` batches it (decode.tokens_per_batch source tokens per batch,
   one compiled search per batch, `translate.decode_batch` with early_stopping='finished') and counts
   sentence-steps: each batch runs (rows) x (the last step of its slowest sentence); its sentences need the sum
   of their own last steps (the longest of their returned hypotheses). Prints both and their ratio: what
   dropping finished sentences (`decode.compact_every_steps`) can save at most.
2. Times one compiled decoding loop (`translate._continue`: the search's steps, 24 of them, over a
   32-position self-attention cache) at 8 ... 256 sentences of 16 random source tokens, fastest of 3 calls:
   ms per step and microseconds per hypothesis-step.
Prints one JSON line per measurement; run it alone on the machine (the figures are times). docs/performance.md
has what it measured (2026-12-03, 2-vCPU Intel Xeon with AMX).
"""
from transformer_jax.cpu import host_allocator  # pylint: disable=g-bad-import-order
from transformer_jax import logs  # pylint: disable=g-bad-import-order

if __name__ == '__main__':  # Before JAX starts, as `python -m transformer_jax.main` does.
  host_allocator.use_fast_allocator()
  logs.quiet_libtpu()  # libtpu's start-up errors where the `tpu` extra is installed without a TPU.

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.data import input_pipeline
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.decoding import backends
from transformer_jax.decoding import translate
from transformer_jax.evaluation import evaluate
from transformer_jax.storage import workdir as workdir_lib
from transformer_jax.run import experiment


def sentence_steps(config, setup, params, split, beam_size: int, alpha: float) -> dict:
  """Sentence-steps the split's batches run and the ones their sentences need (see the module docstring)."""
  tokens_per_batch = config.decode.tokens_per_batch or config.data.tokens_per_batch
  batches = input_pipeline.split_eval_batches(config.data, split.source_ids, split.target_ids, setup.data_shards,
                                              tokens_per_batch=tokens_per_batch)
  run = needed = 0
  for batch in batches:
    tokens, _ = translate.decode_batch(params, jnp.asarray(batch['source_tokens']), model=setup.model,
                                       beam_size=beam_size, alpha=alpha, extra_length=config.decode.extra_length,
                                       with_scores=True, early_stopping='finished')
    last_step = (np.asarray(tokens) != tokenizer_lib.PAD_ID).sum(-1).max(-1)  # [batch]
    real = batch['example_index'] >= 0
    run += int(last_step.max()) * len(real)
    needed += int(last_step[real].sum())
  return {'tokens_per_batch': tokens_per_batch, 'batches': len(batches), 'sentence_steps_run': run,
          'sentence_steps_needed': needed, 'ratio': round(run / needed, 3)}


def step_times(setup, params, beam_size: int, alpha: float, steps: int = 24, cache_length: int = 32) -> list[dict]:
  """A decoding loop's ms per step at several batch sizes (see the module docstring)."""
  rng = np.random.default_rng(0)
  rows = []
  backend = backends.decoding_backend(setup.model.cfg)
  for batch_size in (8, 16, 32, 64, 128, 256):
    source = rng.integers(tokenizer_lib.EOS_ID + 1, setup.model.cfg.vocab_size, (batch_size, 16)).astype(np.int32)
    source[:, -1] = tokenizer_lib.EOS_ID
    state, context = translate._start_jit(  # pylint: disable=protected-access
        params, jnp.asarray(source), model=setup.model, backend=backend, beam_size=beam_size, extra_length=50,
        max_steps=66, cache_length=cache_length, is_greedy=False)
    run = lambda: jax.block_until_ready(translate._continue_jit(  # pylint: disable=protected-access
        params, state, context, steps, model=setup.model, backend=backend, alpha=alpha, early_stopping='bound',
        cache_length=cache_length))
    run()
    seconds = []
    for _ in range(3):
      start = time.perf_counter()
      done_steps = int(run().step)
      seconds.append((time.perf_counter() - start) / done_steps)
    rows.append({'sentences': batch_size, 'hypotheses': batch_size * beam_size, 'steps': done_steps,
                 'ms_per_step': round(1e3 * min(seconds), 2),
                 'us_per_hypothesis_step': round(1e6 * min(seconds) / (batch_size * beam_size), 1)})
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--split', default='test', choices=['test', 'validation'])
  parser.add_argument('--beam_size', type=int, default=None, help="default: the run's decode.beam_size")
  parser.add_argument('--alpha', type=float, default=None, help="default: the run's decode.alpha")
  parser.add_argument('--tokens_per_batch', type=int, default=None, help="default: the run's decode.tokens_per_batch")
  args = parser.parse_args()
  config = workdir_lib.get_config(args.workdir)
  if args.tokens_per_batch is not None:
    config.decode.tokens_per_batch = args.tokens_per_batch
  beam_size = args.beam_size or config.decode.beam_size
  alpha = config.decode.alpha if args.alpha is None else args.alpha
  setup = experiment.setup(config, args.workdir)
  try:
    params, _ = evaluate.load_params(config.eval, setup)
    split = input_pipeline.encode_split(config.data, setup.tokenizer, config.data.test_split
                                        if args.split == 'test' else config.data.eval_split)
    print(json.dumps({'split': args.split, **sentence_steps(config, setup, params, split, beam_size, alpha)}),
          flush=True)
    for row in step_times(setup, params, beam_size, alpha):
      print(json.dumps(row), flush=True)
  finally:
    setup.close()


if __name__ == '__main__':
  sys.exit(main())
