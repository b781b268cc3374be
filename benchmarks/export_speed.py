"""Our beam search against CTranslate2 exports of the same checkpoint: sentences/s and the three BLEUs.

  python benchmarks/export_speed.py --workdir=runs/multi30k [--split=test] [--threads=1,2] [--inter_threads=1,2]
      [--beam_size=4 --alpha=1.4] [--concurrent_batches=1,2,4] [--decoding_kernel=xla,cpu]

Decodes the split with our beam search (the run's decode.beam_size and decode.alpha unless given; twice: the
first call includes compilation; then once per further --concurrent_batches count), then exports the parameters
`eval.checkpoint_selection` chooses to CTranslate2 in float32 and int8 (into <workdir>/export_speed/, replaced)
and decodes the same sources with each, beam decode.beam_size, CTranslate2's default length penalty (1.0:
log-probability / length) and at most the longest source + decode.extra_length tokens, on each thread count
(`intra_threads`) and each count of batches translated at once (`inter_threads`: CTranslate2's counterpart of
decode.concurrent_batches).
Prints one JSON line per row; run it alone on the machine.
"""
from transformer_jax.cpu import host_allocator  # pylint: disable=g-bad-import-order
from transformer_jax import logs  # pylint: disable=g-bad-import-order

if __name__ == '__main__':  # Before JAX starts, as `python -m transformer_jax.main` does.
  host_allocator.use_fast_allocator()
  logs.quiet_libtpu()  # libtpu's start-up errors where the `tpu` extra is installed without a TPU.

import argparse
import dataclasses
import itertools
import json
import os
import shutil
import sys
import time

import ctranslate2
import jax
import sentencepiece

