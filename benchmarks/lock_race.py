"""Processes racing to take over one stale `run.lock`: how many hold it at once (`storage.workdir.RunLock`).

  PYTHONPATH=. python benchmarks/lock_race.py [--trials=100] [--takers=8]

Each trial writes a lock record of a process that no longer runs on this host into a fresh folder, then starts
`--takers` forked processes that wait at one barrier and call `RunLock.acquire()` together; a taker that gets the
lock holds it for `--hold` seconds, so every other taker tries while it is held. Prints, per trial, how many
takers held the lock, and the number of trials with exactly one holder; exits 1 unless every trial had one.
"""
import argparse
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time

from transformer_jax import errors
from transformer_jax.storage import workdir as workdir_lib


def _take(folder: str, barrier, held, hold: float) -> None:
  barrier.wait()
  try:
    lock = workdir_lib.RunLock(folder, 'race').acquire()
  except errors.UserError:
    return
  with held.get_lock():
    held.value += 1
  time.sleep(hold)
  lock.release()


def dead_pid() -> int:
  """The pid of a process that has exited."""
  return int(subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True,
                            text=True, check=True).stdout)


def trial(takers: int, hold: float) -> int:
  """How many of `takers` racing processes held a stale lock."""
  context = multiprocessing.get_context('fork')
  with tempfile.TemporaryDirectory() as folder:
    with open(workdir_lib.path(folder, workdir_lib.LOCK), 'w', encoding='utf-8') as f:
      json.dump({'host': socket.gethostname(), 'pid': dead_pid(), 'purpose': 'train', 'started': 'earlier',
                 'command': 'killed -9'}, f)
    barrier, held = context.Barrier(takers), context.Value('i', 0)
    processes = [context.Process(target=_take, args=(folder, barrier, held, hold)) for _ in range(takers)]
    for p in processes:
      p.start()
    for p in processes:
      p.join()
    return held.value


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--trials', type=int, default=100)
  parser.add_argument('--takers', type=int, default=8)
  parser.add_argument('--hold', type=float, default=0.3, help='seconds a taker that got the lock holds it')
  args = parser.parse_args()
  import logging  # pylint: disable=g-import-not-at-top
  logging.disable(logging.WARNING)  # The takeover's warning, once per trial.
  counts = [trial(args.takers, args.hold) for _ in range(args.trials)]
  ones = sum(count == 1 for count in counts)
  print(f'holders per trial: {counts}')
  print(f'{ones} of {args.trials} trials: exactly one of {args.takers} takers held the stale lock '
        f'(pid {os.getpid()}, host {socket.gethostname()})')
  return 0 if ones == args.trials else 1


if __name__ == '__main__':
  sys.exit(main())
