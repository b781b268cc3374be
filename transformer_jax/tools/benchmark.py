"""--mode=benchmark: compile and time the train step and beam decoding on synthetic batches.

  python -m transformer_jax.main --config=configs/base.py --mode=benchmark \
      --config.benchmark.batch_size=32 --config.benchmark.source_length=64 --config.benchmark.target_length=64

Prints compile time, the median step time, tokens/s (source + target, no padding), model FLOPs per step
counted analytically (matrix products, training = 3x forward) next to XLA's cost analysis, MFU against a
peak measured on the spot (a large matrix product in the compute dtype) or taken from a table of known
accelerators, and beam-search sentences/s. The last line is one JSON object.

The step is compiled before anything is allocated; when it would need more memory than the devices (or the
host) have, the batch is halved until it fits, and the report says so (`memory.fits`).
"""
import functools
import json
import statistics
import time

from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import logs
from transformer_jax.data import batching
from transformer_jax.decoding import backends
from transformer_jax.decoding import translate
from transformer_jax.model import sharding
from transformer_jax.model import transformer as model_lib
from transformer_jax.run import experiment
from transformer_jax.training import flops as flops_lib
from transformer_jax.training import memory
from transformer_jax.training import state as state_lib
from transformer_jax.training import step as step_lib

def _timed(fn, *args, num_steps: int):
  """Median seconds of fn(*args) over num_steps calls after one warm-up call; returns (median, last output)."""
  out = jax.block_until_ready(fn(*args))
  times = []
  for _ in range(num_steps):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times), out


def synthetic_batch(cfg: model_lib.ModelConfig, batch_size: int, source_length: int, target_length: int):
  """Random token ids without padding (ids 3..vocab-1), as numpy int32 arrays."""
  rng = np.random.default_rng(0)
  tokens = lambda length: rng.integers(3, cfg.vocab_size, (batch_size, length), dtype=np.int32)
  target = tokens(target_length)
  decoder_input = np.concatenate([np.ones((batch_size, 1), np.int32), target[:, :-1]], axis=1)
  return {'source_tokens': tokens(source_length), 'decoder_input_tokens': decoder_input, 'target_tokens': target}


