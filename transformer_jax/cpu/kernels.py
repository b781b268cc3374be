"""Hand-written CPU kernels of a beam-search step (§3.2, §6.1) as XLA FFI custom calls.

In `decoding_attention.cc` (beside this file), for bfloat16 and float32:
  * `decoding_self_attention`: one step of masked self-attention over a cache that is never moved; each row
    writes its own key and value once per position, and beam search reorders a small int32 `ancestry`
    [rows, max_len] instead (row r's position j lives in row r + ancestry[r, j]), which the kernel follows
    when it reads;
  * `cross_attention`: the encoder-decoder attention of a step, the beams of a sentence on its memory row;
  * `beam_scores`: what a beam step reads of the logits (`decoding.beam.extension_scores`), in one pass over each row.
On XLA:CPU those parts of a step go through float32 copies of the whole bf16 cache and five passes over the
logits; docs/performance.md has what the kernels save. They reach a search only through `backend.CpuDecoding`.

The kernels are compiled on first use with the system's C++ compiler (`$CXX`, split as a shell would, so
arguments are allowed and a path with spaces must be quoted; else `c++` or `g++`) for the CPU it runs on
(`-march=native`), into the kernel cache `$TRANSFORMER_JAX_KERNEL_CACHE` (default
~/.cache/transformer_jax/kernels), keyed by the source, compiler command, flags, compiler version, jaxlib
version and CPU, and registered with XLA for the CPU platform. The cache is created with mode 0700, and one that
another user owns or that its group or others may write is refused. Beside each build its sha256 is recorded;
a cached build is loaded only where the two agree (and both are this user's alone), else it is built again,
and a build that no longer loads is built again too. Where the kernels cannot be built or loaded, `available()`
is False, the first failure is logged once with its reason, and decoding uses the XLA path.
"""
import ctypes
import hashlib
import logging
import os
import pathlib
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

Array = jax.Array
_log = logging.getLogger(__name__)
CACHE_ENV = 'TRANSFORMER_JAX_KERNEL_CACHE'

_SOURCE = pathlib.Path(__file__).with_name('decoding_attention.cc')
_FLAGS = ('-O3', '-march=native', '-fno-math-errno', '-fassociative-math', '-fno-signed-zeros',
          '-fno-trapping-math', '-shared', '-fPIC', '-std=c++17', '-w')
if platform.machine().lower() in ('x86_64', 'amd64'):  # An x86 option: 512-bit vectors where AVX-512 has them.
  _FLAGS += ('-mprefer-vector-width=512',)
# The kernels' symbols in decoding_attention.cc, each in these dtypes (symbol + 'BF16' / 'F32').
_KERNELS = ('DecodingAttention', 'CrossAttention', 'BeamScores')
_DTYPE_SUFFIX = {jnp.dtype(jnp.bfloat16): 'BF16', jnp.dtype(jnp.float32): 'F32'}
DTYPES = tuple(_DTYPE_SUFFIX)  # What the kernels take: queries and caches (or logits) all of one of these.


def _target(kernel: str, dtype: jnp.dtype) -> str:
  """The XLA custom-call target of a kernel (one of _KERNELS) for a dtype (one of DTYPES)."""
  return f'transformer_jax_{kernel}{_DTYPE_SUFFIX[dtype]}'


_lock = threading.Lock()
_loaded: str | None = None   # None: not tried yet; '': registered; else why it is unavailable.
_library = None              # Keeps the shared library loaded.


class KernelUnavailable(RuntimeError):
  """The CPU kernel cannot be built or loaded here; the message says why."""


def _cpu_key() -> str:
  """What -march=native depends on: the CPU's flags (Linux), else the machine name."""
  try:
    for line in pathlib.Path('/proc/cpuinfo').read_text().splitlines():
      if line.startswith('flags'):
        return line
  except OSError:
    pass
  return platform.machine() + platform.processor()


def cache_directory() -> pathlib.Path:
  """The kernel cache: $TRANSFORMER_JAX_KERNEL_CACHE, default ~/.cache/transformer_jax/kernels (absolute)."""
  return pathlib.Path(os.path.expanduser(os.environ.get(CACHE_ENV) or '~/.cache/transformer_jax/kernels')).absolute()


