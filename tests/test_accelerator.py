"""Checks that need an accelerator (launch/accelerator_check.sh runs them): on a CPU they are skipped, except with
ACCELERATOR_CHECK_DRY_RUN=1, which runs the same code at the same sizes on the CPU to keep the script working.

  - the fused attention (jax.nn.dot_product_attention: cuDNN flash attention on GPUs) equals the einsum path,
    values and gradients, with padding and causal masks;
  - a bf16 train step equals the float32 one within bf16's rounding;
  - a sharded train step on the real devices equals one device.
"""
import functools
import os
import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer_jax.model import attention
from transformer_jax.model import sharding
from transformer_jax.model import transformer as model_lib
from transformer_jax.training import state as state_lib
from transformer_jax.training import step as step_lib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
  sys.path.insert(0, str(REPO_ROOT))  # Configs do `from configs import base`, as when run from the root.
DRY_RUN = os.environ.get('ACCELERATOR_CHECK_DRY_RUN') == '1'
pytestmark = [pytest.mark.accelerator, pytest.mark.skipif(
    jax.default_backend() == 'cpu' and not DRY_RUN,
    reason='needs a GPU or TPU (launch/accelerator_check.sh); ACCELERATOR_CHECK_DRY_RUN=1 runs it on a CPU')]
CFG = dict(vocab_size=512, num_layers=2, d_model=128, d_ff=512, num_heads=4, d_k=32, d_v=32, dropout_rate=0.0)


def random_batch(rows=8, length=24, vocab=512, seed=0):
  rng = np.random.default_rng(seed)
  batch = {key: rng.integers(3, vocab, (rows, length), dtype=np.int32) for key in ('source_tokens', 'target_tokens')}
  batch['source_tokens'][::2, -5:] = 0
  batch['target_tokens'][1::2, -7:] = 0
  batch['decoder_input_tokens'] = np.where(batch['target_tokens'] != 0, np.roll(batch['target_tokens'], 1, 1), 0)
  batch['decoder_input_tokens'][:, 0] = 1
  return batch


def test_fused_attention_equals_einsum_path():
  rng = np.random.default_rng(0)
  dtype = jnp.bfloat16 if jax.default_backend() == 'gpu' else jnp.float32  # cuDNN's kernel wants 16-bit inputs.
  q, k, v = (jnp.asarray(rng.normal(size=(2, 16, 4, 64)), dtype) for _ in range(3))
  segments = jnp.array([[1] * 16, [1] * 10 + [0] * 6])
  mask = attention.padding_mask(segments, segments) & attention.causal_mask(16)

  def loss(fn, q, k, v):
    return jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2)
  einsum_path = lambda q, k, v: attention.dot_product_attention(q, k, v, mask)[0]
  fused_path = lambda q, k, v: attention.fused_dot_product_attention(q, k, v, mask)
  tolerance = dict(rtol=2e-2, atol=2e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(jax.jit(fused_path)(q, k, v), np.float32),
                             np.asarray(jax.jit(einsum_path)(q, k, v), np.float32), **tolerance)
  for a, b in zip(jax.jit(jax.grad(functools.partial(loss, fused_path), argnums=(0, 1, 2)))(q, k, v),
                  jax.jit(jax.grad(functools.partial(loss, einsum_path), argnums=(0, 1, 2)))(q, k, v)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tolerance)


def _two_steps(model, batch, mesh=None):
  tx = optax.adam(1e-3)
  init = functools.partial(state_lib.create_train_state, model=model, tx=tx, batch=batch)
  abstract = jax.eval_shape(init, jax.random.key(0))
  rng = np.random.default_rng(1)
  params = jax.tree.map(lambda x: rng.normal(0.0, 0.1, x.shape).astype(np.float32), nn.unbox(abstract.params))
  state = state_lib.TrainState(step=np.int32(0), params=params, opt_state=jax.device_get(tx.init(params)),
                               rng=np.array([0, 1], np.uint32))
  step = functools.partial(step_lib.train_step, model=model, tx=tx, label_smoothing=0.1)
  if mesh is None:
    fn = jax.jit(step)
  else:
    from configs import base  # pylint: disable=g-import-not-at-top
    rules = sharding.logical_axis_rules(base.get_config().mesh)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      state_sharding = sharding.logical_to_sharding(abstract, mesh, rules)
    batch_sharding = sharding.batch_sharding(mesh)
    fn = jax.jit(step, in_shardings=(state_sharding, batch_sharding), out_shardings=(state_sharding, None))
    state, batch = jax.device_put(state, state_sharding), jax.device_put(batch, batch_sharding)
  losses = []
  for _ in range(2):
    state, metrics = fn(state, batch)
    losses.append(float(metrics['loss_sum'] / metrics['token_count']))
  return losses


def test_bf16_step_equals_float32_within_bf16_rounding():
  """Products in bf16 (8-bit mantissa, relative rounding 2^-8 = 0.4%) with float32 accumulation, softmax and
  loss: the loss after each of two steps within 1% of float32's."""
  batch = random_batch()
  float32 = _two_steps(model_lib.Transformer(model_lib.ModelConfig(**CFG)), batch)
  bf16 = _two_steps(model_lib.Transformer(model_lib.ModelConfig(**CFG, dtype='bfloat16')), batch)
  np.testing.assert_allclose(bf16, float32, rtol=1e-2)


def test_sharded_step_on_the_real_devices_equals_one_device():
  if jax.device_count() < 2:
    pytest.skip(f'one {jax.devices()[0].device_kind}: nothing to shard over')
  from configs import base  # pylint: disable=g-import-not-at-top
  mesh_cfg = base.get_config().mesh
  tensor = 2 if jax.device_count() % 2 == 0 else 1
  mesh_cfg.update(data=jax.device_count() // tensor, fsdp=1, tensor=tensor)
  model = model_lib.Transformer(model_lib.ModelConfig(**CFG))
  batch = random_batch(rows=8 * jax.device_count())
  one = _two_steps(model, batch)
  many = _two_steps(model, batch, sharding.make_mesh(mesh_cfg))
  np.testing.assert_allclose(many, one, rtol=1e-4)
