"""Tests for transformer_jax.model.sharding and aot: mesh and rule checks, parameter layouts under data, FSDP and tensor
parallelism, the sharded train step against one device, checkpoints across device counts, AOT compilation.

Runs on the 8 fake CPU devices of conftest.py. Every train step here is compiled once per mesh.
"""
import ast
import functools
import json
import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import ml_collections
import numpy as np
import pytest

from transformer_jax.decoding import translate
from transformer_jax.model import sharding
from transformer_jax.model import transformer as model_lib
from transformer_jax.storage import checkpoints
from transformer_jax.tools import aot
from transformer_jax.training import memory
from transformer_jax.training import optim
from transformer_jax.training import state as state_lib
from transformer_jax.training import step as step_lib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
  sys.path.insert(0, str(REPO_ROOT))  # Configs do `from configs import base`, as when run from the root.
from configs import base  # pylint: disable=g-import-not-at-top,wrong-import-position
from configs import smoke  # pylint: disable=g-import-not-at-top,wrong-import-position

VOCAB = 64
# One layer of configs/smoke.py: compile time, which dominates these tests on CPU, grows with the layer count.
MODEL = model_lib.Transformer(model_lib.ModelConfig(vocab_size=VOCAB, **(dict(smoke.get_config().model)
                                                                         | dict(num_layers=1))))
# Adam's first steps move every parameter by about +-lr whatever the gradient's size (m / sqrt(v) = sign(g)), so
# with the paper's eps=1e-9 an entry whose exact gradient is 0 (some key-projection directions: softmax ignores a
# shift of all scores) takes the sign of its float rounding noise and the layouts differ by 2 lr (1e-4 measured)
# although their gradients agree to 1e-8. eps=1e-4 leaves real gradients (>= 1e-3) normalised and noise damped.
TX = optim.make_optimizer(optim.rsqrt_schedule(32, warmup_steps=2), eps=1e-4)
LABEL_SMOOTHING = 0.1
# LLVM optimisation level 0 halves CPU compile time; the HLO, its sharding and its collectives are unchanged.
COMPILER_OPTIONS = {'xla_backend_optimization_level': 0}


def mesh_config(data=1, fsdp=1, tensor=1) -> ml_collections.ConfigDict:
  config = base.get_config().mesh
  config.update(data=data, fsdp=fsdp, tensor=tensor)
  return config


def make_batch(rows=16, length=8, seed=0) -> dict[str, np.ndarray]:
  """A fixed batch with padding at the ends of the rows (so masks and token counts matter)."""
  rng = np.random.default_rng(seed)
  source = rng.integers(3, VOCAB, (rows, length), dtype=np.int32)
  target = rng.integers(3, VOCAB, (rows, length), dtype=np.int32)
  source[::2, -3:] = 0
  target[1::2, -2:] = 0
  decoder_input = np.where(target != 0, np.concatenate([np.ones((rows, 1), np.int32), target[:, :-1]], 1), 0)
  return {'source_tokens': source, 'decoder_input_tokens': decoder_input.astype(np.int32), 'target_tokens': target}


def abstract_state(mesh, rules, model=MODEL):
  """(abstract TrainState with logical boxes, its NamedShardings), without compiling anything."""
  init_fn = functools.partial(state_lib.create_train_state, model=model, tx=TX, batch=make_batch(rows=2))
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    abstract = jax.eval_shape(init_fn, jax.random.key(0))
    return abstract, sharding.logical_to_sharding(abstract, mesh, rules)


@pytest.fixture(scope='module')
def initial_state() -> state_lib.TrainState:
  """A host (numpy) TrainState with random values in every parameter (no init compile needed)."""
  mesh = sharding.make_mesh(mesh_config(), jax.devices()[:1])
  abstract, _ = abstract_state(mesh, sharding.logical_axis_rules(mesh_config()))
  rng = np.random.default_rng(1)
  params = jax.tree.map(lambda x: rng.normal(0.0, 0.2, x.shape).astype(np.float32), nn.unbox(abstract.params))
  return state_lib.TrainState(step=np.int32(0), params=params, opt_state=jax.device_get(TX.init(params)),
                              rng=np.array([0, 7], np.uint32))


