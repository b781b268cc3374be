"""The hand-written numerics: the custom-VJP einsum against autodiff, the hash dropout's rate and independence."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.model import numerics

SPECS = [('blm,mhd->blhd', (2, 5, 8), (8, 3, 4)), ('bqhd,bkhd->bhqk', (2, 5, 3, 4), (2, 6, 3, 4)),
         ('blm,nm->bln', (2, 5, 8), (11, 8))]


@pytest.mark.integration
@pytest.mark.parametrize('spec, lhs_shape, rhs_shape', SPECS)
def test_einsum_gradients_equal_autodiff_in_float32(spec, lhs_shape, rhs_shape):
  keys = jax.random.split(jax.random.key(0), 3)
  lhs, rhs = jax.random.normal(keys[0], lhs_shape), jax.random.normal(keys[1], rhs_shape)
  out_shape = jax.eval_shape(lambda a, b: jnp.einsum(spec, a, b), lhs, rhs).shape
  cotangent = jax.random.normal(keys[2], out_shape)
  loss = lambda f: lambda a, b: jnp.sum(f(a, b) * cotangent)
  ours = jax.grad(loss(lambda a, b: numerics.einsum(spec, a, b)), argnums=(0, 1))(lhs, rhs)
  reference = jax.grad(loss(lambda a, b: jnp.einsum(spec, a, b, precision='highest')), argnums=(0, 1))(lhs, rhs)
  np.testing.assert_allclose(numerics.einsum(spec, lhs, rhs), jnp.einsum(spec, lhs, rhs, precision='highest'),
                             rtol=1e-5, atol=1e-5)
  for got, want in zip(ours, reference):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_einsum_in_bfloat16_returns_bfloat16_gradients_close_to_float32():
  keys = jax.random.split(jax.random.key(1), 2)
  lhs, rhs = jax.random.normal(keys[0], (4, 16, 32)), jax.random.normal(keys[1], (32, 24))
  grads = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    f = lambda a, b: jnp.sum(numerics.einsum('blm,mf->blf', a, b, jnp.float32) ** 2)
    grads[dtype] = jax.grad(f, argnums=(0, 1))(lhs.astype(dtype), rhs.astype(dtype))
  assert all(g.dtype == jnp.bfloat16 for g in grads[jnp.bfloat16])
  for got, want in zip(grads[jnp.bfloat16], grads[jnp.float32]):
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=0.02 * scale)  # 8 mantissa bits.


@pytest.mark.parametrize('rate', [0.1, 0.3])
def test_hash_dropout_rate_scale_and_determinism(rate):
  x = jnp.ones((2048, 2048))
  rng = jax.random.key(3)
  y = numerics.dropout(x, rate, rng)
  dropped = np.asarray(y == 0)
  # The dropped fraction is Binomial(n, rate) / n: allow 5 standard deviations (0.0008 at rate 0.1).
  assert abs(dropped.mean() - rate) < 5 * np.sqrt(rate * (1 - rate) / dropped.size)
  np.testing.assert_allclose(np.asarray(y)[~dropped], 1.0 / (1.0 - rate), rtol=1e-6)
  np.testing.assert_array_equal(numerics.dropout(x, rate, rng), y)  # Same key, same mask.
  assert abs(float(jnp.mean(y)) - 1.0) < 0.01  # Inverted dropout keeps the expectation.


def test_hash_dropout_masks_are_independent_across_keys_and_neighbours():
  rate, x = 0.5, jnp.ones((512, 512))
  a = np.asarray(numerics.dropout(x, rate, jax.random.key(0)) == 0).astype(np.float64)
  b = np.asarray(numerics.dropout(x, rate, jax.random.key(1)) == 0).astype(np.float64)
  # Independent Bernoulli(0.5) masks: both dropped at rate 0.25; neighbours (row and column) uncorrelated.
  assert abs((a * b).mean() - 0.25) < 0.005
  for u, v in ((a[:, 1:], a[:, :-1]), (a[1:], a[:-1]), (a.ravel()[1:], a.ravel()[:-1])):
    assert abs(np.corrcoef(u.ravel(), v.ravel())[0, 1]) < 0.01