def _private(status: os.stat_result) -> bool:
  """Whether a file or folder is this user's and no one else may write it."""
  return status.st_uid == os.getuid() and not status.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _check_directory(directory: pathlib.Path) -> None:
  """Creates the kernel cache with mode 0700 where it does not exist, and refuses one that is not this user's
  alone: a library planted in it would be loaded into this process.

  Raises:
    KernelUnavailable: it cannot be created, is not a folder, belongs to another user, or its group or others
      may write it; the message names the folder and the mend.
  """
  try:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    status = directory.stat()
  except OSError as e:
    raise KernelUnavailable(f'cannot create the kernel cache {directory} (${CACHE_ENV}): {e}') from e
  if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid():
    raise KernelUnavailable(f'refusing the kernel cache {directory}: it is not a folder of this user (uid '
                            f'{os.getuid()}; owner uid {status.st_uid}); set ${CACHE_ENV} to a folder of your own')
  if not _private(status):
    raise KernelUnavailable(f'refusing the kernel cache {directory}: its group or others may write it (mode '
                            f'{stat.S_IMODE(status.st_mode):o}); mend with `chmod 700 {directory}`, or set '
                            f'${CACHE_ENV} to a folder of your own')


def _compiler() -> list[str]:
  """The C++ compiler command: $CXX split as a shell would, else `c++` or `g++`.

  Raises:
    KernelUnavailable: none is found.
  """
  compiler = shlex.split(os.environ.get('CXX', '')) or [shutil.which('c++') or shutil.which('g++') or '']
  if not compiler[0]:
    raise KernelUnavailable('no C++ compiler found (set $CXX, or install g++)')
  return compiler


def _library_path(directory: pathlib.Path, compiler: list[str]) -> pathlib.Path:
  """Where the build of this source with this compiler for this CPU and jaxlib lives in the cache.

  Raises:
    KernelUnavailable: the compiler does not run.
  """
  try:
    version = subprocess.run([*compiler, '--version'], capture_output=True, text=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError) as e:
    raise KernelUnavailable(f'the C++ compiler {" ".join(compiler)!r} does not run: {e}') from e
  key = hashlib.sha256(b'\0'.join([_SOURCE.read_bytes(), ' '.join([*compiler, *_FLAGS]).encode(), version.encode(),
                                   jaxlib.__version__.encode(), _cpu_key().encode()])).hexdigest()[:16]
  return directory / f'decoding_attention-{key}.so'


def _record(library: pathlib.Path) -> pathlib.Path:
  """The file beside a build that records its sha256, written when it was built."""
  return library.with_name(library.name + '.sha256')


def _sha256(path: pathlib.Path) -> str:
  return hashlib.sha256(path.read_bytes()).hexdigest()


def _verified(library: pathlib.Path) -> bool:
  """Whether a cached build is one this user built: the library and its record are plain files (not links) of
  this user that no one else may write, and the library's sha256 is the recorded one."""
  try:
    if not all(stat.S_ISREG(s.st_mode) and _private(s) for s in (library.lstat(), _record(library).lstat())):
      return False
    return _record(library).read_text().strip() == _sha256(library)
  except OSError:
    return False


