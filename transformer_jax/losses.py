"""Label-smoothed cross-entropy (§5.4) and token accuracy, returned as sums and counts."""
import jax
import jax.numpy as jnp


def smoothed_cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array,
                           label_smoothing: float) -> dict[str, jax.Array]:
  """Label smoothing of value ε_ls (§5.4, Szegedy et al. 2016), summed over the tokens with weight 1.

  The smoothed target puts 1 - ε on the reference token and ε / (vocab - 1) on every other token. `loss`
  is the cross-entropy against it minus that distribution's entropy (the minimum achievable), so a perfect
  prediction scores 0 for any ε; `nll` is the plain negative log-likelihood of the reference tokens; a
  token is `correct` when no other token has a higher logit (a tie counts as correct).

  Args:
    logits: float32 [batch, length, vocab].
    targets: int32 [batch, length].
    weights: float32 [batch, length]: 1 on real tokens, 0 on padding.
    label_smoothing: ε_ls in [0, 1).

  Returns:
    {'loss_sum', 'nll_sum', 'correct_sum', 'token_count'}: float32 scalars (sums over the batch); divide
    sums by token_count only after summing over steps and devices.
  """
  vocab_size = logits.shape[-1]
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [batch, length, vocab]
  nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]  # [batch, length]
  confidence = 1.0 - label_smoothing
  low_confidence = label_smoothing / (vocab_size - 1)
  # Cross-entropy against the smoothed target, without building a [batch, length, vocab] one-hot.
  smoothed = confidence * nll - low_confidence * (jnp.sum(log_probs, axis=-1) + nll)
  xlogx = lambda p: p * jnp.log(p) if p > 0 else 0.0
  min_entropy = -(xlogx(confidence) + (vocab_size - 1) * xlogx(low_confidence))
  # The reference token is correct when no logit exceeds its own (log_probs[target] == max log_prob).
  # A max reduction is vectorised on every backend; XLA:CPU's argmax over [tokens, vocab] is ~10x slower.
  correct = (nll <= -jnp.max(log_probs, axis=-1)).astype(jnp.float32)
  return {
      'loss_sum': jnp.sum((smoothed - min_entropy) * weights),
      'nll_sum': jnp.sum(nll * weights),
      'correct_sum': jnp.sum(correct * weights),
      'token_count': jnp.sum(weights),
  }


def target_weights(batch: dict[str, jax.Array]) -> jax.Array:
  """float32 [batch, tgt_len]: 1 on real target tokens (including EOS), 0 on padding (id 0)."""
  return (batch['target_tokens'] != 0).astype(jnp.float32)
