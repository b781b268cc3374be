"""Beam search at the issue's SMALL shape against CTranslate2 on the same parameters, alternately, in one process.

  python benchmarks/decode_peers.py [--config=configs/multi30k.py] [--rounds=5] [--threads=1,2]
      [--decoding_kernel=xla,cpu]

The model of the config (configs/multi30k.py: SMALL, 3 layers, d_model 256, vocabulary 8,000) with freshly
initialised parameters decodes 16 synthetic sources of 32 tokens (`benchmark.synthetic_batch`), beam 4, up to
source length + decode.extra_length = 82 tokens. The same parameters are exported to CTranslate2 (int8 and
float32; `export.build_spec`, pieces named by their ids) and decode the same sources with
min_decoding_length = max_decoding_length = 82, so that both run every step (an untrained model rarely ends
a hypothesis; the mean length each side produced is printed to check). Ours runs with the CPU's threads (XLA's
pool); CTranslate2 with `intra_threads` in turn from --threads. Rounds alternate the decoders, so whatever else
the machine does falls on all of them alike; the first call of ours (compilation) is timed apart.
Prints one JSON line per decoder (median and fastest sentences/s over the rounds); run it alone.
"""
from transformer_jax.cpu import host_allocator  # pylint: disable=g-bad-import-order
from transformer_jax import logs  # pylint: disable=g-bad-import-order

if __name__ == '__main__':  # Before JAX starts, as `python -m transformer_jax.main` does.
  host_allocator.use_fast_allocator()
  logs.quiet_libtpu()  # libtpu's start-up errors where the `tpu` extra is installed without a TPU.

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

import ctranslate2
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.decoding import backends
from transformer_jax.decoding import translate
from transformer_jax.model import transformer as model_lib
from transformer_jax.storage import workdir as workdir_lib
from transformer_jax.tools import benchmark
from transformer_jax.tools import export
from transformer_jax.run import experiment


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', default='configs/multi30k.py')
  parser.add_argument('--sentences', type=int, default=16)
  parser.add_argument('--source_length', type=int, default=32)
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--threads', default='1,2', help='CTranslate2 intra_threads, each a decoder of its own')
  parser.add_argument('--decoding_kernel', default='auto',
                      help="ours' model.decoding_kernel, each a decoder of its own, e.g. xla,cpu")
  args = parser.parse_args()
  config = workdir_lib.load_config(args.config)
  setup = experiment.compute_setup(config)
  model, cfg = setup.model, setup.model.cfg
  sources = benchmark.synthetic_batch(cfg, args.sentences, args.source_length, 1)['source_tokens']
  float32_params = nn.unbox(model.init(jax.random.key(0), jnp.asarray(sources), jnp.asarray(sources))['params'])
  params = translate.params_in_compute_dtype(float32_params, cfg)  # Ours, as translate.decode_all casts them.
  beam, alpha, extra = config.decode.beam_size, config.decode.alpha, config.decode.extra_length
  steps = args.source_length + extra

  source_device = jnp.asarray(sources)
  decoders, first_call, tokens = {}, {}, {}
  for kernel in args.decoding_kernel.split(','):
    name = 'ours' if kernel == 'auto' else f'ours_{kernel}'
    kernel_model = model_lib.Transformer(dataclasses.replace(cfg, decoding_kernel=kernel))
    backend = backends.decoding_backend(kernel_model.cfg)  # On the host, before the search is traced.
    decode = jax.jit(lambda p, s, m=kernel_model, b=backend: translate.decode_batch(
        p, s, model=m, beam_size=beam, alpha=alpha, extra_length=extra, backend=b))
    start = time.perf_counter()
    tokens[name] = np.asarray(jax.block_until_ready(decode(params, source_device)))
    first_call[name] = time.perf_counter() - start
    decoders[name] = lambda decode=decode: np.asarray(decode(params, source_device))
  pieces = ['<pad>', '<s>', '</s>', '<unk>'] + [f'p{i}' for i in range(4, cfg.vocab_size)]  # tokenizer_lib's ids.
  source_pieces = [[pieces[i] for i in row] for row in sources]
  root = tempfile.mkdtemp(prefix='decode_peers_')
  for quantization in ('int8', 'float32'):
    spec = export.build_spec(jax.device_get(float32_params), cfg, pieces)
    spec.validate()
    spec.optimize(quantization=quantization)
    os.makedirs(f'{root}/{quantization}')
    spec.save(f'{root}/{quantization}')
    for threads in (int(t) for t in args.threads.split(',')):
      translator = ctranslate2.Translator(f'{root}/{quantization}', device='cpu', inter_threads=1,
                                         intra_threads=threads)
      decoders[f'ctranslate2_{quantization}_{threads}thread'] = (
          lambda t=translator: t.translate_batch(source_pieces, beam_size=beam, max_batch_size=args.sentences,
                                                 min_decoding_length=steps, max_decoding_length=steps))
  # EOS excluded, as CTranslate2 returns its hypotheses.
  lengths = {name: float(np.mean(np.sum((t != 0) & (t != tokenizer_lib.EOS_ID), axis=-1)))
             for name, t in tokens.items()}
  for name, fn in decoders.items():
    if name not in tokens:
      lengths[name] = float(np.mean([len(r.hypotheses[0]) for r in fn()]))
  seconds = {name: [] for name in decoders}
  for _ in range(args.rounds):
    for name, fn in decoders.items():
      start = time.perf_counter()
      fn()
      seconds[name].append(time.perf_counter() - start)
  for name, values in seconds.items():
    print(json.dumps({'decoder': name, 'sentences': args.sentences, 'beam': beam, 'max_steps': steps,
                      'mean_output_tokens': round(lengths[name], 1),
                      'sentences_per_sec_median': round(args.sentences / statistics.median(values), 2),
                      'sentences_per_sec_fastest': round(args.sentences / min(values), 2),
                      **({'first_call_s': round(first_call[name], 2)} if name in first_call else {})}), flush=True)


if __name__ == '__main__':
  sys.exit(main())
