"""Tests for transformer_jax.cpu.host_allocator: the command runs under tcmalloc where it is installed (re-executed
with its own arguments, once), else with glibc's malloc tuned; a bad choice is refused by name."""
import json
import os
import subprocess
import sys

import pytest

from transformer_jax.cpu import host_allocator

# Prints what use_fast_allocator chose, whether tcmalloc is mapped, the arguments and how often it started.
_PROBE = """
import json, os, sys
from transformer_jax.cpu import host_allocator
if len(sys.argv) > 3:
  host_allocator.TCMALLOC_PATHS = (sys.argv[3],)
starts = int(os.environ.get('PROBE_STARTS', '0')) + 1
os.environ['PROBE_STARTS'] = str(starts)  # Inherited by a re-executed process.
chosen = host_allocator.use_fast_allocator()
assert host_allocator.chosen == chosen
assert 'LD_PRELOAD' not in os.environ  # Put back as it was: the children of this process start without it.
print(json.dumps({'chosen': chosen, 'tcmalloc': host_allocator.tcmalloc_loaded(), 'argv': sys.argv[1:3],
                  'starts': starts}))
"""


def probe(choice: str, *extra: str) -> dict:
  env = {k: v for k, v in os.environ.items()
         if k not in ('LD_PRELOAD', 'PROBE_STARTS', host_allocator._REEXECUTED_ENV)}  # pylint: disable=protected-access
  env[host_allocator.ALLOCATOR_ENV] = choice
  result = subprocess.run([sys.executable, '-c', _PROBE, 'first', 'second', *extra], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
  return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(sys.platform != 'linux', reason='mallopt and /proc/self/maps are Linux (glibc) facilities')
def test_auto_uses_tcmalloc_where_installed_and_keeps_the_arguments():
  found = host_allocator.find_tcmalloc()
  result = probe('auto')
  assert result['argv'] == ['first', 'second']
  if found:  # Re-executed once under LD_PRELOAD.
    assert result == {'chosen': 'tcmalloc', 'tcmalloc': True, 'argv': ['first', 'second'], 'starts': 2}
  else:
    assert result == {'chosen': 'glibc (tuned)', 'tcmalloc': False, 'argv': ['first', 'second'], 'starts': 1}


@pytest.mark.skipif(sys.platform != 'linux', reason='mallopt is a glibc facility')
def test_glibc_is_tuned_in_place_and_system_leaves_the_process_alone():
  assert probe('glibc') == {'chosen': 'glibc (tuned)', 'tcmalloc': False, 'argv': ['first', 'second'], 'starts': 1}
  assert probe('system') == {'chosen': 'system', 'tcmalloc': False, 'argv': ['first', 'second'], 'starts': 1}


@pytest.mark.skipif(sys.platform != 'linux', reason='LD_PRELOAD is a Linux (ld.so) facility')
def test_a_library_that_does_not_load_is_tried_once(tmp_path):
  broken = tmp_path / 'libtcmalloc_minimal.so.4'
  broken.write_bytes(b'not a shared library')  # ld.so ignores it (with a warning): tcmalloc never loads.
  result = probe('auto', str(broken))
  assert result == {'chosen': 'glibc (tuned)', 'tcmalloc': False, 'argv': ['first', 'second'], 'starts': 2}
  with pytest.raises(subprocess.CalledProcessError) as error:  # Required, so a library that did not load is an error.
    probe('tcmalloc', str(broken))
  assert f'TRANSFORMER_JAX_ALLOCATOR=tcmalloc: {broken} did not load (LD_PRELOAD)' in error.value.stderr


def test_bad_choice_and_missing_tcmalloc_are_refused_by_name(monkeypatch):
  with pytest.raises(ValueError, match=r"TRANSFORMER_JAX_ALLOCATOR='fast': expected one of auto, tcmalloc, glibc, "
                                       r'system'):
    host_allocator.use_fast_allocator('fast')
  monkeypatch.setattr(host_allocator, 'TCMALLOC_PATHS', ('/nonexistent/libtcmalloc.so.4',))
  monkeypatch.setattr(host_allocator, 'tcmalloc_loaded', lambda: False)
  with pytest.raises(FileNotFoundError, match=r'TRANSFORMER_JAX_ALLOCATOR=tcmalloc: no tcmalloc library at any of '
                                              r'/nonexistent/libtcmalloc\.so\.4'):
    host_allocator.use_fast_allocator('tcmalloc')


def test_the_command_line_names_a_bad_choice_in_one_line():
  env = dict(os.environ, TRANSFORMER_JAX_ALLOCATOR='fast')
  result = subprocess.run([sys.executable, '-m', 'transformer_jax.main', '--mode=config'], env=env,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines() == [
      "TRANSFORMER_JAX_ALLOCATOR='fast': expected one of auto, tcmalloc, glibc, system"]
