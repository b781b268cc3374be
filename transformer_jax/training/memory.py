"""Memory a compiled step needs, against what the devices (or, on CPU, the host) have, checked before running.

XLA states what a compiled program needs per device (`Compiled.memory_analysis()`: arguments, outputs, donated
buffers, temporaries, code). An accelerator's capacity is its allocator's `bytes_limit`; the CPU backend's
devices (one, or N fake ones from --xla_force_host_platform_device_count) all live in host memory, so there the
per-device need times the local devices is compared with the host's available memory. A step that does not fit
stops with `DoesNotFitError` naming the config fields that lower its memory, instead of being killed by the
operating system's out-of-memory killer (or an accelerator's allocator) part way through a run.

Used by training (`check_train_step`, before the first step), --mode=benchmark (which lowers its batch until it
fits) and --mode=compile (which reports whether it would fit here).
"""
from collections.abc import Sequence
import os

from absl import logging
import jax
import jax.numpy as jnp

from transformer_jax import errors
from transformer_jax import logs
from transformer_jax.data import batching

_MEMORY_FIELDS = ('argument_size_in_bytes', 'output_size_in_bytes', 'alias_size_in_bytes', 'temp_size_in_bytes',
                  'generated_code_size_in_bytes')
_PACKED_KEYS = ('source_segment_ids', 'target_segment_ids', 'source_positions', 'target_positions')
# Host memory the CPU backend may use for a step: what the kernel reports available, less a margin for the
# Python process, the input pipeline and whatever XLA's estimate leaves out.
HOST_MEMORY_FRACTION = 0.9


class DoesNotFitError(errors.UserError, MemoryError):
  """A compiled step needs more memory than the devices (or the host) have."""


def memory_figures(compiled) -> dict[str, int]:
  """Per-device bytes from `memory_analysis()`, plus their total (empty where the backend gives none)."""
  stats = compiled.memory_analysis()
  if stats is None:
    return {}
  memory = {field: int(getattr(stats, field)) for field in _MEMORY_FIELDS}
  # The donated state's buffers hold the new state, so aliased bytes count once.
  memory['total_in_bytes'] = (memory['argument_size_in_bytes'] + memory['output_size_in_bytes']
                              - memory['alias_size_in_bytes'] + memory['temp_size_in_bytes']
                              + memory['generated_code_size_in_bytes'])
  return memory


def host_available_bytes() -> int | None:
  """MemAvailable of /proc/meminfo in bytes (Linux), else free physical pages; None if neither is known."""
  try:
    with open('/proc/meminfo') as f:
      for line in f:
        if line.startswith('MemAvailable:'):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  try:
    return os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')
  except (ValueError, OSError, AttributeError):
    return None


def available_bytes(devices: Sequence[jax.Device] | None = None) -> tuple[int, str] | None:
  """(bytes one device's share of the step may use, where that figure comes from), or None if unknown.

  Args:
    devices: the devices the step runs on (this process's are looked at); all local devices by default.
  """
  local = [d for d in (devices if devices is not None else jax.local_devices())
           if d.process_index == jax.process_index()]
  if local[0].platform == 'cpu':
    host = host_available_bytes()
    if host is None:
      return None
    return (int(host * HOST_MEMORY_FRACTION) // len(local),
            f'{HOST_MEMORY_FRACTION:g} of the host\'s {host / 2**30:.1f} GiB available, shared by {len(local)} '
            'CPU devices')
  stats = local[0].memory_stats() or {}
  if 'bytes_limit' not in stats:
    return None
  return int(stats['bytes_limit']), f'{local[0].device_kind} bytes_limit'


def fits(compiled, devices: Sequence[jax.Device] | None = None) -> tuple[bool, str]:
  """(whether the step fits, a sentence with the needed and available GiB); True when either is unknown."""
  need = memory_figures(compiled).get('total_in_bytes')
  have = available_bytes(devices)
  if need is None or have is None:
    return True, 'memory needed or available unknown on this backend; not checked'
  gib = lambda n: f'{n / 2**30:.2f} GiB'
  return need <= have[0], f'needs {gib(need)} per device, {gib(have[0])} available ({have[1]})'


