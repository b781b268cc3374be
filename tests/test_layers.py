"""Tests for transformer_jax.model.layers: positional encodings (§3.5) and the feed-forward network (§3.3)."""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.model import layers


@pytest.mark.parametrize('d_model', [8, 7, 512])
def test_sinusoidal_encoding_matches_formula(d_model):
  positions = [0, 1, 5, 17, 63, 100]
  pe = np.asarray(layers.sinusoidal_position_encoding(jnp.asarray(positions), d_model))
  assert pe.shape == (len(positions), d_model) and pe.dtype == np.float32
  for row, pos in enumerate(positions):
    for i in sorted({0, 1, (d_model - 1) // 2 // 2, (d_model - 1) // 2}):
      angle = pos / 10000 ** (2 * i / d_model)  # §3.5, in float64.
      assert pe[row, 2 * i] == pytest.approx(math.sin(angle), abs=2e-5), (pos, 2 * i)
      if 2 * i + 1 < d_model:  # With odd d_model the last dimension is a sine without its cosine.
        assert pe[row, 2 * i + 1] == pytest.approx(math.cos(angle), abs=2e-5), (pos, 2 * i + 1)


def test_sinusoidal_encoding_batched_positions():
  positions = jnp.array([[0, 1, 2], [0, 0, 1]])  # Packed rows restart their positions.
  pe = layers.sinusoidal_position_encoding(positions, 6)
  assert pe.shape == (2, 3, 6)
  np.testing.assert_array_equal(pe[1, 1], pe[0, 0])
  np.testing.assert_array_equal(pe[1, 2], pe[0, 1])


def test_position_embedding_adds_sinusoids():
  x = jnp.ones((2, 4, 6))
  out = layers.PositionEmbedding('sinusoidal').apply({}, x, None)
  np.testing.assert_allclose(out, x + layers.sinusoidal_position_encoding(jnp.arange(4), 6)[None], rtol=1e-6)
  np.testing.assert_array_equal(layers.PositionEmbedding('none').apply({}, x, None), x)


def test_learned_positions_longer_than_max_length_raise():
  module = layers.PositionEmbedding('learned', max_length=4)
  params = module.init(jax.random.key(0), jnp.zeros((1, 4, 8)), None)
  assert nn.unbox(params)['params']['position_embedding'].shape == (4, 8)
  with pytest.raises(ValueError, match='max_length=4'):
    module.apply(params, jnp.zeros((1, 5, 8)), None)


def test_feed_forward_shape_and_relu():
  d_model, d_ff = 6, 16
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, d_model)), jnp.float32)
  module = layers.FeedForward(d_ff)
  params = nn.unbox(module.init(jax.random.key(0), x, deterministic=True))['params']
  params['b1'] = jnp.linspace(-1.0, 1.0, d_ff)  # Non-zero biases, so b1 and b2 are exercised.
  params['b2'] = jnp.linspace(-0.5, 0.5, d_model)
  out = module.apply({'params': params}, x, deterministic=True)
  assert out.shape == x.shape and out.dtype == jnp.float32
  w1, b1, w2, b2 = (np.asarray(params[name]) for name in ('w1', 'b1', 'w2', 'b2'))
  hidden = np.asarray(x) @ w1 + b1
  assert (hidden < 0).any() and (hidden > 0).any()  # The ReLU has something to cut.
  np.testing.assert_allclose(out, np.maximum(hidden, 0.0) @ w2 + b2, rtol=1e-5, atol=1e-5)  # Eq. 2.
  assert not np.allclose(out, hidden @ w2 + b2, atol=1e-3)


def test_feed_forward_activation_dropout_drops_d_ff_activations_only_in_training():
  """activation_dropout_rate acts on max(0, x W1 + b1), before W2. With d_ff = 2 d_model and W2 = [I; I], output i
  is h_i m_i + h_(i+d) m_(i+d) over the kept-or-dropped mask m: where one of a pair was dropped and the other kept,
  the output is that one activation divided by 1 - rate, which dropout of the output (after W2) cannot give.
  deterministic (evaluation, decoding) leaves Eq. 2 as it is."""
  d, rate = 64, 0.25
  x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 32, d)), jnp.float32)
  module = layers.FeedForward(2 * d, activation_dropout_rate=rate)
  params = nn.unbox(module.init(jax.random.key(0), x, deterministic=True))['params']
  params['w2'], params['b2'] = jnp.concatenate([jnp.eye(d), jnp.eye(d)]), jnp.zeros(d)
  hidden = np.maximum(np.asarray(x) @ np.asarray(params['w1']) + np.asarray(params['b1']), 0.0)
  first, second = hidden[..., :d], hidden[..., d:]
  evaluated = module.apply({'params': params}, x, deterministic=True)
  np.testing.assert_allclose(evaluated, first + second, rtol=1e-5, atol=1e-5)
  out = np.asarray(module.apply({'params': params}, x, deterministic=False, rngs={'dropout': jax.random.key(1)}))
  # Each pair's four outcomes, scaled by 1 / (1 - rate); the closest one names the mask of that pair.
  outcomes = np.stack([0 * first, first, second, first + second], -1) / (1 - rate)
  pattern = np.abs(out[..., None] - outcomes).argmin(-1)
  np.testing.assert_allclose(out, np.take_along_axis(outcomes, pattern[..., None], -1)[..., 0], rtol=1e-4,
                             atol=1e-5)
  both_positive = (first > 0.1) & (second > 0.1)  # Pairs whose four outcomes differ clearly.
  assert np.isin(pattern[both_positive], [1, 2]).mean() > 0.25  # Exactly one of the pair dropped: 2 r (1 - r).
  dropped = 1 - np.concatenate([np.isin(pattern, [1, 3]), np.isin(pattern, [2, 3])])[
      np.concatenate([both_positive, both_positive])].mean()
  assert abs(dropped - rate) < 0.03, dropped


def test_feed_forward_bfloat16_compute_keeps_float32_params():
  x = jnp.ones((1, 2, 4), jnp.bfloat16)
  module = layers.FeedForward(8, dtype=jnp.bfloat16)
  params = module.init(jax.random.key(0), x, deterministic=True)
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nn.unbox(params)))
  assert module.apply(params, x, deterministic=True).dtype == jnp.bfloat16


@pytest.mark.integration
def test_feed_forward_bfloat16_bias_gradients_are_float32_sums():
  # A bias gradient sums over every token. Summed in bf16 over these 2,048 tokens, b2's gradient was 1.0%
  # off the float32 module's (relative L2); added to the float32 accumulator it is 0.11% off. b1's error
  # (2%) comes from bf16 inputs moving units across the ReLU, as it did before.
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(4, 512, 16)), jnp.float32)
  cotangent = jnp.asarray(rng.normal(size=(4, 512, 16)), jnp.float32)
  params = nn.unbox(layers.FeedForward(64).init(jax.random.key(0), x, deterministic=True))['params']
  params['b1'] = jnp.full((64,), 0.1)

  def grads(dtype):
    module = layers.FeedForward(64, dtype=dtype)
    apply = lambda p: module.apply({'params': p}, x.astype(dtype), deterministic=True).astype(jnp.float32)
    loss = lambda p: jnp.sum(apply(p) * cotangent)
    return jax.grad(loss)(params)

  got, want = grads(jnp.bfloat16), grads(jnp.float32)
  error = lambda name: float(jnp.linalg.norm(got[name] - want[name]) / jnp.linalg.norm(want[name]))
  assert got['b2'].dtype == got['b1'].dtype == jnp.float32
  assert error('b2') < 3e-3
  assert error('b1') < 3e-2
