"""The host's memory allocator for XLA:CPU: without care, page faults take a quarter of a CPU train step.

XLA:CPU allocates a step's temporary buffers afresh at every step, hundreds of megabytes at the main job's
shape, and glibc's malloc hands blocks that large back to the kernel when they are freed (one arena per
thread, large blocks mmap-ed and unmapped), so every step faults the same memory in again. tcmalloc keeps
them, and so does glibc's malloc with one arena, no mmap and no trimming (`tune_glibc_malloc`);
docs/performance.md has the page faults and step times of each allocator.

`use_fast_allocator`, which `python -m transformer_jax.main` and the benchmark scripts call before JAX
starts, therefore runs the command under tcmalloc where the library is installed (it re-executes the same
command line with the library in LD_PRELOAD: an allocator cannot be swapped inside a running process; the
re-executed process puts LD_PRELOAD back as it was, so that its own subprocesses start as they would have),
and otherwise tunes glibc's malloc in place. Both keep freed memory in the process: its resident size stays at
its high-water mark. The environment variable TRANSFORMER_JAX_ALLOCATOR chooses: 'auto' (the default, as
above), 'tcmalloc' (required: an error without it), 'glibc' (tuned glibc) or 'system' (leave the process
as it started).
"""
import ctypes
import os
import pathlib
import sys

ALLOCATOR_ENV = 'TRANSFORMER_JAX_ALLOCATOR'
CHOICES = ('auto', 'tcmalloc', 'glibc', 'system')
# Set for the re-executed process, so that a library that fails to load cannot cause a loop of re-executions;
# it holds LD_PRELOAD as it was before, which the re-executed process restores.
_REEXECUTED_ENV = 'TRANSFORMER_JAX_ALLOCATOR_REEXECUTED'
# Where Debian/Ubuntu (libtcmalloc-minimal4, libgoogle-perftools4), Fedora/RHEL (gperftools-libs) and conda
# install tcmalloc.
TCMALLOC_PATHS = (
    '/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4', '/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4',
    '/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4', '/usr/lib/aarch64-linux-gnu/libtcmalloc.so.4',
    '/usr/lib64/libtcmalloc_minimal.so.4', '/usr/lib64/libtcmalloc.so.4',
    str(pathlib.Path(sys.prefix) / 'lib' / 'libtcmalloc_minimal.so.4'),
    str(pathlib.Path(sys.prefix) / 'lib' / 'libtcmalloc.so.4'),
)
# What `use_fast_allocator` chose in this process ('tcmalloc', 'glibc (tuned)' or 'system'); None before it ran.
chosen: str | None = None
# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def tcmalloc_loaded() -> bool:
  """Whether this process runs with tcmalloc (a tcmalloc library is mapped into it; Linux only)."""
  try:
    return 'libtcmalloc' in pathlib.Path('/proc/self/maps').read_text()
  except OSError:
    return False


def find_tcmalloc() -> str | None:
  """The first of TCMALLOC_PATHS that exists, or None."""
  return next((path for path in TCMALLOC_PATHS if os.path.exists(path)), None)


def tune_glibc_malloc() -> bool:
  """Makes glibc's malloc keep freed memory: one arena, no mmap for large blocks, no trimming (mallopt).

  Returns:
    True if glibc's mallopt accepted all three settings; False on another C library (nothing changes).
  """
  if sys.platform != 'linux':
    return False
  libc = ctypes.CDLL(None)  # The C library the process runs with.
  if not hasattr(libc, 'mallopt') or not hasattr(libc, 'gnu_get_libc_version'):  # musl has no mallopt effect.
    return False
  settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))
  return all(libc.mallopt(parameter, value) == 1 for parameter, value in settings)


def use_fast_allocator(choice: str | None = None) -> str:
  """Runs this process under tcmalloc, or with glibc's malloc tuned, as TRANSFORMER_JAX_ALLOCATOR says.

  Call it before JAX starts (it may replace the process: os.execve of the same command line with tcmalloc in
  LD_PRELOAD; nothing after the call runs twice, what ran before it does).

  Args:
    choice: one of CHOICES; None reads TRANSFORMER_JAX_ALLOCATOR ('auto' when unset).

  Returns:
    What the process now uses: 'tcmalloc', 'glibc (tuned)' or 'system' (also kept in `chosen`, which
    `experiment.log_backend` logs).

  Raises:
    ValueError: for a choice not in CHOICES, naming the environment variable.
    FileNotFoundError: for 'tcmalloc' when no tcmalloc library is installed (TCMALLOC_PATHS) or the one found
      did not load.
  """
  global chosen
  choice = choice or os.environ.get(ALLOCATOR_ENV, 'auto')
  if choice not in CHOICES:
    raise ValueError(f'{ALLOCATOR_ENV}={choice!r}: expected one of {", ".join(CHOICES)}')
  reexecuted = _REEXECUTED_ENV in os.environ
  if reexecuted:  # This process was re-executed: LD_PRELOAD has done its work; children start as before.
    previous = os.environ.pop(_REEXECUTED_ENV)
    if previous:
      os.environ['LD_PRELOAD'] = previous
    else:
      os.environ.pop('LD_PRELOAD', None)
  if choice == 'system' or tcmalloc_loaded():
    chosen = 'tcmalloc' if tcmalloc_loaded() else 'system'
    return chosen
  library = find_tcmalloc() if choice in ('auto', 'tcmalloc') else None
  if choice == 'tcmalloc' and (library is None or reexecuted):
    where = (f'{library} did not load (LD_PRELOAD)' if library
             else f'no tcmalloc library at any of {", ".join(TCMALLOC_PATHS)}')
    raise FileNotFoundError(f'{ALLOCATOR_ENV}=tcmalloc: {where} (Debian/Ubuntu: apt install libtcmalloc-minimal4)')
  if library is not None and not reexecuted:
    preload = ':'.join(filter(None, (library, os.environ.get('LD_PRELOAD'))))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
      os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]],
                os.environ | {'LD_PRELOAD': preload, _REEXECUTED_ENV: os.environ.get('LD_PRELOAD', '')})
    except OSError:  # The interpreter cannot be started again: carry on without tcmalloc.
      pass
  chosen = 'glibc (tuned)' if tune_glibc_malloc() else 'system'
  return chosen
