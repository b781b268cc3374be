"""Tests of the later variants in ModelConfig (pre-LN, RMSNorm, RoPE, gated FFNs, multi-/grouped-query attention):
each one's defining property, and for every variant the invariants the paper's model is tested for (cached
decoding equals teacher forcing, packed equals unpacked, sharded equals one device)."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.decoding import translate
from transformer_jax.model import attention
from transformer_jax.model import layers
from transformer_jax.model import sharding
from transformer_jax.model import transformer as model_lib
from transformer_jax.tools import summary
from transformer_jax.training import optim
from transformer_jax.training import state as state_lib
from transformer_jax.training import step as step_lib
import tiny_runs  # pylint: disable=g-bad-import-order

VOCAB = 64
TINY = tiny_runs.tiny_model_fields()  # configs/smoke.py's model.
SOURCE = np.array([[5, 6, 7, 8, 9, 2], [10, 11, 2, 0, 0, 0]], np.int32)
DECODER_INPUT = np.array([[1, 12, 13, 14, 15], [1, 16, 17, 18, 19]], np.int32)
VARIANTS = {
    'pre_ln': dict(layer_norm_position='pre'),
    'rms_norm': dict(norm='rms_norm'),
    'rope': dict(position_embedding='rope'),
    'gelu': dict(feed_forward='gelu'),
    'swiglu': dict(feed_forward='swiglu'),
    'geglu': dict(feed_forward='geglu'),
    'multi_query': dict(num_kv_heads=1),
    'grouped_query': dict(num_kv_heads=2),
    'modern': dict(layer_norm_position='pre', norm='rms_norm', position_embedding='rope', feed_forward='swiglu',
                   num_kv_heads=2),
}
jit = functools.partial(jax.jit, compiler_options={'xla_backend_optimization_level': 0})


def make_model(**overrides) -> model_lib.Transformer:
  return model_lib.Transformer(model_lib.ModelConfig(vocab_size=VOCAB, **(TINY | overrides)))


def random_params(model, seed=0):
  """Random values in every parameter (norm scales and biases too), shapes from eval_shape."""
  abstract = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), SOURCE, DECODER_INPUT)['params'])
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: jnp.asarray(rng.normal(0.0, 0.3, x.shape), x.dtype), abstract)


def test_rope_scores_depend_only_on_the_offset():
  rng = np.random.default_rng(0)
  query, key = (jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32) for _ in range(2))
  at = lambda p: jnp.array([[p]], jnp.int32)

  def score(m, n):
    return float(jnp.sum(layers.apply_rope(query, at(m)) * layers.apply_rope(key, at(n))))

  for m, n in [(0, 0), (3, 7), (10, 2), (0, 40)]:
    for shift in (1, 5, 100):
      assert score(m + shift, n + shift) == pytest.approx(score(m, n), rel=1e-4, abs=1e-4)
  assert score(0, 3) != pytest.approx(score(0, 4), rel=1e-3)  # The offset does matter.
  # A rotation: norms are kept, position 0 is the identity.
  rotated = layers.apply_rope(query, at(17))
  assert float(jnp.linalg.norm(rotated)) == pytest.approx(float(jnp.linalg.norm(query)), rel=1e-5)
  np.testing.assert_allclose(layers.apply_rope(query, at(0)), query, rtol=1e-6)


def test_rope_model_sees_relative_positions_only():
  """With rotary positions and no other position signal, shifting every position of the source and the
  target by the same amount leaves the logits unchanged; sinusoids (absolute) change them."""
  source_positions = np.broadcast_to(np.arange(SOURCE.shape[1]), SOURCE.shape)
  target_positions = np.broadcast_to(np.arange(DECODER_INPUT.shape[1]), DECODER_INPUT.shape)
  segments = lambda tokens: (tokens != 0).astype(np.int32)
  for kind, shifted_equal in (('rope', True), ('sinusoidal', False)):
    model = make_model(position_embedding=kind)
    params = random_params(model)
    apply = jit(lambda p, sp, tp, model=model: model.apply(
        {'params': p}, SOURCE, DECODER_INPUT, segments(SOURCE), segments(DECODER_INPUT), sp, tp))
    logits, shifted = apply(params, source_positions, target_positions), apply(params, source_positions + 7,
                                                                               target_positions + 7)
    assert np.allclose(shifted, logits, rtol=1e-4, atol=1e-4) == shifted_equal, kind


def test_rms_norm_matches_its_formula():
  x = jnp.asarray(np.random.default_rng(0).normal(1.0, 2.0, (2, 3, 16)), jnp.float32)
  norm = layers.make_norm('rms_norm', jnp.float32, 'norm')
  params = nn.unbox(norm.init(jax.random.key(0), x))['params']
  assert set(params) == {'scale'}  # No bias.
  scale = np.random.default_rng(1).normal(size=16).astype(np.float32)
  output = norm.apply({'params': {'scale': scale}}, x)
  xn = np.asarray(x)
  expected = xn / np.sqrt(np.mean(xn ** 2, axis=-1, keepdims=True) + 1e-6) * scale  # No mean subtracted.
  np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('kind', ['swiglu', 'geglu', 'gelu'])
def test_feed_forward_variants_match_numpy(kind):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 3, 8)).astype(np.float32)
  ffn = layers.FeedForward(d_ff=12, kind=kind)
  abstract = nn.unbox(jax.eval_shape(functools.partial(ffn.init, deterministic=True), jax.random.key(0), x)['params'])
  params = jax.tree.map(lambda p: rng.normal(0.0, 0.5, p.shape).astype(np.float32), abstract)
  output = np.asarray(ffn.apply({'params': params}, x, deterministic=True))
  gelu = lambda z: 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))  # flax's approximation.
  swish = lambda z: z / (1 + np.exp(-z))
  if kind == 'gelu':
    assert set(params) == {'w1', 'b1', 'w2', 'b2'}
    expected = gelu(x @ params['w1'] + params['b1']) @ params['w2'] + params['b2']
  else:
    assert set(params) == {'w1', 'v', 'w2'}  # Shazeer (2020): three matrices, no biases.
    activation = swish if kind == 'swiglu' else gelu
    expected = (activation(x @ params['w1']) * (x @ params['v'])) @ params['w2']
  np.testing.assert_allclose(output, expected, rtol=1e-4, atol=1e-5)


def test_gated_feed_forward_at_two_thirds_d_ff_keeps_the_parameter_count():
  d_model, d_ff = 512, 2048
  count = lambda kind, width: summary.count_params(jax.eval_shape(
      functools.partial(layers.FeedForward(width, kind=kind).init, deterministic=True), jax.random.key(0),
      jnp.zeros((1, 1, d_model)))['params'])
  paper = count('relu', d_ff)
  assert paper == 2 * d_model * d_ff + d_ff + d_model
  gated = count('swiglu', d_ff * 2 // 3)
  assert gated == 3 * d_model * (d_ff * 2 // 3)
  assert abs(gated - paper) / paper < 0.002  # 2,096,640 vs 2,099,712: the biases and d_ff's rounding.


def test_multi_query_attention_equals_multi_head_with_the_head_repeated():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 5, 16)), jnp.float32)
  mask = attention.padding_mask(jnp.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]), jnp.array([[1, 1, 1, 1, 0],
                                                                                         [1, 1, 1, 1, 1]]))
  mqa = attention.MultiHeadAttention(num_heads=4, d_k=8, d_v=6, num_kv_heads=1)
  abstract = nn.unbox(jax.eval_shape(functools.partial(mqa.init, deterministic=True), jax.random.key(0), x, x,
                                     mask)['params'])
  assert abstract['key'].shape == (16, 1, 8) and abstract['value'].shape == (16, 1, 6)
  params = jax.tree.map(lambda p: jnp.asarray(rng.normal(0.0, 0.5, p.shape), jnp.float32), abstract)
  repeated = params | {name: jnp.repeat(params[name], 4, axis=1) for name in ('key', 'value')}
  mha = attention.MultiHeadAttention(num_heads=4, d_k=8, d_v=6)
  np.testing.assert_allclose(mqa.apply({'params': params}, x, x, mask, deterministic=True),
                             mha.apply({'params': repeated}, x, x, mask, deterministic=True), rtol=1e-5, atol=1e-6)
  # Grouped: 2 K/V heads, query heads (0, 1) read K/V head 0 and (2, 3) head 1.
  gqa = attention.MultiHeadAttention(num_heads=4, d_k=8, d_v=6, num_kv_heads=2)
  grouped = params | {name: jnp.asarray(rng.normal(0.0, 0.5, (16, 2, p))) for name, p in (('key', 8), ('value', 6))}
  repeated = grouped | {name: jnp.repeat(grouped[name], 2, axis=1) for name in ('key', 'value')}
  np.testing.assert_allclose(gqa.apply({'params': grouped}, x, x, mask, deterministic=True),
                             mha.apply({'params': repeated}, x, x, mask, deterministic=True), rtol=1e-5, atol=1e-6)


def test_decoding_cache_shrinks_with_fewer_kv_heads():
  def cache_bytes(**overrides):
    model = make_model(**overrides)
    memory = jnp.zeros((2, SOURCE.shape[1], TINY['d_model']))
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), memory, jnp.asarray(SOURCE != 0, jnp.int32), 10,
                                               4, method='init_cache')['cache'])
    key = shapes['decoder']['layer_0']['self_attention']['cached_key']
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes)), key.shape
  full, full_shape = cache_bytes()
  mqa, mqa_shape = cache_bytes(num_kv_heads=1)
  assert full_shape == (8, 4, 10, 8) and mqa_shape == (8, 1, 10, 8)  # [rows, kv heads, positions, d_k]
  indices = 2 * 4 + 4  # int32 cache_index of each decoder self-attention, and the decoder position.
  assert (mqa - indices) * 4 == full - indices


@pytest.mark.parametrize('depth', [2, 16])
def test_pre_ln_output_stays_bounded_with_depth(depth):
  """Pre-LN stacks end with a norm: the untrained encoder's output keeps unit RMS however deep the residual
  stream grows (Xiong et al., 2020); without the final norm it grows with the depth."""
  model = make_model(layer_norm_position='pre', num_layers=depth)
  params = random_params(model)
  memory = jit(lambda p: model.apply({'params': p}, SOURCE, method='encode'))(params)
  rms = np.sqrt(np.mean(np.asarray(memory[0]) ** 2, axis=-1))  # Per real token of row 0.
  scale = np.asarray(params['encoder']['final_layer_norm']['scale'])
  bias = np.asarray(params['encoder']['final_layer_norm']['bias'])
  assert np.all(rms <= np.sqrt(np.mean(scale ** 2)) * 4 + np.abs(bias).max() + 1e-3), rms


@pytest.mark.integration
@pytest.mark.parametrize('variant', list(VARIANTS))
def test_cached_decoding_matches_teacher_forcing(variant):
  model = make_model(**VARIANTS[variant])
  params = random_params(model)
  source_segment_ids = (SOURCE != 0).astype(np.int32)
  full = jit(lambda p: model.apply({'params': p}, SOURCE, DECODER_INPUT))(params)

  @jit
  def step_by_step(params):
    memory = model.apply({'params': params}, SOURCE, method='encode')
    _, variables = model.apply({'params': params}, memory, source_segment_ids, DECODER_INPUT.shape[1] + 3,
                               method='init_cache', mutable=['cache'])

    def step(cache, tokens):
      logits, variables = model.apply({'params': params, 'cache': cache}, tokens, memory, source_segment_ids,
                                      use_cache=True, method='decode', mutable=['cache'])
      return variables['cache'], logits[:, 0]
    return jax.lax.scan(step, variables['cache'], DECODER_INPUT.T[:, :, None])[1]

  logits = step_by_step(params)
  for t in range(DECODER_INPUT.shape[1]):
    np.testing.assert_allclose(logits[t], full[:, t], rtol=1e-4, atol=1e-4, err_msg=f'step {t}')


@pytest.mark.integration
@pytest.mark.parametrize('num_kv_heads', [1, 2, 4])
def test_beam_search_in_bf16_runs_with_fewer_kv_heads(num_kv_heads):
  """Table 3's F7 shapes (d_model 256, 4 heads of 64, bf16 products) through the whole search on the CPU: with
  2 K/V heads XLA:CPU once compiled the weights x V product into a dot it cannot run ("Unsupported element type
  for DotThunk::Execute: BF16 x BF16 = F32"), until decoding steps multiplied the caches heads-first
  (`attention.decoding_attention`). And the bf16 search agrees with float32's first tokens."""
  model = make_model(num_layers=1, d_model=256, d_ff=64, num_heads=4, d_k=64, d_v=64, num_kv_heads=num_kv_heads,
                     dtype='bfloat16', attention_product_dtype='compute')
  params = random_params(model)
  source = np.tile(SOURCE, (4, 1))  # 8 sentences.
  tokens = translate.decode_batch(params, jnp.asarray(source), model=model, beam_size=2, alpha=0.6,
                                  extra_length=4)
  assert tokens.shape == (8, source.shape[1] + 4)
  reference = translate.decode_batch(params, jnp.asarray(source), model=make_model(
      num_layers=1, d_model=256, d_ff=64, num_heads=4, d_k=64, d_v=64, num_kv_heads=num_kv_heads),
      beam_size=2, alpha=0.6, extra_length=4)
  np.testing.assert_array_equal(np.asarray(tokens)[:, 0], np.asarray(reference)[:, 0])


@pytest.mark.integration
@pytest.mark.parametrize('variant', list(VARIANTS))
def test_packed_batch_equals_unpacked(variant):
  model = make_model(**VARIANTS[variant])
  params = random_params(model)
  src_a, src_b = [5, 6, 7, 2], [8, 9, 2]
  tgt_a, tgt_b = [1, 10, 11], [1, 12, 13, 14]
  packed = dict(source_tokens=np.array([src_a + src_b + [0]], np.int32),
                decoder_input_tokens=np.array([tgt_a + tgt_b + [0]], np.int32),
                source_segment_ids=np.array([[1, 1, 1, 1, 2, 2, 2, 0]], np.int32),
                target_segment_ids=np.array([[1, 1, 1, 2, 2, 2, 2, 0]], np.int32),
                source_positions=np.array([[0, 1, 2, 3, 0, 1, 2, 0]], np.int32),
                target_positions=np.array([[0, 1, 2, 0, 1, 2, 3, 0]], np.int32))
  apply = jit(lambda p, *args, **kwargs: model.apply({'params': p}, *args, **kwargs))
  packed_logits = apply(params, **packed)
  unpacked = apply(params, np.array([src_a, src_b + [0]], np.int32), np.array([tgt_a + [0], tgt_b], np.int32))
  np.testing.assert_allclose(packed_logits[0, :3], unpacked[0, :3], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(packed_logits[0, 3:7], unpacked[1, :4], rtol=1e-4, atol=1e-4)


def _train_steps(model, mesh_shape, devices, state, batch):
  """Two train steps under a (data, fsdp, tensor) mesh; the host state and losses."""
  from configs import base  # pylint: disable=g-import-not-at-top
  mesh_cfg = base.get_config().mesh
  mesh_cfg.update(data=mesh_shape[0], fsdp=mesh_shape[1], tensor=mesh_shape[2])
  mesh, rules = sharding.make_mesh(mesh_cfg, devices), sharding.logical_axis_rules(mesh_cfg)
  tx = optim.make_optimizer(optim.rsqrt_schedule(32, warmup_steps=2), eps=1e-4)
  init_fn = functools.partial(state_lib.create_train_state, model=model, tx=tx, batch=batch)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    state_sharding = sharding.logical_to_sharding(jax.eval_shape(init_fn, jax.random.key(0)), mesh, rules)
    batch_sharding = sharding.batch_sharding(mesh)
    step = jax.jit(functools.partial(step_lib.train_step, model=model, tx=tx, label_smoothing=0.1),
                   in_shardings=(state_sharding, batch_sharding), out_shardings=(state_sharding, None))
    state, losses = jax.device_put(state, state_sharding), []
    for _ in range(2):
      state, metrics = step(state, jax.device_put(batch, batch_sharding))
      losses.append(float(metrics['loss_sum'] / metrics['token_count']))
  if mesh_shape[2] > 1:  # Queries are split over 'tensor'; the single K/V head is replicated.
    kernel = state.params['decoder']['layer_0']['self_attention']
    assert kernel['query'].sharding.spec[1] == 'tensor' and kernel['key'].sharding.spec[1] is None
  return jax.device_get(state), losses


@pytest.mark.integration
@pytest.mark.parametrize('variant', ['modern', 'multi_query'])
def test_sharded_step_equals_one_device(variant):
  model = make_model(**(VARIANTS[variant] | dict(num_layers=1)))
  rng = np.random.default_rng(0)
  batch = {'source_tokens': rng.integers(3, VOCAB, (8, 6), dtype=np.int32),
           'target_tokens': rng.integers(3, VOCAB, (8, 6), dtype=np.int32)}
  batch['source_tokens'][::2, -2:] = 0
  batch['decoder_input_tokens'] = np.concatenate([np.ones((8, 1), np.int32), batch['target_tokens'][:, :-1]], 1)
  tx = optim.make_optimizer(optim.rsqrt_schedule(32, warmup_steps=2), eps=1e-4)
  abstract = nn.unbox(jax.eval_shape(functools.partial(state_lib.create_train_state, model=model, tx=tx, batch=batch),
                                     jax.random.key(0)))
  params = jax.tree.map(lambda x: rng.normal(0.0, 0.2, x.shape).astype(np.float32), abstract.params)
  state = state_lib.TrainState(step=np.int32(0), params=params, opt_state=jax.device_get(tx.init(params)),
                               rng=np.array([0, 7], np.uint32))
  one, one_losses = _train_steps(model, (1, 1, 1), jax.devices()[:1], state, batch)
  many, many_losses = _train_steps(model, (2, 2, 2), jax.devices()[:8], state, batch)
  np.testing.assert_allclose(many_losses, one_losses, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(many.params), jax.tree.leaves(one.params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_summary_shows_the_parameter_change():
  base = summary.summarize(model_lib.ModelConfig(vocab_size=VOCAB, **TINY))
  swiglu = summary.summarize(model_lib.ModelConfig(vocab_size=VOCAB, **(TINY | dict(feed_forward='swiglu'))))
  mqa = summary.summarize(model_lib.ModelConfig(vocab_size=VOCAB, **(TINY | dict(num_kv_heads=1))))
  total = lambda text: int(text.strip().splitlines()[-1].split()[-1])
  d, f, h, k = TINY['d_model'], TINY['d_ff'], TINY['num_heads'], TINY['d_k']
  layers_ = TINY['num_layers']
  # Per FFN: 3 d f (gated, no biases) instead of 2 d f + f + d; there are 2 * num_layers FFNs.
  assert total(swiglu) - total(base) == 2 * layers_ * (3 * d * f - (2 * d * f + f + d))
  # Per attention block: W^K and W^V lose h - 1 heads; 3 attention blocks per encoder + decoder layer pair.
  assert total(base) - total(mqa) == 3 * layers_ * 2 * d * (h - 1) * k
