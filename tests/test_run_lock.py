"""`storage.workdir.RunLock`: one holder of a run folder's lock, whatever the lock file holds.

The race of eight takers is `benchmarks/lock_race.py`'s (here a few trials; the script runs 100).
"""
import json
import logging
import os
import pathlib
import socket
import subprocess
import sys

import pytest

from transformer_jax import errors
from transformer_jax.storage import workdir as workdir_lib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _dead_pid() -> int:
  return int(subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True, text=True,
                            check=True).stdout)


@pytest.mark.integration
def test_a_stale_lock_taken_over_by_eight_racing_processes_has_one_holder():
  result = subprocess.run([sys.executable, str(REPO_ROOT / 'benchmarks' / 'lock_race.py'), '--trials=4',
                           '--takers=8', '--hold=0.3'], capture_output=True, text=True, timeout=120,
                          env={**os.environ, 'PYTHONPATH': str(REPO_ROOT)})
  assert result.returncode == 0, result.stdout + result.stderr
  assert '4 of 4 trials: exactly one of 8 takers' in result.stdout


def test_a_held_lock_refuses_a_second_taker_and_a_released_one_is_free_again(tmp_path):
  with workdir_lib.RunLock(tmp_path, 'train'):
    with pytest.raises(workdir_lib.WorkdirInUseError, match=rf'in use by process {os.getpid()} on '):
      workdir_lib.RunLock(tmp_path, 'evaluate').acquire()
  assert (tmp_path / workdir_lib.LOCK).read_text() == ''  # Released: the file stays, empty.
  with workdir_lib.RunLock(tmp_path, 'evaluate') as lock:
    assert lock.holder()['purpose'] == 'evaluate'


def test_a_dead_holders_lock_is_taken_over_and_another_hosts_is_refused(tmp_path, caplog):
  stale = {'host': socket.gethostname(), 'pid': _dead_pid(), 'started': 'yesterday', 'command': 'killed -9'}
  (tmp_path / workdir_lib.LOCK).write_text(json.dumps(stale))
  with caplog.at_level(logging.WARNING):
    with workdir_lib.RunLock(tmp_path, 'train') as lock:
      assert lock.holder()['pid'] == os.getpid()
  assert f'left by process {stale["pid"]}' in caplog.text
  (tmp_path / workdir_lib.LOCK).write_text(json.dumps(stale | {'host': 'another-host'}))
  with pytest.raises(workdir_lib.WorkdirInUseError, match=r'on another-host.*if that process no longer runs, '
                                                          r'delete .*run\.lock'):
    workdir_lib.RunLock(tmp_path, 'train').acquire()


@pytest.mark.parametrize('content', [
    b'[1]', b'{"host": "HOST", "pid": 12345678901234567890}', b'{"host": "HOST", "pid": -1}',
    b'{"host": "HOST", "pid": "twelve"}', b'{"host": "HOST", "pid": true}', b'{"host": 7, "pid": 1}',
    b'{"pid": 1}', b'null', b'"run.lock"', b'', b'\x00\xff\xfe garbage \x80' * 50, b'{"host": "HOST", "pid": 1',
    b'{"host": "HOST", "pid": 1.5, "started": [1], "command": {"a": 1}}', 'ü'.encode('latin-1')])
def test_any_lock_content_gives_the_lock_or_one_user_error(tmp_path, content):
  file = tmp_path / workdir_lib.LOCK
  file.write_bytes(content.replace(b'HOST', socket.gethostname().encode()))
  try:
    with workdir_lib.RunLock(tmp_path, 'train') as lock:
      assert json.loads(file.read_text())['pid'] == os.getpid()
      assert lock.held
  except errors.UserError as error:
    assert str(file) in str(error) and '\n' not in errors.one_line(error)


def test_a_directory_in_place_of_the_lock_is_one_line_naming_it(tmp_path):
  (tmp_path / workdir_lib.LOCK).mkdir()
  with pytest.raises(errors.PathError, match=rf'{tmp_path / workdir_lib.LOCK} is a directory'):
    workdir_lib.RunLock(tmp_path, 'train').acquire()


def test_a_lock_held_by_a_live_process_of_this_host_is_never_taken(tmp_path):
  holder = subprocess.Popen(
      [sys.executable, '-c', 'import sys, time; from transformer_jax.storage import workdir as w; '
       f'lock = w.RunLock({str(tmp_path)!r}, "train").acquire(); print("held", flush=True); time.sleep(60)'],
      stdout=subprocess.PIPE, text=True, env={**os.environ, 'PYTHONPATH': str(REPO_ROOT)})
  try:
    assert holder.stdout.readline().strip() == 'held'
    (tmp_path / workdir_lib.LOCK).write_text('[1]')  # Its record overwritten: the kernel's lock still holds.
    with pytest.raises(workdir_lib.WorkdirInUseError, match='in use by'):
      workdir_lib.RunLock(tmp_path, 'train').acquire()
  finally:
    holder.kill()
    holder.wait()
  with workdir_lib.RunLock(tmp_path, 'train'):  # Killed: the kernel dropped its lock.
    pass
