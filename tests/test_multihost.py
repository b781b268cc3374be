"""Multi-process tests: two processes on localhost joined through jax.distributed (CPU collectives over gloo)
compute what one process computes on the same global batch; and the rule that decides when to join.

The processes run this file as a script (`_worker_main`): each sees 2 fake CPU devices, so the pair forms a
4-device mesh (data=2 across the processes, fsdp=2 within each), reads its half of every global batch from
train_iterator.TrainIterator and assembles global arrays with training.build.Build.device_batch. The reference is
one process with 4 devices.
"""
import argparse
import functools
import json
import os
import pathlib
import socket
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from transformer_jax.data import batching
from transformer_jax.data import input_pipeline
from transformer_jax.data import train_iterator
from transformer_jax.decoding import translate
from transformer_jax.model import sharding
from transformer_jax.model import transformer as model_lib
from transformer_jax.training import distributed
from transformer_jax.training import build
from transformer_jax.training import optim
from transformer_jax.training import state as state_lib
from transformer_jax.training import step as step_lib

import processes  # pylint: disable=g-bad-import-order  (tests/processes.py)

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT_SECS = 600  # Compiling on a shared 2-core machine; normally ~20 s.


def _config():
  """configs/smoke.py with one layer on a (data=2, fsdp=2) mesh."""
  if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
  from configs import smoke  # pylint: disable=g-import-not-at-top
  config = smoke.get_config()
  config.model.num_layers = 1
  config.mesh.update(data=2, fsdp=2, tensor=1)
  return config


