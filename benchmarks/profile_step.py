"""Where a train step's time goes: a `jax.profiler` trace of a few steps, op time summed by part of the model.

  python -m benchmarks.profile_step --config=configs/multi30k.py [--config.model.attention_product_dtype=compute]

Compiles `step.jit_train_step` for one synthetic batch (`benchmark.synthetic_batch`, the config's
`benchmark.batch_size` x (`source_length` + `target_length`)), runs it warm, traces `--steps` steps and reads
the trace's XLA ops (one event per thunk of the compiled program, named as its HLO instructions). Each op is
attributed through the `op_name` metadata JAX gives every HLO instruction (the Flax module path and the
primitive, e.g. `.../decoder/layers_0/self_attention/dot_general`) to one part (PARTS, first match wins), and
the ops' time is summed per part, on both threads (the XLA:CPU thunk executor runs independent ops at once, so
op time can exceed wall time; tracing itself slows the step, so compare shares, not absolutes). Prints the
step's wall time while traced, then per part its op time per step, its share and its busiest ops; the last
line is one JSON object. Run it alone on the machine: the figures are times.
"""
from transformer_jax.cpu import host_allocator  # pylint: disable=g-bad-import-order
from transformer_jax import logs  # pylint: disable=g-bad-import-order

if __name__ == '__main__':  # Before JAX starts, as `python -m transformer_jax.main` does.
  host_allocator.use_fast_allocator()
  logs.quiet_libtpu()  # libtpu's start-up errors where the `tpu` extra is installed without a TPU.

import collections
import gzip
import json
import pathlib
import re
import tempfile
import time

from absl import app
from absl import flags
import flax.linen as nn
import jax
from ml_collections import config_flags

from transformer_jax.tools import benchmark

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.', lock_config=False)
_STEPS = flags.DEFINE_integer('steps', 3, 'Steps traced.')
_TOP = flags.DEFINE_integer('top', 4, 'Busiest ops listed per part.')

# (part, regular expression over an op's `op_name` metadata: the Flax module path, then the primitive); the first
# match names the op's part.
PARTS = (
    ('loss and logits (fused, scan)', r'while|_fused'),
    ('layer norm', r'layer_norm|[Nn]orm/'),
    ('attention projections (W^Q, W^K, W^V, W^O)', r'_project|hvm'),
    ('attention core (scores, softmax, dropout, x V)', r'attention/'),
    ('feed-forward', r'feed_forward/'),
    ('embedding and positions', r'embed|position'),
    ('residuals and dropout', r'[Rr]esidual|[Dd]ropout'),
    ('outside the model: update, gradient norm, casts', r'^(?!.*Transformer)'),
)
OTHER = 'other parts of the model'


# Thunks whose events enclose the events of the ops they run (counted there instead).
CONTROL_FLOW = ('while', 'conditional', 'call')


def _op_names(hlo_text: str) -> dict[str, str]:
  """HLO instruction name -> its op_name metadata ('' where absent), from the compiled module's text; control
  flow instructions (CONTROL_FLOW) are left out."""
  names = {}
  for line in hlo_text.splitlines():
    match = re.match(r'\s*(?:ROOT )?%?([\w.\-]+) = .*?\s([a-z\-]+)\(', line)
    if match and match[2] not in CONTROL_FLOW:
      meta = re.search(r'op_name="([^"]*)"', line)
      names[match[1]] = meta[1] if meta else ''
  return names


def _part(op_name: str) -> str:
  return next((part for part, pattern in PARTS if re.search(pattern, op_name)), OTHER)


def _trace_events(directory: pathlib.Path) -> list[dict]:
  """The complete ('X') events of the newest trace under directory."""
  path = max(directory.rglob('*.trace.json.gz'), key=lambda p: p.stat().st_mtime)
  with gzip.open(path, 'rt') as f:
    return [e for e in json.load(f)['traceEvents'] if e.get('ph') == 'X']


def main(argv) -> None:
  del argv
  compiled, state, batch, setup = benchmark.compiled_synthetic_step(_CONFIG.value)
  batch_size, bench = batch['source_tokens'].shape[0], _CONFIG.value.benchmark
  with jax.set_mesh(setup.mesh), nn.logical_axis_rules(setup.rules):
    names = _op_names(compiled.as_text())
    for _ in range(3):
      state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    with tempfile.TemporaryDirectory() as directory:
      jax.profiler.start_trace(directory)
      start = time.perf_counter()
      for _ in range(_STEPS.value):
        state, metrics = compiled(state, batch)
      jax.block_until_ready(metrics)
      wall = (time.perf_counter() - start) / _STEPS.value
      jax.profiler.stop_trace()
      events = _trace_events(pathlib.Path(directory))
  by_part, by_op = collections.Counter(), collections.Counter()
  for event in events:
    instruction = event['name']
    if instruction not in names:  # Not an XLA op of the step (host-side events, the runtime's own).
      continue
    seconds = event['dur'] * 1e-6 / _STEPS.value
    by_part[_part(names[instruction])] += seconds
    by_op[instruction] += seconds
  total = sum(by_part.values())
  print(f'profile_step: [{batch_size}, {bench.source_length} + {bench.target_length}], {wall * 1e3:.1f} ms of wall '
        f'per step while traced, {total * 1e3:.1f} ms of op time (both threads)')
  for part, seconds in by_part.most_common():
    print(f'{part:52s} {seconds * 1e3:7.1f} ms  {seconds / total:6.1%}')
    ops = [(i, t) for i, t in by_op.most_common() if _part(names[i]) == part][:_TOP.value]
    for instruction, seconds in ops:
      print(f'    {instruction:32s} {seconds * 1e3:6.2f} ms  {names[instruction][-80:]}')
  print(json.dumps({'wall_ms': wall * 1e3, 'op_ms': total * 1e3,
                    'parts_ms': {part: seconds * 1e3 for part, seconds in by_part.most_common()}}))


if __name__ == '__main__':
  flags.mark_flag_as_required('config')
  app.run(main)