def run_steps(state, mesh_cfg, devices=None, num_steps=2, rdrop_alpha=0.0):
  """Two jitted train steps on the fixed batch under the mesh; returns (host state, losses, compiled step)."""
  mesh, rules = sharding.make_mesh(mesh_cfg, devices), sharding.logical_axis_rules(mesh_cfg)
  _, state_sharding = abstract_state(mesh, rules)
  batch_sharding = sharding.batch_sharding(mesh)
  state = jax.device_put(state, state_sharding)
  batch = jax.device_put(make_batch(), batch_sharding)
  step_fn = jax.jit(functools.partial(step_lib.train_step, model=MODEL, tx=TX, label_smoothing=LABEL_SMOOTHING,
                                      rdrop_alpha=rdrop_alpha),
                    in_shardings=(state_sharding, batch_sharding), out_shardings=(state_sharding, None),
                    donate_argnums=0)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    compiled = step_fn.lower(state, batch).compile(COMPILER_OPTIONS)
    losses = []
    for _ in range(num_steps):
      state, metrics = compiled(state, batch)
      losses.append(float(metrics['loss_sum'] / metrics['token_count']))
  return state, losses, compiled


@pytest.fixture(scope='module')
def single_device_result(initial_state):
  state, losses, _ = run_steps(initial_state, mesh_config(), jax.devices()[:1])
  return jax.device_get(state), losses


def test_mesh_shape_fills_one_axis_and_names_bad_keys():
  assert sharding.mesh_shape(mesh_config(data=-1, fsdp=2), 8) == (4, 2, 1)
  assert sharding.mesh_shape(mesh_config(data=2, fsdp=2, tensor=2), 8) == (2, 2, 2)
  with pytest.raises(ValueError, match='mesh.fsdp must be a positive integer or -1, got 0'):
    sharding.mesh_shape(mesh_config(fsdp=0), 8)
  with pytest.raises(ValueError, match='at most one of'):
    sharding.mesh_shape(mesh_config(data=-1, fsdp=-1), 8)
  with pytest.raises(ValueError, match='needs 6 devices, 8 are available'):
    sharding.mesh_shape(mesh_config(data=3, tensor=2), 8)


def test_make_mesh_has_auto_axes_in_order():
  mesh = sharding.make_mesh(mesh_config(data=2, fsdp=2, tensor=2))
  assert mesh.axis_names == ('data', 'fsdp', 'tensor')
  assert dict(mesh.shape) == {'data': 2, 'fsdp': 2, 'tensor': 2}
  assert mesh.axis_types == (AxisType.Auto,) * 3
  # 'tensor' is the innermost axis: neighbouring device ids share a tensor group.
  assert [d.id for d in mesh.devices[0, 0]] == [0, 1]


def test_logical_axis_rules_are_checked():
  rules = sharding.logical_axis_rules(mesh_config())
  assert dict(rules)['batch'] == ('data', 'fsdp') and dict(rules)['embed'] == 'fsdp'
  bad = mesh_config()
  bad.logical_axis_rules = (('batch', ('data', 'fsdp')), ('embd', 'fsdp'))
  with pytest.raises(ValueError, match="unknown logical axis 'embd'"):
    sharding.logical_axis_rules(bad)
  bad.logical_axis_rules = (('batch', ('data', 'fsdp')), ('mlp', 'model'))
  with pytest.raises(ValueError, match="'mlp' maps to unknown mesh axis 'model'"):
    sharding.logical_axis_rules(bad)
  bad.logical_axis_rules = (('batch', 'data'),)
  with pytest.raises(ValueError, match="'batch' must map to \\('data', 'fsdp'\\)"):
    sharding.logical_axis_rules(bad)


def per_device_shapes(mesh_cfg) -> dict[str, tuple[int, ...]]:
  mesh, rules = sharding.make_mesh(mesh_cfg), sharding.logical_axis_rules(mesh_cfg)
  abstract, shardings = abstract_state(mesh, rules)
  leaves = jax.tree_util.tree_leaves_with_path(nn.unbox(abstract.params))
  return {jax.tree_util.keystr(path): s.shard_shape(x.shape)
          for (path, x), s in zip(leaves, jax.tree.leaves(shardings.params))}


