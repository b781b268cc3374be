"""Label-smoothed cross-entropy (§5.4) and token accuracy, returned as sums and counts; the fused, chunked
form that training uses (`fused_smoothed_cross_entropy`), with R-Drop's divergence where train.rdrop_alpha > 0."""
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
  loss, nll, correct, _, _ = _token_terms(logits.astype(jnp.float32), targets, label_smoothing)
  return {
      'loss_sum': jnp.sum(loss * weights),
      'nll_sum': jnp.sum(nll * weights),
      'correct_sum': jnp.sum(correct * weights),
      'token_count': jnp.sum(weights),
  }


def _token_terms(logits: jax.Array, targets: jax.Array, label_smoothing: float):
  """Per-token terms of `smoothed_cross_entropy`, float32 [..., length]: (loss, nll, correct, softmax, log-softmax).

  loss is the cross-entropy against the smoothed target minus that target's entropy; correct is 1 where no
  logit exceeds the target's (a tie counts); softmax and log-softmax are float32 [..., length, vocab] (the fused
  loss's gradient needs the first, R-Drop's divergence both; unused, XLA drops them). No [..., vocab] one-hot
  is built.
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
  return (smoothed - _min_entropy(label_smoothing, vocab_size), nll, correct, exp / sum_exp[..., None],
          shifted - log_normaliser[..., None])


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fused(features, embedding, targets, weights, label_smoothing, chunk, rdrop_alpha):
  return _fused_forward(features, embedding, targets, weights, label_smoothing, chunk, rdrop_alpha,
                        gradients=False)[0]


def _r_drop_terms(probs, log_probs, weights, alpha):
  """R-Drop's divergence over paired rows (2i and 2i + 1: one row's two passes) of a chunk.

  Args are [rows, chunk, vocab] float32 softmax and log-softmax and the [rows, chunk] token weights of a chunk
  whose rows come in such pairs. Returns (per-token KL of each row's distribution from its partner's, times the
  row's weight, float32 [rows, chunk]: a pair's two entries sum to KL(P1‖P2) + KL(P2‖P1) where the pair's weights
  agree; the gradient of α/2 times the weighted pair sums with respect to the logits, float32 [rows, chunk,
  vocab]). With p = softmax(z) and q the partner's: d KL(p‖q) / dz = p (log p - log q - KL(p‖q)) and
  d KL(q‖p) / dz = p - q; each term carries the weight of the row whose KL it is.
  """
  partner = lambda x: jnp.flip(x.reshape(-1, 2, *x.shape[1:]), axis=1).reshape(x.shape)
  log_ratio = log_probs - partner(log_probs)
  divergence = jnp.sum(probs * log_ratio, axis=-1, keepdims=True)
  d_logits = 0.5 * alpha * (weights[..., None] * probs * (log_ratio - divergence)
                            + partner(weights)[..., None] * (probs - partner(probs)))
  return divergence[..., 0] * weights, d_logits


def _fused_forward(features, embedding, targets, weights, label_smoothing, chunk, rdrop_alpha, gradients):
  """Scans the chunks: sums of (objective, loss, nll, correct, R-Drop's divergence), and with gradients=True the
  gradient of the objective with respect to features ([batch, length, d_model], compute dtype) and embedding
  (float32). The objective is the loss, plus rdrop_alpha / 2 times the divergence when rdrop_alpha > 0."""
  compute_embedding = embedding.astype(features.dtype)

  def body(d_embedding, inputs):
    x, t, w = inputs  # [batch, chunk, d_model], [batch, chunk], [batch, chunk]
    logits = jnp.einsum('blm,nm->bln', x, compute_embedding, preferred_element_type=jnp.float32)
    loss, nll, correct, probs, log_probs = _token_terms(logits, t, label_smoothing)
    loss_sum = jnp.sum(loss * w)
    kl_sum, d_divergence = jnp.zeros((), jnp.float32), None
    if rdrop_alpha:
      divergence, d_divergence = _r_drop_terms(probs, log_probs, w, rdrop_alpha)
      kl_sum = jnp.sum(divergence)
    sums = (loss_sum + 0.5 * rdrop_alpha * kl_sum, loss_sum, jnp.sum(nll * w), jnp.sum(correct * w), kl_sum)
    if not gradients:
      return d_embedding, sums
    # d loss / d logits: softmax - smoothed target, times the token's weight.
    confidence, low_confidence = 1.0 - label_smoothing, label_smoothing / (embedding.shape[0] - 1)
    one_hot = jnp.arange(embedding.shape[0])[None, None, :] == t[..., None]
    d_logits = (probs - jnp.where(one_hot, confidence, low_confidence)) * w[..., None]
    if rdrop_alpha:
      d_logits = d_logits + d_divergence
    d_logits = d_logits.astype(features.dtype)
    d_x = jnp.einsum('bln,nm->blm', d_logits, compute_embedding, preferred_element_type=jnp.float32)
    d_embedding = d_embedding + jnp.einsum('bln,blm->nm', d_logits, x, preferred_element_type=jnp.float32)
    return d_embedding, (sums, d_x.astype(features.dtype))

  inputs = tuple(_chunked(a, chunk) for a in (features, targets, weights))
  d_embedding, outputs = jax.lax.scan(body, jnp.zeros(embedding.shape, jnp.float32), inputs)
  if not gradients:
    return tuple(jnp.sum(s) for s in outputs), None
  sums, d_features = outputs
  return tuple(jnp.sum(s) for s in sums), (_unchunked(d_features), d_embedding.astype(embedding.dtype))


def _fused_fwd(features, embedding, targets, weights, label_smoothing, chunk, rdrop_alpha):
  sums, gradients = _fused_forward(features, embedding, targets, weights, label_smoothing, chunk, rdrop_alpha,
                                   gradients=True)
  return sums, (gradients, targets, weights)


def _fused_bwd(label_smoothing, chunk, rdrop_alpha, residuals, cotangents):
  del label_smoothing, chunk, rdrop_alpha
  (d_features, d_embedding), targets, weights = residuals
  d_objective = cotangents[0]  # Only the objective is differentiable; the other sums are metrics.
  return ((d_objective * d_features).astype(d_features.dtype), d_objective * d_embedding,
          np.zeros(targets.shape, jax.dtypes.float0), jnp.zeros_like(weights))


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_smoothed_cross_entropy(features: jax.Array, embedding: jax.Array, targets: jax.Array,
                                 weights: jax.Array, label_smoothing: float,
                                 chunk_tokens: int = 512, rdrop_alpha: float = 0.0) -> dict[str, jax.Array]:
  """`smoothed_cross_entropy` of the tied output projection's logits, without holding them (§3.4, §5.4).

  The logits features @ embedding^T are computed a chunk of about `chunk_tokens` tokens at a time (a
  `lax.scan` over the length axis), and each chunk's gradient (softmax - smoothed target, times the token's
  weight) is multiplied into the features' and the embedding's gradients at once, in the forward pass: the
  [batch, length, vocab] float32 logits and their gradient never reach memory whole, and the embedding's
  gradient is one product over the token axis per chunk. Measured on a 2-vCPU AMD EPYC at the main job's
  shape (docs/performance.md).

  With rdrop_alpha = α > 0 (R-Drop, Liang et al., 2021, Eq. 3; not in the paper) the rows come in pairs, 2i and
  2i + 1 holding one row's two passes under different dropout masks, and the objective per pair is
  L1 + L2 + α/2 (KL(P1‖P2) + KL(P2‖P1)), with L1, L2 the label-smoothed losses and P1, P2 the two passes'
  distributions over the vocabulary at each target position; its gradient is formed per chunk as the loss's is.

  Only the objective (`loss_sum`, or `objective_sum` under R-Drop) is differentiable: the gradient of the other
  sums (metrics) is not computed (under R-Drop, `jax.grad` of `loss_sum` reads zero).

  Args:
    features: the decoder output [batch, length, d_model] in the compute dtype (`Transformer.features`); under
      R-Drop [2 x rows, length, d_model], each row followed by its second pass.
    embedding: the shared embedding [vocab, d_model], float32 (cast to features.dtype for the products).
    targets: int32 [batch, length] (under R-Drop each row twice in a row).
    weights: float32 [batch, length]: 1 on real tokens, 0 on padding (under R-Drop each row twice in a row).
    label_smoothing: ε_ls in [0, 1).
    chunk_tokens: tokens per chunk (batch x a divisor of length).
    rdrop_alpha: R-Drop's α >= 0; 0 (the default) is the label-smoothed loss alone.

  Returns:
    The dict of `smoothed_cross_entropy`: float32 sums `loss_sum`, `nll_sum`, `correct_sum`, `token_count` (under
    R-Drop over both passes), and under R-Drop `kl_sum` (KL(P1‖P2) + KL(P2‖P1) in nats, summed over the
    rows' tokens once) and `objective_sum` = loss_sum + α/2 kl_sum, the sum to differentiate.

  Raises:
    ValueError: at trace time, under R-Drop, if features has an odd number of rows.
  """
  if rdrop_alpha and features.shape[0] % 2:
    raise ValueError(f'R-Drop needs each row followed by its copy: {features.shape[0]} rows is odd')
  chunk = _chunk_length(features.shape[0], features.shape[1], chunk_tokens)
  objective_sum, loss_sum, nll_sum, correct_sum, kl_sum = _fused(
      features, embedding, targets, weights.astype(jnp.float32), label_smoothing, chunk, rdrop_alpha)
  if not rdrop_alpha:  # The objective is the loss: its differentiable output.
    return {'loss_sum': objective_sum, 'nll_sum': nll_sum, 'correct_sum': correct_sum,
            'token_count': jnp.sum(weights)}
  return {'loss_sum': loss_sum, 'nll_sum': nll_sum, 'correct_sum': correct_sum, 'token_count': jnp.sum(weights),
          'kl_sum': kl_sum, 'objective_sum': objective_sum}
