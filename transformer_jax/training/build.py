"""What a run is built of: a `Build` (mesh, model, optimiser) and a `Setup` (a Build with the run folder's vocabulary
and checkpoint managers).

`run/experiment.py` makes them from a config (`compute_setup`, `setup`); the compiled steps, the loop and the
evaluation take them.
"""
import contextlib
import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
import numpy as np
import optax

from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.model import sharding
from transformer_jax.model import transformer as model_lib
from transformer_jax.storage import checkpoints as checkpoints_lib
from transformer_jax.storage import workdir as workdir_lib
from transformer_jax.training import state as state_lib

Array = jax.Array
Batch = dict[str, Array]


@dataclasses.dataclass
class Build:
  """What every mode builds from the config without reading or writing anything: mesh, model and optimiser.

  `compute_setup` makes it (--mode=compile and --mode=benchmark need no more); `Setup` adds the run folder's
  vocabulary and checkpoints for the modes that read or write one. It holds what the config decided, not the
  config: a stage that needs a config value is given the config (or its section).
  """
  mesh: Mesh
  rules: Any
  model: model_lib.Transformer
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  grad_accum_steps: int  # train.grad_accum_steps: micro-batches per step (`step.train_step`).

  # Devices a batch's rows are split over (mesh.data x mesh.fsdp): batch rows must divide by it.
  data_shards: int = dataclasses.field(init=False)
  # What a global training batch's rows are padded to a multiple of: data shards x train.grad_accum_steps.
  rows_multiple: int = dataclasses.field(init=False)
  # Where a batch's rows go: split over the data axes (`sharding.batch_sharding`).
  batch_sharding: NamedSharding = dataclasses.field(init=False)

  def __post_init__(self):
    self.data_shards = self.mesh.shape['data'] * self.mesh.shape['fsdp']
    self.rows_multiple = self.data_shards * self.grad_accum_steps
    self.batch_sharding = sharding.batch_sharding(self.mesh)

  @contextlib.contextmanager
  def mesh_context(self):
    """The mesh and its logical axis rules, as every jitted step of this build is traced and run under."""
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      yield

  def abstract_state(self):
    """ShapeDtypeStructs with shardings of the TrainState (for restoring or compiling without initialising).

    Built from shapes alone: no array is created, so it works for compile-only devices (`tpu_slices`).
    """
    batch = {key: jax.ShapeDtypeStruct((self.data_shards, 8), jnp.int32)
             for key in ('source_tokens', 'decoder_input_tokens', 'target_tokens')}
    init_fn = functools.partial(state_lib.create_train_state, model=self.model, tx=self.tx)
    rng = jax.eval_shape(lambda: jax.random.key(0))
    with self.mesh_context():
      abstract = jax.eval_shape(init_fn, rng, batch=batch)
      shardings = sharding.logical_to_sharding(abstract, self.mesh, self.rules)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        nn.unbox(abstract), shardings)

  def state_sharding(self):
    """The TrainState's tree of NamedShardings on this mesh (`abstract_state`'s)."""
    return sharding.shardings_of(self.abstract_state())

  def device_batch(self, batch: dict[str, np.ndarray]) -> Batch:
    """This host's rows of a global batch as global arrays split over the data axes."""
    return {key: jax.make_array_from_process_local_data(self.batch_sharding, value)
            for key, value in batch.items() if key != 'example_index'}


@dataclasses.dataclass
class Setup(Build):
  """A `Build` with the run folder's vocabulary and checkpoint managers (`run/experiment.setup`): what training and
  evaluation use."""
  workdir: str
  tokenizer: tokenizer_lib.Tokenizer
  checkpoints: checkpoints_lib.CheckpointManager
  # The eval.average_best_n checkpoints (parameters only) with the best validation BLEU, when
  # train.eval_bleu_every_steps > 0; else None.
  best_checkpoints: checkpoints_lib.CheckpointManager | None = None
  lock: workdir_lib.RunLock | None = None  # The run folder's lock, for the modes that write it.

  def close(self) -> None:
    """Waits for pending checkpoint saves, releases the checkpoint managers' threads, then the run's lock."""
    try:
      self.checkpoints.close()
      if self.best_checkpoints is not None:
        self.best_checkpoints.close()
    finally:
      if self.lock is not None:
        self.lock.release()

