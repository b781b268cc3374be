"""Tests for transformer_jax.model.attention: Eq. 1 against NumPy, masks, and the fused path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.model import attention

BATCH, Q_LEN, KV_LEN, HEADS, D_K, D_V = 2, 3, 5, 2, 4, 6


def reference_attention(query, key, value, mask):
  """softmax(Q K^T / sqrt(d_k)) V in float64 NumPy; a query with no allowed key gets zero weights."""
  scores = np.einsum('bqhd,bkhd->bhqk', query, key) / np.sqrt(query.shape[-1])
  scores = np.where(mask, scores, -np.inf)
  row_max = scores.max(axis=-1, keepdims=True)
  exp = np.where(mask, np.exp(scores - np.where(np.isfinite(row_max), row_max, 0.0)), 0.0)
  total = exp.sum(axis=-1, keepdims=True)
  weights = np.divide(exp, total, out=np.zeros_like(exp), where=total > 0)
  return np.einsum('bhqk,bkhv->bqhv', weights, value), weights


def random_inputs(seed=0, d_k=D_K):
  rng = np.random.default_rng(seed)
  query = rng.normal(size=(BATCH, Q_LEN, HEADS, d_k)).astype(np.float32)
  key = rng.normal(size=(BATCH, KV_LEN, HEADS, D_K)).astype(np.float32)
  value = rng.normal(size=(BATCH, KV_LEN, HEADS, D_V)).astype(np.float32)
  mask = rng.random((BATCH, 1, Q_LEN, KV_LEN)) < 0.6
  mask[:, :, :, 0] = True  # Every query may attend somewhere...
  mask[1, 0, 2, :] = False  # ...except this one.
  return query, key, value, mask


def test_matches_numpy_reference():
  query, key, value, mask = random_inputs()
  output, weights = attention.dot_product_attention(query, key, value, jnp.asarray(mask))
  expected_output, expected_weights = reference_attention(
      query.astype(np.float64), key.astype(np.float64), value.astype(np.float64), mask)
  assert output.shape == (BATCH, Q_LEN, HEADS, D_V) and output.dtype == jnp.float32
  assert weights.shape == (BATCH, HEADS, Q_LEN, KV_LEN) and weights.dtype == jnp.float32
  np.testing.assert_allclose(weights, expected_weights, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(output, expected_output, rtol=1e-5, atol=1e-5)


def test_no_mask_matches_all_true_mask():
  query, key, value, _ = random_inputs()
  full = np.ones((BATCH, 1, Q_LEN, KV_LEN), bool)
  np.testing.assert_allclose(attention.dot_product_attention(query, key, value, None)[0],
                             reference_attention(query, key, value, full)[0], rtol=1e-5, atol=1e-5)


def test_weights_sum_to_one_where_any_key_allowed():
  query, key, value, mask = random_inputs()
  _, weights = attention.dot_product_attention(query, key, value, jnp.asarray(mask))
  sums = np.asarray(weights.sum(axis=-1))  # [batch, heads, q_len]
  any_key = np.broadcast_to(mask.any(axis=-1), sums.shape)
  np.testing.assert_allclose(sums[any_key], 1.0, rtol=1e-6)
  np.testing.assert_array_equal(sums[~any_key], 0.0)
  assert np.all(np.asarray(weights)[~np.broadcast_to(mask, weights.shape)] == 0.0)


def test_fully_masked_query_gives_zeros_and_zero_gradient():
  query, key, value, mask = random_inputs()
  mask = jnp.asarray(mask)

  def masked_row_output(q, k, v):
    return attention.dot_product_attention(q, k, v, mask)[0][1, 2].sum()  # The query with no key.

  output, weights = attention.dot_product_attention(query, key, value, mask)
  np.testing.assert_array_equal(output[1, 2], 0.0)
  np.testing.assert_array_equal(weights[1, :, 2], 0.0)
  for grad in jax.jit(jax.grad(masked_row_output, argnums=(0, 1, 2)))(query, key, value):
    np.testing.assert_array_equal(grad, 0.0)
  full_grads = jax.jit(jax.grad(lambda *a: attention.dot_product_attention(*a, mask)[0].sum(),
                                argnums=(0, 1, 2)))(query, key, value)
  assert all(np.isfinite(g).all() for g in full_grads)


def test_all_masked_bfloat16_is_finite():
  query, key, value, _ = random_inputs()
  cast = lambda x: jnp.asarray(x, jnp.bfloat16)
  mask = jnp.zeros((BATCH, 1, Q_LEN, KV_LEN), bool)
  output, _ = attention.dot_product_attention(cast(query), cast(key), cast(value), mask)
  assert output.dtype == jnp.bfloat16
  np.testing.assert_array_equal(output.astype(jnp.float32), 0.0)


def test_d_k_mismatch_raises():
  query, key, value, mask = random_inputs(d_k=D_K + 1)
  with pytest.raises(ValueError, match='d_k'):
    attention.dot_product_attention(query, key, value, mask)


def test_kv_length_mismatch_raises():
  query, key, value, mask = random_inputs()
  with pytest.raises(ValueError, match='length'):
    attention.dot_product_attention(query, key, value[:, :-1], mask)


def test_padding_mask():
  segment_ids = jnp.array([[1, 1, 0], [1, 2, 2]])
  expected = np.array([
      [[1, 1, 0], [1, 1, 0], [0, 0, 0]],  # Padding (segment 0) attends to nothing and is never attended.
      [[1, 0, 0], [0, 1, 1], [0, 1, 1]],  # Packed sentences see only themselves.
  ], bool)[:, None]
  np.testing.assert_array_equal(attention.padding_mask(segment_ids, segment_ids), expected)
  cross = attention.padding_mask(jnp.array([[1, 1]]), jnp.array([[1, 1, 0]]))  # [1, 1, q_len 2, kv_len 3]
  np.testing.assert_array_equal(cross, np.array([[[[1, 1, 0], [1, 1, 0]]]], bool))


def test_causal_mask():
  mask = attention.causal_mask(4)
  assert mask.shape == (1, 1, 4, 4) and mask.dtype == jnp.bool_
  np.testing.assert_array_equal(mask[0, 0], np.arange(4)[:, None] >= np.arange(4)[None, :])


def test_fused_equals_xla():
  query, key, value, mask = random_inputs()
  value = value[..., :D_K]  # The fused path needs d_v == d_k.
  try:
    fused = jax.jit(attention.fused_dot_product_attention)(query, key, value, jnp.asarray(mask))
  except (NotImplementedError, RuntimeError) as e:  # pragma: no cover - depends on the backend.
    pytest.skip(f'jax.nn.dot_product_attention unsupported on {jax.default_backend()}: {e}')
  xla, _ = attention.dot_product_attention(query, key, value, jnp.asarray(mask))
  np.testing.assert_allclose(fused, xla, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(fused[1, 2], 0.0)  # The fully masked query.


def test_multi_head_attention_fused_equals_xla():
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(BATCH, KV_LEN, 16)), jnp.float32)
  mask = attention.padding_mask(jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]),
                                jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]))
  make = lambda impl: attention.MultiHeadAttention(HEADS, D_K, D_K, attention_impl=impl)
  params = jax.jit(lambda x, mask: make('xla').init(jax.random.key(0), x, x, mask, deterministic=True))(x, mask)
  apply = jax.jit(lambda params, x, mask, impl: make(impl).apply(params, x, x, mask, deterministic=True),
                  static_argnames='impl')
  xla, fused = apply(params, x, mask, impl='xla'), apply(params, x, mask, impl='fused')
  assert xla.shape == x.shape
  np.testing.assert_allclose(fused, xla, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('kv_heads', [4, 2, 1])
def test_decoding_attention_equals_dot_product_attention_on_the_transposed_caches(kv_heads):
  rng = np.random.default_rng(0)
  query = jnp.asarray(rng.normal(size=(3, 1, 4, 8)), jnp.float32)
  key, value = (jnp.asarray(rng.normal(size=(3, kv_heads, 6, d)), jnp.float32) for d in (8, 5))
  mask = (jnp.arange(6) <= 3)[None, None, None, :]  # Positions 0..3 written, 4 and 5 not yet.
  output, weights = attention.decoding_attention(query, key, value, mask)
  want_output, want_weights = attention.dot_product_attention(query, jnp.swapaxes(key, 1, 2),
                                                              jnp.swapaxes(value, 1, 2), mask)
  np.testing.assert_allclose(output, want_output, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(weights, want_weights, rtol=1e-5, atol=1e-7)
  assert output.shape == (3, 1, 4, 5) and weights.shape == (3, 4, 1, 6) and np.all(weights[..., 4:] == 0)


def test_decoding_attention_refuses_what_it_cannot_take():
  query, cache = jnp.zeros((2, 1, 4, 8)), jnp.zeros((2, 2, 6, 8))
  with pytest.raises(ValueError, match='one query position, got 2'):
    attention.decoding_attention(jnp.zeros((2, 2, 4, 8)), cache, cache, None)
  with pytest.raises(ValueError, match=r'broadcast to \[batch, 1, 1, max_len\]'):
    attention.decoding_attention(query, cache, cache, jnp.ones((2, 4, 1, 6), bool))
  with pytest.raises(ValueError, match=r'broadcast to \[batch, 1, 1, max_len\]'):
    attention.decoding_attention(query, cache, cache, jnp.ones((2, 1, 1, 5), bool))
  with pytest.raises(ValueError, match='do not fit the query'):
    attention.decoding_attention(query, jnp.zeros((2, 3, 6, 8)), jnp.zeros((2, 3, 6, 8)), None)
  with pytest.raises(ValueError, match='do not fit the query'):
    attention.decoding_attention(query, jnp.zeros((3, 2, 6, 8)), jnp.zeros((3, 2, 6, 8)), None)
