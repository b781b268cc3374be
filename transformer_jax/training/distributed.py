"""Process start-up of a multi-host job: which launcher started this process, joining the others through
`jax.distributed.initialize` before any JAX use, and checking that the job has the processes and devices the
launcher promised (`start`, which `main.py` calls first).

Launch faults this catches, each with the expected and the actual counts:
  * a process that waits for peers that never start (a TPU slice started on one worker only, a lost srun task):
    `jax.distributed.initialize` gives up after `initialization_timeout_secs` (XLA then aborts the process with
    DEADLINE_EXCEEDED), and the line logged before it names how many processes it waited for and from where;
  * fewer or more processes than SLURM_NTASKS / JAX_NUM_PROCESSES / OMPI_COMM_WORLD_SIZE / TPU_WORKER_HOSTNAMES;
  * fewer local devices than the launcher gave the task: jax.distributed gives each SLURM task only the GPU of
    its SLURM_LOCALID unless JAX_LOCAL_DEVICE_IDS says otherwise, so one task per node with 8 GPUs drives 1;
  * a workdir that the processes do not share (`check_shared_workdir`, called when the workdir is opened).

Kept apart from `model/sharding.py` (logical axes, mesh, rules), which model code imports.
"""
from collections.abc import Mapping
import dataclasses
import os
import re
import secrets
import time

from absl import logging
import jax

from transformer_jax import errors


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


class LaunchError(errors.UserError, RuntimeError):
  """The job's processes or devices differ from what the launcher promised, or they did not meet in time."""


