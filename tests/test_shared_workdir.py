"""Multi-host workdirs (#16 class 5): two processes on localhost, joined through jax.distributed, either share
one workdir or each use their own folder (as a local path on each host would be). The check at start-up
(`distributed.check_shared_workdir`) must pass on the first and stop both processes on the second, and the
processes must agree on the checkpoint step they restore (`CheckpointManager.restore_latest`).

The processes run this file as a script (`_worker_main`); the checkpoints are written beforehand by pytest.
"""
import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from transformer_jax.storage import checkpoints
from transformer_jax.training import distributed

import processes  # pylint: disable=g-bad-import-order  (tests/processes.py)

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT_SECS = 300


def _abstract_state():
  """A replicated [4] float32 leaf over every device of the job."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('data',))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return {'w': jax.ShapeDtypeStruct((4,), np.float32, sharding=sharding)}


def _worker_main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--workdirs', required=True, help='comma-separated, one per process (or one for all)')
  parser.add_argument('--out', required=True)
  args = parser.parse_args()
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  distributed.initialize_distributed()
  workdirs = args.workdirs.split(',')
  workdir = workdirs[jax.process_index() % len(workdirs)]
  result = {'process_index': jax.process_index()}
  try:
    distributed.check_shared_workdir(workdir, timeout_secs=2.0)
    result['check'] = 'ok'
  except distributed.LaunchError as e:
    result['check'] = str(e)
  try:
    restored = checkpoints.CheckpointManager(workdir, read_only=True).restore_latest(_abstract_state())
    result['restore'] = {'step': restored.step, 'w': np.asarray(restored.state['w']).tolist()}
  except ValueError as e:
    result['restore'] = str(e)
  pathlib.Path(args.out).write_text(json.dumps(result))
  jax.distributed.shutdown()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def _run_pair(tmp_path, workdirs) -> list[dict]:
  env = {k: v for k, v in os.environ.items() if not k.startswith(('JAX_', 'SLURM_', 'OMPI_', 'TPU_'))}
  env |= {'XLA_FLAGS': '--xla_force_host_platform_device_count=1', 'JAX_PLATFORMS': 'cpu',
          'TF_CPP_MIN_LOG_LEVEL': '2', 'PYTHONPATH': str(REPO_ROOT),
          'JAX_COORDINATOR_ADDRESS': f'localhost:{_free_port()}', 'JAX_NUM_PROCESSES': '2'}
  started = []
  for i in range(2):
    out = tmp_path / f'result_{i}.json'
    started.append((subprocess.Popen(
        [sys.executable, __file__, f'--workdirs={",".join(map(str, workdirs))}', f'--out={out}'],
        env=env | {'JAX_PROCESS_ID': str(i)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out))
  return processes.results(started, TIMEOUT_SECS)


def _write_checkpoints(workdir, steps):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ('data',))
  with checkpoints.CheckpointManager(workdir) as manager:
    for step in steps:
      manager.save(step, {'w': jax.device_put(np.full((4,), step, np.float32),
                                               jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))},
                   {'position': step}, force=True)


@pytest.mark.slow
def test_shared_workdir_passes_and_both_processes_restore_the_same_step(tmp_path):
  workdir = tmp_path / 'shared'
  _write_checkpoints(workdir, [2, 4])
  results = _run_pair(tmp_path, [workdir])
  assert [r['check'] for r in results] == ['ok', 'ok']
  assert [r['restore'] for r in results] == [{'step': 4, 'w': [4.0] * 4}] * 2
  assert sorted(p.name for p in workdir.iterdir()) == ['checkpoints']  # The marker is gone.


def test_separate_workdirs_stop_every_process_and_no_step_is_restored(tmp_path):
  local = [tmp_path / 'host0', tmp_path / 'host1']
  _write_checkpoints(local[0], [2, 4])
  _write_checkpoints(local[1], [2])
  results = _run_pair(tmp_path, local)
  for r in results:
    assert r['check'].startswith(f'--workdir={local[r["process_index"]]} is not shared storage: process(es) [1] of '
                                 '2 did not see the marker'), r['check']
    # Had the check been skipped, restoring would stop too rather than let each process resume its own step.
    assert r['restore'].startswith('The processes disagree on the checkpoint steps in'), r['restore']
    assert "0: '2 steps, latest 4', 1: '1 steps, latest 2'" in r['restore']


if __name__ == '__main__':
  _worker_main()