def _corpus(num_pairs=96, seed=0) -> tuple[list[list[int]], list[list[int]]]:
  """Random pairs of 8 to 14 ids: with EOS all fall in the bucket of length 16, so every batch has one shape."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(8, 15, (2, num_pairs))
  return tuple([rng.integers(3, 64, n).tolist() for n in side] for side in lengths)


def _random_state(model, tx, mesh, rules, batch):
  """The same random TrainState on every process, placed in its sharded layout (no init compile)."""
  init_fn = functools.partial(state_lib.create_train_state, model=model, tx=tx, batch=batch)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    abstract = jax.eval_shape(init_fn, jax.random.key(0))
    shardings = sharding.logical_to_sharding(abstract, mesh, rules)
  rng = np.random.default_rng(1)
  params = jax.tree.map(lambda x: rng.normal(0.0, 0.2, x.shape).astype(np.float32), nn.unbox(abstract.params))
  state = state_lib.TrainState(step=np.int32(0), params=params, opt_state=jax.device_get(tx.init(params)),
                               rng=np.array([0, 7], np.uint32))
  return jax.device_put(state, shardings), shardings


def _translate(s, params, max_length: int, num_sentences=10) -> list[list[int]]:
  """Beam search over the first sentences of the corpus, each process feeding its rows of every batch."""
  source = batching.Ragged.from_lists(_corpus()[0][:num_sentences])
  batches = batching.eval_batches(
      source, source, tokens_per_batch=64, max_length=max_length, bucket_lengths=(16,),
      batch_size_multiple=s.data_shards, process_index=jax.process_index(), process_count=jax.process_count())
  outputs = translate.decode_all(params, batches, num_sentences, model=s.model, beam_size=2, alpha=0.6,
                                 extra_length=2, batch_sharding=sharding.batch_sharding(s.mesh))
  return [row.tolist() for row in outputs]


def _worker_main() -> None:
  """One process of a (possibly multi-process) run; writes its figures as JSON to --out."""
  parser = argparse.ArgumentParser()
  parser.add_argument('--steps', type=int, default=0, help='train steps; 0 evaluates one batch only')
  parser.add_argument('--out', required=True)
  args = parser.parse_args()
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.config.update('jax_numpy_rank_promotion', 'raise')
  joined = distributed.initialize_distributed()  # JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID.
  config = _config()
  mesh, rules = sharding.make_mesh(config.mesh), sharding.logical_axis_rules(config.mesh)
  model = model_lib.Transformer(model_lib.ModelConfig(vocab_size=config.data.vocab_size, **config.model))
  schedule = optim.rsqrt_schedule(config.model.d_model, config.train.warmup_steps)
  tx = optim.make_optimizer(schedule)
  s = build.Build(mesh, rules, model, tx, schedule, config.train.grad_accum_steps)
  iterator = train_iterator.TrainIterator.from_config(
      config.data, *_corpus(), batch_size_multiple=s.data_shards, process_index=jax.process_index(),
      process_count=jax.process_count())
  batches = [next(iterator) for _ in range(max(args.steps, 1))]
  if args.steps:
    state, state_sharding = state_lib.sharded_train_state(
        jax.random.key(0), model, tx, s.device_batch(batches[0]), mesh, rules)
  else:
    state, state_sharding = _random_state(model, tx, mesh, rules, batches[0])
  train_fn = step_lib.jit_train_step(s, state_sharding, config.train.label_smoothing)
  eval_fn = step_lib.jit_eval_step(s, state_sharding.params, config.train.label_smoothing)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    first = s.device_batch(batches[0])
    eval_fn = eval_fn.lower(state.params, first).compile()
    train_fn = train_fn.lower(state, first).compile() if args.steps else None
    # Gloo gives a process 30 s to meet its peers at the first collective; compile times on a busy machine
    # differ by more, so the processes meet at a barrier of the coordination service first.
    ocp.multihost.get_barrier_sync_fn()(key='compiled', timeout_ms=TIMEOUT_SECS * 1000)
    sums = jax.device_get(eval_fn(state.params, first))
    losses = []
    for batch in batches[:args.steps]:
      state, metrics = train_fn(state, s.device_batch(batch))
      losses.append(float(metrics['loss_sum'] / metrics['token_count']))
    translations = _translate(s, state.params, config.data.max_length) if not args.steps else []
  # BPE-dropout's samples differ from process to process: every process trains on process 0's (input_pipeline.py).
  own = batching.Ragged.from_lists(_corpus(seed=1 + jax.process_index())[0])
  # ~1,000 ids: several chunks, the last padded.
  input_pipeline._BROADCAST_CHUNK = 256  # pylint: disable=protected-access
  shared = input_pipeline.broadcast_ragged(own if jax.process_index() == 0 else None, len(own))
  result = {'joined': joined, 'process_index': jax.process_index(), 'process_count': jax.process_count(),
            'device_count': jax.device_count(), 'local_rows': [len(b['source_tokens']) for b in batches],
            'eval_loss': float(sums['loss_sum'] / sums['token_count']), 'eval_tokens': float(sums['token_count']),
            'train_losses': losses, 'translations': translations,
            'shared_ids': [shared[i].tolist() for i in range(len(shared))]}
  pathlib.Path(args.out).write_text(json.dumps(result))
  if joined:
    jax.distributed.shutdown()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def _start(tmp_path, steps: int, num_processes: int, devices_per_process: int):
  """Starts the processes of one run; returns [(process, output path)] in process order."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(('JAX_', 'SLURM_', 'OMPI_', 'TPU_'))}
  env |= {'XLA_FLAGS': f'--xla_force_host_platform_device_count={devices_per_process}', 'JAX_PLATFORMS': 'cpu',
          'TF_CPP_MIN_LOG_LEVEL': '2', 'PYTHONPATH': str(REPO_ROOT)}
  if num_processes > 1:
    env |= {'JAX_COORDINATOR_ADDRESS': f'localhost:{_free_port()}', 'JAX_NUM_PROCESSES': str(num_processes)}
  started = []
  for i in range(num_processes):
    out = tmp_path / f'{num_processes}_{i}.json'
    started.append((subprocess.Popen(
        [sys.executable, __file__, f'--steps={steps}', f'--out={out}'], env=env | {'JAX_PROCESS_ID': str(i)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out))
  return started


def _results(started) -> list[dict]:
  """Waits for every process (killing all on a timeout) and reads their JSON results."""
  return processes.results(started, TIMEOUT_SECS)


def _check_against_one_process(tmp_path, steps):
  pair_started = _start(tmp_path, steps, num_processes=2, devices_per_process=2)
  single_started = _start(tmp_path, steps, num_processes=1, devices_per_process=4)
  single, = _results(single_started)
  pair = _results(pair_started)
  assert [r['process_index'] for r in pair] == [0, 1]
  assert all(r['joined'] and r['process_count'] == 2 and r['device_count'] == 4 for r in pair)
  assert not single['joined'] and single['process_count'] == 1 and single['device_count'] == 4
  # Each process read half of every global batch.
  assert [2 * n for n in pair[0]['local_rows']] == single['local_rows'] == [2 * n for n in pair[1]['local_rows']]
  for r in pair:
    assert r['eval_tokens'] == single['eval_tokens'] > 0
    np.testing.assert_allclose(r['eval_loss'], single['eval_loss'], rtol=0, atol=1e-5)
    np.testing.assert_allclose(r['train_losses'], single['train_losses'], rtol=0, atol=1e-5)
    assert r['shared_ids'] == single['shared_ids'] == _corpus(seed=1)[0]  # Process 0's ids everywhere.
  return pair, single


@pytest.mark.slow  # Two processes each import TensorFlow and compile the decoder: ~15 s.
def test_two_processes_evaluate_and_translate_like_one(tmp_path):
  pair, single = _check_against_one_process(tmp_path, steps=0)
  # Each process fed its half of every batch of 4 rows (the last one half padding) and got every row back.
  assert len(single['translations']) == 10 and len({tuple(t) for t in single['translations']}) > 1
  assert pair[0]['translations'] == pair[1]['translations'] == single['translations']


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path):
  _, single = _check_against_one_process(tmp_path, steps=3)
  # Three steps on three different batches (losses need not fall; they must agree, checked above).
  assert len(single['train_losses']) == 3 and len(set(single['train_losses'])) == 3


@pytest.mark.parametrize('environ, expected', [
    ({}, None),
    ({'JAX_COORDINATOR_ADDRESS': 'h:1234', 'JAX_NUM_PROCESSES': '2', 'JAX_PROCESS_ID': '1'}, 'coordinator'),
    ({'SLURM_JOB_ID': '7', 'SLURM_STEP_NODELIST': 'n[1-2]', 'SLURM_NTASKS': '16', 'SLURM_PROCID': '3',
      'SLURM_LOCALID': '3'}, 'slurm'),
    ({'SLURM_JOB_ID': '7', 'SLURM_STEP_NODELIST': 'n1', 'SLURM_NTASKS': '1', 'SLURM_PROCID': '0',
      'SLURM_LOCALID': '0'}, None),  # A single srun task.
    ({'SLURM_JOB_ID': '7', 'SLURM_NTASKS': '16'}, None),  # The batch script itself, outside srun.
    ({'OMPI_MCA_orte_hnp_uri': '1.0;tcp://10.0.0.1:1', 'OMPI_COMM_WORLD_SIZE': '4'}, 'openmpi'),
    ({'TPU_WORKER_HOSTNAMES': 'w0,w1,w2,w3'}, 'cloud_tpu'),
    ({'TPU_WORKER_HOSTNAMES': 'w0'}, None),  # A single-host TPU VM.
])
def test_distributed_environment_rule(environ, expected):
  assert distributed.distributed_environment(environ) == expected


def test_initialize_distributed_follows_the_rule_and_the_flag(monkeypatch):
  calls = []
  monkeypatch.setattr(jax.distributed, 'initialize', lambda **kwargs: calls.append(kwargs))
  assert not distributed.initialize_distributed(None, {})
  assert not distributed.initialize_distributed(False, {'TPU_WORKER_HOSTNAMES': 'a,b'})
  assert distributed.initialize_distributed(True, {}) and calls[-1] == {}  # jax detects the cluster itself.
  env = {'JAX_COORDINATOR_ADDRESS': 'h:1234', 'JAX_NUM_PROCESSES': '2', 'JAX_PROCESS_ID': '1'}
  assert distributed.initialize_distributed(None, env)
  assert calls[-1] == {'coordinator_address': 'h:1234', 'num_processes': 2, 'process_id': 1}
  slurm = {'SLURM_JOB_ID': '7', 'SLURM_STEP_NODELIST': 'n1', 'SLURM_NTASKS': '2', 'SLURM_PROCID': '0',
           'SLURM_LOCALID': '0'}
  assert distributed.initialize_distributed(None, slurm | {'JAX_COORDINATOR_ADDRESS': 'h:1'}) and calls[-1] == {}
  with pytest.raises(ValueError, match=r"\['JAX_PROCESS_ID'\] are not"):
    distributed.initialize_distributed(None, {'JAX_COORDINATOR_ADDRESS': 'h:1', 'JAX_NUM_PROCESSES': '2'})
  assert len(calls) == 3


if __name__ == '__main__':
  _worker_main()