def test_parameter_layouts_follow_the_mesh():
  query = "['encoder']['layer_0']['self_attention']['query']"   # [d_model=32, heads=4, d_k=8]
  output = "['decoder']['layer_0']['self_attention']['output']"  # [heads, d_v, d_model]
  w1, w2 = "['encoder']['layer_0']['feed_forward']['w1']", "['encoder']['layer_0']['feed_forward']['w2']"
  b1 = "['encoder']['layer_0']['feed_forward']['b1']"
  norm = "['encoder']['layer_0']['feed_forward_residual']['layer_norm']['scale']"
  embedding = "['shared_embedding']['embedding']"                # [vocab=64, d_model=32]
  data = per_device_shapes(mesh_config(data=8))
  assert data[query] == (32, 4, 8) and data[embedding] == (64, 32)  # Replicated.
  fsdp = per_device_shapes(mesh_config(fsdp=8))  # d_model split 8 ways, nothing else.
  assert (fsdp[query], fsdp[output], fsdp[w1], fsdp[w2]) == ((4, 4, 8), (4, 8, 4), (4, 64), (64, 4))
  assert (fsdp[b1], fsdp[norm], fsdp[embedding]) == ((64,), (4,), (64, 4))
  tensor = per_device_shapes(mesh_config(data=4, tensor=2))  # Heads, d_ff and vocabulary split 2 ways.
  assert (tensor[query], tensor[output], tensor[w1], tensor[w2]) == ((32, 2, 8), (2, 8, 32), (32, 32), (32, 32))
  assert (tensor[b1], tensor[norm], tensor[embedding]) == ((32,), (32,), (32, 32))


def test_adam_moments_are_sharded_like_the_parameters():
  mesh_cfg = mesh_config(data=2, fsdp=2, tensor=2)
  _, shardings = abstract_state(sharding.make_mesh(mesh_cfg), sharding.logical_axis_rules(mesh_cfg))
  adam = shardings.opt_state[0]
  assert jax.tree.map(lambda s: s.spec, adam.mu) == jax.tree.map(lambda s: s.spec, shardings.params)
  assert adam.mu['shared_embedding']['embedding'].spec == P('tensor', 'fsdp')
  assert shardings.step.spec == P()


def test_indivisible_dimension_names_the_parameter():
  mesh_cfg = mesh_config(data=2, tensor=4)
  model = model_lib.Transformer(model_lib.ModelConfig(vocab_size=VOCAB, num_layers=1, d_model=32, d_ff=64,
                                                      num_heads=2, d_k=8, d_v=8))
  with pytest.raises(ValueError, match=r"\['key'\] has shape \(32, 2, 8\).*dimension 2 does not divide by 4 shards"):
    abstract_state(sharding.make_mesh(mesh_cfg), sharding.logical_axis_rules(mesh_cfg), model)


def test_describe_lists_every_parameter_with_its_spec():
  mesh_cfg = mesh_config(fsdp=8)
  abstract, shardings = abstract_state(sharding.make_mesh(mesh_cfg), sharding.logical_axis_rules(mesh_cfg))
  lines = sharding.describe(abstract.params, shardings.params).splitlines()
  assert len(lines) == len(jax.tree.leaves(nn.unbox(abstract.params)))
  assert "['shared_embedding']['embedding']  (64, 32)  P('tensor', 'fsdp')  per device (64, 4)" in lines


@pytest.mark.integration
@pytest.mark.parametrize('layout', [dict(data=4, tensor=2), dict(fsdp=8)], ids=['data4_tensor2', 'fsdp8'])
def test_sharded_train_steps_match_one_device(layout, initial_state, single_device_result):
  expected_state, expected_losses = single_device_result
  state, losses, compiled = run_steps(initial_state, mesh_config(**layout))
  np.testing.assert_allclose(losses, expected_losses, rtol=0, atol=1e-5)
  assert losses[1] < losses[0]  # The steps really train.
  assert int(state.step) == 2
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=0, atol=1e-5),
               jax.device_get(state.params), expected_state.params)
  moved = jax.tree.map(lambda new, old: np.max(np.abs(new - old)), expected_state.params, initial_state.params)
  assert min(jax.tree.leaves(moved)) > 1e-2  # Every parameter changed by far more than the tolerance.
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=0, atol=1e-5),
               jax.device_get(state.opt_state), expected_state.opt_state)
  # The new state comes out in the layout it went in, and the step communicates as the layout implies.
  out_query = compiled.output_shardings[0].params['encoder']['layer_0']['self_attention']['query']
  counts = aot.collective_counts(compiled.as_text())
  if 'fsdp' in layout:
    assert out_query.shard_shape((32, 4, 8)) == (4, 4, 8)
    assert counts['all-gather'] > 0  # Weights gathered before use.
  else:
    assert out_query.shard_shape((32, 4, 8)) == (32, 2, 8)
    assert counts['all-reduce'] > 0  # Gradients over 'data', partial activations over 'tensor'.


