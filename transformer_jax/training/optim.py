"""The optimiser of §5.3: Adam(β1=0.9, β2=0.98, ε=1e-9) with the warm-up / inverse-square-root schedule.

Beside the paper's: global-norm clipping (train.grad_clip_norm) and decoupled weight decay (train.weight_decay,
AdamW), both off by default.
"""
import jax
import jax.numpy as jnp
import optax

from transformer_jax import errors


def rsqrt_schedule(d_model: int, warmup_steps: int, learning_rate_scale: float = 1.0) -> optax.Schedule:
  """lrate = scale · d_model^-0.5 · min(step^-0.5, step · warmup_steps^-1.5) (§5.3, Eq. 3).

  optax calls a schedule with the number of updates already applied (0 for the first update), so the
  formula is evaluated at step = count + 1: the first update uses step 1 (for d_model=512 and 4000
  warm-up steps, 1.747e-7), and the peak d_model^-0.5 · warmup_steps^-0.5 is reached at step warmup_steps.

  Args:
    d_model: model width.
    warmup_steps: steps of linear warm-up; must be positive.
    learning_rate_scale: a constant factor (1.0 in the paper), e.g. for small batches.

  Returns:
    A schedule mapping the int update count to a float32 learning rate.

  Raises:
    errors.ConfigError: if warmup_steps or d_model is not positive, or the scale is not positive.
  """
  if warmup_steps <= 0:
    raise errors.ConfigError(f'train.warmup_steps must be a positive integer, got {warmup_steps!r} '
                             '(the §5.3 schedule divides by it)')
  if d_model <= 0:
    raise errors.ConfigError(f'model.d_model must be positive, got {d_model!r}')
  if learning_rate_scale <= 0:
    raise errors.ConfigError(f'train.learning_rate_scale must be positive, got {learning_rate_scale!r}')

  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    return learning_rate_scale * d_model ** -0.5 * jnp.minimum(step ** -0.5, step * warmup_steps ** -1.5)

  return schedule


def make_optimizer(schedule: optax.Schedule, *, b1: float = 0.9, b2: float = 0.98, eps: float = 1e-9,
                   grad_clip_norm: float = 0.0, weight_decay: float = 0.0) -> optax.GradientTransformation:
  """Adam with the paper's hyperparameters (§5.3); global-norm clipping only when grad_clip_norm > 0.

  weight_decay > 0 makes it AdamW (Loshchilov & Hutter, 2019; not in the paper): each update also subtracts
  lrate · weight_decay · θ from every matrix θ (embeddings and projections: parameters of 2 or more
  dimensions), never from biases or normalisation scales. 0 is the paper's Adam, with the same state.

  Raises:
    errors.ConfigError: for betas outside [0, 1), a non-positive eps, a negative grad_clip_norm or a negative
      weight_decay.
  """
  for name, value in (('adam_b1', b1), ('adam_b2', b2)):
    if not 0.0 <= value < 1.0:
      raise errors.ConfigError(f'train.{name} must be in [0, 1), got {value!r}')
  if eps <= 0:
    raise errors.ConfigError(f'train.adam_eps must be positive, got {eps!r}')
  if grad_clip_norm < 0:
    raise errors.ConfigError(f'train.grad_clip_norm must be >= 0 (0 disables clipping), got {grad_clip_norm!r}')
  if weight_decay < 0:
    raise errors.ConfigError(f'train.weight_decay must be >= 0 (0 is the paper\'s Adam), got {weight_decay!r}')
  if weight_decay > 0:
    matrices = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    adam = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=matrices)
  else:
    adam = optax.adam(schedule, b1=b1, b2=b2, eps=eps)
  if grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(grad_clip_norm), adam)
  return adam
