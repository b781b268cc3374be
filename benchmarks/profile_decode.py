"""Where a beam-search step's time goes on a trained run: a `jax.profiler` trace of one compiled decoding loop.

  python benchmarks/profile_decode.py --workdir=RUN [--sentences=40] [--decoding_kernel=xla,cpu]

For each `model.decoding_kernel` setting: starts a search of --sentences random 16-token sources (beam 4, the
run's checkpoint as `eval.checkpoint_selection` chooses it), compiles `translate._continue` for --steps steps
over a --cache_length-position self-attention cache, times it untraced (fastest of 3), then traces one call and
sums the XLA ops' time per step by part of the model (self-attention, encoder-decoder attention, feed-forward,
logits and embedding; the rest is the search's own work: scores, top-k, reorders), through the ops' `op_name`
metadata as `profile_step.py` does. Prints the busiest ops and one JSON line per setting. docs/performance.md
has what it measured (2026-12-03, 2-vCPU Intel Xeon with AMX); run it alone on the machine (the figures are
times).
"""
from transformer_jax.cpu import host_allocator  # pylint: disable=g-bad-import-order
from transformer_jax import logs  # pylint: disable=g-bad-import-order

if __name__ == '__main__':  # Before JAX starts, as `python -m transformer_jax.main` does.
  host_allocator.use_fast_allocator()
  logs.quiet_libtpu()  # libtpu's start-up errors where the `tpu` extra is installed without a TPU.

import argparse
import collections
import dataclasses
import json
import pathlib
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import profile_step  # pylint: disable=g-bad-import-order  (beside this script)
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.decoding import backends
from transformer_jax.decoding import translate
from transformer_jax.evaluation import evaluate
from transformer_jax.model import transformer as model_lib
from transformer_jax.storage import workdir as workdir_lib
from transformer_jax.run import experiment

PARTS = (('self-attention', r'/self_attention'), ('encoder-decoder attention', r'encoder_decoder_attention'),
         ('feed-forward', r'feed_forward'), ('layer norm', r'[Nn]orm'), ('logits and embedding', r'embed|logits'))
SEARCH = 'the search (scores, top-k, reorders, casts)'


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--sentences', type=int, default=40, help='40: about a 512-token batch of Multi30k')
  parser.add_argument('--steps', type=int, default=24)
  parser.add_argument('--cache_length', type=int, default=32)
  parser.add_argument('--decoding_kernel', default='xla,cpu', help="model.decoding_kernel settings, one row each")
  parser.add_argument('--top', type=int, default=8, help='busiest ops printed per setting')
  args = parser.parse_args()
  config = workdir_lib.get_config(args.workdir)
  setup = experiment.setup(config, args.workdir)
  try:
    params, _ = evaluate.load_params(config.eval, setup)
  finally:
    setup.close()
  rng = np.random.default_rng(0)
  source = rng.integers(tokenizer_lib.EOS_ID + 1, setup.model.cfg.vocab_size, (args.sentences, 16)).astype(np.int32)
  source[:, -1] = tokenizer_lib.EOS_ID
  for kernel in args.decoding_kernel.split(','):
    model = model_lib.Transformer(dataclasses.replace(setup.model.cfg, decoding_kernel=kernel))
    backend = backends.decoding_backend(model.cfg)
    cast = translate.params_in_compute_dtype(params, model.cfg)  # As translate.decode_all does.
    state, context = translate._start_jit(  # pylint: disable=protected-access
        cast, jnp.asarray(source), model=model, backend=backend, beam_size=4, extra_length=50, max_steps=66,
        cache_length=args.cache_length, is_greedy=False)
    options = dict(model=model, backend=backend, alpha=0.6, early_stopping='bound',
                   cache_length=args.cache_length)
    run = lambda: jax.block_until_ready(translate._continue_jit(  # pylint: disable=protected-access
        cast, state, context, args.steps, **options))
    run()
    seconds = []
    for _ in range(3):
      start = time.perf_counter()
      run()
      seconds.append(time.perf_counter() - start)
    compiled = translate._continue_jit.lower(  # pylint: disable=protected-access
        cast, state, context, args.steps, **options).compile()
    names = profile_step._op_names(compiled.as_text())  # pylint: disable=protected-access
    directory = pathlib.Path(tempfile.mkdtemp(prefix='profile_decode_'))
    jax.profiler.start_trace(str(directory))
    run()
    jax.profiler.stop_trace()
    events = [e for e in profile_step._trace_events(directory) if e['name'] in names]  # pylint: disable=protected-access
    per_part, per_op = collections.Counter(), collections.Counter()
    for event in events:
      op_name = names[event['name']]
      part = next((part for part, pattern in PARTS if re.search(pattern, op_name)), SEARCH)
      per_part[part] += event['dur'] / args.steps / 1e3  # Microseconds per call -> ms per step.
      per_op[(event['name'], op_name[-70:])] += event['dur'] / args.steps / 1e3
    ms_per_step = 1e3 * min(seconds) / args.steps
    print(f'model.decoding_kernel={kernel}: {ms_per_step:.2f} ms per step untraced, '
          f'{sum(per_part.values()):.2f} ms of op time per step traced')
    for part, ms in per_part.most_common():
      print(f'  {part}: {ms:.2f} ms')
    for (name, op_name), ms in per_op.most_common(args.top):
      print(f'    {ms:.3f} ms {name} {op_name}')
    print(json.dumps({'decoding_kernel': kernel, 'sentences': args.sentences, 'beam': 4,
                      'cache_length': args.cache_length, 'ms_per_step': round(ms_per_step, 2),
                      'op_ms_per_step': {part: round(ms, 3) for part, ms in per_part.items()}}), flush=True)


if __name__ == '__main__':
  sys.exit(main())
