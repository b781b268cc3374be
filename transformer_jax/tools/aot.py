"""--mode=compile: ahead-of-time compilation of the train step for a mesh or a TPU slice, to catch OOM early.

  python -m transformer_jax.main --config=configs/big.py --mode=compile --config.compile.topology=v5e-8
  python -m transformer_jax.main --config=configs/big.py --mode=compile --workdir=/tmp/aot \
      --config.mesh.data=1 --config.mesh.fsdp=-1

Lowers and compiles exactly the jitted `step.train_step` (training/step.py) that training runs (same shardings,
donation, train.grad_accum_steps and logical axis rules) for the batch shape that needs the most memory, without reading
data, training a vocabulary, touching checkpoints or running the step. It prints what each device would need
(`Compiled.memory_analysis()`: arguments, outputs, aliased (donated) buffers, temporaries, generated code),
the compiler's FLOP and byte counts (`cost_analysis()`, per device), and the collectives in the optimised HLO,
which show how the step is sharded (all-reduce for data parallelism; all-gather and reduce-scatter for FSDP;
tensor parallelism adds all-reduces of activations). With --workdir the figures are also written to
`<workdir>/compile.json`, the only file this mode writes.

Where it compiles:
- `compile.topology` (e.g. v5e-8): for that Cloud TPU slice with the TPU compiler, on any machine with the
  `tpu` extra (`tpu_slices`). The figures are the real slice's; each chip's memory is compared with its HBM,
  a step that does not fit is compiled again with larger train.grad_accum_steps, then mesh.fsdp, until one
  fits (`compile.find_fit`), and a roofline estimate of the step time and MFU is derived from the chip's
  published bf16 peak and HBM bandwidth.
- otherwise: for the devices this process sees (run it on the target machine; or, for a rough CPU estimate
  of sharding and memory, on N fake CPU devices via XLA_FLAGS=--xla_force_host_platform_device_count=N: CPU
  memory figures use the CPU backend's layouts and fusion decisions).
"""
import collections
import copy
import json
import math
import re
import time
from typing import Any

from absl import logging
from etils import epath
import jax
import numpy as np

from transformer_jax import errors
from transformer_jax import logs
from transformer_jax.model import sharding
from transformer_jax.storage import workdir as workdir_lib
from transformer_jax.tools import tpu_slices
from transformer_jax.run import experiment
from transformer_jax.training import flops
from transformer_jax.training import memory
from transformer_jax.training import step as step_lib

_COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all', 'collective-permute')


def collective_counts(hlo_text: str) -> dict[str, int]:
  """How many times each cross-device collective appears in (optimised) HLO text; async pairs count once."""
  counts = collections.Counter()
  for op in _COLLECTIVES:
    counts[op] = len(re.findall(rf'\s{op}(?:-start)?\(', hlo_text))
  return dict(counts)


