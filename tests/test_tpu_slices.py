"""Tests for transformer_jax.tools.tpu_slices and aot's compile for a TPU slice (--config.compile.topology).

The compile tests need libtpu (the `tpu` extra) and skip without it; they compile with the real TPU compiler
on this CPU machine. Measured on a 2-vCPU AMD EPYC: the tiny model for v5e-4 compiles in ~10 s, the model too
large for a chip is refused by the compiler in ~4 s; base and big for v5e-8 take minutes (slow tests).
"""
import importlib.util
import pathlib
import resource
import sys

import pytest

from transformer_jax.tools import aot
from transformer_jax.tools import tpu_slices
from transformer_jax.training import memory

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
  sys.path.insert(0, str(REPO_ROOT))
from configs import smoke  # pylint: disable=g-import-not-at-top,wrong-import-position

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec('libtpu') is None,
                                  reason="libtpu is not installed (pip install -e '.[tpu]')")


@pytest.mark.parametrize('name,chips,topology,kind', [
    ('v4-8', 4, 'v4:2x2x1', 'TPU v4'),          # v4 names count TensorCores, two per chip.
    ('v4-128', 64, 'v4:4x4x4', 'TPU v4'),
    ('v5e-8', 8, 'v5e:2x4', 'TPU v5 lite'),     # v5e names count chips.
    ('v5litepod-8', 8, 'v5e:2x4', 'TPU v5 lite'),
    ('v5e-64', 64, 'v5e:8x8', 'TPU v5 lite'),
    ('v5p-8', 4, 'v5p:2x2x1', 'TPU v5'),
    ('v6e-8', 8, 'v6e:2x4', 'TPU v6 lite'),
])
def test_slice_names_map_to_chips_and_jax_topologies(name, chips, topology, kind):
  slice_ = tpu_slices.parse(name)
  assert (slice_.num_chips, slice_.topology, slice_.chip.device_kind) == (chips, topology, kind)


@pytest.mark.parametrize('name', ['v5e-7', 'v4-4', 'v4-9', 'tpu-8', 'v5e'])
def test_an_unknown_slice_is_an_error_listing_the_known_ones(name):
  with pytest.raises(ValueError, match=r"compile.topology='.*' is not a known TPU slice; known: v4-8, .*v5e-8"):
    tpu_slices.parse(name)


def test_chip_figures_are_the_published_ones():
  # Google's pages (tpu_slices.CHIPS cites each): HBM per chip, bf16 peak, HBM bandwidth.
  figures = {g: (c.hbm_bytes / 2**30, c.peak_flops / 1e12, c.hbm_bytes_per_second / 1e9)
             for g, c in tpu_slices.CHIPS.items()}
  assert figures == {'v4': (32, 275, 1200), 'v5e': (16, 197, 819), 'v5p': (95, 459, 2765), 'v6e': (32, 918, 1640)}


def test_without_libtpu_the_error_names_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, 'libtpu', None)  # `import libtpu` raises ImportError.
  with pytest.raises(tpu_slices.LibtpuMissingError, match=r"pip install -e '\.\[tpu\]'"):
    tpu_slices.devices(tpu_slices.parse('v5e-8'))


def test_find_fit_tries_grad_accum_then_fsdp_and_stops_at_the_first_fit(monkeypatch):
  config = smoke.get_config()  # Longest bucket 32: 8 rows, 2 per data shard on 4 chips.
  tried = []

  def fake_compile(candidate, slice_, devices):
    del slice_, devices
    tried.append((candidate.train.grad_accum_steps, candidate.mesh.data, candidate.mesh.fsdp))
    fits = candidate.mesh.fsdp == 4
    return {'fits': fits, 'memory_per_device': {'total_in_bytes': 5}, 'compile_seconds': 1.0}

  monkeypatch.setattr(aot, '_compile_on_slice', fake_compile)
  fit = aot.find_fit(config, tpu_slices.parse('v5e-4'), devices=[None] * 4)
  assert tried == [(2, -1, 1), (1, -1, 2), (1, -1, 4)]
  assert fit == {'overrides': {'mesh.fsdp': 4, 'mesh.data': -1}, 'total_in_bytes': 5, 'compile_seconds': 1.0}
  tried.clear()
  monkeypatch.setattr(aot, '_compile_on_slice', lambda *args: fake_compile(*args) | {'fits': False})
  assert aot.find_fit(config, tpu_slices.parse('v5e-4'), devices=[None] * 4) is None and len(tried) == 3


def test_find_fit_resolves_a_mesh_axis_of_minus_one():
  config = smoke.get_config()  # 8 rows at the longest bucket.
  config.mesh.update(data=2, fsdp=-1, tensor=1)  # fsdp=4: 8 shards of one row each, no room for micro-batches.
  assert aot._candidates(config, 8) == [{'mesh.fsdp': 8, 'mesh.data': -1}]
  config.mesh.update(data=-1, fsdp=1, tensor=2)  # 4 data shards: 2 rows each, fsdp up to 4.
  assert aot._candidates(config, 8) == [{'train.grad_accum_steps': 2}, {'mesh.fsdp': 2, 'mesh.data': -1},
                                        {'mesh.fsdp': 4, 'mesh.data': -1}]


