"""Waiting for the processes of a multi-process test (test_multihost.py, test_shared_workdir.py)."""
import json
import pathlib
import subprocess


def results(started: list[tuple[subprocess.Popen, pathlib.Path]], timeout_secs: float) -> list[dict]:
  """Waits for every process (killing all on a timeout), asserts each exited 0 (showing the end of its log
  otherwise) and reads the JSON result each wrote to its path."""
  try:
    logs = [proc.communicate(timeout=timeout_secs)[0] for proc, _ in started]
  finally:
    for proc, _ in started:
      proc.kill()
  for (proc, _), log in zip(started, logs):
    assert proc.returncode == 0, log[-3000:]
  return [json.loads(out.read_text()) for _, out in started]
