"""The paper's batch on any hardware: gradient accumulation equals the whole batch, the batches are a function of
the config (not of the mesh or the process count), and a data position resumes on another topology.

Small synthetic corpora made here: the real corpus is not the point. Runs on the 8 fake CPU devices of conftest.py.
"""
import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer_jax.data import train_iterator
from transformer_jax.model import sharding
from transformer_jax.model import transformer as model_lib
from transformer_jax.training import state as state_lib
from transformer_jax.run import train
from transformer_jax.training import step as step_lib

VOCAB = 40
MODEL = model_lib.Transformer(model_lib.ModelConfig(
    vocab_size=VOCAB, num_layers=1, d_model=16, d_ff=32, num_heads=2, d_k=8, d_v=8, dropout_rate=0.0))
BUCKETS = (8, 16)


def corpus(num_pairs=120, seed=0):
  """Distinct random sentences (each pair's source starts with its index, base VOCAB - 4), 2-14 ids."""
  rng = np.random.default_rng(seed)
  source, target = [], []
  for i in range(num_pairs):
    prefix = [4 + i // (VOCAB - 4), 4 + i % (VOCAB - 4)]
    source.append(prefix + rng.integers(4, VOCAB, rng.integers(0, 12)).tolist())
    target.append(rng.integers(4, VOCAB, rng.integers(1, 14)).tolist())
  return source, target


def iterator(pad_rows_to=1, process_index=0, process_count=1, tokens_per_batch=96):
  return train_iterator.TrainIterator(*corpus(), tokens_per_batch=tokens_per_batch, max_length=16,
                                      bucket_lengths=BUCKETS, pad_rows_to=pad_rows_to, process_index=process_index,
                                      process_count=process_count)


def sentences(batch) -> list[tuple[int, ...]]:
  """The non-empty source rows of a batch, as tuples."""
  return [tuple(row[row != 0]) for row in batch['source_tokens'] if row.any()]


def init_state(tx, batch):
  abstract = jax.eval_shape(functools.partial(state_lib.create_train_state, model=MODEL, tx=tx, batch=batch),
                            jax.random.key(0))
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda x: rng.normal(0.0, 0.3, x.shape).astype(np.float32), nn.unbox(abstract.params))
  return state_lib.TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params), rng=jnp.array([0, 1],
                                                                                                         jnp.uint32))


def step_fn(tx, grad_accum_steps):
  return jax.jit(functools.partial(step_lib.train_step, model=MODEL, tx=tx, label_smoothing=0.1,
                                   grad_accum_steps=grad_accum_steps))