def _compile(compiler: list[str], library: pathlib.Path) -> None:
  """Compiles decoding_attention.cc to `library` and records its sha256 beside it (`_record`).

  Raises:
    KernelUnavailable: the compiler fails (the message has its output).
  """
  with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
    built, record = pathlib.Path(scratch) / library.name, pathlib.Path(scratch) / _record(library).name
    command = [*compiler, *_FLAGS, f'-I{jax.ffi.include_dir()}', str(_SOURCE), '-o', str(built)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
      raise KernelUnavailable(f'{" ".join(command)} failed:\n{result.stderr[-2000:]}')
    record.write_text(_sha256(built) + '\n')
    os.replace(built, library)  # Atomic: concurrent builders each write a whole file.
    os.replace(record, _record(library))


def _build(rebuild: bool = False) -> pathlib.Path:
  """The path of a verified build of the kernels: the cached one where `_verified`, else compiled now (or
  `rebuild`). A cached library that does not match its record is never loaded: it is built again.

  Raises:
    KernelUnavailable: a kernel cache that is refused or cannot be created (`_check_directory`); no compiler,
      one that does not run or fails.
  """
  directory = cache_directory()
  _check_directory(directory)
  compiler = _compiler()
  library = _library_path(directory, compiler)
  if not rebuild and _verified(library):
    return library
  if not rebuild and os.path.lexists(library):
    _log.warning('Building the CPU decoding kernels again: %s has no sha256 record of this user that matches it',
                 library)
  _compile(compiler, library)
  return library


def load() -> None:
  """Builds (once per machine) and registers the kernels with XLA; cheap after the first call. A cached build
  that does not load is built once more; the first failure is logged, once, with its reason.

  Raises:
    KernelUnavailable: a refused kernel cache, no C++ compiler, or the build or load failed (the message says
      why: the compiler's output, or the mend for the cache).
  """
  global _loaded, _library
  with _lock:
    if _loaded is None:
      try:
        path = _build()
        try:
          library, symbols = _open(path)
        except OSError as e:  # A verified build that does not load (e.g. another C++ runtime): build it once more.
          _log.warning('Rebuilding the CPU decoding kernels: the cached build %s did not load (%s)', path, e)
          library, symbols = _open(_build(rebuild=True))
        for (kernel, dtype), symbol in symbols.items():
          jax.ffi.register_ffi_target(_target(kernel, dtype), jax.ffi.pycapsule(symbol), platform='cpu')
        _library = library
        _loaded = ''
      except (KernelUnavailable, OSError, AttributeError) as e:
        _loaded = str(e)
        _log.warning("The CPU decoding kernels cannot be built or loaded here ('auto' decodes with XLA): %s", _loaded)
    if _loaded:
      raise KernelUnavailable(_loaded)


def _open(path: pathlib.Path) -> tuple[ctypes.CDLL, dict]:
  """The shared library at `path` and its kernels' symbols by (kernel, dtype).

  Raises:
    OSError: it does not load. AttributeError: a kernel's symbol is missing.
  """
  library = ctypes.cdll.LoadLibrary(str(path))
  return library, {(kernel, dtype): getattr(library, kernel + suffix)
                   for kernel in _KERNELS for dtype, suffix in _DTYPE_SUFFIX.items()}


def available() -> bool:
  """Whether the kernels can run here (builds and registers them on the first call)."""
  try:
    load()
  except KernelUnavailable:
    return False
  return True


def cross_attention(query: Array, key: Array, value: Array, valid: Array) -> Array:
  """The encoder-decoder attention of one decoding step (Eq. 1, §3.2.3) on the CPU kernel.

  The beams of a sentence are consecutive query rows and share its memory row. Equal to
  `attention.dot_product_attention` with the queries of a sentence's beams folded into its query length (the
  XLA path), up to float32 summation order.

  Args:
    query: [rows, num_heads, d_k], bfloat16 or float32; rows = batch * beams.
    key: [batch, kv_heads, src_len, d_k], query's dtype, heads-first as the cache stores it; kv_heads divides
      num_heads.
    value: [batch, kv_heads, src_len, d_v], query's dtype.
    valid: bool [batch, src_len], the source positions that may be attended (not padding). A row with none
      gets zeros.

  Returns:
    [rows, num_heads, d_v] in query's dtype.

  Raises:
    KernelUnavailable: the kernels cannot be built here.
    ValueError: for other dtypes.
  """
  dtype = jnp.dtype(query.dtype)
  if dtype not in DTYPES or jnp.dtype(key.dtype) != dtype or jnp.dtype(value.dtype) != dtype:
    raise ValueError(f'the cross-attention kernel takes bfloat16 or float32 throughout, got query {query.dtype}, '
                     f'key {key.dtype}, value {value.dtype}')
  load()
  output = jax.ShapeDtypeStruct((*query.shape[:2], value.shape[-1]), dtype)
  return jax.ffi.ffi_call(_target('CrossAttention', dtype), output)(query, key, value, valid.astype(bool))


def beam_scores(logits: Array, k: int, *, eos_id: int, bos_id: int, pad_id: int
                ) -> tuple[Array, Array, Array, Array]:
  """`decoding.beam.extension_scores` (what a beam step reads of the logits, §6.1) in one pass over each row.

  XLA makes five passes; on XLA:CPU they were a fifth of a step at 40 sentences x beam 4, vocabulary 8,000.
  The same values, the log-sum-exp to float32 rounding, for logits without NaN (a NaN counts as exp(-87) in the
  log-sum-exp, and the top k assume none).

  Args:
    logits: [rows, vocab], float32 or bfloat16.
    k: how many of the best tokens to return, 1 <= k <= vocab.
    eos_id, bos_id, pad_id: the special ids; PAD and BOS are never generated.

  Returns:
    float32 [rows] log-sum-exp over the tokens other than PAD and BOS; float32 [rows, k] the largest logits
    of the tokens other than PAD, BOS and EOS, best first, and int32 [rows, k] their ids (equal logits to the
    lowest id, as `jax.lax.top_k`, except that -0.0 and +0.0 count as equal, where top_k puts +0.0 first);
    float32 [rows] the EOS logit.

  Raises:
    KernelUnavailable: the kernels cannot be built here.
    ValueError: for another dtype.
    jax.errors.JaxRuntimeError: at run time, for k or an id outside the vocabulary.
  """
  dtype = jnp.dtype(logits.dtype)
  if dtype not in DTYPES:
    raise ValueError(f'beam_scores takes bfloat16 or float32 logits, got {logits.dtype}')
  load()
  rows = logits.shape[0]
  shapes = (jax.ShapeDtypeStruct((rows,), jnp.float32), jax.ShapeDtypeStruct((rows, k), jnp.float32),
            jax.ShapeDtypeStruct((rows, k), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.float32))
  return jax.ffi.ffi_call(_target('BeamScores', dtype), shapes)(
      logits, k=np.int64(k), eos_id=np.int64(eos_id), bos_id=np.int64(bos_id), pad_id=np.int64(pad_id))


def decoding_self_attention(query: Array, key_cache: Array, value_cache: Array, ancestry: Array, new_key: Array,
                            new_value: Array, index: Array) -> tuple[Array, Array, Array, Array]:
  """One decoding step of self-attention (Eq. 1) on the CPU kernel, the caches updated in place.

  Row r's key and value at position j < index are those of row r + ancestry[r, j]; this step writes row r's
  new_key and new_value at position `index` (ancestry 0 there) and attends over positions 0..index. Equal to
  `attention.decoding_attention` on caches gathered along the ancestry, up to float32 summation order.

  Args:
    query: [rows, num_heads, d_k], bfloat16 or float32.
    key_cache: [rows, kv_heads, max_len, d_k], query's dtype; kv_heads divides num_heads (query head i reads
      key/value head i // (num_heads // kv_heads)).
    value_cache: [rows, kv_heads, max_len, d_v], query's dtype.
    ancestry: int32 [rows, max_len] (another integer dtype is converted); at positions j < index,
      r + ancestry[r, j] in [0, rows).
    new_key: [rows, kv_heads, d_k]; new_value: [rows, kv_heads, d_v].
    index: int32 [], the step's position, in [0, max_len).

  Returns:
    (output [rows, num_heads, d_v] in query's dtype, key_cache, value_cache, int32 ancestry), the caches
    updated.

  Raises:
    KernelUnavailable: the kernels cannot be built here.
    ValueError: for other dtypes.
    jax.errors.JaxRuntimeError: at run time, for an index outside the cache or an ancestry pointing outside
      its rows.
  """
  dtype = jnp.dtype(query.dtype)
  if dtype not in DTYPES or any(jnp.dtype(x.dtype) != dtype for x in (key_cache, value_cache, new_key, new_value)):
    raise ValueError(f'the decoding kernel takes bfloat16 or float32 throughout, got query {query.dtype}, '
                     f'caches {key_cache.dtype}/{value_cache.dtype}, new {new_key.dtype}/{new_value.dtype}')
  load()
  output = jax.ShapeDtypeStruct((*query.shape[:2], value_cache.shape[-1]), dtype)
  results = (jax.ShapeDtypeStruct(key_cache.shape, dtype), jax.ShapeDtypeStruct(value_cache.shape, dtype),
             jax.ShapeDtypeStruct(ancestry.shape, jnp.int32))
  call = jax.ffi.ffi_call(_target('DecodingAttention', dtype), (output, *results),
                          input_output_aliases={1: 1, 2: 2, 3: 3})
  return call(query, key_cache, value_cache, ancestry.astype(jnp.int32), new_key, new_value,
              jnp.asarray(index, jnp.int32))
