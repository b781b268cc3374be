"""Label-smoothed cross-entropy (§5.4) and token accuracy, returned as sums and counts; the fused, chunked
form that training uses (`fused_smoothed_cross_entropy`)."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np


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
  loss, nll, correct, _ = _token_terms(logits.astype(jnp.float32), targets, label_smoothing)
  return {
      'loss_sum': jnp.sum(loss * weights),
      'nll_sum': jnp.sum(nll * weights),
      'correct_sum': jnp.sum(correct * weights),
      'token_count': jnp.sum(weights),
  }


def _token_terms(logits: jax.Array, targets: jax.Array, label_smoothing: float):
  """Per-token terms of `smoothed_cross_entropy`, float32 [..., length]: (loss, nll, correct, softmax).

  loss is the cross-entropy against the smoothed target minus that target's entropy; correct is 1 where no
  logit exceeds the target's (a tie counts); softmax is float32 [..., length, vocab] (the fused loss's gradient
  needs it; unused, XLA drops it). No [..., vocab] one-hot is built.
  """
  vocab_size = logits.shape[-1]
  shifted = logits - jnp.max(logits, axis=-1, keepdims=True)  # Its maximum is 0.
  exp = jnp.exp(shifted)
  sum_exp = jnp.sum(exp, axis=-1)
  log_normaliser = jnp.log(sum_exp)
  target_shifted = jnp.take_along_axis(shifted, targets[..., None], axis=-1)[..., 0]
  nll = log_normaliser - target_shifted
  sum_log_probs = jnp.sum(shifted, axis=-1) - vocab_size * log_normaliser
  confidence = 1.0 - label_smoothing
  low_confidence = label_smoothing / (vocab_size - 1)
  smoothed = confidence * nll - low_confidence * (sum_log_probs + nll)
  # A max reduction is vectorised on every backend; XLA:CPU's argmax over [tokens, vocab] is ~10x slower.
  correct = (target_shifted >= 0.0).astype(jnp.float32)
  return smoothed - _min_entropy(label_smoothing, vocab_size), nll, correct, exp / sum_exp[..., None]


def target_weights(batch: dict[str, jax.Array]) -> jax.Array:
  """float32 [batch, tgt_len]: 1 on real target tokens (including EOS), 0 on padding (id 0)."""
  return (batch['target_tokens'] != 0).astype(jnp.float32)


def _chunk_length(batch: int, length: int, chunk_tokens: int) -> int:
  """The largest divisor of `length` with batch * divisor <= chunk_tokens (at least 1)."""
  return max(d for d in range(1, length + 1) if length % d == 0 and (d == 1 or batch * d <= chunk_tokens))


def _chunked(x: jax.Array, chunk: int) -> jax.Array:
  """[batch, length, ...] -> [length / chunk, batch, chunk, ...]: the scan runs over the first axis."""
  batch, length = x.shape[:2]
  return jnp.swapaxes(x.reshape(batch, length // chunk, chunk, *x.shape[2:]), 0, 1)


def _unchunked(x: jax.Array) -> jax.Array:
  """The inverse of `_chunked`."""
  x = jnp.swapaxes(x, 0, 1)
  return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _min_entropy(label_smoothing: float, vocab_size: int) -> float:
  """The entropy of the smoothed target distribution: the smallest label-smoothed cross-entropy."""
  xlogx = lambda p: p * math.log(p) if p > 0 else 0.0
  return -(xlogx(1.0 - label_smoothing) + (vocab_size - 1) * xlogx(label_smoothing / (vocab_size - 1)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused(features, embedding, targets, weights, label_smoothing, chunk):
  return _fused_forward(features, embedding, targets, weights, label_smoothing, chunk, gradients=False)[0]


def _fused_forward(features, embedding, targets, weights, label_smoothing, chunk, gradients):
  """Scans the chunks: sums of (loss, nll, correct), and with gradients=True the gradient of loss_sum with
  respect to features ([batch, length, d_model], compute dtype) and embedding (float32)."""
  compute_embedding = embedding.astype(features.dtype)

  def body(d_embedding, inputs):
    x, t, w = inputs  # [batch, chunk, d_model], [batch, chunk], [batch, chunk]
    logits = jnp.einsum('blm,nm->bln', x, compute_embedding, preferred_element_type=jnp.float32)
    loss, nll, correct, probs = _token_terms(logits, t, label_smoothing)
    sums = (jnp.sum(loss * w), jnp.sum(nll * w), jnp.sum(correct * w))
    if not gradients:
      return d_embedding, sums
    # d loss / d logits: softmax - smoothed target, times the token's weight.
    confidence, low_confidence = 1.0 - label_smoothing, label_smoothing / (embedding.shape[0] - 1)
    one_hot = jnp.arange(embedding.shape[0])[None, None, :] == t[..., None]
    d_logits = ((probs - jnp.where(one_hot, confidence, low_confidence)) * w[..., None]).astype(features.dtype)
    d_x = jnp.einsum('bln,nm->blm', d_logits, compute_embedding, preferred_element_type=jnp.float32)
    d_embedding = d_embedding + jnp.einsum('bln,blm->nm', d_logits, x, preferred_element_type=jnp.float32)
    return d_embedding, (sums, d_x.astype(features.dtype))

  inputs = tuple(_chunked(a, chunk) for a in (features, targets, weights))
  d_embedding, outputs = jax.lax.scan(body, jnp.zeros(embedding.shape, jnp.float32), inputs)
  if not gradients:
    return tuple(jnp.sum(s) for s in outputs), None
  sums, d_features = outputs
  return tuple(jnp.sum(s) for s in sums), (_unchunked(d_features), d_embedding.astype(embedding.dtype))


def _fused_fwd(features, embedding, targets, weights, label_smoothing, chunk):
  sums, gradients = _fused_forward(features, embedding, targets, weights, label_smoothing, chunk, gradients=True)
  return sums, (gradients, targets, weights)


def _fused_bwd(label_smoothing, chunk, residuals, cotangents):
  del label_smoothing, chunk
  (d_features, d_embedding), targets, weights = residuals
  d_loss = cotangents[0]  # Only loss_sum is differentiable; nll_sum and correct_sum are metrics.
  return ((d_loss * d_features).astype(d_features.dtype), d_loss * d_embedding,
          np.zeros(targets.shape, jax.dtypes.float0), jnp.zeros_like(weights))


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_smoothed_cross_entropy(features: jax.Array, embedding: jax.Array, targets: jax.Array,
                                 weights: jax.Array, label_smoothing: float,
                                 chunk_tokens: int = 512) -> dict[str, jax.Array]:
  """`smoothed_cross_entropy` of the tied output projection's logits, without holding them (§3.4, §5.4).

  The logits features @ embedding^T are computed a chunk of about `chunk_tokens` tokens at a time (a
  `lax.scan` over the length axis), and each chunk's gradient (softmax - smoothed target, times the token's
  weight) is multiplied into the features' and the embedding's gradients at once, in the forward pass: the
  [batch, length, vocab] float32 logits and their gradient never reach memory whole, and the embedding's
  gradient is one product over the token axis per chunk. Measured on a 2-vCPU AMD EPYC at the main job's
  shape (docs/performance.md).

  Only `loss_sum` is differentiable: the gradient of `nll_sum` and `correct_sum` (metrics) is not computed.

  Args:
    features: the decoder output [batch, length, d_model] in the compute dtype (`Transformer.features`).
    embedding: the shared embedding [vocab, d_model], float32 (cast to features.dtype for the products).
    targets: int32 [batch, length].
    weights: float32 [batch, length]: 1 on real tokens, 0 on padding.
    label_smoothing: ε_ls in [0, 1).
    chunk_tokens: tokens per chunk (batch x a divisor of length).

  Returns:
    The dict of `smoothed_cross_entropy`: float32 sums `loss_sum`, `nll_sum`, `correct_sum`, `token_count`.
  """
  chunk = _chunk_length(features.shape[0], features.shape[1], chunk_tokens)
  loss_sum, nll_sum, correct_sum = _fused(features, embedding, targets, weights.astype(jnp.float32),
                                          label_smoothing, chunk)
  return {'loss_sum': loss_sum, 'nll_sum': nll_sum, 'correct_sum': correct_sum, 'token_count': jnp.sum(weights)}


def r_drop_cross_entropy(features: jax.Array, embedding: jax.Array, targets: jax.Array, weights: jax.Array,
                         label_smoothing: float, alpha: float) -> dict[str, jax.Array]:
  """R-Drop (Liang et al., 2021, Eq. 3; not in the paper): two passes' label-smoothed losses and their agreement.

  `features` holds the decoder output of one batch run twice under independent dropout masks, each row followed
  by its copy (rows 2i and 2i + 1 are row i's two passes; on a data-sharded mesh a row and its copy stay on one
  device). The objective per pair is L1 + L2 + α/2 (KL(P1‖P2) + KL(P2‖P1)), with L1, L2 the
  label-smoothed losses of §5.4 and P1, P2 the two passes' distributions over the vocabulary at each target
  position. The logits are held whole ([2 x batch, length, vocab], float32), unlike the fused loss training
  uses otherwise (`fused_smoothed_cross_entropy`): the divergence needs both passes' softmax at once.

  Args:
    features: the decoder output [2 x batch, length, d_model] in the compute dtype: each row, then its copy.
    embedding: the shared embedding [vocab, d_model], float32 (cast to features.dtype for the product).
    targets: int32 [2 x batch, length], each row of the batch's targets twice in a row.
    weights: float32 [2 x batch, length]: 1 on real tokens, 0 on padding, each row twice in a row.
    label_smoothing: ε_ls in [0, 1).
    alpha: α >= 0, the divergence's weight.

  Returns:
    `smoothed_cross_entropy`'s float32 sums over both passes (`loss_sum`, `nll_sum`, `correct_sum`,
    `token_count`: twice the batch's tokens), `kl_sum` (KL(P1‖P2) + KL(P2‖P1), nats, summed over the batch's
    tokens once) and `objective_sum` = loss_sum + α/2 kl_sum, the sum that training differentiates.

  Raises:
    ValueError: at trace time, if features has an odd number of rows.
  """
  if features.shape[0] % 2:
    raise ValueError(f'R-Drop needs each row followed by its copy: {features.shape[0]} rows is odd')
  logits = jnp.einsum('blm,nm->bln', features, embedding.astype(features.dtype), preferred_element_type=jnp.float32)
  sums = smoothed_cross_entropy(logits, targets, weights, label_smoothing)
  log_probs = jax.nn.log_softmax(logits)
  first, second = log_probs[0::2], log_probs[1::2]
  # KL(P1‖P2) + KL(P2‖P1) = Σ_v (p1 - p2) (log p1 - log p2).
  divergence = jnp.sum((jnp.exp(first) - jnp.exp(second)) * (first - second), axis=-1)
  kl_sum = jnp.sum(divergence * weights[0::2])
  return sums | {'kl_sum': kl_sum, 'objective_sum': sums['loss_sum'] + 0.5 * alpha * kl_sum}
