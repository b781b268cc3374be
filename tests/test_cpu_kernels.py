"""The C++ decoding kernels (transformer_jax.cpu): the XLA path's numbers, the same translations, and the
backend that is their only way into a search."""
import contextlib
import ctypes
import hashlib
import logging
import os
import re
import shutil
import stat
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.test_evaluate import SOURCE, init_params, make_model
from transformer_jax.cpu import backend as cpu_backend
from transformer_jax.cpu import kernels
from transformer_jax.decoding import backends
from transformer_jax.decoding import beam
from transformer_jax.decoding import translate
from transformer_jax.model import attention

CPU = cpu_backend.CpuDecoding()


@pytest.fixture(name='kernels')
def fixture_kernels():
  """Builds the kernels once per test session (conftest gives it its own folder); skips without a compiler."""
  if not kernels.available():
    pytest.skip('the CPU kernels do not build here (no C++ compiler?)')


def gathered_step(query, key_cache, value_cache, new_key, new_value, parent, index):
  """The XLA path of a beam step: caches gathered for the parents, the position written, then attention."""
  key_cache, value_cache = key_cache[parent], value_cache[parent]
  key_cache = jax.lax.dynamic_update_slice(key_cache, new_key[:, :, None], (0, 0, index, 0))
  value_cache = jax.lax.dynamic_update_slice(value_cache, new_value[:, :, None], (0, 0, index, 0))
  mask = (jnp.arange(key_cache.shape[2]) <= index)[None, None, None, :]
  output, _ = attention.decoding_attention(query[:, None], key_cache, value_cache, mask)
  return output[:, 0], key_cache, value_cache