@pytest.mark.integration
def test_uneven_micro_batches_give_the_merged_batch_gradient():
  """Micro-batches of 3 and 13 real target tokens: the summed gradient is the whole batch's, (x1+x2)/(n1+n2)."""
  batch = {'source_tokens': np.array([[5, 6, 2] + [0] * 13, [7, 8, 9, 2] + [0] * 12], np.int32),
           'target_tokens': np.zeros((2, 16), np.int32)}
  batch['target_tokens'][0, :3] = [10, 11, 2]
  batch['target_tokens'][1, :13] = list(range(12, 24)) + [2]
  batch['decoder_input_tokens'] = np.where(batch['target_tokens'] != 0, np.roll(batch['target_tokens'], 1, 1), 0)
  batch['decoder_input_tokens'][:, 0] = 1
  tx = optax.sgd(1.0)  # params_after = params - gradient.
  state = init_state(tx, batch)
  whole, whole_metrics = step_fn(tx, 1)(state, batch)
  micro, micro_metrics = step_fn(tx, 2)(state, batch)
  assert float(whole_metrics['token_count']) == float(micro_metrics['token_count']) == 16.0
  assert float(micro_metrics['loss_sum']) == pytest.approx(float(whole_metrics['loss_sum']), rel=1e-6)
  gradient = lambda new: jax.tree.map(lambda p, q: np.asarray(p) - np.asarray(q), state.params, new.params)
  for a, b in zip(jax.tree.leaves(gradient(micro)), jax.tree.leaves(gradient(whole))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # float32 sums in another order: ~1e-7 apart.
  # A mean of the two micro-batches' means (3 and 13 tokens) is another gradient: the test tells them apart.
  halves = [jax.tree.map(lambda x, i=i: x[i:i + 1], batch) for i in range(2)]
  means = [gradient(step_fn(tx, 1)(state, half)[0]) for half in halves]
  mean_of_means = jax.tree.map(lambda a, b: (a + b) / 2, *means)
  assert not all(np.allclose(a, b, rtol=1e-3) for a, b in zip(jax.tree.leaves(mean_of_means),
                                                                 jax.tree.leaves(gradient(whole))))


@pytest.mark.integration
def test_two_steps_with_one_and_four_micro_batches_agree():
  """Float32, no dropout, Adam: 4 micro-batches of 4 rows = 1 batch of 16 rows after two updates. Tolerance
  1e-5 relative: the gradients differ only by the order of float32 sums (~1e-7), which Adam's first steps,
  moving each parameter by ~lr * sign(g), amplify where a gradient entry is near 0."""
  batch = next(iterator(pad_rows_to=4))
  assert batch['source_tokens'].shape[0] % 4 == 0
  tx = optax.adam(1e-3, eps=1e-6)
  states = {}
  for n in (1, 4):
    state, fn, losses = init_state(tx, batch), step_fn(tx, n), []
    for _ in range(2):
      state, metrics = fn(state, batch)
      losses.append(float(metrics['loss_sum'] / metrics['token_count']))
    states[n] = (state, losses)
  np.testing.assert_allclose(states[4][1], states[1][1], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(states[4][0].params), jax.tree.leaves(states[1][0].params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_grad_accum_steps_must_divide_the_rows():
  batch = next(iterator())
  rows = batch['source_tokens'].shape[0]
  tx = optax.sgd(1.0)
  with pytest.raises(ValueError, match=rf'train.grad_accum_steps=7 does not divide the {rows} rows of a batch'):
    step_fn(tx, 7)(init_state(tx, batch), batch)


def test_batches_are_the_same_sentences_on_any_mesh_and_process_count():
  """The plan depends on the config only: padding rows (all PAD) complete each batch to the mesh's multiple."""
  one = iterator()
  eight = iterator(pad_rows_to=8)
  hosts = [iterator(pad_rows_to=8, process_index=i, process_count=2) for i in range(2)]
  for _ in range(12):  # More than one epoch.
    a, b = next(one), next(eight)
    parts = [next(host) for host in hosts]
    assert b['source_tokens'].shape[0] % 8 == 0 and b['source_tokens'].shape[0] - a['source_tokens'].shape[0] < 8
    assert sentences(a) == sentences(b) == sentences(parts[0]) + sentences(parts[1])
    assert int(np.count_nonzero(a['target_tokens'])) == int(np.count_nonzero(b['target_tokens']))


@pytest.mark.integration
def test_losses_through_the_pipeline_agree_on_one_and_eight_devices():
  """The real pipeline feeds one device and a data=4 x tensor=2 mesh the same sentences: equal float32 losses."""
  from configs import base  # pylint: disable=g-import-not-at-top
  tx = optax.adam(1e-3, eps=1e-6)
  results = {}
  for devices, (data, tensor) in ((1, (1, 1)), (8, (4, 2))):
    mesh_cfg = base.get_config().mesh
    mesh_cfg.update(data=data, fsdp=1, tensor=tensor)
    mesh, rules = sharding.make_mesh(mesh_cfg, jax.devices()[:devices]), sharding.logical_axis_rules(mesh_cfg)
    batches = iterator(pad_rows_to=data)
    first = next(iterator(pad_rows_to=data))
    state = jax.device_get(init_state(tx, first))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      state_sharding = sharding.logical_to_sharding(jax.eval_shape(
          functools.partial(state_lib.create_train_state, model=MODEL, tx=tx, batch=first), jax.random.key(0)), mesh,
          rules)
      batch_sharding = sharding.batch_sharding(mesh)
      fn = jax.jit(functools.partial(step_lib.train_step, model=MODEL, tx=tx, label_smoothing=0.1),
                   in_shardings=(state_sharding, batch_sharding), out_shardings=(state_sharding, None))
      state, losses = jax.device_put(state, state_sharding), []
      for _ in range(3):
        state, metrics = fn(state, jax.device_put(next(batches), batch_sharding))
        losses.append(float(metrics['loss_sum'] / metrics['token_count']))
    results[devices] = losses
  np.testing.assert_allclose(results[8], results[1], rtol=2e-6)


@pytest.mark.parametrize('before, after', [((1, 1), (8, 2)), ((8, 2), (1, 1)), ((4, 1), (8, 2))])
def test_resume_on_another_topology_sees_every_sentence_once(before, after):
  """Saved with (pad_rows_to, processes) `before`, resumed with `after`: the union of the sentences seen
  before and after the resume is an uninterrupted run's, none twice, none skipped."""
  def run(pad, processes, num_batches, state=None):
    hosts = [iterator(pad_rows_to=pad, process_index=i, process_count=processes) for i in range(processes)]
    for host in hosts:
      if state is not None:
        host.set_state(state)
    seen = [s for _ in range(num_batches) for host in hosts for s in sentences(next(host))]
    return seen, hosts[0].get_state()

  uninterrupted, _ = run(1, 1, 10)
  first, state = run(*before, 4)
  second, _ = run(*after, 6, state)
  assert sorted(first + second) == sorted(uninterrupted)
  assert first + second == uninterrupted  # The same order, too.


@pytest.mark.parametrize('model_overrides, mesh_overrides, message', [
    (dict(num_heads=3, d_k=8, d_v=8), dict(data=4, tensor=2), r'model\.num_heads=3 does not divide by mesh\.tensor=2'),
    (dict(d_model=36), dict(data=1, fsdp=8), r'model\.d_model=36 does not divide by mesh\.fsdp=8'),
    (dict(d_ff=66), dict(data=2, tensor=4), r'model\.d_ff=66 does not divide by mesh\.tensor=4'),
])
def test_a_mesh_that_does_not_divide_the_model_fails_before_any_write(tmp_path, model_overrides, mesh_overrides,
                                                                      message):
  from configs import smoke  # pylint: disable=g-import-not-at-top
  config = smoke.get_config()
  config.model.update(**model_overrides)
  config.mesh.update(**mesh_overrides)
  workdir = tmp_path / 'run'
  with pytest.raises(ValueError, match=message):
    train.train_and_evaluate(config, str(workdir))
  assert not workdir.exists()  # No checkpoints/, config.json or vocabulary.


def test_resume_with_another_tokens_per_batch_finishes_the_epoch_without_repeats(caplog):
  first_run = iterator(tokens_per_batch=96)
  seen = [s for _ in range(3) for s in sentences(next(first_run))]
  resumed = iterator(tokens_per_batch=160)
  with caplog.at_level('WARNING'):
    resumed.set_state(first_run.get_state())
  assert 'saved with data.tokens_per_batch=96, this run has 160' in caplog.text
  while True:
    batch = next(resumed)
    if resumed.get_state()['epoch'] == 1:  # This batch opens the next epoch.
      break
    seen += sentences(batch)
  assert sorted(seen) == sorted((*s, 2) for s in corpus()[0])  # Every pair of the epoch exactly once (EOS = 2).


@pytest.mark.integration
def test_accumulation_with_packing_remat_bf16_on_a_mesh_matches_one_batch():
  """grad_accum_steps=2 on data=2 x fsdp=2 x tensor=2 with packed rows, remat and bf16 products: the same
  losses as one batch on one device, within bf16 rounding (products of 8-bit mantissas, 2e-3 relative)."""
  from configs import base  # pylint: disable=g-import-not-at-top
  model = model_lib.Transformer(dataclasses.replace(MODEL.cfg, remat=True, dtype='bfloat16'))
  packed = train_iterator.TrainIterator(*corpus(), tokens_per_batch=96, max_length=16, bucket_lengths=BUCKETS,
                                        packing=True, pad_rows_to=8)
  batches = [next(packed) for _ in range(2)]
  assert 'source_segment_ids' in batches[0]
  tx = optax.adam(1e-3, eps=1e-6)
  results = {}
  for devices, mesh_shape, n in ((1, (1, 1, 1), 1), (8, (2, 2, 2), 2)):
    mesh_cfg = base.get_config().mesh
    mesh_cfg.update(data=mesh_shape[0], fsdp=mesh_shape[1], tensor=mesh_shape[2])
    mesh, rules = sharding.make_mesh(mesh_cfg, jax.devices()[:devices]), sharding.logical_axis_rules(mesh_cfg)
    init = functools.partial(state_lib.create_train_state, model=model, tx=tx, batch=batches[0])
    abstract = jax.eval_shape(init, jax.random.key(0))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: rng.normal(0.0, 0.3, x.shape).astype(np.float32), nn.unbox(abstract.params))
    state = state_lib.TrainState(step=np.int32(0), params=params, opt_state=jax.device_get(tx.init(params)),
                                 rng=np.array([0, 1], np.uint32))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      state_sharding = sharding.logical_to_sharding(abstract, mesh, rules)
      batch_sharding = sharding.batch_sharding(mesh)
      fn = jax.jit(functools.partial(step_lib.train_step, model=model, tx=tx, label_smoothing=0.1,
                                     grad_accum_steps=n),
                   in_shardings=(state_sharding, batch_sharding), out_shardings=(state_sharding, None))
      state, losses = jax.device_put(state, state_sharding), []
      for batch in batches:
        state, metrics = fn(state, jax.device_put(batch, batch_sharding))
        losses.append(float(metrics['loss_sum'] / metrics['token_count']))
    results[n] = losses
  np.testing.assert_allclose(results[2], results[1], rtol=2e-3)