def initialize_distributed(multihost: bool | None = None, environ: Mapping[str, str] | None = None,
                           initialization_timeout_secs: int | None = None) -> bool:
  """Calls `jax.distributed.initialize()` when this is one of several processes; call before any JAX use.

  Args:
    multihost: True forces initialisation (JAX then detects Cloud TPU, SLURM, Open MPI or reads
      JAX_COORDINATOR_ADDRESS), False forbids it, None (default) follows `distributed_environment`.
    environ: the environment; os.environ by default.
    initialization_timeout_secs: how long to wait for every process to join; None: JAX's default (300 s).

  Returns:
    Whether jax.distributed was initialised.

  Raises:
    errors.ConfigError: if JAX_COORDINATOR_ADDRESS is set without JAX_NUM_PROCESSES and JAX_PROCESS_ID and no other
      launcher supplies them.
    LaunchError: if the processes did not all join within the timeout (or initialisation failed otherwise).
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
      raise errors.ConfigError(f'JAX_COORDINATOR_ADDRESS={env["JAX_COORDINATOR_ADDRESS"]} is set but {missing} are not '
                               '(each process needs the process count and its own id)')
    kwargs = dict(coordinator_address=env['JAX_COORDINATOR_ADDRESS'],
                  num_processes=int(env['JAX_NUM_PROCESSES']), process_id=int(env['JAX_PROCESS_ID']))
  if initialization_timeout_secs is not None:
    kwargs['initialization_timeout'] = initialization_timeout_secs
  expected = expected_topology(env)
  waited = f'{initialization_timeout_secs} s' if initialization_timeout_secs is not None else "JAX's 300 s"
  waiting = (f'jax.distributed.initialize ({detected or "--multihost"}) waiting up to {waited} for '
             f'{expected.num_processes or "all the"} processes{expected.said(processes=True)}')
  advice = ('Every process of the job must run the same command (a TPU slice: --worker=all; SLURM: srun starts '
            'every task); check that each one started and can reach the coordinator.')
  # On a timeout XLA's client aborts the process (DEADLINE_EXCEEDED) rather than raising: say first what it
  # waits for, so that the log of a hung or aborted start-up names the expected processes.
  logging.warning('%s. If this process aborts with DEADLINE_EXCEEDED, some did not join. %s', waiting, advice)
  try:
    jax.distributed.initialize(**kwargs)
  except Exception as e:  # pylint: disable=broad-except
    raise LaunchError(f'{waiting} failed: {type(e).__name__}: {e}. {advice}') from e
  return True


@dataclasses.dataclass(frozen=True)
class Topology:
  """What the launcher promised: processes in the job and devices per process (None where it says nothing)."""
  num_processes: int | None
  local_devices: int | None
  sources: tuple[str, ...] = ()  # The variables that said so, e.g. ('SLURM_NTASKS=16', 'SLURM_GPUS_ON_NODE=8').
  hint: str = ''                 # Why the devices could differ, for the error message.

  def said(self, processes: bool = False) -> str:
    """' (VAR=value, ...)': the variables the promise came from (only the process-count ones with
    processes=True), for error messages; '' when there are none."""
    sources = [s for s in self.sources if not processes or not s.startswith(_DEVICE_VARIABLES)]
    return f' ({", ".join(sources)})' if sources else ''


_DEVICE_VARIABLES = ('JAX_LOCAL_DEVICE_IDS', 'SLURM_GPUS', 'SLURM_NTASKS_PER_NODE', 'SLURM_STEP_TASKS_PER_NODE')


def _leading_int(env: Mapping[str, str], key: str) -> int:
  """'8' -> 8, '4(x2),2' -> 4 (SLURM's per-node lists: the first node's), 'a100:2' -> 2 (a typed GPU count).

  Raises:
    LaunchError: naming the variable if its value holds no count.
  """
  match = re.match(r'(?:[^:,]*:)?(\d+)', env[key])
  if not match:
    raise LaunchError(f'cannot read a count from {key}={env[key]!r}')
  return int(match.group(1))


def expected_topology(environ: Mapping[str, str] | None = None) -> Topology:
  """The process count and local device count the launcher promised this process.

  Processes: JAX_NUM_PROCESSES, else SLURM_STEP_NUM_TASKS / SLURM_NTASKS inside an srun step, else
  OMPI_COMM_WORLD_SIZE, else the hosts of TPU_WORKER_HOSTNAMES. Local devices: JAX_LOCAL_DEVICE_IDS (what
  jax.distributed restricts the process to), else under SLURM SLURM_GPUS_PER_TASK, else the node's GPUs
  (SLURM_GPUS_ON_NODE) divided among its tasks (SLURM_NTASKS_PER_NODE or SLURM_STEP_TASKS_PER_NODE).

  Args:
    environ: the environment; os.environ by default.
  """
  env = os.environ if environ is None else environ
  launcher = distributed_environment(env)
  processes, local, sources, hint = None, None, [], ''
  for key, applies in (('JAX_NUM_PROCESSES', True), ('SLURM_STEP_NUM_TASKS', launcher == 'slurm'),
                       ('SLURM_NTASKS', launcher == 'slurm'), ('OMPI_COMM_WORLD_SIZE', launcher == 'openmpi')):
    if applies and env.get(key):
      processes = _leading_int(env, key)
      sources.append(f'{key}={env[key]}')
      break
  else:
    hosts = [h for h in env.get('TPU_WORKER_HOSTNAMES', '').split(',') if h]
    if len(hosts) > 1:
      processes = len(hosts)
      sources.append(f'TPU_WORKER_HOSTNAMES lists {len(hosts)} hosts')
  if env.get('JAX_LOCAL_DEVICE_IDS'):
    local = len(env['JAX_LOCAL_DEVICE_IDS'].split(','))
    sources.append(f'JAX_LOCAL_DEVICE_IDS={env["JAX_LOCAL_DEVICE_IDS"]}')
  elif launcher == 'slurm' and env.get('SLURM_GPUS_PER_TASK'):
    local = _leading_int(env, 'SLURM_GPUS_PER_TASK')
    sources.append(f'SLURM_GPUS_PER_TASK={env["SLURM_GPUS_PER_TASK"]}')
  elif launcher == 'slurm' and env.get('SLURM_GPUS_ON_NODE'):
    per_node_key = next((k for k in ('SLURM_NTASKS_PER_NODE', 'SLURM_STEP_TASKS_PER_NODE') if env.get(k)), None)
    if per_node_key:
      gpus, tasks = _leading_int(env, 'SLURM_GPUS_ON_NODE'), _leading_int(env, per_node_key)
      local = max(gpus // tasks, 1)
      sources += [f'SLURM_GPUS_ON_NODE={gpus}', f'{per_node_key}={env[per_node_key]}']
  if launcher == 'slurm' and local is not None and local > 1 and not env.get('JAX_LOCAL_DEVICE_IDS'):
    hint = (f'jax.distributed gives each SLURM task only the GPU of its SLURM_LOCALID: set JAX_LOCAL_DEVICE_IDS '
            f"to this task's {local} GPUs (launch/slurm.sbatch does for one task per node), or start one task "
            'per GPU')
  return Topology(processes, local, tuple(sources), hint)


def check_topology(expected: Topology, process_count: int, local_device_count: int) -> None:
  """Compares the job with what the launcher promised.

  Args:
    expected: `expected_topology()`.
    process_count: jax.process_count().
    local_device_count: jax.local_device_count().

  Raises:
    LaunchError: naming the expected and the actual counts, and the variables the expectation came from.
  """
  problems = []
  if expected.num_processes is not None and process_count != expected.num_processes:
    problems.append(f'expected {expected.num_processes} processes{expected.said(processes=True)}, '
                    f'the job has {process_count}')
  if expected.local_devices is not None and local_device_count != expected.local_devices:
    problems.append(f'expected {expected.local_devices} local devices per process{expected.said()}, this '
                    f'process has {local_device_count}' + (f': {expected.hint}' if expected.hint else ''))
  if problems:
    raise LaunchError('Launch check failed: ' + '; '.join(problems) + '.')


def start(multihost: bool | None = None, initialization_timeout_secs: int | None = None) -> None:
  """Joins the other processes (`initialize_distributed`), then checks the job (`check_topology`).

  Call before any other JAX use (main.py does).

  Raises:
    errors.ConfigError, LaunchError: see `initialize_distributed` and `check_topology`.
  """
  initialize_distributed(multihost, initialization_timeout_secs=initialization_timeout_secs)
  check_topology(expected_topology(), jax.process_count(), jax.local_device_count())


def check_shared_workdir(workdir: str, timeout_secs: float = 120.0, poll_secs: float = 0.2) -> None:
  """Stops unless every process reads and writes the same workdir (call on all processes, after creating it).

  Processes that do not share it (a local path on each host) would each find their own latest checkpoint,
  vocabulary and config. Process 0 writes a marker file named by a random token, the token reaches the others
  through JAX (`broadcast_one_to_all`), and each process looks for the marker until `timeout_secs` have passed
  (shared storage such as NFS or gs:// may show a new file late). Then the processes compare what they saw and
  process 0 deletes the marker. A single process returns at once.

  Args:
    workdir: the run's folder (a local path or a URL such as gs://...), existing on every process.
    timeout_secs: how long each process looks for the marker.
    poll_secs: seconds between looks.

  Raises:
    LaunchError: on every process, naming the processes that did not see the marker.
  """
  if jax.process_count() == 1:
    return
  # pylint: disable=g-import-not-at-top
  from etils import epath
  from jax.experimental import multihost_utils
  import numpy as np
  # pylint: enable=g-import-not-at-top
  token = np.frombuffer(secrets.token_bytes(16), np.uint8) if jax.process_index() == 0 else np.zeros(16, np.uint8)
  token = bytes(np.asarray(multihost_utils.broadcast_one_to_all(token)).astype(np.uint8)).hex()
  marker = epath.Path(workdir) / f'.shared_workdir_{token}'
  if jax.process_index() == 0:
    marker.write_text(token)
  deadline = time.monotonic() + timeout_secs
  seen = False
  while not seen:
    seen = marker.exists() and marker.read_text() == token
    if seen or time.monotonic() > deadline:
      break
    time.sleep(poll_secs)
  everyone = np.asarray(multihost_utils.process_allgather(np.array([seen]))).reshape(-1)
  if jax.process_index() == 0:
    marker.unlink()
  blind = np.flatnonzero(~everyone).tolist()
  if blind:
    raise LaunchError(
        f'--workdir={workdir} is not shared storage: process(es) {blind} of {jax.process_count()} did not see '
        f'the marker {marker.name} that process 0 wrote there within {timeout_secs:g} s. Every process must use '
        'the same workdir on storage all hosts share (a network file system, gs://...): with a local folder on '
        'each host every process would find a different latest checkpoint.')
