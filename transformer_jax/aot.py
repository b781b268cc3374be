"""--mode=compile: ahead-of-time compilation of the train step for the configured mesh, to catch OOM early.

  python -m transformer_jax.main --config=configs/big.py --mode=compile --workdir=/tmp/aot \
      --config.mesh.data=1 --config.mesh.fsdp=-1

Lowers and compiles exactly the jitted `train.train_step` that training runs (same shardings, donation and
logical axis rules) for the batch shape that needs the most memory, without reading data, training a
vocabulary, touching checkpoints or running the step. It prints what each device would need
(`Compiled.memory_analysis()`: arguments, outputs, aliased (donated) buffers, temporaries, generated code),
XLA's FLOP count (`cost_analysis()`, per device), and the collectives in the optimised HLO, which show how
the step is sharded (all-reduce for data parallelism; all-gather and reduce-scatter for FSDP; tensor
parallelism adds all-reduces of activations). The figures are also written to `<workdir>/compile.json`.

It compiles for the devices this process sees: run it on the target topology (or, for a rough CPU estimate
of sharding and memory, on N fake CPU devices via XLA_FLAGS=--xla_force_host_platform_device_count=N; CPU
memory figures use the CPU backend's layouts and fusion decisions, so treat them as an estimate).
"""
import collections
import json
import re
import time
from typing import Any

from absl import logging
from etils import epath
import jax
import numpy as np

from transformer_jax import experiment
from transformer_jax import memory
from transformer_jax import sharding
from transformer_jax import train
from transformer_jax import workdir as workdir_lib

_COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all', 'collective-permute')


def collective_counts(hlo_text: str) -> dict[str, int]:
  """How many times each cross-device collective appears in (optimised) HLO text; async pairs count once."""
  counts = collections.Counter()
  for op in _COLLECTIVES:
    counts[op] = len(re.findall(rf'\s{op}(?:-start)?\(', hlo_text))
  return dict(counts)


def compile_train_step(config, workdir: str | None = None) -> tuple[Any, dict[str, Any]]:
  """Lowers and compiles the sharded train step; nothing is executed or read.

  Args:
    config: the full ConfigDict (configs/*.py); the vocabulary size is `config.data.vocab_size`.
    workdir: recorded in the Setup only (nothing is read from or written to it here).

  Returns:
    (the `jax.stages.Compiled` step, a dict of figures: mesh, batch shape, parameter count, per-device
    memory in bytes, per-device and total HLO FLOPs, collective counts, compile seconds, and whether the step
    fits in this machine's memory (`memory.fits`)).

  Raises:
    ValueError: for a bad config value (see `experiment.validate_config`) or a mesh the model does not divide by.
  """
  setup = experiment.compute_setup(config, workdir)  # Compile mode reads and writes nothing.
  abstract_state = setup.abstract_state()
  shape = memory.largest_batch_shape(config.data, setup.rows_multiple)
  batch = memory.abstract_batch(config.data, shape, sharding.batch_sharding(setup.mesh))
  state_sharding = sharding.shardings_of(abstract_state)
  train_fn, _ = train.jit_steps(setup, state_sharding)
  start = time.perf_counter()
  with setup.mesh_context():
    lowered = train_fn.lower(abstract_state, batch)
  compiled = lowered.compile()
  seconds = time.perf_counter() - start
  flops = float((compiled.cost_analysis() or {}).get('flops', float('nan')))  # Per device (one SPMD program).
  figures = {
      'mesh': dict(setup.mesh.shape), 'devices': setup.mesh.size, 'device_kind': setup.mesh.devices.flat[0].device_kind,
      'batch_shape': list(shape), 'tokens_per_batch': config.data.tokens_per_batch,
      'grad_accum_steps': config.train.grad_accum_steps,
      'num_params': int(sum(np.prod(x.shape) for x in jax.tree.leaves(abstract_state.params))),
      'memory_per_device': memory.memory_figures(compiled),
      'fits_here': memory.fits(compiled, setup.mesh.devices.flat)[1], 'flops_per_device': flops,
      'flops_total': flops * setup.mesh.size, 'collectives': collective_counts(compiled.as_text()),
      'compile_seconds': seconds}
  return compiled, figures


def format_report(figures: dict[str, Any]) -> str:
  """A human-readable summary of `compile_train_step`'s figures."""
  gib = lambda n: f'{n / 2**30:8.3f} GiB'
  batch, length = figures['batch_shape']
  lines = [f"mesh {figures['mesh']} on {figures['devices']} x {figures['device_kind']}; batch [{batch}, {length}] "
           f"per side ({batch * length:,} slots, tokens_per_batch={figures['tokens_per_batch']:,}); "
           f"{figures['num_params']:,} parameters; compiled in {figures['compile_seconds']:.1f} s",
           'memory per device:']
  names = {'argument_size_in_bytes': 'arguments (state + batch)', 'output_size_in_bytes': 'outputs',
           'alias_size_in_bytes': 'aliased (donated)', 'temp_size_in_bytes': 'temporaries',
           'generated_code_size_in_bytes': 'generated code', 'total_in_bytes': 'total (args+out-alias+temp+code)'}
  lines += [f'  {names[k]:34s}{gib(v)}' for k, v in figures['memory_per_device'].items()]
  lines.append(f"on this machine: {figures['fits_here']}")
  lines.append(f"HLO FLOPs per step: {figures['flops_per_device']:.4g} per device, "
               f"{figures['flops_total']:.4g} in total")
  lines.append('collectives: ' + ', '.join(f'{k} {v}' for k, v in figures['collectives'].items()))
  return '\n'.join(lines)


def compile_only(config, workdir: str | None) -> dict[str, Any]:
  """--mode=compile: compiles the train step, prints the report and a JSON line, writes workdir/compile.json.

  Returns:
    The figures of `compile_train_step`.
  """
  _, figures = compile_train_step(config, workdir)
  print(format_report(figures))
  print(json.dumps(figures))
  if workdir and jax.process_index() == 0:
    path = epath.Path(workdir_lib.path(workdir, workdir_lib.COMPILE_REPORT))  # epath: gs:// works too.
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=2))
    logging.info('Compile figures written to %s', path)
  return figures