@pytest.mark.usefixtures('kernels')
@pytest.mark.parametrize('dtype, tolerance', [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize('kv_heads', [4, 2, 1])
def test_kernel_steps_equal_the_xla_path_with_beams_reordered(dtype, tolerance, kv_heads):
  """Eight steps of a beam search over 3 sentences x beam 4, each step's parents drawn at random within the
  sentence, in one compiled loop (the caches updated in place): the kernel, which never moves its cache and
  reorders the ancestry instead, gives the output of the XLA path, which gathers the whole cache at every step
  (multi-head, grouped-query, multi-query)."""
  rng = np.random.default_rng(0)
  beam_size, rows, heads, max_len, d = 4, 12, 4, 8, 64
  draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  queries, new_keys, new_values = draw(max_len, rows, heads, d), draw(max_len, rows, kv_heads, d), draw(
      max_len, rows, kv_heads, d)
  parents = jnp.asarray(rng.integers(0, beam_size, (max_len, rows // beam_size, beam_size)))
  empty = jnp.zeros((rows, kv_heads, max_len, d), dtype)

  @jax.jit
  def both(queries, new_keys, new_values, parents):
    def step(carry, x):
      reference, kernel, ancestry = carry
      index, query, new_key, new_value, parent = x
      rows_of = (jnp.arange(rows // beam_size)[:, None] * beam_size + parent).reshape(-1)
      expected, *reference = gathered_step(query, *reference, new_key, new_value, rows_of, index)
      ancestry = CPU.reorder_cache({'ancestry': ancestry}, parent, beam_size)['ancestry']
      output, *kernel, ancestry = kernels.decoding_self_attention(query, *kernel, ancestry, new_key,
                                                                     new_value, index)
      return (tuple(reference), tuple(kernel), ancestry), (output, expected)
    init = ((empty, empty), (empty, empty), jnp.zeros((rows, max_len), jnp.int32))
    return jax.lax.scan(step, init, (jnp.arange(max_len), queries, new_keys, new_values, parents))

  (reference, kernel, ancestry), (outputs, expected) = both(queries, new_keys, new_values, parents)
  np.testing.assert_allclose(np.asarray(outputs, np.float32), np.asarray(expected, np.float32),
                             rtol=tolerance, atol=tolerance)
  # Followed through the ancestry, the kernel's cache holds the gathered cache's values.
  source_rows = np.arange(rows)[:, None] + np.asarray(ancestry)  # [rows, max_len]
  held = np.asarray(kernel[0], np.float32)[source_rows, :, np.arange(max_len)[None, :]]  # [rows, max_len, kv, d]
  np.testing.assert_array_equal(held.transpose(0, 2, 1, 3), np.asarray(reference[0], np.float32))


@pytest.mark.usefixtures('kernels')
def test_bad_indices_fail_at_run_time_without_reading_outside_the_cache():
  rows, max_len = 2, 3
  query, new = jnp.zeros((rows, 1, 64)), jnp.zeros((rows, 1, 64))
  cache = jnp.zeros((rows, 1, max_len, 64))
  call = lambda ancestry, index: jax.block_until_ready(kernels.decoding_self_attention(
      query, cache, cache, jnp.asarray(ancestry, jnp.int32), new, new, index))
  with pytest.raises(jax.errors.JaxRuntimeError, match='cache index 3 outside'):
    call(np.zeros((rows, max_len)), 3)
  with pytest.raises(jax.errors.JaxRuntimeError, match='ancestry points outside'):
    call([[0, 0, 0], [1, 0, 0]], 1)  # Row 1, position 0: row 2 of 2.


def test_reorder_moves_the_ancestry_not_the_cache():
  """Rows 0, 1 of sentence 0 take beams 1, 1 and rows 2, 3 of sentence 1 take beams 1, 0: the caches under an
  'ancestry' entry (also inside a tuple) stay where they are, the ancestry is the parent's shifted by
  (parent row - row)."""
  key = jnp.arange(4.0)[:, None, None, None] * jnp.ones((4, 1, 3, 2))
  layer = {'cached_key': key, 'cache_index': jnp.int32(2),
           'ancestry': jnp.asarray([[0, 1, 0], [0, 0, 0], [0, 1, 0], [0, -1, 0]], jnp.int32)}
  out = CPU.reorder_cache(({'layer': layer}, jnp.arange(4.0)), jnp.asarray([[1, 1], [1, 0]]), beam_size=2)
  np.testing.assert_array_equal(out[0]['layer']['cached_key'], key)
  np.testing.assert_array_equal(out[0]['layer']['ancestry'], [[1, 1, 1], [0, 0, 0], [1, 0, 1], [-1, 0, -1]])
  np.testing.assert_array_equal(out[1], [1, 1, 3, 2])  # Elsewhere rows are gathered as before.


@pytest.mark.integration
@pytest.mark.usefixtures('kernels')
@pytest.mark.parametrize('overrides, beam_size', [
    ({}, 3), (dict(dtype='bfloat16', num_kv_heads=1, position_embedding='rope'), 3), ({}, 1)])
def test_kernels_decode_the_same_translations(overrides, beam_size):
  """Whole searches (cache stages, and compaction, which gathers whole sentences' rows with their ancestry;
  greedy where beam_size is 1 without scores) give the same tokens and scores on the kernels as on XLA."""
  source = np.concatenate([SOURCE, SOURCE[::-1], SOURCE], axis=0)
  results = {}
  for kernel in ('cpu', 'xla'):
    model = make_model(decoding_kernel=kernel, **overrides)
    params = init_params(model, seed=3)
    common = dict(model=model, beam_size=beam_size, alpha=0.6, extra_length=9, cache_stages=(4, 8))
    plain = translate.decode_batch(params, jnp.asarray(source), with_scores=True, **common)
    compacted = translate.decode_batch_compacted(params, source, compact_every_steps=2, min_size=2,
                                                 with_scores=beam_size > 1, **common)
    compacted = compacted if isinstance(compacted, tuple) else (compacted,)
    results[kernel] = [np.asarray(x) for x in (*plain, *compacted)]
  for got, expected in zip(results['cpu'], results['xla']):
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def self_attention_cache_names(backend='chosen', **overrides):
  """The entries of a self-attention cache as `Transformer.init_cache` creates them under a backend: 'chosen' by
  `backends.decoding_backend` from the model's config, or None for the model alone."""
  model = make_model(**overrides)
  if backend == 'chosen':
    backend = backends.decoding_backend(model.cfg)
  memory = jnp.zeros((2, SOURCE.shape[1], 16))
  with backend.attention() if backend else contextlib.nullcontext():
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), memory, jnp.asarray(SOURCE != 0, jnp.int32), 5,
                                               2, method='init_cache')['cache'])
  return sorted(shapes['decoder']['layer_0']['self_attention'])


XLA_LAYOUT = ['cache_index', 'cached_key', 'cached_value']
KERNEL_LAYOUT = ['ancestry', 'cache_index', 'cached_key', 'cached_value']


@pytest.mark.usefixtures('kernels')
def test_auto_uses_the_kernels_on_one_cpu_device_only(monkeypatch):
  """This process has 8 CPU devices (conftest): 'auto' keeps the XLA layout; on one device it takes the
  kernel's; 'cpu' always does; float32 products with a bf16 compute dtype fit no kernel."""
  assert jax.device_count() == 8
  assert self_attention_cache_names(decoding_kernel='auto') == XLA_LAYOUT
  assert self_attention_cache_names(decoding_kernel='cpu') == KERNEL_LAYOUT
  monkeypatch.setattr(jax, 'device_count', lambda: 1)
  assert self_attention_cache_names(decoding_kernel='auto') == KERNEL_LAYOUT
  assert self_attention_cache_names(decoding_kernel='auto', dtype='bfloat16',
                                    attention_product_dtype='float32') == XLA_LAYOUT
  with pytest.raises(ValueError, match="decoding_kernel='cpu' needs the attention products"):
    self_attention_cache_names(decoding_kernel='cpu', dtype='bfloat16', attention_product_dtype='float32')


def test_auto_falls_back_to_xla_without_the_kernels(monkeypatch):
  monkeypatch.setattr(jax, 'device_count', lambda: 1)
  monkeypatch.setattr(kernels, 'available', lambda: False)
  assert self_attention_cache_names(decoding_kernel='auto') == XLA_LAYOUT


@pytest.mark.usefixtures('kernels')
def test_the_model_alone_never_takes_the_kernels():
  """model.decoding_kernel is a decoding choice: the model applied outside a backend's context is plain XLA,
  and the kernels' backend changes the cache's layout only inside it."""
  assert self_attention_cache_names(None, decoding_kernel='cpu') == XLA_LAYOUT
  assert self_attention_cache_names(CPU, decoding_kernel='xla') == KERNEL_LAYOUT


def test_the_backend_is_chosen_once_on_the_host(monkeypatch):
  """A compacted search and a whole split each choose their backend once, outside any trace."""
  tracing = lambda: isinstance(jnp.zeros(()) + 1, jax.core.Tracer)
  calls = []
  wanted = cpu_backend.wanted
  monkeypatch.setattr(cpu_backend, 'wanted', lambda cfg: (calls.append(tracing()), wanted(cfg))[1])
  model = make_model()
  params = init_params(model, seed=1)
  translate.decode_batch_compacted(params, SOURCE, model=model, beam_size=2, alpha=0.6, extra_length=3,
                                   compact_every_steps=1, min_size=1)
  batches = [{'source_tokens': SOURCE, 'example_index': np.arange(len(SOURCE))}]
  translate.decode_all(params, batches, len(SOURCE), model=model, beam_size=2, alpha=0.6, extra_length=3,
                       compact_every_steps=1)
  assert calls == [False, False]


def test_grow_decoding_cache_pads_the_ancestry():
  cache = {'cached_key': jnp.ones((2, 1, 3, 4)), 'cached_value': jnp.ones((2, 1, 3, 4)),
           'cache_index': jnp.int32(3), 'ancestry': jnp.ones((2, 3), jnp.int32)}
  grown = CPU.grow_cache(cache, 5)
  assert grown['ancestry'].shape == (2, 5) and grown['cached_key'].shape == (2, 1, 5, 4)
  np.testing.assert_array_equal(grown['ancestry'][:, 3:], 0)


def test_a_missing_compiler_is_reported_not_crashed(monkeypatch, tmp_path):
  monkeypatch.setenv('CXX', str(tmp_path / 'no-such-compiler'))
  with pytest.raises(kernels.KernelUnavailable, match='does not run'):
    kernels._build()


def test_cpu_setting_names_the_config_key_where_the_kernels_cannot_build(monkeypatch, tmp_path):
  monkeypatch.setattr(kernels, '_loaded', None)  # Not built yet in this process, as far as load() knows.
  monkeypatch.setenv('CXX', str(tmp_path / 'no-such-compiler'))
  with pytest.raises(kernels.KernelUnavailable, match=r"model.decoding_kernel='cpu'.*'auto'.*does not run"):
    backends.decoding_backend(make_model(decoding_kernel='cpu').cfg)
  monkeypatch.setattr(jax, 'device_count', lambda: 1)
  # Where 'auto' would take them, it falls back to XLA instead.
  assert backends.decoding_backend(make_model(decoding_kernel='auto').cfg) == backends.XlaDecoding()


@pytest.mark.integration
@pytest.mark.usefixtures('kernels')
def test_a_cached_build_that_does_not_load_is_built_again(monkeypatch, tmp_path):
  """A truncated library in the cache (an interrupted copy, a full disk) is replaced, not kept failing."""
  monkeypatch.setenv('TRANSFORMER_JAX_KERNEL_CACHE', str(tmp_path))
  library = kernels._build()
  size = library.stat().st_size
  library.write_bytes(library.read_bytes()[:100])
  # A new process (XLA keeps one library per kernel name in a process, so not this one).
  subprocess.run([sys.executable, '-c', 'from transformer_jax.cpu import kernels; kernels.load()'],
                 check=True, env=os.environ | {'JAX_PLATFORMS': 'cpu'})
  assert library.stat().st_size == size


@pytest.mark.integration
def test_a_compiler_command_with_arguments_builds(monkeypatch, tmp_path):
  """$CXX may carry arguments (`ccache g++`, `g++ -O2`): split as a shell would, and part of the cache key."""
  compiler = shutil.which('g++') or shutil.which('c++')
  if not compiler:
    pytest.skip('no C++ compiler here')
  monkeypatch.setenv('TRANSFORMER_JAX_KERNEL_CACHE', str(tmp_path))
  monkeypatch.setenv('CXX', f'{compiler} -w')
  with_argument = kernels._build()
  assert with_argument.exists() and with_argument.parent == tmp_path
  monkeypatch.setenv('CXX', compiler)
  assert kernels._build().name != with_argument.name


@pytest.mark.usefixtures('kernels')
def test_a_decoding_step_with_attention_dropout_leaves_the_cross_attention_kernel(monkeypatch):
  """The cross-attention kernel applies no dropout; a step with dropout on (deterministic=False) runs on XLA
  and gives the XLA path's logits under the same dropout key."""
  monkeypatch.setattr(jax, 'device_count', lambda: 1)
  memory = jnp.asarray(np.random.default_rng(5).standard_normal((2, SOURCE.shape[1], 16)), jnp.float32)
  segment_ids = jnp.asarray(SOURCE != 0, jnp.int32)
  logits = {}
  for kernel in ('cpu', 'xla'):
    model = make_model(decoding_kernel=kernel, attention_dropout_rate=0.5)
    params = init_params(model, seed=6)
    with backends.decoding_backend(model.cfg).attention():
      _, variables = model.apply({'params': params}, memory, segment_ids, 4, method='init_cache', mutable=['cache'])
      logits[kernel], _ = model.apply({'params': params, 'cache': variables['cache']}, jnp.ones((2, 1), jnp.int32),
                                      memory, segment_ids, deterministic=False, use_cache=True, method='decode',
                                      mutable=['cache'], rngs={'dropout': jax.random.key(7)})
    assert ('ancestry' in variables['cache']['decoder']['layer_0']['self_attention']) == (kernel == 'cpu')
  np.testing.assert_allclose(logits['cpu'], logits['xla'], rtol=1e-5, atol=1e-5)


def test_bad_dtypes_are_refused_before_the_call():
  x = jnp.zeros((2, 1, 4), jnp.float16)
  with pytest.raises(ValueError, match='bfloat16 or float32'):
    kernels.decoding_self_attention(x, jnp.zeros((2, 1, 3, 4), jnp.float16), jnp.zeros((2, 1, 3, 4), jnp.float16),
                                        jnp.zeros((2, 3), jnp.int32), x[:, :1], x[:, :1], 0)


@pytest.mark.usefixtures('kernels')
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_beam_scores_equal_the_xla_path(dtype):
  """Log-sum-exp, the k best non-special tokens (with ties, which go to the lowest id, as lax.top_k) and the
  EOS logit, on rows where the best logit is EOS's, BOS's or PAD's, a row of equal logits, a row with +inf;
  and a vocabulary shorter than one block, with k equal to it."""
  rng = np.random.default_rng(1)
  logits = rng.standard_normal((7, 300)).astype(np.float32) * 4
  logits[1, 2] = logits[2, 1] = logits[3, 0] = 50.0  # EOS / BOS / PAD best (EOS 2, BOS 1, PAD 0 below).
  logits[4, 100:110] = logits[4].max() + 1  # Ten tied best tokens.
  logits[5] = 0.25
  logits[6, 7] = np.inf
  special = dict(eos_id=2, bos_id=1, pad_id=0)
  for x, k in ((logits, 4), (logits[:2, :10], 10)):
    x = jnp.asarray(x, dtype)
    got, expected = kernels.beam_scores(x, k, **special), beam.extension_scores(x, k, **special)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-6)  # Log-sum-exp: float32 rounding apart.
    for g, e in zip(got[1:], expected[1:]):
      np.testing.assert_array_equal(g, e)
  np.testing.assert_array_equal(got[2][0, 7:], [0, 1, 2])  # PAD, BOS, EOS last, at -inf, in id order.
  got = kernels.beam_scores(jnp.asarray(logits, dtype), 4, **special)
  np.testing.assert_array_equal(got[2][4], [100, 101, 102, 103])
  np.testing.assert_array_equal(got[2][5], [3, 4, 5, 6])


@pytest.mark.usefixtures('kernels')
@pytest.mark.parametrize('dtype, tolerance', [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize('kv_heads', [4, 1])
def test_cross_attention_equals_the_xla_path(dtype, tolerance, kv_heads):
  """3 sentences x beam 2 against memories of 5 positions, one sentence with 2 padded positions and one with
  all 5 padded (zeros out, as the XLA path's fully masked rows)."""
  rng = np.random.default_rng(2)
  batch, beam_size, heads, src_len, d = 3, 2, 4, 5, 64
  draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  query = draw(batch * beam_size, heads, d)
  key, value = draw(batch, kv_heads, src_len, d), draw(batch, kv_heads, src_len, d)
  valid = jnp.asarray([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], bool)
  got = kernels.cross_attention(query, key, value, valid)
  folded = query.reshape(batch, beam_size, heads, d)  # The beams of a sentence as its query positions.
  expected, _ = attention.dot_product_attention(folded, jnp.swapaxes(key, 1, 2), jnp.swapaxes(value, 1, 2),
                                                valid[:, None, None, :])
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected.reshape(got.shape), np.float32),
                             rtol=tolerance, atol=tolerance)
  np.testing.assert_array_equal(np.asarray(got[4:], np.float32), 0.0)


@pytest.mark.integration
@pytest.mark.parametrize('kernel', ['cpu', 'xla'])
def test_weights_cast_before_the_search_decode_the_same(kernel, request):
  """`translate.params_in_compute_dtype` (what translate.decode_all does once) leaves a bf16 search's tokens and
  scores exactly as casting inside every step does; norm parameters (1-D) stay float32."""
  if kernel == 'cpu':
    request.getfixturevalue('kernels')
  model = make_model(dtype='bfloat16', decoding_kernel=kernel)
  params = init_params(model, seed=4)
  cast = translate.params_in_compute_dtype(params, model.cfg)
  assert cast['shared_embedding']['embedding'].dtype == jnp.bfloat16
  assert {x.dtype for x in jax.tree.leaves(cast) if x.ndim == 1} == {jnp.dtype(jnp.float32)}
  decode = lambda p: translate.decode_batch(p, jnp.asarray(SOURCE), model=model, beam_size=3, alpha=0.6,
                                            extra_length=6, with_scores=True)
  for got, expected in zip(decode(cast), decode(params)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


@pytest.fixture(name='no_loading')
def fixture_no_loading(monkeypatch, tmp_path):
  """A kernel cache folder of the test's own (not yet created) as $TRANSFORMER_JAX_KERNEL_CACHE, load() not yet
  tried in this process, and the dynamic loader and the compiler replaced by recorders: (folder, the paths
  given to ctypes to load, the libraries the compiler was asked to build). The stub compiler fails."""
  directory = tmp_path / 'kernels'
  monkeypatch.setenv(kernels.CACHE_ENV, str(directory))
  monkeypatch.setattr(kernels, '_loaded', None)
  loaded, built = [], []
  monkeypatch.setattr(ctypes.cdll, 'LoadLibrary', loaded.append)

  def compile_stub(compiler, library):
    del compiler
    built.append(library)
    raise kernels.KernelUnavailable('compiler stubbed out by the test')
  monkeypatch.setattr(kernels, '_compile', compile_stub)
  return directory, loaded, built


def refusal_lines(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records if r.name == kernels.__name__]


@pytest.mark.parametrize('mode', [0o777, 0o775, 0o757], ids=oct)
def test_a_kernel_cache_others_may_write_is_refused(no_loading, caplog, monkeypatch, mode):
  """A world- or group-writable kernel cache (a library planted there would be loaded): nothing in it is loaded
  or built, one log line names the folder and the mend, and 'auto' decodes with XLA."""
  directory, loaded, built = no_loading
  directory.mkdir()
  directory.chmod(mode)
  (directory / 'decoding_attention-0123456789abcdef.so').write_bytes(b'planted')
  with caplog.at_level(logging.WARNING, logger=kernels.__name__):
    mend = re.escape(f'chmod 700 {directory}')
    with pytest.raises(kernels.KernelUnavailable, match=f'group or others may write it.*{mend}'):
      kernels.load()
    monkeypatch.setattr(jax, 'device_count', lambda: 1)
    assert backends.decoding_backend(make_model(decoding_kernel='auto').cfg) == backends.XlaDecoding()
  assert loaded == [] and built == []
  line, = refusal_lines(caplog)
  assert f'refusing the kernel cache {directory}' in line and f'chmod 700 {directory}' in line


def test_a_kernel_cache_of_another_user_is_refused(no_loading, caplog, monkeypatch):
  directory, loaded, built = no_loading
  directory.mkdir(mode=0o700)
  uid = os.getuid()
  monkeypatch.setattr(os, 'getuid', lambda: uid + 1)
  with caplog.at_level(logging.WARNING, logger=kernels.__name__):
    assert not kernels.available()
  assert loaded == [] and built == []
  line, = refusal_lines(caplog)
  assert f'owner uid {uid}' in line and kernels.CACHE_ENV in line


def test_a_new_kernel_cache_is_created_private(no_loading):
  directory, loaded, _ = no_loading
  assert not kernels.available()  # The stub compiler fails after the folder is made.
  assert stat.S_IMODE(directory.stat().st_mode) == 0o700 and loaded == []


@pytest.mark.parametrize('record', ['none', 'another digest', 'group-writable'])
def test_a_foreign_library_at_the_expected_name_is_never_loaded(no_loading, record):
  """A library at the name this build would have, without a record of this user that matches it (none, the
  digest of other bytes, or the right digest in a file others may write), is built again, never loaded."""
  directory, loaded, built = no_loading
  try:
    compiler = kernels._compiler()
    library = kernels._library_path(directory, compiler)  # Runs the compiler's --version.
  except kernels.KernelUnavailable:
    pytest.skip('no C++ compiler here')
  directory.mkdir(mode=0o700)
  library.write_bytes(b'\x7fELF planted')
  if record != 'none':
    digest = hashlib.sha256(b'other bytes' if record == 'another digest' else library.read_bytes()).hexdigest()
    kernels._record(library).write_text(digest + '\n')
    kernels._record(library).chmod(0o664 if record == 'group-writable' else 0o600)
  with pytest.raises(kernels.KernelUnavailable, match='compiler stubbed out'):
    kernels.load()
  assert loaded == [] and built == [library]


_PLANTED = r'''
#include <cstdio>
#include <cstdlib>
__attribute__((constructor)) static void Planted() {
  if (std::FILE* f = std::fopen(std::getenv("PLANTED_MARKER"), "w")) std::fclose(f);
}
'''


@pytest.mark.integration
def test_a_planted_library_is_built_again_not_loaded(tmp_path):
  """A real library planted at the expected name, whose loading would be seen (its constructor writes a file):
  a fresh process that loads the kernels never runs it, and replaces it with a verified build."""
  compiler = shutil.which('g++') or shutil.which('c++')
  if not compiler:
    pytest.skip('no C++ compiler here')
  directory, marker, source, planted = (tmp_path / name for name in ('kernels', 'marker', 'planted.cc', 'planted.so'))
  directory.mkdir(mode=0o700)
  env = os.environ | {kernels.CACHE_ENV: str(directory), 'PLANTED_MARKER': str(marker), 'CXX': compiler,
                      'JAX_PLATFORMS': 'cpu'}
  source.write_text(_PLANTED)
  subprocess.run([compiler, '-shared', '-fPIC', str(source), '-o', str(planted)], check=True)
  subprocess.run([sys.executable, '-c', 'import ctypes, sys; ctypes.CDLL(sys.argv[1])', str(planted)], env=env,
                 check=True)
  assert marker.exists()  # Loading it is seen.
  marker.unlink()
  library = kernels._library_path(directory, [compiler])
  shutil.copy(planted, library)
  subprocess.run([sys.executable, '-c', 'from transformer_jax.cpu import kernels; kernels.load()'], env=env,
                 check=True)
  assert not marker.exists() and kernels._verified(library)