@pytest.mark.integration
def test_sharded_r_drop_steps_match_one_device(initial_state):
  """R-Drop (rdrop_alpha > 0) runs each row beside its copy under dropout (configs/smoke.py's 0.1): on data=4 x
  tensor=2 its losses and parameters are one device's, so the copies draw the same masks in both layouts."""
  assert MODEL.cfg.dropout_rate > 0
  expected_state, expected_losses, _ = run_steps(initial_state, mesh_config(), jax.devices()[:1], rdrop_alpha=5.0)
  state, losses, _ = run_steps(initial_state, mesh_config(data=4, tensor=2), rdrop_alpha=5.0)
  np.testing.assert_allclose(losses, expected_losses, rtol=0, atol=1e-5)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=0, atol=1e-5),
               jax.device_get(state.params), jax.device_get(expected_state.params))


@pytest.mark.integration
@pytest.mark.parametrize('layout', [dict(data=4, tensor=2), dict(fsdp=8)], ids=['data4_tensor2', 'fsdp8'])
def test_sharded_beam_search_matches_one_device(layout, initial_state):
  source = make_batch()['source_tokens'][:8]  # Even rows end in padding.
  batches = [{'source_tokens': source, 'example_index': np.arange(8, dtype=np.int32)}]

  def decode(mesh_cfg, devices=None):
    mesh, rules = sharding.make_mesh(mesh_cfg, devices), sharding.logical_axis_rules(mesh_cfg)
    _, state_sharding = abstract_state(mesh, rules)
    params = jax.device_put(initial_state.params, state_sharding.params)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      return translate.decode_all(params, batches, 8, model=MODEL, beam_size=2, alpha=0.6, extra_length=3,
                                  batch_sharding=sharding.batch_sharding(mesh))

  expected = decode(mesh_config(), jax.devices()[:1])
  assert len({tuple(row) for row in expected}) > 1
  for got, want in zip(decode(mesh_config(**layout)), expected):
    np.testing.assert_array_equal(got, want)


@pytest.mark.integration
def test_checkpoint_saved_on_8_devices_restores_on_4_and_1(tmp_path, initial_state):
  save_cfg = mesh_config(data=2, fsdp=2, tensor=2)
  mesh8 = sharding.make_mesh(save_cfg)
  _, shardings8 = abstract_state(mesh8, sharding.logical_axis_rules(save_cfg))
  initial_state = initial_state.replace(step=np.int32(5))  # A restore checks the state's step against the folder's.
  state8 = jax.device_put(initial_state, shardings8)
  with checkpoints.CheckpointManager(tmp_path, max_to_keep=2) as manager:
    assert manager.save(5, state8, {'epoch': 0, 'position': 5}, force=True)
    manager.wait_until_finished()
  assert len(state8.params['shared_embedding']['embedding'].addressable_shards) == 8
  for restore_cfg, devices in ((mesh_config(fsdp=4), jax.devices()[:4]), (mesh_config(), jax.devices()[:1])):
    mesh = sharding.make_mesh(restore_cfg, devices)
    _, shardings = abstract_state(mesh, sharding.logical_axis_rules(restore_cfg))
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=s),
                          initial_state, shardings)
    with checkpoints.CheckpointManager(tmp_path) as manager:
      restored = manager.restore_latest(target)
    assert restored.step == 5 and restored.data_state == {'epoch': 0, 'position': 5}
    for got, want, s in zip(jax.tree.leaves(restored.state), jax.tree.leaves(initial_state),
                            jax.tree.leaves(shardings)):
      assert got.sharding == s and len(got.sharding.device_set) == len(devices)
      np.testing.assert_array_equal(np.asarray(got), want)


def test_largest_batch_shape_is_the_longest_bucket_at_tokens_per_batch():
  assert memory.largest_batch_shape(smoke.get_config().data, num_shards=8) == (8, 32)
  # 25000 // 256 = 97 rows, padded with empty rows to a multiple of the 8 shards (the pipeline's global batch).
  assert memory.largest_batch_shape(base.get_config().data, num_shards=8) == (104, 256)


def test_collective_counts_reads_sync_and_async_ops():
  hlo = ('  %ar = f32[4] all-reduce(f32[4] %x), replica_groups={}\n'
         '  %ags = (f32[2], f32[8]) all-gather-start(f32[2] %y)\n  %agd = f32[8] all-gather-done(%ags)\n')
  assert aot.collective_counts(hlo) == {'all-reduce': 1, 'all-gather': 1, 'reduce-scatter': 0, 'all-to-all': 0,
                                        'collective-permute': 0}


