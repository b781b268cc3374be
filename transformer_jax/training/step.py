"""The compiled steps (§5): one Adam update on the label-smoothed loss, and the teacher-forced validation loss.

`train_step` and `eval_step` are pure functions of the parameters and a batch; `jit_train_step` and
`jit_eval_step` compile them for a `Build`'s mesh, model and optimiser, as `run/train.py`'s loop calls them.
"""
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from transformer_jax.model import transformer as model_lib
from transformer_jax.training import losses
from transformer_jax.training import state as state_lib
from transformer_jax.training.build import Build
from transformer_jax.training.state import TrainState

Array = jax.Array
Batch = dict[str, Array]


def train_step(state: TrainState, batch: Batch, *, model: model_lib.Transformer,
               tx: optax.GradientTransformation, label_smoothing: float,
               grad_accum_steps: int = 1, rdrop_alpha: float = 0.0) -> tuple[TrainState, dict[str, Array]]:
  """One Adam update on the label-smoothed loss averaged over the batch's real target tokens.

  With grad_accum_steps = n > 1 the batch is cut into n micro-batches (rows i, i + n, i + 2n, ... form
  micro-batch i, so every device keeps an equal share of each), whose gradients a `lax.scan` sums: activations
  are held for one micro-batch at a time, and the update is the one of the whole batch. Each micro-batch's
  loss is divided by the whole batch's token count (over every micro-batch and device), so the sum of their
  gradients is the gradient of (x1 + ... + xn) / (n1 + ... + nn), not a mean of per-micro-batch means.

  A non-finite loss, gradient or parameter update leaves the state unchanged except for the step counter
  (the parameters are never overwritten with NaN or inf) and reports `nonfinite=1`; the caller stops or
  carries on (`train.on_nonfinite`).

  With rdrop_alpha = α > 0 (R-Drop, `losses.fused_smoothed_cross_entropy`), each micro-batch is run twice in one pass,
  each row followed by its copy, so the two copies draw different dropout masks; the update follows the R-Drop objective
  divided by twice the batch's token count, and the step costs twice the FLOPs.

  Args:
    state: the TrainState (its buffers are donated by the jitted caller).
    batch: int32 arrays `source_tokens` [batch, src_len], `decoder_input_tokens`, `target_tokens`
      [batch, tgt_len], and for packed batches `*_segment_ids` and `*_positions`.
    model: the Transformer (static).
    tx: the optimiser (static).
    label_smoothing: ε_ls (static).
    grad_accum_steps: micro-batches per update (static); it must divide the batch's rows.
    rdrop_alpha: R-Drop's α (static); 0 trains on the label-smoothed loss alone.

  Returns:
    (new state, metrics): float32 sums `loss_sum`, `nll_sum`, `correct_sum`, `token_count`, plus
    `grad_norm` and `nonfinite` (1.0 when the update was not applied) for this step; with R-Drop the sums cover
    both copies (so token_count is twice the batch's), and `kl_sum` and `objective_sum` are added.

  Raises:
    ValueError: at trace time, if grad_accum_steps does not divide the rows of the batch.
  """
  dropout_rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
  token_count = jnp.maximum(passes_per_step(rdrop_alpha) * jnp.sum(losses.target_weights(batch)), 1.0)

  def loss_fn(params, micro_batch, rng):
    if rdrop_alpha:  # Each row, then its copy (on the same device): the dropout masks differ by row.
      micro_batch = jax.tree.map(lambda x: jnp.repeat(x, 2, axis=0), micro_batch)
    features = model.apply({'params': params}, micro_batch['source_tokens'], micro_batch['decoder_input_tokens'],
                           **state_lib.model_inputs(micro_batch), deterministic=False, rngs={'dropout': rng},
                           method='features')
    sums = losses.fused_smoothed_cross_entropy(
        features, params['shared_embedding']['embedding'], micro_batch['target_tokens'],
        losses.target_weights(micro_batch), label_smoothing, rdrop_alpha=rdrop_alpha)
    return sums['objective_sum' if rdrop_alpha else 'loss_sum'] / token_count, sums

  grad_fn = jax.grad(loss_fn, has_aux=True)
  if grad_accum_steps == 1:
    grads, sums = grad_fn(state.params, batch, dropout_rng)
  else:
    rows = batch['source_tokens'].shape[0]
    if rows % grad_accum_steps:
      raise ValueError(f'train.grad_accum_steps={grad_accum_steps} does not divide the {rows} rows of a batch')
    micro_batches = jax.tree.map(  # [n, rows / n, length]; micro-batch i holds rows i, i + n, ...
        lambda x: jnp.swapaxes(x.reshape(rows // grad_accum_steps, grad_accum_steps, *x.shape[1:]), 0, 1), batch)

    def accumulate(totals, inputs):
      index, micro_batch = inputs
      step_grads, step_sums = grad_fn(state.params, micro_batch, jax.random.fold_in(dropout_rng, index))
      return jax.tree.map(jnp.add, totals, (step_grads, step_sums)), None

    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(
        grad_fn, state.params, jax.tree.map(lambda x: x[0], micro_batches), dropout_rng))
    (grads, sums), _ = jax.lax.scan(accumulate, zeros, (jnp.arange(grad_accum_steps), micro_batches))
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  grad_norm = optax.tree.norm(grads)
  # The update can overflow when the gradient does not (an infinite learning rate, Adam's moments).
  finite = (jnp.isfinite(sums['loss_sum']) & jnp.isfinite(grad_norm)
            & jnp.isfinite(optax.tree.norm(updates)))
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  new_state = state.replace(step=state.step + 1, params=keep(params, state.params),
                            opt_state=keep(opt_state, state.opt_state))
  metrics = dict(sums, grad_norm=grad_norm, nonfinite=1.0 - finite.astype(jnp.float32))
  return new_state, metrics


def passes_per_step(rdrop_alpha: float) -> int:
  """Forward-backward passes of each batch in a training step: 2 under R-Drop (train.rdrop_alpha > 0), else 1."""
  return 2 if rdrop_alpha else 1


def jit_train_step(setup: Build, state_sharding, label_smoothing: float, *, rdrop_alpha: float = 0.0):
  """`train_step` jitted as training runs it (§5), for the mesh, model and optimiser of `setup`.

  Args:
    setup: the Build or Setup (mesh, model, optimiser, grad_accum_steps).
    state_sharding: the TrainState's tree of NamedShardings (`Build.state_sharding()`).
    label_smoothing: train.label_smoothing (ε_ls, §5.4).
    rdrop_alpha: train.rdrop_alpha (R-Drop's α; 0: off).

  Returns:
    train_fn(state, batch) -> (state, metrics), which donates the state it is given. Batches are split over the
    data axes (`sharding.batch_sharding`); it compiles once per batch shape.
  """
  return jax.jit(
      functools.partial(train_step, model=setup.model, tx=setup.tx,
                        label_smoothing=label_smoothing, grad_accum_steps=setup.grad_accum_steps,
                        rdrop_alpha=rdrop_alpha),
      in_shardings=(state_sharding, setup.batch_sharding), out_shardings=(state_sharding, None),
      donate_argnums=0)


def eval_step(params: Any, batch: Batch, *, model: model_lib.Transformer,
              label_smoothing: float) -> dict[str, Array]:
  """Teacher-forced validation metrics for one batch, as sums: the training objective (§5.4) without dropout.

  Args:
    params: the parameters.
    batch: int32 arrays `source_tokens` [batch, src_len], `decoder_input_tokens`, `target_tokens`
      [batch, tgt_len] (0 = padding), and for packed batches `*_segment_ids` and `*_positions`.
    model: the Transformer (static).
    label_smoothing: ε_ls (static): the loss is the label-smoothed one training optimises.

  Returns:
    `losses.smoothed_cross_entropy`'s float32 sums over the batch's real target tokens: `loss_sum`, `nll_sum`,
    `correct_sum`, `token_count` (divide after summing over batches and devices).
  """
  logits = model.apply({'params': params}, batch['source_tokens'], batch['decoder_input_tokens'],
                       **state_lib.model_inputs(batch), deterministic=True)
  return losses.smoothed_cross_entropy(logits, batch['target_tokens'], losses.target_weights(batch), label_smoothing)


def jit_eval_step(setup: Build, params_sharding, label_smoothing: float):
  """`eval_step` jitted for the mesh and model of `setup`: eval_fn(params, batch) -> metric sums.

  Args:
    setup: the Build or Setup (mesh, model).
    params_sharding: the parameters' tree of NamedShardings (`Build.state_sharding().params`).
    label_smoothing: train.label_smoothing (the validation loss is the training objective's).

  Returns:
    eval_fn(params, batch) -> `eval_step`'s sums; batches are split over the data axes (`Build.batch_sharding`),
    and it compiles once per batch shape.
  """
  return jax.jit(functools.partial(eval_step, model=setup.model, label_smoothing=label_smoothing),
                 in_shardings=(params_sharding, setup.batch_sharding))