def compile_train_step(config, devices=None) -> tuple[Any, dict[str, Any]]:
  """Lowers and compiles the sharded train step; nothing is executed, read or allocated.

  Args:
    config: the full ConfigDict (configs/*.py); the vocabulary size is `config.data.vocab_size`.
    devices: the mesh's devices: a TPU slice's compile-only ones (`tpu_slices.devices`), or by default all
      of `jax.devices()`.

  Returns:
    (the `jax.stages.Compiled` step, a dict of figures: mesh, batch shape, parameter count, per-device
    memory in bytes, per-device HLO FLOPs and bytes accessed (XLA counts a loop's body once: one of
    train.grad_accum_steps micro-batches, one 512-token chunk of the loss), model FLOPs per step
    (`flops.train_step_flops`), collective counts and compile seconds).

  Raises:
    errors.ConfigError: for a bad config value (see `config_checks.validate_config`) or a mesh the model does not
      divide by.
    CompilerOutOfMemoryError: when the compiler itself finds the step too large for a device (TPU).
  """
  setup = experiment.compute_setup(config, devices)  # Compile mode reads and writes nothing.
  abstract_state = setup.abstract_state()
  shape = memory.largest_batch_shape(config.data, setup.rows_multiple)
  batch = memory.abstract_batch(config.data, shape, setup.batch_sharding)
  train_fn = step_lib.jit_train_step(setup, sharding.shardings_of(abstract_state), config.train.label_smoothing,
                                     rdrop_alpha=config.train.rdrop_alpha)
  figures = {
      'mesh': dict(setup.mesh.shape), 'devices': setup.mesh.size, 'device_kind': setup.mesh.devices.flat[0].device_kind,
      'batch_shape': list(shape), 'tokens_per_batch': config.data.tokens_per_batch,
      'grad_accum_steps': config.train.grad_accum_steps, 'dtype': config.model.dtype,
      'num_params': int(sum(np.prod(x.shape) for x in jax.tree.leaves(abstract_state.params))),
      'model_flops': flops.train_step_flops(setup.model.cfg, shape[0], shape[1], shape[1],
                                            step_lib.passes_per_step(config.train.rdrop_alpha))}
  start = time.perf_counter()
  logging.info('Compiling the train step for %d x %s, batch [%d, %d] per side, %s (minutes for the paper\'s '
               'models on a 2-core CPU).', setup.mesh.size, figures['device_kind'], *shape, config.model.dtype)
  try:
    with setup.mesh_context(), logs.heartbeat(lambda s: f'Compiling the train step: {s:.0f} s so far.'):
      lowered = train_fn.lower(abstract_state, batch)
      compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as error:
    if 'RESOURCE_EXHAUSTED' not in str(error):
      raise
    figures['compile_seconds'] = time.perf_counter() - start
    raise CompilerOutOfMemoryError(str(error).strip().splitlines()[0], figures) from None
  cost = compiled.cost_analysis() or {}  # Per device (one SPMD program).
  figures.update(
      memory_per_device=memory.memory_figures(compiled), flops_per_device=float(cost.get('flops', float('nan'))),
      bytes_accessed_per_device=float(cost.get('bytes accessed', float('nan'))),
      collectives=collective_counts(compiled.as_text()), compile_seconds=time.perf_counter() - start)
  figures['flops_total'] = figures['flops_per_device'] * setup.mesh.size
  return compiled, figures


class CompilerOutOfMemoryError(errors.UserError, MemoryError):
  """The compiler refused the step: it needs more memory than a device has (the TPU compiler checks).

  Attributes:
    figures: what `compile_train_step` knew before compiling (mesh, batch shape, parameters, model FLOPs).
  """

  def __init__(self, message: str, figures: dict[str, Any]):
    super().__init__(message)
    self.figures = figures


def roofline(figures: dict[str, Any], chip: tpu_slices.Chip) -> dict[str, Any]:
  """An estimate of the step time from the step's work and the chip's published peaks (a roofline).

  Compute: the model FLOPs (`flops.train_step_flops`, shared by the chips) at the bf16 peak, a lower bound on
  the time. Memory: XLA's bytes accessed at the HBM bandwidth, times train.grad_accum_steps (XLA counts the
  micro-batch loop's body once). XLA counts every fused op's operands and results, some of which stay in on-chip
  memory, and the loss's chunk loop once: the memory side is an estimate, not a bound. The step time is the
  larger of the two; collectives (ICI), stalls and the host are left out. A measured step is the real figure.

  Returns:
    {'compute_seconds', 'memory_seconds', 'step_seconds', 'bound' ('compute' or 'memory'), 'mfu' (model FLOPs
    per chip over the estimated time at the peak)}.
  """
  compute = figures['model_flops'] / figures['devices'] / chip.peak_flops
  memory_seconds = (figures['bytes_accessed_per_device'] * figures['grad_accum_steps']
                    / chip.hbm_bytes_per_second)
  if not math.isfinite(memory_seconds):  # The compiler gave no byte count: the compute side alone.
    memory_seconds = 0.0
  step = max(compute, memory_seconds)
  return {'compute_seconds': compute, 'memory_seconds': memory_seconds, 'step_seconds': step,
          'bound': 'compute' if compute >= memory_seconds else 'memory', 'mfu': compute / step}


# What lowers the step's memory per device, said when it does not fit.
_FIT_ADVICE = ('raise train.grad_accum_steps or mesh.fsdp (which shards parameters and optimiser state), or lower '
               'data.tokens_per_batch or data.max_length (data.bucket_lengths), or compute in model.dtype=bfloat16')


def _compile_on_slice(config, slice_: tpu_slices.Slice, devices) -> dict[str, Any]:
  """`compile_train_step`'s figures on the slice plus 'fits' (the compiler accepted the step and its total is
  within the chip's HBM) and, when the compiler refused it, 'compiler_error'."""
  try:
    _, figures = compile_train_step(config, devices=devices)
  except CompilerOutOfMemoryError as error:
    return error.figures | {'fits': False, 'compiler_error': str(error)}
  return figures | {'fits': figures['memory_per_device']['total_in_bytes'] <= slice_.chip.hbm_bytes}


