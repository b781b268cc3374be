"""The training state (§5.3, §5.4): `TrainState`, the model's keyword inputs from a batch (`model_inputs`), and
the state's creation, directly in its sharded layout (`sharded_train_state`) or from shapes alone
(`create_train_state` under `jax.eval_shape`, as `build.Build.abstract_state` does).
"""
import functools
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from transformer_jax.model import sharding
from transformer_jax.model import transformer as model_lib

Array = jax.Array
Batch = dict[str, Array]


@flax.struct.dataclass
class TrainState:
  """Everything a checkpoint needs to resume training exactly.

  Attributes:
    step: int32 scalar, number of updates applied.
    params: float32 parameter tree.
    opt_state: the optimiser's state (`optim.make_optimizer`: Adam's moments and count).
    rng: uint32 [2] raw PRNG key data; dropout at step s uses fold_in(rng, s).
  """
  step: Array
  params: Any
  opt_state: Any
  rng: Array


def model_inputs(batch: Batch) -> dict[str, Array]:
  """Model keyword arguments from a batch dict (segment ids and positions only for packed batches)."""
  keys = ('source_segment_ids', 'target_segment_ids', 'source_positions', 'target_positions')
  return {key: batch[key] for key in keys if key in batch}


def create_train_state(rng: Array, model: model_lib.Transformer, tx: optax.GradientTransformation,
                       batch: Batch) -> TrainState:
  """Initialises parameters (boxed with logical axis names) and the optimiser state.

  Args:
    rng: a PRNG key.
    model: the Transformer.
    tx: the optimiser.
    batch: an example batch (only shapes matter).

  Returns:
    A TrainState at step 0 whose params are `LogicallyPartitioned` boxes.
  """
  init_rng, dropout_rng = jax.random.split(rng)
  variables = model.init({'params': init_rng}, batch['source_tokens'], batch['decoder_input_tokens'],
                         **model_inputs(batch))
  params = variables['params']
  return TrainState(step=jnp.array(0, jnp.int32), params=params, opt_state=tx.init(params),
                    rng=jax.random.key_data(dropout_rng))


def sharded_train_state(rng, model, tx, batch, mesh, rules) -> tuple[TrainState, Any]:
  """Creates the TrainState directly in its sharded layout (jit of the initialiser with out_shardings).

  Returns:
    (state with unboxed params, the matching tree of NamedShardings).
  """
  init_fn = functools.partial(create_train_state, model=model, tx=tx, batch=batch)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    abstract = jax.eval_shape(init_fn, rng)
    state_sharding = sharding.logical_to_sharding(abstract, mesh, rules)
    state = jax.jit(lambda r: nn.unbox(init_fn(r)), out_shardings=state_sharding)(rng)
  return state, state_sharding