def check_fits(compiled, *, what: str, fields: Sequence[str], devices: Sequence[jax.Device] | None = None) -> str:
  """Raises unless the compiled step fits in memory; returns the sentence of `fits` otherwise.

  Args:
    compiled: a `jax.stages.Compiled`.
    what: the step, for the message (e.g. 'the train step at batch [104, 256]').
    fields: config fields that lower its memory, named in the message.
    devices: as in `available_bytes`.

  Raises:
    DoesNotFitError: naming `what`, the needed and available memory and `fields`.
  """
  ok, sentence = fits(compiled, devices)
  if not ok:
    raise DoesNotFitError(f'{what} {sentence}: it would run out of memory. Lower {", ".join(fields)}, or shard '
                          'the state over more devices (mesh.fsdp).')
  return sentence


def largest_batch_shape(data_config, num_shards: int) -> tuple[int, int]:
  """The global [batch, length] of the longest bucket at data.tokens_per_batch (Sec. 5.1), as training feeds it.

  The longest bucket has the fewest rows but the largest attention matrices (batch * length^2 per head, i.e.
  tokens_per_batch * length), so it bounds the step's memory; packed batches use the same row length. Its
  tokens_per_batch // length rows are padded to a multiple of num_shards (data shards x train.grad_accum_steps),
  as `train_iterator.TrainIterator` pads them.

  Raises:
    ValueError: if the batch size rounds down to 0 (see `batching.batch_size_for`).
  """
  length = int(batching.bucket_lengths_for(data_config.bucket_lengths, data_config.max_length)[-1])
  rows = batching.batch_size_for(length, data_config.tokens_per_batch, 1)
  return batching.padded_rows(rows, num_shards), length


def abstract_batch(data_config, shape: tuple[int, int], batch_sharding) -> dict[str, jax.ShapeDtypeStruct]:
  """ShapeDtypeStructs of a training batch of `shape` (with the packed keys when data.packing)."""
  keys = ('source_tokens', 'decoder_input_tokens', 'target_tokens')
  keys += _PACKED_KEYS if data_config.packing else ()
  return {key: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding) for key in keys}


TRAIN_BATCH_FIELDS = ('data.tokens_per_batch', 'data.max_length (or data.bucket_lengths)',
                      'or raise train.grad_accum_steps')


def check_train_step(setup, train_fn, data_config, shapes: Sequence[tuple[int, int]]) -> str:
  """Compiles the train step for the batch that needs the most memory and raises if it would not fit.

  Call before the state is created (it lowers the abstract state), so that nothing has been allocated yet.
  The step compiled for the longest of `shapes` is the one training then runs, so with the persistent
  compilation cache the loop's first step loads it instead of compiling again.

  Args:
    setup: the `training.build.Build` (or `Setup`).
    train_fn: the jitted step training runs (`step.jit_train_step` for `setup.state_sharding()`).
    data_config: config.data (the batch fields).
    shapes: the global [batch, length] shapes training will feed, at least one (`train_iterator.TrainIterator.shapes`,
      or `[largest_batch_shape(...)]` for data not yet read); the longest (then the widest) is checked.

  Returns:
    The sentence of `fits`, also logged.

  Raises:
    DoesNotFitError: naming the batch fields to lower.
  """
  abstract_state = setup.abstract_state()
  shape = max(shapes, key=lambda shape: (shape[1], shape[0]))
  batch = abstract_batch(data_config, shape, setup.batch_sharding)
  what = f'The train step at its largest batch [{shape[0]}, {shape[1]}]'
  logging.info('Compiling the train step at its largest batch [%d, %d] (kept in the compilation cache).', *shape)
  with setup.mesh_context(), logs.heartbeat(lambda s: f'Compiling the train step: {s:.0f} s so far.'):
    compiled = train_fn.lower(abstract_state, batch).compile()
  sentence = check_fits(compiled, what=what, fields=TRAIN_BATCH_FIELDS, devices=setup.mesh.devices.flat)
  logging.info('%s %s.', what, sentence)
  return sentence
