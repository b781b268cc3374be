"""Tests for transformer_jax.storage.checkpoints and evaluation.selection: round trips, resharding, damage, averaging,
fingerprints."""
import logging
import os
import pathlib
import re
import time

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import ml_collections
import numpy as np
import pytest

from transformer_jax.evaluation import selection
from transformer_jax.storage import checkpoints
from transformer_jax.storage import fingerprint

DATA_STATE = {'epoch': 3, 'position': 120}


def make_mesh(num_devices):
  return Mesh(np.array(jax.devices()[:num_devices]).reshape(num_devices), ('data',))


def spec_for(shape):
  """[16, 8] arrays are split over 'data' on axis 0; everything else is replicated."""
  return P('data') if len(shape) == 2 else P()


def make_state(mesh, seed=0):
  """A training-state-like pytree: float32 and bf16 params, an int leaf, moments, step, key data."""
  rng = np.random.default_rng(seed)
  state = {
      'params': {
          'w': rng.standard_normal((16, 8), dtype=np.float32),
          'b': rng.standard_normal((8,), dtype=np.float32).astype(jnp.bfloat16),
          'count': np.int32(seed + 1),
      },
      'opt_state': {'mu': rng.standard_normal((16, 8), dtype=np.float32)},
      'step': np.int32(100 + seed),
      'key': np.array([seed, 42], np.uint32),
  }
  return jax.tree.map(
      lambda x: jax.device_put(x, NamedSharding(mesh, spec_for(np.shape(x)))), state)


def abstract(tree, mesh):
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                     sharding=NamedSharding(mesh, spec_for(x.shape))), tree)


