"""The optimised HLO of beam search's compiled programs, source locations stripped, to compare two trees.

  cd TREE && PYTHONPATH=TREE python PATH/TO/benchmarks/decode_hlo.py --output=DIR [--config=configs/multi30k.py]
      [--decoding_kernel=cpu,xla] [--raw]
  diff -r -x '*.raw.hlo' DIR_BEFORE DIR_AFTER

For each `model.decoding_kernel` setting, the model of the config with freshly initialised parameters (the
programs do not depend on their values) compiles what a search runs: its start (`_start_jit`: the encoder and
the first state, 16 sentences of 16 tokens, beam 4, a 32-position cache), its decoding loop (`_continue_jit`:
24 steps over that cache) and the whole `decode_batch` as `benchmarks/decode_peers.py` times it (16 sentences
of 32 tokens, up to 82 steps). Each program's optimised HLO (`compiled.as_text()`) is written to
DIR/<kernel>_<program>.hlo without source locations: op metadata (op_name, source_file, source_line, stack
frames) and the module's file, function, location and stack-frame tables, which name the Python files a tree
traced (--raw also writes the HLO as compiled, <kernel>_<program>.raw.hlo). The model's config goes to
DIR/model_config.txt. Prints where the package was imported from, then one line per file: its name, lines and
sha256. The same files from two trees mean the same compiled programs, hence the same speed of everything
inside them; `diff -r` shows any difference.

Runs on the package in sub-packages and on the flat package before them (a686d99 and earlier), so that one file
compares the two. Compiles only, nothing is timed: 2-5 minutes on a loaded 2-vCPU machine.
"""
import argparse
import dataclasses
import hashlib
import inspect
import pathlib
import re
import sys

from transformer_jax import logs  # pylint: disable=g-bad-import-order

if __name__ == '__main__':
  logs.quiet_libtpu()  # libtpu's start-up errors where the `tpu` extra is installed without a TPU.

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

try:  # The package in sub-packages.
  from transformer_jax.data import tokenizer as tokenizer_lib
  from transformer_jax.decoding import backends
  from transformer_jax.decoding import translate
  from transformer_jax.model import transformer as model_lib
  from transformer_jax.storage import workdir as workdir_lib
  try:
    from transformer_jax.run import experiment
  except ImportError:  # Sub-packages before run/ (cbbd587).
    from transformer_jax.training import experiment
except ImportError:  # The flat package (a686d99 and earlier): the kernels chosen inside the model, no backend.
  from transformer_jax import experiment
  from transformer_jax import model as model_lib
  from transformer_jax import tokenizer as tokenizer_lib
  from transformer_jax import translation as translate
  from transformer_jax import workdir as workdir_lib
  backends = None

# metadata={...} (no nested braces inside), the module-level location tables, and the stack-frame ids.
_METADATA = re.compile(r',? ?metadata=\{[^{}]*\}')
_TABLE = re.compile(r'^(FileNames|FunctionNames|FileLocations|StackFrames)\s*$')
_FRAME = re.compile(r',? ?stack_frame_id=\d+')


def strip_locations(hlo: str) -> str:
  """The HLO text without op metadata, stack-frame ids and the file/function/location/stack-frame tables."""
  lines, in_table = [], False
  for line in hlo.splitlines():
    if _TABLE.match(line):  # A table runs until the next computation (or the entry computation).
      in_table = True
    elif line.startswith(('%', 'ENTRY')):
      in_table = False
    if not in_table:
      lines.append(_FRAME.sub('', _METADATA.sub('', line)))
  return '\n'.join(lines) + '\n'


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--output', required=True, help='folder for the stripped HLO files (created)')
  parser.add_argument('--config', default='configs/multi30k.py')
  parser.add_argument('--decoding_kernel', default='cpu,xla', help='model.decoding_kernel settings, e.g. cpu,xla')
  parser.add_argument('--raw', action='store_true', help='also write the HLO as compiled (<name>.raw.hlo)')
  args = parser.parse_args()
  output = pathlib.Path(args.output)
  output.mkdir(parents=True, exist_ok=False)
  print(f'transformer_jax from {pathlib.Path(logs.__file__).parent}', flush=True)
  config = workdir_lib.load_config(args.config)
  cfg = experiment.compute_setup(config).model.cfg
  (output / 'model_config.txt').write_text(repr(cfg) + '\n')
  beam, alpha, extra = config.decode.beam_size, config.decode.alpha, config.decode.extra_length
  early_stopping = config.decode.get('early_stopping', 'bound')
  rng = np.random.default_rng(0)
  sources = {}
  for length in (16, 32):
    tokens = rng.integers(tokenizer_lib.EOS_ID + 1, cfg.vocab_size, (16, length)).astype(np.int32)
    tokens[:, -1] = tokenizer_lib.EOS_ID
    sources[length] = jnp.asarray(tokens)
  start_parameters = inspect.signature(translate._start).parameters  # pylint: disable=protected-access
  greedy_name = 'is_greedy' if 'is_greedy' in start_parameters else 'greedy'  # 'greedy' in the flat package.
  for kernel in args.decoding_kernel.split(','):
    model = model_lib.Transformer(dataclasses.replace(cfg, decoding_kernel=kernel))
    with_backend = {} if backends is None else {'backend': backends.decoding_backend(model.cfg)}
    params = nn.unbox(model.init(jax.random.key(0), sources[16], sources[16])['params'])
    cast = getattr(translate, 'params_in_compute_dtype', None) or model_lib.params_in_compute_dtype
    params = cast(params, model.cfg)  # As translate.decode_all casts them.
    start_options = dict(model=model, beam_size=beam, extra_length=extra, max_steps=16 + extra, cache_length=32,
                         **{greedy_name: False}, **with_backend)
    start = translate._start_jit.lower(  # pylint: disable=protected-access
        params, sources[16], **start_options).compile()
    state, context = start(params, sources[16])
    loop = translate._continue_jit.lower(  # pylint: disable=protected-access
        params, state, context, 24, model=model, alpha=alpha, early_stopping=early_stopping, cache_length=32,
        **with_backend).compile()
    whole = jax.jit(lambda p, s, m=model, b=with_backend: translate.decode_batch(
        p, s, model=m, beam_size=beam, alpha=alpha, extra_length=extra, **b))  # As decode_peers.py times it.
    programs = {'start': start, 'continue': loop, 'decode_batch': whole.lower(params, sources[32]).compile()}
    for program, compiled in programs.items():
      text = compiled.as_text()
      path = output / f'{kernel}_{program}.hlo'
      if args.raw:
        path.with_suffix('.raw.hlo').write_text(text)
      stripped = strip_locations(text)
      if 'metadata=' in stripped or '.py"' in stripped:  # A form of metadata the patterns above do not know.
        raise ValueError(f'{path.name}: source locations left after stripping; see --raw')
      path.write_text(stripped)
      print(f'{path.name}: {stripped.count(chr(10))} lines, sha256 {hashlib.sha256(stripped.encode()).hexdigest()}',
            flush=True)


if __name__ == '__main__':
  sys.exit(main())