def compiled_synthetic_step(config):
  """The train step of `config` compiled for its synthetic benchmark batch, with a fresh state to run it on.

  The batch is `synthetic_batch` at config.benchmark's sizes ([batch_size or tokens_per_batch // source_length,
  source_length + target_length]), placed as training places batches. Used by the benchmark scripts
  (benchmarks/ab_step.py, benchmarks/profile_step.py).

  Returns:
    (compiled step, state, batch, setup); call the step inside `jax.set_mesh(setup.mesh)` and
    `nn.logical_axis_rules(setup.rules)`, as `run` does.
  """
  setup = experiment.compute_setup(config)
  bench = config.benchmark
  batch_size = bench.batch_size or max(1, config.data.tokens_per_batch // bench.source_length)
  host_batch = synthetic_batch(setup.model.cfg, batch_size, bench.source_length, bench.target_length)
  batch = {k: jax.device_put(v, setup.batch_sharding) for k, v in host_batch.items()}
  step_fn = step_lib.jit_train_step(setup, sharding.shardings_of(setup.abstract_state()), config.train.label_smoothing,
                                    rdrop_alpha=config.train.rdrop_alpha)
  with jax.set_mesh(setup.mesh), nn.logical_axis_rules(setup.rules):
    state, _ = state_lib.sharded_train_state(jax.random.key(0), setup.model, setup.tx, batch, setup.mesh,
                                             setup.rules)
    with logs.heartbeat(lambda s: f'Compiling the train step: {s:.0f} s so far.'):
      compiled = step_fn.lower(state, batch).compile()
  return compiled, state, batch, setup


def run(config) -> dict[str, float]:
  """Benchmarks the configured model; prints a report and returns (and prints last) the JSON figures."""
  # The model, optimiser (adam_*, grad_clip_norm, weight_decay, learning_rate_scale), mesh and jitted step of training.
  setup = experiment.compute_setup(config)
  cfg, model, mesh, rules = setup.model.cfg, setup.model, setup.mesh, setup.rules
  bench = config.benchmark
  requested = bench.batch_size or max(1, config.data.tokens_per_batch // bench.source_length)
  abstract_state = setup.abstract_state()
  state_sharding = sharding.shardings_of(abstract_state)
  step_fn = step_lib.jit_train_step(setup, state_sharding, config.train.label_smoothing,
                                    rdrop_alpha=config.train.rdrop_alpha)
  # Compiled on the abstract state first: nothing is allocated until a batch that fits is found.
  print(f'benchmark: compiling the train step for [{requested}, {bench.source_length} + {bench.target_length}]...',
        flush=True)
  batch_size, compiled, compile_time = _fitting_step(setup, bench, step_fn, abstract_state, requested)
  print(f'benchmark: compiled in {compile_time:.1f} s; timing {bench.num_steps} steps, then beam search...',
        flush=True)
  host_batch = synthetic_batch(cfg, batch_size, bench.source_length, bench.target_length)
  batch_sharding = sharding.batch_sharding(mesh)
  batch = {k: jax.device_put(v, batch_sharding) for k, v in host_batch.items()}
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    state, _ = state_lib.sharded_train_state(jax.random.key(0), model, setup.tx, batch, mesh, rules)
    xla_flops = float((compiled.cost_analysis() or {}).get('flops', float('nan')))
    state, _ = compiled(state, batch)
    times = []
    for _ in range(bench.num_steps):
      start = time.perf_counter()
      state, metrics = compiled(state, batch)
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - start)
    step_time = statistics.median(times)
    decode_rate = _decode_rate(state.params, model, config, host_batch)
  flops = flops_lib.train_step_flops(cfg, batch_size, bench.source_length, bench.target_length,
                                     step_lib.passes_per_step(config.train.rdrop_alpha))
  peak, peak_source = flops_lib.peak_flops(cfg.compute_dtype)
  tokens = batch_size * (bench.source_length + bench.target_length)
  results = {
      'train_tokens_per_sec': tokens / step_time, 'step_time_ms': 1e3 * step_time,
      'mfu': flops / step_time / peak, 'peak_flops': peak, 'model_flops_per_step': flops,
      'xla_flops_per_step': xla_flops * jax.device_count(), 'compile_time_s': compile_time,
      'decode_sentences_per_sec': decode_rate, 'batch_size': batch_size,
      'source_length': bench.source_length, 'target_length': bench.target_length,
      'dtype': cfg.dtype, 'devices': jax.device_count(), 'device_kind': jax.devices()[0].device_kind,
      'grad_accum_steps': config.train.grad_accum_steps}
  _print_report(results, peak_source)
  return results


def _fitting_step(setup, bench, step_fn, abstract_state, batch_size: int):
  """(batch size, compiled step, compile seconds) for the largest batch <= batch_size that fits in memory.

  `bench` is config.benchmark (the source and target lengths). The batch is padded as the input pipeline pads
  training batches, and halved while the compiled step needs more memory than the devices (or the host) have
  (`memory.fits`); the change is logged and printed.

  Raises:
    memory.DoesNotFitError: if even the smallest batch (one row per data shard) does not fit.
  """
  num_shards = setup.rows_multiple
  requested = batch_size = batching.padded_rows(batch_size, num_shards)
  batch_sharding = setup.batch_sharding
  while True:
    lengths = {'source_tokens': bench.source_length, 'decoder_input_tokens': bench.target_length,
               'target_tokens': bench.target_length}
    batch = {k: jax.ShapeDtypeStruct((batch_size, n), jnp.int32, sharding=batch_sharding) for k, n in lengths.items()}
    start = time.perf_counter()
    with setup.mesh_context(), logs.heartbeat(lambda s: f'Compiling the train step at batch {batch_size}: '
                                                  f'{s:.0f} s so far.'):
      compiled = step_fn.lower(abstract_state, batch).compile()
    compile_time = time.perf_counter() - start
    ok, sentence = memory.fits(compiled, setup.mesh.devices.flat)
    if ok:
      if batch_size != requested:
        message = (f'benchmark: batch_size {requested} does not fit in memory; benchmarking batch_size '
                   f'{batch_size}, which {sentence}.')
        logging.warning(message)
        print(message)
      return batch_size, compiled, compile_time
    smaller = batching.padded_rows(max(batch_size // 2, 1), num_shards)
    if smaller >= batch_size:
      raise memory.DoesNotFitError(
          f'The benchmark train step at batch [{batch_size}, {bench.source_length} + {bench.target_length}] '
          f'{sentence}, even at the smallest batch (one row per data shard). Lower benchmark.source_length and '
          'benchmark.target_length (benchmark.batch_size is already at its minimum), use a smaller model, or '
          'shard the state over more devices (mesh.fsdp).')
    logging.warning('benchmark: batch_size %d %s; trying %d.', batch_size, sentence, smaller)
    batch_size = smaller


def _decode_rate(params, model, config, host_batch) -> float:
  """Beam search (decode.beam_size, alpha) sentences/s on benchmark.decode_sentences synthetic sources."""
  count = min(config.benchmark.decode_sentences, host_batch['source_tokens'].shape[0])
  source = jnp.asarray(host_batch['source_tokens'][:count])
  decode = functools.partial(translate.decode_batch, model=model, beam_size=config.decode.beam_size,
                             alpha=config.decode.alpha, extra_length=config.decode.extra_length,
                             early_stopping=config.decode.early_stopping,
                             backend=backends.decoding_backend(model.cfg))
  seconds, _ = _timed(decode, params, source, num_steps=2)
  return count / seconds


def _print_report(results: dict, peak_source: str) -> None:
  r = results
  logging.info('benchmark done')
  print(f"shape: {r['batch_size']} x ({r['source_length']} + {r['target_length']}) tokens, {r['dtype']}, "
        f"{r['devices']} x {r['device_kind']}")
  print(f"compile_time: {r['compile_time_s']:.1f} s")
  print(f"step_time: {r['step_time_ms']:.1f} ms (median)   train_tokens_per_sec: {r['train_tokens_per_sec']:.0f}")
  print(f"model_flops_per_step: {r['model_flops_per_step'] / 1e9:.1f} G (analytic)   "
        f"xla_flops_per_step: {r['xla_flops_per_step'] / 1e9:.1f} G (cost analysis)")
  print(f"peak_flops: {r['peak_flops'] / 1e12:.2f} TFLOP/s ({peak_source})   mfu: {100 * r['mfu']:.1f}%")
  print(f"decode_sentences_per_sec: {r['decode_sentences_per_sec']:.1f}")
  print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in results.items()}))
