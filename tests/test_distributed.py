"""Launch checks of distributed.py (#16 class 6) with fake launcher environments, and two real start-ups of
`transformer_jax.main` that must stop with the expected and actual counts instead of hanging or running."""
import os
import pathlib
import socket
import subprocess
import sys
import time

import jax
import pytest

from transformer_jax.training import distributed

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SLURM_STEP = {'SLURM_JOB_ID': '7', 'SLURM_STEP_NODELIST': 'n[1-2]', 'SLURM_PROCID': '0', 'SLURM_LOCALID': '0'}


@pytest.mark.parametrize('environ, processes, local_devices', [
    ({}, None, None),
    ({'JAX_COORDINATOR_ADDRESS': 'h:1', 'JAX_NUM_PROCESSES': '4', 'JAX_PROCESS_ID': '0'}, 4, None),
    (SLURM_STEP | {'SLURM_NTASKS': '16', 'SLURM_NTASKS_PER_NODE': '8', 'SLURM_GPUS_ON_NODE': '8'}, 16, 1),
    (SLURM_STEP | {'SLURM_NTASKS': '2', 'SLURM_NTASKS_PER_NODE': '1', 'SLURM_GPUS_ON_NODE': '8'}, 2, 8),
    (SLURM_STEP | {'SLURM_NTASKS': '2', 'SLURM_STEP_NUM_TASKS': '4', 'SLURM_STEP_TASKS_PER_NODE': '2(x2)',
                   'SLURM_GPUS_ON_NODE': '8'}, 4, 4),  # The step's own counts win over the allocation's.
    (SLURM_STEP | {'SLURM_NTASKS': '4', 'SLURM_GPUS_PER_TASK': 'h100:2', 'SLURM_GPUS_ON_NODE': '4'}, 4, 2),
    (SLURM_STEP | {'SLURM_NTASKS': '2', 'SLURM_NTASKS_PER_NODE': '1', 'SLURM_GPUS_ON_NODE': '8',
                   'JAX_LOCAL_DEVICE_IDS': '0,1,2,3,4,5,6,7'}, 2, 8),
    ({'OMPI_MCA_orte_hnp_uri': 'x', 'OMPI_COMM_WORLD_SIZE': '3'}, 3, None),
    ({'TPU_WORKER_HOSTNAMES': 'w0,w1,w2,w3'}, 4, None),
])
def test_expected_topology_from_the_launcher(environ, processes, local_devices):
  expected = distributed.expected_topology(environ)
  assert (expected.num_processes, expected.local_devices) == (processes, local_devices)


def test_one_slurm_task_per_node_driving_one_of_eight_gpus_is_named():
  env = SLURM_STEP | {'SLURM_NTASKS': '2', 'SLURM_NTASKS_PER_NODE': '1', 'SLURM_GPUS_ON_NODE': '8'}
  expected = distributed.expected_topology(env)
  distributed.check_topology(expected, process_count=2, local_device_count=8)
  with pytest.raises(distributed.LaunchError, match=(
      r'expected 8 local devices per process \(SLURM_NTASKS=2, SLURM_GPUS_ON_NODE=8, SLURM_NTASKS_PER_NODE=1\), '
      r'this process has 1: jax.distributed gives each SLURM task only the GPU of its SLURM_LOCALID.*'
      r'JAX_LOCAL_DEVICE_IDS')):
    distributed.check_topology(expected, process_count=2, local_device_count=1)
  with pytest.raises(distributed.LaunchError, match=r'expected 2 processes \(SLURM_NTASKS=2\), the job has 1; '
                                                    r'expected 8 local devices'):
    distributed.check_topology(expected, process_count=1, local_device_count=1)


def test_initialize_failure_names_the_timeout_and_the_processes(monkeypatch):
  calls = []

  def never_meet(**kwargs):
    calls.append(kwargs)
    raise RuntimeError('DEADLINE_EXCEEDED: Barrier timed out')
  monkeypatch.setattr(jax.distributed, 'initialize', never_meet)
  with pytest.raises(distributed.LaunchError, match=(
      r'jax.distributed.initialize \(cloud_tpu\) waiting up to 5 s for 4 processes '
      r'\(TPU_WORKER_HOSTNAMES lists 4 hosts\) failed: RuntimeError: DEADLINE_EXCEEDED.*--worker=all')):
    distributed.initialize_distributed(None, {'TPU_WORKER_HOSTNAMES': 'w0,w1,w2,w3'}, initialization_timeout_secs=5)
  assert calls == [{'initialization_timeout': 5}]


def _main(tmp_path, env, *flags, timeout=120):
  clean = {k: v for k, v in os.environ.items() if not k.startswith(('JAX_', 'SLURM_', 'OMPI_', 'TPU_'))}
  clean |= {'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': '--xla_force_host_platform_device_count=1', 'PYTHONPATH': str(REPO_ROOT)}
  start = time.monotonic()
  result = subprocess.run([sys.executable, '-m', 'transformer_jax.main', '--config=configs/smoke.py',
                           f'--workdir={tmp_path / "run"}', *flags], cwd=REPO_ROOT, env=clean | env,
                          capture_output=True, text=True, timeout=timeout, check=False)
  return result, time.monotonic() - start


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


@pytest.mark.integration
def test_main_stops_within_the_timeout_when_a_process_never_starts(tmp_path):
  env = {'JAX_COORDINATOR_ADDRESS': f'localhost:{_free_port()}', 'JAX_NUM_PROCESSES': '2', 'JAX_PROCESS_ID': '0'}
  result, seconds = _main(tmp_path, env, '--initialization_timeout_secs=3')  # Process 1 is never started.
  assert result.returncode != 0
  # XLA aborts the process on the deadline; the line before names what it waited for.
  assert ('jax.distributed.initialize (coordinator) waiting up to 3 s for 2 processes (JAX_NUM_PROCESSES=2). If '
          'this process aborts with DEADLINE_EXCEEDED, some did not join.') in result.stderr, result.stderr[-3000:]
  assert 'DEADLINE_EXCEEDED' in result.stderr
  assert seconds < 60 and not (tmp_path / 'run').exists()


def test_main_stops_when_the_job_has_fewer_processes_than_promised(tmp_path):
  result, _ = _main(tmp_path, {'JAX_NUM_PROCESSES': '2'})  # No coordinator: this process runs alone.
  assert result.returncode != 0
  assert 'Launch check failed: expected 2 processes (JAX_NUM_PROCESSES=2), the job has 1.' in result.stderr, (
      result.stderr[-3000:])
  assert not (tmp_path / 'run').exists()