def _candidates(config, num_devices: int) -> list[dict[str, int]]:
  """Settings to try, least disruptive first: train.grad_accum_steps 2, 4, ... while each data shard keeps a
  real (not padding) row per micro-batch, then mesh.fsdp 2, 4, ... up to every device outside mesh.tensor (the
  others on mesh.data)."""
  rows = memory.largest_batch_shape(config.data, 1)[0]
  data, fsdp, tensor = sharding.mesh_shape(config.mesh, num_devices)
  powers = [2**i for i in range(1, 17)]
  return ([{'train.grad_accum_steps': g} for g in powers
           if config.train.grad_accum_steps < g <= -(-rows // (data * fsdp))]
          + [{'mesh.fsdp': f, 'mesh.data': -1} for f in powers if fsdp < f <= num_devices // tensor])


def find_fit(config, slice_: tpu_slices.Slice, devices) -> dict[str, Any] | None:
  """Compiles the step again with each of `_candidates` until one fits the chip's HBM.

  Returns:
    {'overrides': {config key: value}, 'total_in_bytes': per-device need, 'compile_seconds'} of the first
    setting that fits, or None when none does.
  """
  for overrides in _candidates(config, len(devices)):
    candidate = copy.deepcopy(config)
    with candidate.unlocked():
      for key, value in overrides.items():
        section, field = key.split('.')
        candidate[section][field] = value
    flags = ' '.join(f'--config.{k}={v}' for k, v in overrides.items())
    try:
      figures = _compile_on_slice(candidate, slice_, devices)
    except ValueError as error:  # E.g. a mesh the model does not divide by.
      logging.info('%s: %s', flags, error)
      continue
    logging.info('%s %s on %s.', flags, 'fits' if figures['fits'] else 'does not fit', slice_.name)
    if figures['fits']:
      return {'overrides': overrides, 'total_in_bytes': figures['memory_per_device']['total_in_bytes'],
              'compile_seconds': figures['compile_seconds']}
  return None


def compile_for_slice(config) -> dict[str, Any]:
  """The train step compiled for the TPU slice `config.compile.topology`, with what a chip needs and has.

  Returns:
    `compile_train_step`'s figures plus 'slice', 'topology', 'hbm_bytes', 'chip_source', 'fits', and either
    'roofline' (a step the compiler accepted) or 'compiler_error' (its out-of-memory message); for a step that
    does not fit, with `compile.find_fit`, 'fit' (`find_fit`'s answer).

  Raises:
    ValueError: for an unknown slice name (listing the known ones) or a bad config value.
    tpu_slices.LibtpuMissingError: without the `tpu` extra.
  """
  slice_ = tpu_slices.parse(config.compile.topology)
  devices = tpu_slices.devices(slice_)
  figures = _compile_on_slice(config, slice_, devices)
  figures.update(slice=slice_.name, topology=slice_.topology, hbm_bytes=slice_.chip.hbm_bytes,
                 chip_source=slice_.chip.source)
  if 'memory_per_device' in figures:
    figures['roofline'] = roofline(figures, slice_.chip)
  if not figures['fits'] and config.compile.find_fit:
    figures['fit'] = find_fit(config, slice_, devices)
  return figures


def format_report(figures: dict[str, Any]) -> str:
  """A human-readable summary of `compile_train_step`'s (or `compile_for_slice`'s) figures."""
  gib = lambda n: f'{n / 2**30:8.3f} GiB'
  batch, length = figures['batch_shape']
  target = (f"{figures['slice']} ({figures['topology']}, {figures['devices']} x {figures['device_kind']}), "
            f"mesh {figures['mesh']}" if 'slice' in figures else
            f"mesh {figures['mesh']} on {figures['devices']} x {figures['device_kind']}")
  lines = [f"{target}; batch [{batch}, {length}] per side ({batch * length:,} slots, tokens_per_batch="
           f"{figures['tokens_per_batch']:,}, grad_accum_steps={figures['grad_accum_steps']}, {figures['dtype']}); "
           f"{figures['num_params']:,} parameters; compiled in {figures['compile_seconds']:.1f} s"]
  names = {'argument_size_in_bytes': 'arguments (state + batch)', 'output_size_in_bytes': 'outputs',
           'alias_size_in_bytes': 'aliased (donated)', 'temp_size_in_bytes': 'temporaries',
           'generated_code_size_in_bytes': 'generated code', 'total_in_bytes': 'total (args+out-alias+temp+code)'}
  if 'memory_per_device' in figures:
    lines.append('memory per device:')
    lines += [f'  {names[k]:34s}{gib(v)}' for k, v in figures['memory_per_device'].items()]
  if 'slice' in figures:
    hbm = f"{figures['hbm_bytes'] / 2**30:.0f} GiB of HBM per chip ({figures['chip_source']})"
    if 'compiler_error' in figures:
      lines.append(f"DOES NOT FIT in {hbm}: the TPU compiler says {figures['compiler_error']}")
    else:
      used = figures['memory_per_device']['total_in_bytes'] / figures['hbm_bytes']
      lines.append(f"{'fits' if figures['fits'] else 'DOES NOT FIT'} in {hbm}: {used:.0%} used")
    if not figures['fits']:
      lines.append(f'to fit: {_FIT_ADVICE}')
    if 'fit' in figures:
      fit = figures['fit']
      lines.append('smallest change that fits (compiled): ' + (
          ' '.join(f'--config.{k}={v}' for k, v in fit['overrides'].items())
          + f" ({fit['total_in_bytes'] / 2**30:.2f} GiB per chip)" if fit else
          'none of train.grad_accum_steps or mesh.fsdp does: a smaller model or batch, or a chip with more HBM'))
  else:
    lines.append(f"on this machine: {figures['fits_here']}")
  if 'flops_per_device' in figures:
    lines.append(f"HLO per device (loop bodies once): {figures['flops_per_device']:.4g} FLOPs, "
                 f"{figures['bytes_accessed_per_device']:.4g} bytes accessed; model FLOPs per step "
                 f"{figures['model_flops']:.4g} in total (flops.train_step_flops)")
  if 'roofline' in figures:
    r = figures['roofline']
    lines.append(f"ESTIMATE (roofline: model FLOPs at the chip's bf16 peak, XLA's bytes accessed at its HBM bandwidth; "
                 f"collectives left out): step {r['step_seconds'] * 1e3:.1f} ms, {r['bound']}-bound (compute "
                 f"{r['compute_seconds'] * 1e3:.1f} ms, HBM {r['memory_seconds'] * 1e3:.1f} ms), MFU {r['mfu']:.0%}")
  if 'collectives' in figures:
    lines.append('collectives: ' + ', '.join(f'{k} {v}' for k, v in figures['collectives'].items()))
  return '\n'.join(lines)


def compile_only(config, workdir: str | None) -> dict[str, Any]:
  """--mode=compile: compiles the train step, prints the report and a JSON line, writes workdir/compile.json.

  For `compile.topology` (a TPU slice) see `compile_for_slice`; otherwise it compiles for this process's
  devices and says whether the step fits their memory (`memory.fits`).

  Returns:
    The figures of `compile_for_slice` or `compile_train_step`.

  Raises:
    errors.PathError: naming --workdir, before compiling, when compile.json cannot be written there.
    memory.DoesNotFitError: after the report, when the step does not fit the chips of `compile.topology`
      (so that launchers stop before creating the slice).
  """
  target = (f'the Cloud TPU slice {config.compile.topology} (the TPU compiler, on this machine)'
            if config.compile.topology else f'{jax.device_count()} {jax.default_backend()} device(s) of this machine')
  logging.info('JAX %s, --mode=compile: the train step of a %d-layer d_model=%d model for %s.', jax.__version__,
               config.model.num_layers, config.model.d_model, target)
  if workdir and jax.process_index() == 0:  # Before the compilation, which can take minutes.
    workdir_lib.check_report_folder(workdir, workdir_lib.COMPILE_REPORT)
  if config.compile.topology:
    figures = compile_for_slice(config)
  else:
    compiled, figures = compile_train_step(config)
    figures['fits_here'] = memory.fits(compiled)[1]
  print(format_report(figures))
  print(json.dumps(figures))
  if workdir and jax.process_index() == 0:
    path = epath.Path(workdir_lib.path(workdir, workdir_lib.COMPILE_REPORT))  # epath: gs:// works too.
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=2))
    logging.info('Compile figures written to %s', path)
  if config.compile.topology and not figures['fits']:
    fit = figures.get('fit')
    change = (' '.join(f'--config.{k}={v}' for k, v in fit['overrides'].items()) + ' fits (compiled)' if fit
              else _FIT_ADVICE)
    raise memory.DoesNotFitError(f"the train step does not fit the chips of {figures['slice']} "
                                 f"({figures['hbm_bytes'] / 2**30:.0f} GiB of HBM each): {change}")
  return figures