@pytest.mark.integration
def test_compile_only_reports_per_device_memory_flops_and_collectives(tmp_path, capsys):
  config = smoke.get_config()
  config.model.num_layers = 1
  config.mesh.update(data=8, fsdp=1, tensor=1)
  figures = aot.compile_only(config, str(tmp_path / 'aot'))
  assert figures['batch_shape'] == [8, 32] and figures['mesh'] == {'data': 8, 'fsdp': 1, 'tensor': 1}
  # Arguments are the replicated state plus this device's rows of the three int32 batch arrays.
  mesh = sharding.make_mesh(config.mesh)
  abstract, _ = abstract_state(mesh, sharding.logical_axis_rules(config.mesh))
  state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nn.unbox(abstract)))
  memory = figures['memory_per_device']
  assert memory['argument_size_in_bytes'] == state_bytes + 3 * (8 // 8) * 32 * 4
  assert memory['alias_size_in_bytes'] == state_bytes  # The donated state's buffers hold the new state.
  assert memory['temp_size_in_bytes'] > 0 and memory['total_in_bytes'] > memory['argument_size_in_bytes']
  assert figures['num_params'] == sum(x.size for x in jax.tree.leaves(nn.unbox(abstract.params)))
  # Data parallelism: gradients all-reduced, no weight gathers. FLOPs are per device: one row of eight.
  assert figures['collectives']['all-reduce'] >= 1 and figures['collectives']['all-gather'] == 0
  assert 0 < figures['flops_per_device'] and figures['flops_total'] == 8 * figures['flops_per_device']
  assert json.loads((tmp_path / 'aot' / 'compile.json').read_text()) == figures
  out = capsys.readouterr().out
  assert 'memory per device:' in out and json.loads(out.splitlines()[-1]) == figures


def test_batch_sharding_splits_rows_over_data_and_fsdp():
  mesh = sharding.make_mesh(mesh_config(data=2, fsdp=2, tensor=2))
  batch = jax.device_put(np.arange(16 * 3).reshape(16, 3), sharding.batch_sharding(mesh))
  assert batch.sharding == NamedSharding(mesh, P(('data', 'fsdp')))
  assert {s.data.shape for s in batch.addressable_shards} == {(4, 3)}
  assert np.asarray(batch).sum() == np.arange(48).sum()
  with jax.set_mesh(mesh):
    total = jax.jit(lambda x: jnp.sum(x * 2))(batch)
  assert int(total) == 2 * np.arange(48).sum()


def test_process_layout_needs_its_own_batch_shards_per_process():
  one_process = np.zeros((2, 2, 2), np.int64)
  sharding.check_process_layout(one_process)
  # 2 hosts x 4 devices, data=2 across hosts: each host holds one batch shard.
  sharding.check_process_layout(np.array([0, 0, 0, 0, 1, 1, 1, 1]).reshape(2, 1, 4))
  # data=2 x fsdp=2 x tensor=2 over 4 hosts of 2 devices: one shard per host.
  sharding.check_process_layout(np.repeat(np.arange(4), 2).reshape(2, 2, 2))
  with pytest.raises(ValueError, match='1 batch shards do not divide among 2 processes'):
    sharding.check_process_layout(np.array([0, 0, 0, 0, 1, 1, 1, 1]).reshape(1, 1, 8))  # tensor=8 over 2 hosts.
  with pytest.raises(ValueError, match=r'process 0 holds batch shards \[0, 1, 2\] of 4'):
    sharding.check_process_layout(np.array([0, 0, 0, 1, 0, 1, 1, 1]).reshape(2, 2, 2))  # Shard 1 on both hosts.
  # Non-adjacent shards are fine: make_array_from_process_local_data places the host's rows in order.
  sharding.check_process_layout(np.array([0, 0, 1, 1, 0, 0, 1, 1]).reshape(2, 2, 2))


def test_sharding_imports_neither_absl_nor_process_start_up():
  """Model code imports model/sharding.py: it names logical axes and meshes only (#13); start-up is distributed.py's."""
  tree = ast.parse((pathlib.Path(sharding.__file__)).read_text())
  imported = {alias.name.split('.')[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
              for alias in node.names}
  imported |= {node.module.split('.')[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
  assert imported == {'typing', 'flax', 'jax', 'numpy'}
  assert not hasattr(sharding, 'initialize_distributed') and not hasattr(sharding, 'distributed_environment')
