"""Tests for transformer_jax.training.optim: the §5.3 schedule against its formula, and Adam against hand-computed
steps."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer_jax.training import optim


def paper_lrate(step: int, d_model: int = 512, warmup_steps: int = 4000) -> float:
  """§5.3, Eq. 3, written out independently: lrate = d_model^-0.5 · min(step^-0.5, step · warmup_steps^-1.5)."""
  return d_model ** -0.5 * min(step ** -0.5, step * warmup_steps ** -1.5)


@pytest.mark.parametrize('step', [1, 4000, 40000])
def test_schedule_matches_paper_formula(step):
  schedule = optim.rsqrt_schedule(512, 4000)
  # optax passes the number of updates already applied: the update of step s sees count s - 1.
  np.testing.assert_allclose(float(schedule(step - 1)), paper_lrate(step), rtol=1e-6)


def test_schedule_first_update_and_peak():
  schedule = optim.rsqrt_schedule(512, 4000)
  assert float(schedule(0)) == pytest.approx(1.747e-7, rel=1e-3)  # 512^-0.5 · 4000^-1.5.
  rates = np.asarray(schedule(jnp.arange(12000)))
  assert int(rates.argmax()) + 1 == 4000  # The peak is the step that ends warm-up ...
  assert rates.max() == pytest.approx(6.988e-4, rel=1e-3)  # ... at 512^-0.5 · 4000^-0.5.
  assert np.all(np.diff(rates[:3999]) > 0) and np.all(np.diff(rates[3999:]) < 0)


def test_schedule_scale_multiplies_every_rate():
  base, scaled = optim.rsqrt_schedule(256, 400), optim.rsqrt_schedule(256, 400, learning_rate_scale=0.5)
  counts = jnp.array([0, 10, 399, 5000])
  np.testing.assert_allclose(scaled(counts), 0.5 * base(counts), rtol=1e-6)
  np.testing.assert_allclose(base(counts), [paper_lrate(s, 256, 400) for s in (1, 11, 400, 5001)], rtol=1e-6)


@pytest.mark.parametrize(('args', 'match'), [
    ((512, 0), r'train\.warmup_steps must be a positive integer, got 0'),
    ((512, -10), r'train\.warmup_steps must be a positive integer, got -10'),
    ((0, 4000), r'model\.d_model must be positive, got 0'),
    ((512, 4000, 0.0), r'train\.learning_rate_scale must be positive, got 0\.0'),
])
def test_schedule_rejects_bad_arguments(args, match):
  with pytest.raises(ValueError, match=match):
    optim.rsqrt_schedule(*args)


def numpy_adam(grads, lr, b1=0.9, b2=0.98, eps=1e-9, clip=None):
  """Kingma & Ba (2015), Algorithm 1, with bias correction; the updates (to add to the params) of each step."""
  m = v = np.zeros_like(grads[0])
  updates = []
  for t, g in enumerate(grads, start=1):
    if clip is not None:
      g = g * min(1.0, clip / np.linalg.norm(g))
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
    updates.append(-lr * m_hat / (np.sqrt(v_hat) + eps))
  return updates


def run_optimizer(tx, grads):
  params = jnp.zeros_like(grads[0])
  state = tx.init(params)
  updates = []
  for g in grads:
    update, state = tx.update(jnp.asarray(g), state, params)
    updates.append(np.asarray(update))
  return updates


GRADS = [np.array([0.5, -2.0, 1e-3], np.float32), np.array([1.0, 1.0, -4.0], np.float32),
         np.array([-0.2, 3.0, 0.5], np.float32)]


def test_adam_defaults_are_the_papers_hyperparameters():
  # §5.3: Adam with β1 = 0.9, β2 = 0.98 and ε = 1e-9; the defaults of make_optimizer must be these.
  updates = run_optimizer(optim.make_optimizer(lambda count: 0.1), GRADS)
  for got, expected in zip(updates, numpy_adam(GRADS, lr=0.1)):
    np.testing.assert_allclose(got, expected, rtol=1e-5)
  np.testing.assert_allclose(updates[0], [-0.1, 0.1, -0.1], rtol=1e-5)  # Step 1: -lr · sign(g).


def test_adam_follows_the_schedule():
  schedule = optim.rsqrt_schedule(64, 10)
  updates = run_optimizer(optim.make_optimizer(schedule), [GRADS[0], GRADS[0]])
  # With a constant gradient m_hat / sqrt(v_hat) = sign(g), so each update is -lrate(step) · sign(g).
  for step, update in enumerate(updates, start=1):
    np.testing.assert_allclose(update, -paper_lrate(step, 64, 10) * np.sign(GRADS[0]), rtol=1e-4)


def test_grad_clip_norm_clips_the_global_norm_first():
  grads = [np.array([30.0, 40.0], np.float32), np.array([0.3, -0.4], np.float32)]  # Norms 50 and 0.5.
  clipped = run_optimizer(optim.make_optimizer(lambda count: 0.1, grad_clip_norm=1.0), grads)
  unclipped = run_optimizer(optim.make_optimizer(lambda count: 0.1), grads)
  np.testing.assert_allclose(clipped[1], numpy_adam(grads, lr=0.1, clip=1.0)[1], rtol=1e-5)
  np.testing.assert_allclose(unclipped[1], numpy_adam(grads, lr=0.1)[1], rtol=1e-5)
  assert not np.allclose(clipped[1], unclipped[1], rtol=1e-2)


def test_weight_decay_shrinks_matrices_only_by_lrate_times_decay():
  # AdamW (Loshchilov & Hutter, 2019, Algorithm 2 with the schedule multiplier η_t = lrate): θ ← θ - lrate ·
  # (Adam's step + λ θ). A matrix gets both terms; a bias or normalisation scale (1 dimension) gets Adam's only.
  params = {'w': jnp.array([[2.0, -1.0], [0.5, 4.0]]), 'b': jnp.array([3.0, -3.0])}
  grads = {'w': jnp.array([[1.0, -2.0], [0.0, 0.5]]), 'b': jnp.array([0.5, -1.0])}
  lr, decay = 0.1, 0.3
  tx = optim.make_optimizer(lambda count: lr, weight_decay=decay)
  updates, _ = tx.update(grads, tx.init(params), params)
  adam_w = [numpy_adam([np.asarray(g)], lr=lr)[0] for g in np.asarray(grads['w']).reshape(-1)]
  expected_w = np.reshape(adam_w, (2, 2)) - lr * decay * np.asarray(params['w'])
  np.testing.assert_allclose(updates['w'], expected_w, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(updates['b'], numpy_adam([np.asarray(grads['b'])], lr=lr)[0], rtol=1e-5)
  # With a zero gradient, only the decay is left: exactly -lrate · λ · θ.
  zero = {'w': jnp.zeros((2, 2)), 'b': jnp.zeros(2)}
  updates, _ = tx.update(zero, tx.init(params), params)
  np.testing.assert_allclose(updates['w'], -lr * decay * np.asarray(params['w']), rtol=1e-6)
  np.testing.assert_array_equal(updates['b'], [0.0, 0.0])


def test_zero_weight_decay_is_the_papers_adam_with_its_state():
  """weight_decay=0 gives optax's Adam itself: the same updates of a matrix, and the same state tree, so that
  checkpoints written before train.weight_decay existed restore."""
  params = {'w': jnp.array([[2.0, -1.0], [0.5, 4.0]]), 'b': jnp.array([3.0, -3.0])}
  grads = {'w': jnp.array([[1.0, -2.0], [0.0, 0.5]]), 'b': jnp.array([0.5, -1.0])}
  tx = optim.make_optimizer(lambda count: 0.1, weight_decay=0.0)
  adam = optax.adam(lambda count: 0.1, b1=0.9, b2=0.98, eps=1e-9)  # A schedule, as make_optimizer gets.
  state, adam_state = tx.init(params), adam.init(params)
  assert jax.tree.structure(state) == jax.tree.structure(adam_state)
  for _ in range(2):
    updates, state = tx.update(grads, state, params)
    expected, adam_state = adam.update(grads, adam_state, params)
    np.testing.assert_array_equal(updates['w'], expected['w'])


@pytest.mark.parametrize(('kwargs', 'match'), [
    (dict(weight_decay=-0.1), r'train\.weight_decay must be >= 0'),
    (dict(b1=1.0), r'train\.adam_b1 must be in \[0, 1\), got 1\.0'),
    (dict(b2=-0.1), r'train\.adam_b2 must be in \[0, 1\), got -0\.1'),
    (dict(eps=0.0), r'train\.adam_eps must be positive, got 0\.0'),
    (dict(grad_clip_norm=-1.0), r'train\.grad_clip_norm must be >= 0'),
])
def test_make_optimizer_rejects_bad_hyperparameters(kwargs, match):
  with pytest.raises(ValueError, match=match):
    optim.make_optimizer(lambda count: 0.1, **kwargs)