def test_compile_mode_exits_through_does_not_fit_after_the_report(monkeypatch, capsys):
  config = smoke.get_config()
  config.compile.topology = 'v5e-4'
  figures = {'slice': 'v5e-4', 'hbm_bytes': 16 * 2**30, 'fits': False,
             'fit': {'overrides': {'mesh.fsdp': 2, 'mesh.data': -1}, 'total_in_bytes': 2**30, 'compile_seconds': 1.0}}
  monkeypatch.setattr(aot, 'compile_for_slice', lambda config: figures)
  monkeypatch.setattr(aot, 'format_report', lambda figures: 'REPORT')
  with pytest.raises(memory.DoesNotFitError, match=r'does not fit the chips of v5e-4 \(16 GiB of HBM each\): '
                                                   r'--config.mesh.fsdp=2 --config.mesh.data=-1 fits'):
    aot.compile_only(config, None)
  assert capsys.readouterr().out.startswith('REPORT')  # The report comes first.


def test_multi_host_slices_split_into_hosts_of_the_chips_host_bounds():
  assert tpu_slices.parse('v5e-8').chips_per_host == (2, 4, 1)     # One host holds v5e-8.
  assert tpu_slices.parse('v5e-64').chips_per_host == (2, 4, 1)    # Eight hosts of 8 chips.
  assert tpu_slices.parse('v4-8').chips_per_host == (2, 2, 1)      # One host of 4 chips.
  assert tpu_slices.parse('v4-128').chips_per_host == (2, 2, 1)    # Sixteen hosts of 4 chips.


def test_roofline_takes_the_slower_of_compute_and_hbm():
  chip = tpu_slices.CHIPS['v5e']
  figures = {'model_flops': 4 * 197e12 * 0.010, 'devices': 4, 'bytes_accessed_per_device': 819e9 * 0.002,
             'grad_accum_steps': 2}
  r = aot.roofline(figures, chip)  # 10 ms of compute per chip; 2 micro-batches x 2 ms of HBM traffic.
  assert r['compute_seconds'] == pytest.approx(0.010) and r['memory_seconds'] == pytest.approx(0.004)
  assert r['step_seconds'] == pytest.approx(0.010) and r['bound'] == 'compute' and r['mfu'] == pytest.approx(1.0)
  figures['bytes_accessed_per_device'] *= 10
  r = aot.roofline(figures, chip)
  assert r['bound'] == 'memory' and r['mfu'] == pytest.approx(0.25)
  r = aot.roofline(figures | {'bytes_accessed_per_device': float('nan')}, chip)  # No byte count from XLA.
  assert r['bound'] == 'compute' and r['step_seconds'] == pytest.approx(0.010)


@pytest.mark.integration
@needs_libtpu
def test_tiny_model_compiles_for_a_v5e_slice():
  config = smoke.get_config()
  config.compile.topology = 'v5e-4'
  figures = aot.compile_for_slice(config)
  assert figures['device_kind'] == 'TPU v5 lite' and figures['devices'] == 4
  assert figures['mesh'] == {'data': 4, 'fsdp': 1, 'tensor': 1} and figures['batch_shape'] == [8, 32]
  memory = figures['memory_per_device']
  assert 0 < memory['argument_size_in_bytes'] < memory['total_in_bytes'] < figures['hbm_bytes'] == 16 * 2**30
  assert figures['fits'] and 'fit' not in figures
  # The compiler's FLOPs (products and elementwise work, one device's quarter of the rows) near the model's.
  assert 1.0 < figures['flops_per_device'] / (figures['model_flops'] / 4) < 1.6
  assert figures['roofline']['step_seconds'] > 0 and 0 < figures['roofline']['mfu'] <= 1
  assert figures['collectives']['all-reduce'] >= 1  # Data parallelism: gradients all-reduced.
  report = aot.format_report(figures)
  assert 'v5e-4 (v5e:2x2, 4 x TPU v5 lite)' in report and 'fits in 16 GiB of HBM per chip' in report
  assert 'ESTIMATE (roofline' in report


@needs_libtpu
def test_a_model_too_large_for_the_chip_is_reported_with_the_fields_to_change():
  config = smoke.get_config()
  config.model.update(num_layers=1, d_model=8192)
  config.data.vocab_size = 131072  # 1.08e9 parameters: 12 GiB of float32 state with Adam's moments.
  config.compile.update(topology='v5e-4', find_fit=False)
  peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  figures = aot.compile_for_slice(config)
  # Built from shapes alone: the 12 GiB state never existed in this process.
  assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak_before < 2 * 2**30
  assert figures['num_params'] > 1e9 and not figures['fits']
  assert 'RESOURCE_EXHAUSTED' in figures['compiler_error'] and 'roofline' not in figures
  report = aot.format_report(figures)
  assert 'DOES NOT FIT in 16 GiB of HBM per chip' in report
  assert 'train.grad_accum_steps' in report and 'mesh.fsdp' in report


@needs_libtpu
@pytest.mark.slow
def test_find_fit_compiles_until_the_large_model_fits():
  config = smoke.get_config()
  config.model.update(num_layers=1, d_model=8192)
  config.data.vocab_size = 131072
  config.compile.topology = 'v5e-4'
  figures = aot.compile_for_slice(config)
  # Two micro-batches leave the state as large; sharding it over two chips (measured: 14.1 GiB) fits.
  assert figures['fit']['overrides'] == {'mesh.fsdp': 2, 'mesh.data': -1}
  assert figures['fit']['total_in_bytes'] < 16 * 2**30


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize('config_name', ['base', 'big'])
def test_paper_configs_fit_a_v5e_8_at_the_papers_batch(config_name):
  config = __import__(f'configs.{config_name}', fromlist=['get_config']).get_config()
  config.compile.topology = 'v5e-8'
  figures = aot.compile_for_slice(config)
  assert figures['fits'] and figures['mesh'] == {'data': 8, 'fsdp': 1, 'tensor': 1}
  assert figures['batch_shape'] == [104, 256]  # 25,000 tokens // 256 = 97 rows, padded to a multiple of 8.
