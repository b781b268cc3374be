"""Tests for transformer_jax.training.losses: label-smoothed cross-entropy (§5.4) against hand and NumPy
computations."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.training import losses


def numpy_smoothed_loss(logits, targets, weights, label_smoothing):
  """Reference: KL(q || p) per token with q = 1 - ε on the target and ε / (V - 1) elsewhere, explicit one-hot."""
  logits = np.asarray(logits, np.float64)
  vocab_size = logits.shape[-1]
  log_probs = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) \
      - logits.max(-1, keepdims=True)
  one_hot = np.eye(vocab_size)[targets]
  q = one_hot * (1 - label_smoothing) + (1 - one_hot) * label_smoothing / (vocab_size - 1)
  q_log_q = np.where(q > 0, q * np.log(np.where(q > 0, q, 1.0)), 0.0)
  kl = np.sum(q_log_q - q * log_probs, -1)
  nll = -np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
  correct = logits.argmax(-1) == targets
  return {'loss_sum': np.sum(kl * weights), 'nll_sum': np.sum(nll * weights),
          'correct_sum': np.sum(correct * weights), 'token_count': np.sum(weights)}


def test_uniform_logits_hand_computed():
  # V = 4, ε = 0.1, uniform prediction p = 1/4. By hand: nll = ln 4 = 1.3862944;
  # H(q) = -(0.9 ln 0.9 + 3 · (0.1/3) ln(0.1/3)) = 0.0948245 + 0.3401197 = 0.4349442;
  # loss = CE(q, p) - H(q) = ln 4 - 0.4349442 = 0.9513502 per token.
  logits = jnp.zeros((1, 3, 4))
  targets = jnp.array([[0, 2, 0]])
  weights = jnp.array([[1.0, 1.0, 0.0]])  # The third position is padding.
  sums = losses.smoothed_cross_entropy(logits, targets, weights, 0.1)
  assert float(sums['token_count']) == 2.0
  assert float(sums['loss_sum']) == pytest.approx(2 * 0.9513502, abs=2e-6)
  assert float(sums['nll_sum']) == pytest.approx(2 * math.log(4), abs=2e-6)
  assert float(sums['correct_sum']) == 2.0  # Every token ties for the highest logit; a tie counts as correct.
  logits = logits.at[0, 1, 3].set(0.5)  # Now token 3 beats the second target (2).
  assert float(losses.smoothed_cross_entropy(logits, targets, weights, 0.1)['correct_sum']) == 1.0


def random_batch(seed=0, batch=2, length=5, vocab_size=7):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(batch, length, vocab_size)).astype(np.float32) * 3
  targets = rng.integers(0, vocab_size, size=(batch, length))
  weights = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.float32)[:batch, :length]
  return logits, targets, weights


@pytest.mark.parametrize('label_smoothing', [0.0, 0.1, 0.3])
def test_matches_numpy_reference(label_smoothing):
  logits, targets, weights = random_batch()
  sums = losses.smoothed_cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights),
                                       label_smoothing)
  expected = numpy_smoothed_loss(logits, targets, weights, label_smoothing)
  for key, value in expected.items():
    assert sums[key].dtype == jnp.float32
    np.testing.assert_allclose(float(sums[key]), value, rtol=1e-5, err_msg=key)
  if label_smoothing == 0.0:
    np.testing.assert_allclose(float(sums['loss_sum']), float(sums['nll_sum']), rtol=1e-6)
  else:
    assert float(sums['loss_sum']) < float(sums['nll_sum'])


def test_padding_does_not_change_the_loss():
  logits, targets, weights = random_batch()
  base = losses.smoothed_cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights), 0.1)
  # Three more padded positions per row and a padded row, with large garbage logits and arbitrary targets.
  rng = np.random.default_rng(1)
  padded_logits = rng.normal(size=(3, 8, 7)).astype(np.float32) * 50
  padded_logits[:2, :5] = logits
  padded_targets = rng.integers(0, 7, size=(3, 8))
  padded_targets[:2, :5] = targets
  padded_weights = np.zeros((3, 8), np.float32)
  padded_weights[:2, :5] = weights
  padded = losses.smoothed_cross_entropy(jnp.asarray(padded_logits), jnp.asarray(padded_targets),
                                         jnp.asarray(padded_weights), 0.1)
  for key in base:
    np.testing.assert_allclose(float(padded[key]), float(base[key]), rtol=1e-6, err_msg=key)
  per_token = float(padded['loss_sum']) / float(padded['token_count'])
  assert per_token == pytest.approx(float(base['loss_sum']) / 8.0, rel=1e-6)  # 8 real tokens.


def test_prediction_equal_to_smoothed_target_scores_zero():
  vocab_size, eps = 5, 0.1
  targets = np.array([[1, 4, 0]])
  q = np.full((1, 3, vocab_size), eps / (vocab_size - 1))
  np.put_along_axis(q, targets[..., None], 1 - eps, axis=-1)
  sums = losses.smoothed_cross_entropy(jnp.log(jnp.asarray(q, jnp.float32)) + 2.0, jnp.asarray(targets),
                                       jnp.ones((1, 3)), eps)
  assert abs(float(sums['loss_sum'])) < 1e-5  # KL(q || q) = 0: the minimum, whatever ε.
  assert float(sums['nll_sum']) == pytest.approx(-3 * math.log(1 - eps), rel=1e-5)


def test_bfloat16_logits_give_float32_sums():
  logits, targets, weights = random_batch()
  sums = losses.smoothed_cross_entropy(jnp.asarray(logits, jnp.bfloat16), jnp.asarray(targets),
                                       jnp.asarray(weights), 0.1)
  expected = numpy_smoothed_loss(np.asarray(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32)), targets,
                                 weights, 0.1)
  assert all(value.dtype == jnp.float32 for value in sums.values())
  np.testing.assert_allclose(float(sums['loss_sum']), expected['loss_sum'], rtol=1e-5)


@pytest.mark.integration
@pytest.mark.parametrize('dtype,chunk_tokens', [(jnp.float32, 6), (jnp.float32, 1000), (jnp.bfloat16, 6)])
def test_fused_loss_equals_reference_values_and_gradients(dtype, chunk_tokens):
  # The training loss: the fused, chunked form against the logits -> smoothed_cross_entropy reference, in value
  # and in the gradient of loss_sum with respect to the features and the tied embedding.
  import jax  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  batch, length, d_model, vocab = 3, 8, 16, 37
  features = jnp.asarray(rng.normal(size=(batch, length, d_model)), dtype)
  embedding = jnp.asarray(rng.normal(size=(vocab, d_model)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, vocab, (batch, length)), jnp.int32)
  weights = jnp.asarray(rng.random((batch, length)) > 0.2, jnp.float32)

  def reference(x, e):
    logits = jnp.einsum('blm,nm->bln', x.astype(jnp.float32), e.astype(x.dtype).astype(jnp.float32))
    return losses.smoothed_cross_entropy(logits, targets, weights, 0.1)

  def fused(x, e):
    return losses.fused_smoothed_cross_entropy(x, e, targets, weights, 0.1, chunk_tokens=chunk_tokens)

  expected, got = reference(features, embedding), jax.jit(fused)(features, embedding)
  for key in ('loss_sum', 'nll_sum', 'correct_sum', 'token_count'):
    assert float(got[key]) == pytest.approx(float(expected[key]), rel=1e-5), key
  grad = lambda f: jax.grad(lambda x, e: f(x, e)['loss_sum'], argnums=(0, 1))(features, embedding)
  (dx_ref, de_ref), (dx, de) = grad(reference), jax.jit(lambda x, e: grad(fused))(features, embedding)
  assert dx.dtype == dtype and de.dtype == jnp.float32
  tolerance = 1e-5 if dtype == jnp.float32 else 1e-2  # bf16: the gradient of the logits is rounded to bf16.
  scale = float(jnp.max(jnp.abs(de_ref)))
  np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(dx_ref, np.float32),
                             atol=tolerance * float(jnp.max(jnp.abs(dx_ref.astype(jnp.float32)))))
  np.testing.assert_allclose(np.asarray(de), np.asarray(de_ref, np.float32), atol=tolerance * scale)


def test_fused_loss_chunks_divide_the_length():
  assert losses._chunk_length(32, 64, 512) == 16  # 32 x 16 = 512 tokens per chunk.
  assert losses._chunk_length(32, 24, 512) == 12
  assert losses._chunk_length(1000, 7, 512) == 1  # One position per chunk when a row alone is too many.
  assert losses._chunk_length(2, 7, 512) == 7


def test_r_drop_divergence_against_numpy_and_zero_for_identical_passes():
  """Under R-Drop the fused loss's kl_sum is Σ KL(P1‖P2) + KL(P2‖P1) over the sentences' tokens (NumPy in
  float64), its objective adds α/2 of it, and its gradient is autodiff's of that objective; for two identical
  passes the divergence is 0 and the losses are one pass's, twice."""
  rng = np.random.default_rng(0)
  features = rng.normal(size=(4, 6, 8)).astype(np.float32)  # Two passes of a [2, 6] batch: rows 0, 0, 1, 1.
  embedding = rng.normal(size=(11, 8)).astype(np.float32)
  targets = np.repeat(rng.integers(1, 11, size=(2, 6)), 2, axis=0).astype(np.int32)
  weights = np.repeat(np.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]], np.float32), 2, axis=0)
  fused = lambda f, e, chunk_tokens=8: losses.fused_smoothed_cross_entropy(
      f, e, jnp.asarray(targets), jnp.asarray(weights), 0.1, chunk_tokens=chunk_tokens, rdrop_alpha=5.0)
  sums = fused(jnp.asarray(features), jnp.asarray(embedding))  # Chunks of 2 positions: a 3-step scan.
  logits = np.einsum('blm,nm->bln', features.astype(np.float64), embedding)
  log_p = logits - np.log(np.sum(np.exp(logits), -1, keepdims=True))
  p = np.exp(log_p)
  kl = lambda a, b: np.sum(p[a] * (log_p[a] - log_p[b]), -1)
  first, second = slice(0, 4, 2), slice(1, 4, 2)
  expected_kl = np.sum((kl(first, second) + kl(second, first)) * weights[first])
  assert float(sums['kl_sum']) == pytest.approx(expected_kl, rel=1e-4)
  reference = numpy_smoothed_loss(logits, targets, weights, 0.1)
  assert float(sums['loss_sum']) == pytest.approx(reference['loss_sum'], rel=1e-4)
  assert float(sums['token_count']) == 16.0  # Both passes: 8 tokens each.
  assert float(sums['objective_sum']) == pytest.approx(reference['loss_sum'] + 2.5 * expected_kl, rel=1e-4)

  def autodiff_objective(f, e, w):  # Each row's KL from its partner, times the row's weight.
    log_probs = jax.nn.log_softmax(jnp.einsum('blm,nm->bln', f, e), axis=-1)
    partner = jnp.stack([log_probs[1::2], log_probs[0::2]], axis=1).reshape(log_probs.shape)
    divergence = jnp.sum(jnp.exp(log_probs) * (log_probs - partner), axis=-1)
    loss = losses.smoothed_cross_entropy(jnp.einsum('blm,nm->bln', f, e), jnp.asarray(targets), w, 0.1)['loss_sum']
    return loss + 2.5 * jnp.sum(divergence * w)

  # The pairs' weights agree, as training's do; then two tokens keep their weight in one pass of their row only.
  for w in (weights, np.where(np.arange(4)[:, None] * np.arange(6)[None] == 4, 0.0, weights).astype(np.float32)):
    w = jnp.asarray(w)
    expected = jax.grad(autodiff_objective, argnums=(0, 1))(jnp.asarray(features), jnp.asarray(embedding), w)
    computed = jax.grad(lambda f, e: losses.fused_smoothed_cross_entropy(  # pylint: disable=cell-var-from-loop
        f, e, jnp.asarray(targets), w, 0.1, chunk_tokens=8, rdrop_alpha=5.0)['objective_sum'], argnums=(0, 1))(
            jnp.asarray(features), jnp.asarray(embedding))
    for a, b in zip(computed, expected):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)

  same = np.repeat(features[first], 2, axis=0)
  sums = fused(jnp.asarray(same), jnp.asarray(embedding))
  one_pass = numpy_smoothed_loss(np.einsum('blm,nm->bln', features[first].astype(np.float64), embedding),
                                 targets[first], weights[first], 0.1)
  assert float(sums['kl_sum']) == pytest.approx(0.0, abs=1e-5)
  assert float(sums['objective_sum']) == pytest.approx(2 * one_pass['loss_sum'], rel=1e-4)
  with pytest.raises(ValueError, match='odd'):
    losses.fused_smoothed_cross_entropy(jnp.asarray(features[:3]), jnp.asarray(embedding), jnp.asarray(targets[:3]),
                                        jnp.asarray(weights[:3]), 0.1, rdrop_alpha=5.0)
