"""Memory checks before running (#16 class 11): the compiled step's memory_analysis() against an available-memory
figure that the tests make small by monkeypatching `memory.available_bytes` (nothing here needs much memory)."""
import json

import jax
import jax.numpy as jnp
import pytest

from transformer_jax.model import sharding
from transformer_jax.tools import benchmark
from transformer_jax.run import experiment
from transformer_jax.training import memory
from transformer_jax.training import step as step_lib

from configs import smoke  # pylint: disable=g-bad-import-order


def limit_memory(monkeypatch, nbytes):
  monkeypatch.setattr(memory, 'available_bytes', lambda devices=None: (nbytes, 'test limit'))


def compiled_matmul(n):
  return jax.jit(lambda x: x @ x).lower(jax.ShapeDtypeStruct((n, n), jnp.float32)).compile()


def test_check_fits_compares_memory_analysis_with_the_limit(monkeypatch):
  compiled = compiled_matmul(512)
  need = memory.memory_figures(compiled)['total_in_bytes']
  assert need >= 2 * 512 * 512 * 4  # The argument and the output.
  limit_memory(monkeypatch, need)
  assert memory.fits(compiled)[0]
  limit_memory(monkeypatch, need - 1)
  with pytest.raises(memory.DoesNotFitError, match=r'The product needs \d+\.\d\d GiB per device, \d+\.\d\d GiB '
                                                   r'available \(test limit\): it would run out of memory\. '
                                                   r'Lower a\.x, b\.y'):
    memory.check_fits(compiled, what='The product', fields=('a.x', 'b.y'))


def test_host_memory_is_shared_by_the_cpu_devices():
  have, source = memory.available_bytes(jax.local_devices())
  host = memory.host_available_bytes()  # Read again: other processes' use moves it by a little in between.
  assert have == pytest.approx(host * memory.HOST_MEMORY_FRACTION / jax.local_device_count(), rel=0.01)
  assert f'shared by {jax.local_device_count()} CPU devices' in source


def _tiny_benchmark_config(batch_size):
  config = smoke.get_config()
  config.benchmark.update(batch_size=batch_size, source_length=8, target_length=8, num_steps=1, decode_sentences=2)
  config.decode.extra_length = 2
  return config


@pytest.mark.slow  # ~50 s on the shared 2-core machine: five compiles.
def test_benchmark_lowers_the_batch_until_the_step_fits(monkeypatch, capsys):
  config = _tiny_benchmark_config(32)
  s = experiment.compute_setup(config)
  abstract_state = s.abstract_state()
  step_fn = step_lib.jit_train_step(s, sharding.shardings_of(abstract_state), config.train.label_smoothing)
  fitting = benchmark._fitting_step  # pylint: disable=protected-access
  need = {b: memory.memory_figures(fitting(s, config.benchmark, step_fn, abstract_state, b)[1])['total_in_bytes']
          for b in (16, 32)}
  assert need[16] < need[32]
  limit_memory(monkeypatch, (need[16] + need[32]) // 2)  # 32 rows do not fit, 16 do.
  results = benchmark.run(config)
  out = capsys.readouterr().out
  assert 'benchmark: batch_size 32 does not fit in memory; benchmarking batch_size 16, which needs' in out
  assert results['batch_size'] == 16 == json.loads(out.strip().splitlines()[-1])['batch_size']


@pytest.mark.integration
def test_benchmark_stops_naming_the_fields_when_no_batch_fits(monkeypatch):
  limit_memory(monkeypatch, 1024)
  with pytest.raises(memory.DoesNotFitError, match=r'The benchmark train step at batch \[8, 8 \+ 8\] needs .* '
                                                   r'available \(test limit\), even at the smallest batch.*'
                                                   r'benchmark\.source_length and benchmark\.target_length'):
    benchmark.run(_tiny_benchmark_config(8))  # One row per data shard already.


@pytest.mark.integration
def test_train_step_check_names_the_batch_fields(monkeypatch):
  config = smoke.get_config()
  s = experiment.compute_setup(config)
  limit_memory(monkeypatch, 1024)
  with pytest.raises(memory.DoesNotFitError, match=r'The train step at its largest batch \[8, 32\] needs .*'
                                                   r'Lower data\.tokens_per_batch, data\.max_length'):
    memory.check_train_step(s, step_lib.jit_train_step(s, s.state_sharding(), 0.1), config.data,
                            [memory.largest_batch_shape(config.data, s.rows_multiple)])


@pytest.mark.integration
def test_train_step_check_takes_the_longest_of_the_shapes_training_feeds(monkeypatch):
  # A packed run feeds one shape; the check compiles that one (which training then reuses), not the config's
  # longest bucket.
  config = smoke.get_config()
  s = experiment.compute_setup(config)
  limit_memory(monkeypatch, 1024)
  with pytest.raises(memory.DoesNotFitError, match=r'The train step at its largest batch \[16, 24\] needs'):
    memory.check_train_step(s, step_lib.jit_train_step(s, s.state_sharding(), 0.1), config.data,
                            [(32, 8), (16, 24), (24, 16)])
