"""Times the train step of two or more config variants alternately in one process: an A/B that a noisy CPU allows.

  python -m benchmarks.ab_step --config=configs/multi30k.py \
      --variant=base: --variant=bf16_attention:model.attention_product_dtype=compute --rounds=8

Each --variant is NAME:KEY=VALUE[,KEY=VALUE...] (overrides of the config, parsed as `--config.KEY=VALUE` would
be; an empty list is the config as given). Every variant's step is compiled for the same synthetic batch
(`benchmark.synthetic_batch`: [batch_size, source_length + target_length] without padding, the
`benchmark.*` sizes), then the variants run `--steps` steps each, in turn, for `--rounds` rounds, so that
whatever else the machine does falls on all of them alike. Prints each variant's median and fastest round
(milliseconds per step) and its ratio to the first variant's median; the last line is one JSON object.
Run it with nothing else on the machine where possible; alternation protects the ratio, not the absolutes.
"""
from transformer_jax.cpu import host_allocator  # pylint: disable=g-bad-import-order
from transformer_jax import logs  # pylint: disable=g-bad-import-order

if __name__ == '__main__':  # Before JAX starts, as `python -m transformer_jax.main` does.
  host_allocator.use_fast_allocator()
  logs.quiet_libtpu()  # libtpu's start-up errors where the `tpu` extra is installed without a TPU.

import json
import statistics
import time

from absl import app
from absl import flags
import flax.linen as nn
import jax
from ml_collections import config_flags

from transformer_jax.tools import benchmark

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.', lock_config=False)
_VARIANTS = flags.DEFINE_multi_string('variant', None, 'NAME:KEY=VALUE[,KEY=VALUE...]; two or more.')
_ROUNDS = flags.DEFINE_integer('rounds', 8, 'Rounds; each runs every variant --steps steps.')
_STEPS = flags.DEFINE_integer('steps', 5, 'Steps per variant per round.')


def _parse(variant: str) -> tuple[str, dict[str, str]]:
  name, _, overrides = variant.partition(':')
  pairs = [item.split('=', 1) for item in overrides.split(',') if item]
  if not name or any(len(pair) != 2 for pair in pairs):
    raise app.UsageError(f'--variant={variant!r}: expected NAME:KEY=VALUE[,KEY=VALUE...]')
  return name, dict(pairs)


def _compiled_step(config, overrides: dict[str, str]):
  """(compiled step, state, batch, setup) of the config with `overrides` (dotted keys) applied."""
  config = config.copy_and_resolve_references()
  for key, value in overrides.items():
    *parents, leaf = key.split('.')
    node = config
    for part in parents:
      node = node[part]
    node[leaf] = _convert(node[leaf], value)
  return benchmark.compiled_synthetic_step(config)


def _convert(old, value: str):
  """`value` as the type of the field it replaces (bool, int, float or str; 'None' is None)."""
  if value == 'None':
    return None
  if isinstance(old, bool):
    return value.lower() in ('1', 'true', 'yes')
  if isinstance(old, (int, float)) and not isinstance(old, bool):
    return type(old)(value)
  return value


def main(argv) -> None:
  del argv
  variants = [_parse(v) for v in _VARIANTS.value or []]
  if len(variants) < 2:
    raise app.UsageError('give two or more --variant')
  runs = {}
  for name, overrides in variants:
    print(f'ab_step: compiling {name} {overrides or ""}', flush=True)
    runs[name] = _compiled_step(_CONFIG.value, overrides)
  times = {name: [] for name in runs}
  for _ in range(_ROUNDS.value):
    for name, (compiled, state, batch, setup) in runs.items():
      with jax.set_mesh(setup.mesh), nn.logical_axis_rules(setup.rules):
        state, metrics = compiled(state, batch)  # Warm: this step is not timed.
        jax.block_until_ready(metrics)
        start = time.perf_counter()
        for _ in range(_STEPS.value):
          state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times[name].append((time.perf_counter() - start) / _STEPS.value)
      runs[name] = (compiled, state, batch, setup)
  first = statistics.median(times[variants[0][0]])
  results = {}
  for name, values in times.items():
    median = statistics.median(values)
    results[name] = {'median_ms': 1e3 * median, 'fastest_ms': 1e3 * min(values), 'ratio': median / first}
    print(f'{name:24s} median {1e3 * median:8.1f} ms  fastest {1e3 * min(values):8.1f} ms  '
          f'x{median / first:.3f} of {variants[0][0]}')
  print(json.dumps(results))


if __name__ == '__main__':
  flags.mark_flag_as_required('config')
  app.run(main)