from transformer_jax.data import input_pipeline
from transformer_jax.decoding import translate
from transformer_jax.evaluation import bleu
from transformer_jax.evaluation import evaluate
from transformer_jax.model import transformer as model_lib
from transformer_jax.storage import workdir as workdir_lib
from transformer_jax.tools import export
from transformer_jax.run import experiment


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--split', default='test', choices=['test', 'validation'])
  parser.add_argument('--threads', default='1,2', help="CTranslate2's intra_threads, one row each")
  parser.add_argument('--inter_threads', default='1',
                      help="CTranslate2's inter_threads (batches at once, each on intra_threads threads), one row each")
  parser.add_argument('--concurrent_batches', default=None,
                      help="ours' decode.concurrent_batches (0: automatic), one row each, e.g. 1,2,4; default: the "
                           "run's")
  parser.add_argument('--no_length_penalty', action='store_true',
                      help='alpha 0 for ours and length_penalty 0 (with min_decoding_length 0) for CTranslate2: the '
                           'two searches then score hypotheses alike')
  parser.add_argument('--beam_size', type=int, default=None, help="default: the run's decode.beam_size")
  parser.add_argument('--alpha', type=float, default=None, help="ours' length penalty; default: the run's decode.alpha")
  parser.add_argument('--early_stopping', default=None, help="ours' decode.early_stopping; default: the run's")
  parser.add_argument('--tokens_per_batch', type=int, default=None,
                      help="ours' decode.tokens_per_batch; default: the run's")
  parser.add_argument('--compact_every_steps', type=int, default=None,
                      help="ours' decode.compact_every_steps (0: no compaction); default: the run's")
  parser.add_argument('--decoding_kernel', default='auto',
                      help="ours' model.decoding_kernel, one row each, e.g. xla,cpu (alternated: xla,cpu,xla,cpu)")
  args = parser.parse_args()
  config = workdir_lib.get_config(args.workdir)
  if args.early_stopping is not None:
    config.decode.early_stopping = args.early_stopping
  if args.tokens_per_batch is not None:
    config.decode.tokens_per_batch = args.tokens_per_batch
  if args.compact_every_steps is not None:
    config.decode.compact_every_steps = args.compact_every_steps
  if args.beam_size is not None:
    config.decode.beam_size = args.beam_size
  if args.alpha is not None:
    config.decode.alpha = args.alpha
  alpha = 0.0 if args.no_length_penalty else None  # None: the run's decode.alpha.
  setup = experiment.setup(config, args.workdir)
  lang = config.data.target_lang
  try:
    params, steps = evaluate.load_params(config.eval, setup)
    split_name = config.data.test_split if args.split == 'test' else config.data.eval_split
    split = input_pipeline.encode_split(config.data, setup.tokenizer, split_name)
    counts = ([int(c) for c in args.concurrent_batches.split(',')] if args.concurrent_batches is not None
              else [config.decode.concurrent_batches])
    compiled = set()
    for kernel, count in itertools.product(args.decoding_kernel.split(','), counts):
      config.decode.concurrent_batches = count
      model = model_lib.Transformer(dataclasses.replace(setup.model.cfg, decoding_kernel=kernel))
      at_once = translate.concurrent_batches_for(count) if jax.device_count() == 1 else 1
      label = (f'ours, {config.decode.early_stopping}, decode.tokens_per_batch={config.decode.tokens_per_batch}, '
               f'decode.compact_every_steps={config.decode.compact_every_steps}, {at_once} batch(es) at once, '
               f'model.decoding_kernel={kernel}')
      # The first call of a kernel setting compiles its searches; later ones (and other counts) reuse them.
      for suffix in ([' (compilation included)', ''] if kernel not in compiled else ['']):
        hypotheses, scores, seconds = evaluate.translate_split(config, dataclasses.replace(setup, model=model),
                                                               params, split, alpha=alpha)
        report(label + suffix, len(hypotheses), seconds, scores, config.decode.alpha if alpha is None else alpha,
               steps)
      compiled.add(kernel)
  finally:
    setup.close()
  root = os.path.join(args.workdir, 'export_speed')
  shutil.rmtree(root, ignore_errors=True)
  vocabulary = workdir_lib.path(args.workdir, workdir_lib.vocabulary_file(config.data.vocab_size))
  processor = sentencepiece.SentencePieceProcessor(model_file=vocabulary)
  sources = [processor.encode(line, out_type=str) for line in split.source_texts]
  max_length = max(map(len, sources)) + 1 + config.decode.extra_length  # Ours: source tokens, EOS, + extra_length.
  for quantization in ('float32', 'int8'):
    output = export.export_ctranslate2(params, setup.model.cfg, vocabulary, os.path.join(root, quantization),
                                       quantization)
    for intra_threads, inter_threads in itertools.product([int(t) for t in args.threads.split(',')],
                                                          [int(t) for t in args.inter_threads.split(',')]):
      translator = ctranslate2.Translator(output, device='cpu', inter_threads=inter_threads,
                                          intra_threads=intra_threads)
      start = time.perf_counter()
      penalty = dict(length_penalty=0.0, min_decoding_length=0) if args.no_length_penalty else {}
      results = translator.translate_batch(sources, beam_size=config.decode.beam_size, max_batch_size=64,
                                           max_decoding_length=max_length, **penalty)
      seconds = time.perf_counter() - start
      hypotheses = [processor.decode(r.hypotheses[0]) for r in results]
      label = f'CTranslate2 {quantization}, {intra_threads} thread(s)' + (
          f' x {inter_threads} batches at once' if inter_threads > 1 else '')
      report(label, len(hypotheses), seconds, bleu.all_bleu(hypotheses, split.target_texts, lang), alpha, steps)


def report(label: str, count: int, seconds: float, scores: dict, alpha, steps) -> None:
  print(json.dumps({'decoder': label, 'sentences': count, 'seconds': round(seconds, 2),
                    'sentences_per_sec': round(count / seconds, 2), 'alpha': alpha, 'checkpoint_steps': steps,
                    **{key: round(scores[key], 2) for key in ('bleu', 'tokenized_bleu', 'lowercased_tokenized_bleu',
                                                             'length_ratio')}}), flush=True)


if __name__ == '__main__':
  sys.exit(main())
