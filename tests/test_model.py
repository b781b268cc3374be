"""Tests for transformer_jax.model.transformer on a tiny Transformer: shapes, dtypes, invariances and cached decoding."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.model import transformer as model_lib
from transformer_jax.training import losses
import tiny_runs  # pylint: disable=g-bad-import-order

VOCAB = 64
TINY = tiny_runs.tiny_model_fields()  # configs/smoke.py's model.
# Two sentences, 0-padded, ending in EOS (2); decoder inputs start with BOS (1).
SOURCE = np.array([[5, 6, 7, 8, 9, 2], [10, 11, 2, 0, 0, 0]], np.int32)
DECODER_INPUT = np.array([[1, 12, 13, 14, 15], [1, 16, 17, 18, 0]], np.int32)

# Every function here is compiled once and run once or twice. Skipping LLVM's optimisations halves the
# compile time, which dominates these tests on CPU; the HLO, and so the properties tested, stay the same.
jit = functools.partial(jax.jit, compiler_options={'xla_backend_optimization_level': 0})


def make_model(**overrides) -> model_lib.Transformer:
  return model_lib.Transformer(model_lib.ModelConfig(vocab_size=VOCAB, **{**TINY, **overrides}))


def init_params(model, source=SOURCE, decoder_input=DECODER_INPUT, seed=0):
  """Random float32 values for every parameter, biases and LayerNorm included (init leaves them at 0 and 1,
  which could hide a missing term). Shapes come from jax.eval_shape: compiling `init` takes ~10 s on CPU."""
  abstract = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), source, decoder_input)['params'])
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: jnp.asarray(rng.normal(0.0, 0.3, x.shape), x.dtype), abstract)


def forward(model):
  """jit(model.apply) for the teacher-forced pass; the keyword arguments are those of __call__."""
  return jit(lambda params, *args, **kwargs: model.apply({'params': params}, *args, **kwargs))


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_shapes_and_dtypes(dtype):
  model = make_model(dtype=dtype)
  abstract = jax.eval_shape(model.init, jax.random.key(0), SOURCE, DECODER_INPUT)['params']
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nn.unbox(abstract)))
  params = init_params(model)
  logits = forward(model)(params, SOURCE, DECODER_INPUT)
  assert logits.shape == (2, DECODER_INPUT.shape[1], VOCAB) and logits.dtype == jnp.float32
  assert np.isfinite(logits).all()
  memory = jit(lambda p, s: model.apply({'params': p}, s, method='encode'))(params, SOURCE)
  assert memory.shape == (2, SOURCE.shape[1], TINY['d_model']) and memory.dtype == jnp.dtype(dtype)


def test_decoder_is_causal():
  """Row t of the batch changes every decoder input after position t; logits up to t must not move."""
  model = make_model()
  params = init_params(model)
  length = DECODER_INPUT.shape[1]
  base = np.repeat(DECODER_INPUT[:1], length, axis=0)  # [length, length]
  changed = base.copy()
  future = np.arange(length)[None, :] > np.arange(length)[:, None]
  changed[future] = np.random.default_rng(0).integers(3, VOCAB, size=future.sum())
  source = np.repeat(SOURCE[:1], length, axis=0)
  apply = forward(model)
  logits, changed_logits = apply(params, source, base), apply(params, source, changed)
  for t in range(length):
    np.testing.assert_allclose(changed_logits[t, :t + 1], logits[t, :t + 1], rtol=1e-6, atol=1e-6)
  assert not np.allclose(changed_logits[0, 1:], logits[0, 1:], atol=1e-3)  # The change is visible later.


@pytest.mark.integration
def test_padded_source_tokens_do_not_matter():
  model = make_model()
  params = init_params(model)
  segment_ids = (SOURCE != 0).astype(np.int32)
  garbage = np.where(segment_ids == 0, np.random.default_rng(0).integers(3, VOCAB, SOURCE.shape), SOURCE)
  apply = forward(model)
  logits = apply(params, SOURCE, DECODER_INPUT, segment_ids)
  np.testing.assert_allclose(apply(params, garbage, DECODER_INPUT, segment_ids), logits, rtol=1e-6, atol=1e-6)
  longer = np.pad(SOURCE, ((0, 0), (0, 3)))  # More padding columns, segment ids derived from the tokens.
  np.testing.assert_allclose(apply(params, longer, DECODER_INPUT), logits, rtol=1e-5, atol=1e-5)


def test_encoder_without_positions_is_permutation_equivariant():
  permutation = np.array([3, 0, 5, 1, 4, 2])
  memories = {}
  for position_embedding in ('none', 'sinusoidal'):
    model = make_model(position_embedding=position_embedding)
    params = init_params(model)
    encode = jit(lambda p, s, model=model: model.apply({'params': p}, s, method='encode'))
    memories[position_embedding] = encode(params, SOURCE), encode(params, SOURCE[:, permutation])
  memory, permuted = memories['none']
  np.testing.assert_allclose(permuted, memory[:, permutation], rtol=1e-5, atol=1e-5)
  memory, permuted = memories['sinusoidal']  # Sanity: positions do break the symmetry.
  assert not np.allclose(permuted[0], memory[0, permutation], atol=1e-3)


@pytest.mark.integration
@pytest.mark.parametrize('layer_norm_position, position_embedding', [('post', 'sinusoidal'), ('pre', 'learned')])
def test_cached_decoding_matches_teacher_forcing(layer_norm_position, position_embedding):
  model = make_model(layer_norm_position=layer_norm_position, position_embedding=position_embedding)
  params = init_params(model)
  source_segment_ids = (SOURCE != 0).astype(np.int32)
  decoder_input = DECODER_INPUT.copy()
  decoder_input[1, -1] = 19  # Cached decoding has no target padding; compare on real tokens only.
  full = forward(model)(params, SOURCE, decoder_input)

  @jit  # One compilation for the whole loop: init_cache, then one use_cache=True call per position.
  def decode_step_by_step(params):
    memory = model.apply({'params': params}, SOURCE, method='encode')
    max_decode_length = decoder_input.shape[1] + 3  # Unused cache slots must stay masked.
    _, variables = model.apply({'params': params}, memory, source_segment_ids, max_decode_length,
                               method='init_cache', mutable=['cache'])

    def step(cache, tokens):  # tokens: [batch, 1]
      logits, variables = model.apply({'params': params, 'cache': cache}, tokens, memory, source_segment_ids,
                                      use_cache=True, method='decode', mutable=['cache'])
      return variables['cache'], logits[:, 0]  # [batch, vocab]

    _, logits = jax.lax.scan(step, variables['cache'], decoder_input.T[:, :, None])
    return logits  # [tgt_len, batch, vocab]

  logits = decode_step_by_step(params)
  for t in range(decoder_input.shape[1]):
    np.testing.assert_allclose(logits[t], full[:, t], rtol=1e-5, atol=1e-5, err_msg=f'step {t}')


@pytest.mark.integration
@pytest.mark.parametrize('position_embedding', ['sinusoidal', 'learned'])
def test_packed_batch_equals_unpacked(position_embedding):
  model = make_model(position_embedding=position_embedding)
  params = init_params(model)
  src_a, src_b = [5, 6, 7, 2], [8, 9, 2]
  tgt_a, tgt_b = [1, 10, 11], [1, 12, 13, 14]
  packed = dict(
      source_tokens=np.array([src_a + src_b + [0]], np.int32),
      decoder_input_tokens=np.array([tgt_a + tgt_b + [0]], np.int32),
      source_segment_ids=np.array([[1, 1, 1, 1, 2, 2, 2, 0]], np.int32),
      target_segment_ids=np.array([[1, 1, 1, 2, 2, 2, 2, 0]], np.int32),
      source_positions=np.array([[0, 1, 2, 3, 0, 1, 2, 0]], np.int32),
      target_positions=np.array([[0, 1, 2, 0, 1, 2, 3, 0]], np.int32))
  unpacked_source = np.array([src_a, src_b + [0]], np.int32)
  unpacked_decoder_input = np.array([tgt_a + [0], tgt_b], np.int32)
  apply = forward(model)
  packed_logits = apply(params, **packed)
  unpacked_logits = apply(params, unpacked_source, unpacked_decoder_input)
  np.testing.assert_allclose(packed_logits[0, :3], unpacked_logits[0, :3], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(packed_logits[0, 3:7], unpacked_logits[1, :4], rtol=1e-5, atol=1e-5)


@pytest.mark.integration
def test_fully_padded_row_has_finite_loss_and_gradients():
  model = make_model()
  source = SOURCE.copy()
  decoder_input = DECODER_INPUT.copy()
  source[1], decoder_input[1] = 0, 0
  targets = np.concatenate([decoder_input[:, 1:], np.zeros((2, 1), np.int32)], axis=1)
  targets[0, -1] = 2
  params = init_params(model, source, decoder_input)

  @jit
  def loss_and_grads(params):
    def loss_fn(params):
      logits = model.apply({'params': params}, source, decoder_input, deterministic=False,
                           rngs={'dropout': jax.random.key(1)})
      metrics = losses.smoothed_cross_entropy(logits, targets, (targets != 0).astype(jnp.float32), 0.1)
      return metrics['loss_sum'] / metrics['token_count'], logits
    return jax.value_and_grad(loss_fn, has_aux=True)(params)

  (loss, logits), grads = loss_and_grads(params)
  assert np.isfinite(loss) and np.isfinite(logits).all()
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


@pytest.mark.parametrize('field, value, match', [
    ('vocab_size', 0, 'model.vocab_size must be a positive integer, got 0'),
    ('num_layers', 0, 'model.num_layers must be a positive integer, got 0'),
    ('d_model', -8, 'model.d_model must be a positive integer, got -8'),
    ('d_ff', 2.5, 'model.d_ff must be a positive integer, got 2.5'),
    ('num_heads', 0, 'model.num_heads must be a positive integer'),
    ('d_k', 0, 'model.d_k must be a positive integer'),
    ('max_length', True, 'model.max_length must be a positive integer, got True'),
    ('dropout_rate', 1.5, r'model.dropout_rate must be in \[0, 1\), got 1.5'),
    ('attention_dropout_rate', -0.1, r'model.attention_dropout_rate must be in \[0, 1\)'),
    ('activation_dropout_rate', 1.0, r'model.activation_dropout_rate must be in \[0, 1\), got 1.0'),
    ('position_embedding', 'rotary',
     r"model.position_embedding must be one of \('sinusoidal', 'learned', 'rope', 'none'\), got 'rotary'"),
    ('norm', 'batch_norm', r"model.norm must be one of \('layer_norm', 'rms_norm'\), got 'batch_norm'"),
    ('feed_forward', 'glu', r"model.feed_forward must be one of \('relu', 'gelu', 'swiglu', 'geglu'\)"),
    ('num_kv_heads', 3, r'model.num_kv_heads must be a positive divisor of model.num_heads=4'),
    ('num_kv_heads', 0, r'model.num_kv_heads must be a positive divisor'),
    ('layer_norm_position', 'sandwich',
     r"model.layer_norm_position must be one of \('post', 'pre'\), got 'sandwich'"),
    ('dtype', 'float16', r"model.dtype must be one of \('float32', 'bfloat16'\)"),
    ('attention_impl', 'flash', r"model.attention_impl must be one of \('xla', 'fused'\)"),
])
def test_bad_config_raises(field, value, match):
  kwargs = {'vocab_size': VOCAB, **TINY, field: value}
  with pytest.raises(ValueError, match=match):
    model_lib.ModelConfig(**kwargs)


@pytest.mark.integration
def test_grow_decoding_cache_pads_self_attention_positions_only():
  model = make_model()
  params = init_params(model)
  source_segment_ids = (SOURCE != 0).astype(np.int32)
  memory = model.apply({'params': params}, SOURCE, method='encode')
  _, variables = model.apply({'params': params}, memory, source_segment_ids, 3, 2, method='init_cache',
                             mutable=['cache'])
  cache = variables['cache']
  grown = model_lib.grow_decoding_cache(cache, 7)
  layer, grown_layer = cache['decoder']['layer_0'], grown['decoder']['layer_0']
  self_key = layer['self_attention']['cached_key']
  rows = 2 * SOURCE.shape[0]  # beam_size 2.
  assert self_key.shape == (rows, model.cfg.num_heads, 3, model.cfg.d_k)
  assert grown_layer['self_attention']['cached_key'].shape == (
      rows, model.cfg.num_heads, 7, model.cfg.d_k)
  assert grown_layer['encoder_decoder_attention']['cached_value'].shape == (
      SOURCE.shape[0], model.cfg.num_heads, SOURCE.shape[1], model.cfg.d_v)  # One row per sentence.
  with pytest.raises(ValueError, match='cannot shrink a decoding cache of 3 positions to 2'):
    model_lib.grow_decoding_cache(cache, 2)


def test_fused_attention_decodes_in_bfloat16_like_the_einsum_path():
  """The encoder-decoder cache holds K/V in the product dtype (here float32) while bf16 queries come in (the
  self-attention cache is bf16): the fused path must cast them to one dtype (jax.nn.dot_product_attention
  rejects mixed ones)."""
  logits = {}
  for impl in ('xla', 'fused'):
    model = make_model(dtype='bfloat16', attention_impl=impl, attention_product_dtype='float32')
    params = init_params(model)
    source_segment_ids = (SOURCE != 0).astype(np.int32)

    @jit
    def first_steps(params, model=model):
      memory = model.apply({'params': params}, SOURCE, method='encode')
      _, variables = model.apply({'params': params}, memory, source_segment_ids, 4, method='init_cache',
                                 mutable=['cache'])
      out, _ = model.apply({'params': params, 'cache': variables['cache']}, DECODER_INPUT[:, :1], memory,
                           source_segment_ids, use_cache=True, method='decode', mutable=['cache'])
      return out
    logits[impl] = np.asarray(first_steps(params), np.float32)
  np.testing.assert_allclose(logits['fused'], logits['xla'], rtol=5e-2, atol=5e-2)


def first_decoding_step(model, params):
  """(logits float32 [batch, 1, vocab] of the first cached step, the cache collection after it)."""
  source_segment_ids = (SOURCE != 0).astype(np.int32)

  @jit
  def run(params):
    memory = model.apply({'params': params}, SOURCE, method='encode')
    _, variables = model.apply({'params': params}, memory, source_segment_ids, 4, method='init_cache',
                               mutable=['cache'])
    return model.apply({'params': params, 'cache': variables['cache']}, DECODER_INPUT[:, :1], memory,
                       source_segment_ids, use_cache=True, method='decode', mutable=['cache'])
  logits, variables = run(params)
  return logits, variables['cache']


@pytest.mark.integration
@pytest.mark.parametrize('product, cross_cache_dtype', [('compute', jnp.bfloat16), ('float32', jnp.float32)])
def test_attention_product_dtype_is_the_configs_not_the_backends(product, cross_cache_dtype):
  """Both settings run here (the CPU) and keep what they say: bf16 attention products with 'compute' (what
  accelerators run), float32 with 'float32'; their logits agree to bf16 precision. The self-attention cache,
  which beam search reorders at every step, holds K and V in the compute dtype (bf16) either way; the
  encoder-decoder cache, cast once per sentence, in the product dtype."""
  model = make_model(dtype='bfloat16', attention_product_dtype=product)
  params = init_params(model)
  logits, cache = first_decoding_step(model, params)
  dtypes = {kind: {x.dtype for path, x in jax.tree_util.tree_leaves_with_path(cache)
                   if 'cached_key' in str(path) and (kind == 'cross') == ('encoder_decoder' in str(path))}
            for kind in ('self', 'cross')}
  assert dtypes == {'self': {jnp.dtype(jnp.bfloat16)}, 'cross': {jnp.dtype(cross_cache_dtype)}}
  reference, _ = first_decoding_step(make_model(dtype='float32'), params)
  np.testing.assert_allclose(np.asarray(logits, np.float32), reference, rtol=0.1, atol=0.1)
  teacher_forced = forward(model)(params, SOURCE, DECODER_INPUT)
  np.testing.assert_allclose(np.asarray(teacher_forced[:, :1]), np.asarray(logits), rtol=0.05, atol=0.05)


@pytest.mark.integration
def test_remat_gives_the_same_loss_and_gradients_with_dropout():
  """remat=True recomputes each layer's activations in the backward pass: same loss and gradients, dropout
  included (its masks depend on the same keys), and `deterministic` stays a Python bool (static)."""
  grads = {}
  for remat in (False, True):
    model = make_model(remat=remat, dropout_rate=0.3)
    params = init_params(model)

    @jit
    def loss_and_grads(params, model=model):
      def loss(params):
        logits = model.apply({'params': params}, SOURCE, DECODER_INPUT, deterministic=False,
                             rngs={'dropout': jax.random.key(7)})
        return losses.smoothed_cross_entropy(logits, DECODER_INPUT, (DECODER_INPUT != 0).astype(jnp.float32),
                                             0.1)['loss_sum']
      return jax.value_and_grad(loss)(params)
    grads[remat] = loss_and_grads(params)
  np.testing.assert_allclose(grads[True][0], grads[False][0], rtol=1e-5)
  for got, want in zip(jax.tree.leaves(grads[True][1]), jax.tree.leaves(grads[False][1])):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