def assert_trees_equal(actual, expected):
  """Same structure, dtypes, and values bit for bit."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    assert a.dtype == e.dtype
    np.testing.assert_array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(e).view(np.uint8))


def assert_shardings(tree, abstract_tree):
  for a, e in zip(jax.tree.leaves(tree), jax.tree.leaves(abstract_tree)):
    assert a.sharding == e.sharding


def save_steps(workdir, states_by_step, **kwargs):
  with checkpoints.CheckpointManager(workdir, **kwargs) as manager:
    for step, state in states_by_step.items():
      assert manager.save(step, state, {**DATA_STATE, 'position': step})
    manager.wait_until_finished()


def test_round_trip_after_async_save_and_deleted_source(tmp_path):
  mesh = make_mesh(8)
  state = make_state(mesh)
  expected = jax.tree.map(np.asarray, state)
  manager = checkpoints.CheckpointManager(tmp_path, max_to_keep=3)
  assert manager.latest_step() is None
  data_state = dict(DATA_STATE)
  assert manager.save(10, state, data_state)
  # The training loop donates the state right after save; the copy to host must already be done.
  jax.tree.map(lambda x: x.delete(), state)
  data_state['position'] = -1  # save copied it.
  manager.wait_until_finished()
  assert manager.latest_step() == 10
  assert manager.all_steps() == [10]

  target = abstract(expected, mesh)
  restored, restored_data_state = manager.restore(10, target)
  assert_trees_equal(restored, expected)
  assert_shardings(restored, target)
  assert restored_data_state == DATA_STATE
  manager.close()


def test_max_to_keep_and_save_interval(tmp_path):
  state = make_state(make_mesh(8))
  with checkpoints.CheckpointManager(tmp_path, max_to_keep=2, save_interval_steps=2) as manager:
    assert not manager.save(1, state, DATA_STATE)  # Not a multiple of 2, even as the first.
    for step in (2, 4, 6):
      assert manager.save(step, state, DATA_STATE)
      assert not manager.save(step + 1, state, DATA_STATE)
    assert manager.save(7, state, DATA_STATE, force=True)
    assert not manager.save(7, state, DATA_STATE, force=True)  # Never overwritten.
    manager.wait_until_finished()
    assert manager.all_steps() == [6, 7]
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['6', '7']


@pytest.mark.parametrize('num_devices', [4, 1])
def test_saved_on_8_devices_restores_on_fewer(tmp_path, num_devices):
  state = make_state(make_mesh(8))
  assert state['params']['w'].sharding.shard_shape((16, 8)) == (2, 8)
  save_steps(tmp_path, {5: state})
  target = abstract(state, make_mesh(num_devices))
  manager = checkpoints.CheckpointManager(tmp_path)
  restored, data_state = manager.restore(5, target)
  assert_trees_equal(restored, state)
  assert_shardings(restored, target)
  assert restored['params']['w'].sharding.shard_shape((16, 8)) == (16 // num_devices, 8)
  assert data_state == {**DATA_STATE, 'position': 5}
  manager.close()


def test_restore_requires_shardings(tmp_path):
  state = make_state(make_mesh(8))
  save_steps(tmp_path, {1: state})
  no_shardings = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  with checkpoints.CheckpointManager(tmp_path) as manager:
    with pytest.raises(ValueError, match=r"\['params'\]\['w'\].*no sharding"):
      manager.restore(1, no_shardings)
    with pytest.raises(ValueError, match='No checkpoint for step 2'):
      manager.restore(2, abstract(state, make_mesh(1)))


def _truncate(path):
  path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def _truncate_array_data(step_dir):
  """Truncates the data files of the merged OCDBT database (per-process copies are not read)."""
  files = [p for p in (step_dir / 'state' / 'd').iterdir() if p.is_file()]
  assert files
  for path in files:
    _truncate(path)


@pytest.mark.parametrize('damage', [
    _truncate_array_data,
    lambda step_dir: (step_dir / 'state' / 'manifest.ocdbt').unlink(),
    lambda step_dir: _truncate(step_dir / 'state' / '_METADATA'),
    lambda step_dir: (step_dir / 'data_state' / 'metadata').unlink(),
], ids=['truncated_array_data', 'deleted_manifest', 'truncated_tree_metadata',
        'deleted_data_state'])
# When a restore fails, tensorstore callbacks can reach orbax's already-closed asyncio loop.
@pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')
def test_damaged_newest_checkpoint_falls_back_to_previous(tmp_path, caplog, damage):
  mesh = make_mesh(8)
  states = {1: make_state(mesh, seed=1), 2: make_state(mesh, seed=2)}
  save_steps(tmp_path, states)
  damage(tmp_path / 'checkpoints' / '2')

  with checkpoints.CheckpointManager(tmp_path) as manager:
    assert manager.latest_step() == 2
    with caplog.at_level(logging.WARNING):
      restored = manager.restore_latest(abstract(states[1], mesh))
  assert restored.step == 1
  assert_trees_equal(restored.state, states[1])
  assert restored.data_state == {**DATA_STATE, 'position': 1}
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert any('step 2' in w and 'unusable' in w for w in warnings), warnings


def test_restore_latest_without_checkpoints_returns_none(tmp_path):
  mesh = make_mesh(8)
  with checkpoints.CheckpointManager(tmp_path) as manager:
    assert manager.restore_latest(abstract(make_state(mesh), mesh)) is None


def test_restore_latest_raises_when_every_checkpoint_fails(tmp_path):
  mesh = make_mesh(8)
  state = make_state(mesh)
  save_steps(tmp_path, {1: state})
  wrong = abstract({'params': state['params']}, mesh)  # A state structure the run never saved.
  with checkpoints.CheckpointManager(tmp_path) as manager:
    with pytest.raises(ValueError, match='could be restored'):
      manager.restore_latest(wrong)


def test_average_of_identical_checkpoints_is_bitwise_identity(tmp_path):
  mesh = make_mesh(8)
  state = make_state(mesh)
  state['params']['w'] = state['params']['w'].at[0, 0].set(-0.0)
  save_steps(tmp_path, {1: state, 2: state, 3: state, 4: state, 5: state})
  target = abstract(state['params'], make_mesh(4))
  with checkpoints.CheckpointManager(tmp_path) as manager:
    averaged = selection.average_checkpoints(manager, manager.all_steps(), target)
  assert_trees_equal(averaged, state['params'])
  assert_shardings(averaged, target)


def test_average_of_two_checkpoints_is_their_mean(tmp_path):
  mesh = make_mesh(8)
  old, new = make_state(mesh, seed=1), make_state(mesh, seed=2)
  save_steps(tmp_path, {1: old, 2: new})
  target = abstract(new['params'], mesh)
  with checkpoints.CheckpointManager(tmp_path) as manager:
    averaged = selection.average_checkpoints(manager, [2, 1], target)
    whole = selection.average_checkpoints(manager, [1, 2], abstract(new, mesh), subtree=None)

  def mean(a, b):
    return (np.asarray(a, np.float32) + np.asarray(b, np.float32)) / 2

  # m + (x - m) / 2 and (m + x) / 2 differ by rounding: up to an ulp of the inputs (~1e-7).
  np.testing.assert_allclose(averaged['w'], mean(old['params']['w'], new['params']['w']),
                             rtol=1e-6, atol=1e-6)
  assert averaged['b'].dtype == jnp.bfloat16
  np.testing.assert_array_equal(
      np.asarray(averaged['b'], np.float32),
      mean(old['params']['b'], new['params']['b']).astype(jnp.bfloat16).astype(np.float32))
  assert averaged['count'].dtype == jnp.int32 and int(averaged['count']) == 3  # Newest, not 2.5.
  assert_shardings(averaged, target)

  np.testing.assert_allclose(whole['opt_state']['mu'],
                             mean(old['opt_state']['mu'], new['opt_state']['mu']),
                             rtol=1e-6, atol=1e-6)
  assert int(whole['step']) == 102
  np.testing.assert_array_equal(whole['key'], new['key'])


def test_average_rejects_bad_steps(tmp_path):
  mesh = make_mesh(8)
  state = make_state(mesh)
  save_steps(tmp_path, {1: state})
  target = abstract(state['params'], mesh)
  with checkpoints.CheckpointManager(tmp_path) as manager:
    for steps, message in [([], 'at least one'), ([1, 1], 'repeated'), ([1, 9], r'\[9\]')]:
      with pytest.raises(ValueError, match=message):
        selection.average_checkpoints(manager, steps, target)
    with pytest.raises(ValueError, match=r"no leaves \[\"\['paramz'\]\['b'\]"):
      selection.average_checkpoints(manager, [1], target, subtree='paramz')


def _snapshot(directory: pathlib.Path):
  return sorted((str(p.relative_to(directory)), p.stat().st_size, p.stat().st_mtime_ns)
                for p in directory.rglob('*'))


def test_incompatible_fingerprint_raises_and_leaves_workdir_untouched(tmp_path):
  fingerprint = {'model': {'d_model': 512, 'num_layers': 6}, 'vocab_size': 64}
  save_steps(tmp_path, {1: make_state(make_mesh(8))}, fingerprint=fingerprint)
  before = _snapshot(tmp_path)

  changed = {'model': {'d_model': 256, 'num_layers': 6}, 'vocab_size': 32}
  with pytest.raises(ValueError) as error:
    checkpoints.CheckpointManager(tmp_path, fingerprint=changed)
  message = str(error.value)
  assert f'workdir {tmp_path} holds a run with model.d_model=512; ' \
         'this config has model.d_model=256' in message
  assert 'vocab_size=64' in message and 'vocab_size=32' in message
  assert 'num_layers' not in message
  assert _snapshot(tmp_path) == before

  with checkpoints.CheckpointManager(tmp_path, fingerprint=fingerprint) as manager:
    manager.check_compatible({'vocab_size': 64, 'model': {'num_layers': 6, 'd_model': 512}})
    with pytest.raises(ValueError, match=r"model.dropout_rate=\(absent\); "
                                         r"this config has model.dropout_rate=0.1"):
      manager.check_compatible({**fingerprint, 'model': {**fingerprint['model'],
                                                         'dropout_rate': 0.1}})


def _fail_data_state_write(monkeypatch):
  """The data_state JSON write, which orbax runs in its background thread, fails: disk full."""
  from orbax.checkpoint._src.handlers import json_checkpoint_handler  # pylint: disable=g-import-not-at-top

  async def disk_full(*args, **kwargs):
    del args, kwargs
    raise OSError(28, 'No space left on device')
  monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, '_save_fn', disk_full)


def _fail_commit(monkeypatch):
  """The rename of the finished temporary directory, in the background thread, fails: permission changed."""
  from orbax.checkpoint._src.path import atomicity  # pylint: disable=g-import-not-at-top

  async def denied(*args, **kwargs):
    del args, kwargs
    raise PermissionError(13, 'Permission denied')
  monkeypatch.setattr(atomicity, 'on_commit_callback', denied)


@pytest.mark.parametrize('inject', [_fail_data_state_write, _fail_commit])
@pytest.mark.parametrize('max_to_keep', [1, 2])
@pytest.mark.parametrize('surfaced_by', ['due_save', 'wait', 'next_call'])
def test_background_save_failure_stops_naming_the_step_and_keeps_good_checkpoints(
    monkeypatch, tmp_path, inject, max_to_keep, surfaced_by):
  mesh = make_mesh(2)
  manager = checkpoints.CheckpointManager(tmp_path, max_to_keep=max_to_keep, save_interval_steps=2)
  for step in (2, 4):
    assert manager.save(step, make_state(mesh, seed=step), {'position': step})
  manager.wait_until_finished()
  kept = [2, 4][-max_to_keep:]
  inject(monkeypatch)
  assert manager.save(6, make_state(mesh, seed=6), {'position': 6})  # Starts; fails in the background.
  match = rf'Saving checkpoint step 6 in {tmp_path}/checkpoints failed \((OSError|PermissionError): .*\)\..*' \
          rf'Steps on disk: {re.escape(str(kept))} \(the newest, step 4,'
  with pytest.raises(checkpoints.CheckpointSaveError, match=match):
    if surfaced_by == 'due_save':  # The next save that is due waits for step 6 and reports it, not step 8.
      manager.save(8, make_state(mesh, seed=8), {'position': 8})
    elif surfaced_by == 'wait':
      manager.wait_until_finished()
    else:  # Between intervals, a call that does not block reports the failure once the thread has ended.
      deadline = time.monotonic() + 60
      while time.monotonic() < deadline:
        assert not manager.save(7, make_state(mesh, seed=7), {'position': 7})
        time.sleep(0.01)
  monkeypatch.undo()
  manager.close()
  committed = sorted(int(p.name) for p in (tmp_path / 'checkpoints').iterdir() if p.name.isdigit())
  assert committed == kept  # No older good step deleted by the retention policy; no step 6 or 8.
  restored = checkpoints.CheckpointManager(tmp_path, max_to_keep=max_to_keep).restore_latest(
      abstract(make_state(mesh), mesh))
  assert restored.step == 4 and restored.data_state == {'position': 4}
  assert_trees_equal(restored.state, make_state(mesh, seed=4))


def test_checkpoints_of_older_code_still_open_with_todays_fingerprint(tmp_path):
  """A fingerprint written before ModelConfig gained attention_product_dtype (and the variant fields) must
  agree with today's for the same architecture: those fields change no parameter or are at their defaults."""
  from transformer_jax.run import config_checks  # pylint: disable=g-import-not-at-top  (imports TensorFlow)
  from transformer_jax.storage import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  config = workdir_lib.load_config(pathlib.Path(__file__).resolve().parents[1] / 'configs' / 'smoke.py')
  model_cfg = config_checks.validate_config(config)
  today = fingerprint._fingerprint(config, model_cfg)  # pylint: disable=protected-access
  old_fields = ('vocab_size', 'num_layers', 'd_model', 'd_ff', 'num_heads', 'd_k', 'd_v', 'dropout_rate',
                'attention_dropout_rate', 'position_embedding', 'layer_norm_position', 'scale_embeddings',
                'max_length', 'dtype', 'attention_impl', 'remat')  # ModelConfig's fields at 2026-11-30.
  older = {'model': {key: today['model'].get(key) for key in old_fields}, 'data': today['data']}
  older['model'].update(dtype=None, attention_impl=None, remat=None)
  assert today == older


def test_selecting_the_best_checkpoints_of_a_run_without_them_names_the_setting():
  eval_config = ml_collections.ConfigDict({'checkpoint_selection': 'best', 'average_last_n': 5, 'average_best_n': 5})
  with pytest.raises(ValueError, match=r"eval.checkpoint_selection='best' .*train.eval_bleu_every_steps > 0"):
    selection.select_params(eval_config, last=None, best=None, abstract_params={})
