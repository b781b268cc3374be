"""Does a trainer that saves every step survive readers of its run? (`--mode=translate` and `--mode=export`.)

  PYTHONPATH=. python benchmarks/readers_vs_trainer.py [--readers=20] [--folder=/tmp/readers_vs_trainer]

Trains configs/smoke.py on the tests' synthetic corpus (tests/tiny_runs.py) with a checkpoint every step and
100,000 steps to go, then starts `--readers` processes one after another against the running trainer, translate
and export in turn, each while the trainer is saving. A reader that opened the checkpoints writably would delete
the save in progress (orbax's clean-up of temporary folders) and the trainer would stop with CheckpointSaveError.
Prints each reader's exit status and the trainer's step, then how many readers the trainer survived; exits 1
unless it survived every one and every reader succeeded.
"""
import argparse
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / 'tests'))
import tiny_runs  # pylint: disable=g-import-not-at-top,wrong-import-position


def newest_step(workdir: pathlib.Path) -> int | None:
  steps = tiny_runs.checkpoint_steps(workdir)
  return steps[-1] if steps else None


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--readers', type=int, default=20)
  parser.add_argument('--folder', default='/tmp/readers_vs_trainer')
  args = parser.parse_args()
  folder = pathlib.Path(args.folder)
  shutil.rmtree(folder, ignore_errors=True)
  corpus = tiny_runs.write_corpus(folder / 'corpus')
  workdir = folder / 'run'
  env = {**os.environ, 'PYTHONPATH': str(REPO_ROOT)}
  flags = tiny_runs.config_flags(corpus, num_train_steps=100_000, checkpoint_every_steps=1, eval_every_steps=100_000,
                                 max_checkpoints_to_keep=3, log_every_steps=50)
  with open(folder / 'trainer.log', 'w') as log:
    trainer = subprocess.Popen(tiny_runs.main_command(workdir, flags), cwd=REPO_ROOT, env=env, stdout=log,
                               stderr=subprocess.STDOUT)
  try:
    while newest_step(workdir) is None or newest_step(workdir) < 3:
      if trainer.poll() is not None:
        print(f'the trainer stopped before its third step (status {trainer.returncode}): {folder / "trainer.log"}')
        return 1
      time.sleep(1)
    (folder / 'input.txt').write_text('a man runs on the street\nthe red dog\n')
    failures, start = 0, time.time()
    for i in range(args.readers):
      mode = ('translate', 'export')[i % 2]
      extra = ([f'--input={folder / "input.txt"}', f'--output={folder / f"out{i}.txt"}'] if mode == 'translate'
               else [f'--output={folder / f"ct2_{i}"}'])
      before = newest_step(workdir)
      reader = subprocess.run(tiny_runs.main_command(workdir, [f'--mode={mode}', *extra]), cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True, check=False)
      alive = trainer.poll() is None
      failures += reader.returncode != 0
      print(f'reader {i + 1:2d} ({mode:9s}): status {reader.returncode}; trainer at step {before} -> '
            f'{newest_step(workdir)}, {"running" if alive else f"STOPPED (status {trainer.returncode})"}',
            flush=True)
      if reader.returncode != 0:
        print(reader.stderr[-2000:])
      if not alive:
        break
    survived = i + 1 if trainer.poll() is None else i
    print(f'the trainer (a checkpoint every step) survived {survived} of {args.readers} readers; '
          f'{args.readers - failures if survived == args.readers else "-"} readers succeeded; '
          f'{time.time() - start:.0f} s')
    return 0 if survived == args.readers and failures == 0 else 1
  finally:
    if trainer.poll() is None:
      trainer.send_signal(signal.SIGINT)
      try:
        trainer.wait(timeout=120)
      except subprocess.TimeoutExpired:
        trainer.kill()


if __name__ == '__main__':
  sys.exit(main())
