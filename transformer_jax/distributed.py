"""Process start-up of a multi-host job: which launcher started this process, and joining the others
through `jax.distributed.initialize` before any JAX use (`main.py` calls `initialize_distributed` first).

Kept apart from `sharding.py` (logical axes, mesh, rules), which model code imports.
"""
from collections.abc import Mapping
import os

from absl import logging
import jax


def distributed_environment(environ: Mapping[str, str] | None = None) -> str | None:
  """The multi-process launcher this process runs under, or None for a single process.

  The rule (checked before any JAX call, since `jax.distributed.initialize` must come first):
    'coordinator'  JAX_COORDINATOR_ADDRESS is set (with JAX_NUM_PROCESSES and JAX_PROCESS_ID; any launcher);
    'slurm'        inside an `srun` step of more than one task (SLURM_STEP_NODELIST and SLURM_NTASKS > 1);
    'openmpi'      under `mpirun` with more than one rank (OMPI_MCA_orte_hnp_uri, OMPI_COMM_WORLD_SIZE > 1);
    'cloud_tpu'    a multi-worker Cloud TPU slice (TPU_WORKER_HOSTNAMES lists several hosts, or
                   MEGASCALE_COORDINATOR_ADDRESS is set). Plain `gcloud ... tpu-vm ssh --worker=all` does not set
                   these: `launch/tpu_vm.sh run` passes --multihost instead.

  Args:
    environ: the environment; os.environ by default.
  """
  env = os.environ if environ is None else environ
  if env.get('JAX_COORDINATOR_ADDRESS'):
    return 'coordinator'
  slurm = ('SLURM_JOB_ID', 'SLURM_STEP_NODELIST', 'SLURM_NTASKS', 'SLURM_PROCID', 'SLURM_LOCALID')
  if all(key in env for key in slurm) and int(env['SLURM_NTASKS']) > 1:
    return 'slurm'
  if 'OMPI_MCA_orte_hnp_uri' in env and int(env.get('OMPI_COMM_WORLD_SIZE', '1')) > 1:
    return 'openmpi'
  if len([h for h in env.get('TPU_WORKER_HOSTNAMES', '').split(',') if h]) > 1 or env.get(
      'MEGASCALE_COORDINATOR_ADDRESS'):
    return 'cloud_tpu'
  return None


def initialize_distributed(multihost: bool | None = None, environ: Mapping[str, str] | None = None) -> bool:
  """Calls `jax.distributed.initialize()` when this is one of several processes; call before any JAX use.

  Args:
    multihost: True forces initialisation (JAX then detects Cloud TPU, SLURM, Open MPI or reads
      JAX_COORDINATOR_ADDRESS), False forbids it, None (default) follows `distributed_environment`.
    environ: the environment; os.environ by default.

  Returns:
    Whether jax.distributed was initialised.

  Raises:
    ValueError: if JAX_COORDINATOR_ADDRESS is set without JAX_NUM_PROCESSES and JAX_PROCESS_ID and no other
      launcher supplies them.
  """
  env = os.environ if environ is None else environ
  detected = distributed_environment(env)
  if multihost is False or (multihost is None and detected is None):
    return False
  kwargs = {}
  if detected == 'coordinator' and distributed_environment(
      {k: v for k, v in env.items() if k != 'JAX_COORDINATOR_ADDRESS'}) is None:
    missing = [k for k in ('JAX_NUM_PROCESSES', 'JAX_PROCESS_ID') if k not in env]
    if missing:
      raise ValueError(f'JAX_COORDINATOR_ADDRESS={env["JAX_COORDINATOR_ADDRESS"]} is set but {missing} are not '
                       '(each process needs the process count and its own id)')
    kwargs = dict(coordinator_address=env['JAX_COORDINATOR_ADDRESS'],
                  num_processes=int(env['JAX_NUM_PROCESSES']), process_id=int(env['JAX_PROCESS_ID']))
  logging.info('Initialising jax.distributed (%s).', detected or '--multihost')
  jax.distributed.initialize(**kwargs)
  return True
