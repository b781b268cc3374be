"""Which checkpoints give the parameters that are evaluated and translated with (§6.1), in one place.

§6.1: "For the base models, we used a single model obtained by averaging the last 5 checkpoints, which were
written at 10-minute intervals. For the big models, we averaged the last 20 checkpoints." See
`average_checkpoints` and `config.eval.average_last_n`. Which checkpoints the final evaluation uses
(`SELECTIONS`, eval.checkpoint_selection) is `select_params`; the best-by-BLEU checkpoints
(`<workdir>/best_checkpoints`, parameters only) are saved by `save_best`. Storing and restoring them is
`storage/checkpoints.py`'s.
"""
from __future__ import annotations

from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import errors
from transformer_jax.storage import checkpoint_checks
from transformer_jax.storage.checkpoints import CheckpointManager

PyTree = Any


def average_checkpoints(manager: CheckpointManager, steps: list[int], abstract_subtree: PyTree,
                        subtree: str | None = 'params') -> PyTree:
  """Element-wise mean of one subtree of the state over several checkpoints (Sec. 6.1).

  By default only `state['params']` (or `state.params`) is read and averaged: evaluation and
  decoding need the parameters alone, and the optimizer's moments are large (twice the params for
  Adam) and meaningless for an averaged model, so they are never loaded. `subtree=None` averages
  the whole state.

  Floating leaves are averaged in float32 (float64 stays float64) and cast back to their dtype;
  the others (integer step counters, uint32 PRNG key data, bools) are taken from the newest step.
  The mean is updated one checkpoint at a time in ascending step order,
    mean_k = mean_{k-1} + (x_k - mean_{k-1}) / k,
  so memory holds one float32 accumulator and one restored checkpoint, the result is
  deterministic, and identical checkpoints average to themselves bit for bit (a running sum
  would not: 3 * x rounds in float32).

  Args:
    manager: the run's CheckpointManager.
    steps: committed steps to average, e.g. `manager.all_steps()[-config.eval.average_last_n:]`.
    abstract_subtree: `jax.ShapeDtypeStruct`s with shardings for `state[subtree]` (for the whole
      state if `subtree` is None). The result has these shardings and dtypes.
    subtree: top-level key or attribute of the state to average, or None for all of it.

  Returns:
    The averaged subtree, structured like `abstract_subtree`.

  Raises:
    ValueError: if `steps` is empty, repeats a step, or names a step that does not exist.
  """
  if not steps:
    raise ValueError('average_checkpoints needs at least one step; got [].')
  if len(set(steps)) != len(steps):
    raise ValueError(f'average_checkpoints got repeated steps: {list(steps)}.')
  missing = sorted(set(steps) - set(manager.all_steps()))
  if missing:
    raise ValueError(f'Steps {missing} are not in {manager.directory}; '
                     f'steps: {manager.all_steps()}.')
  checkpoint_checks.require_shardings(abstract_subtree, 'abstract_subtree')
  leaves, treedef = jax.tree.flatten(abstract_subtree)
  floating = [jnp.issubdtype(leaf.dtype, jnp.floating) for leaf in leaves]
  mean = None
  for count, step in enumerate(sorted(steps), start=1):
    if subtree is None:
      restored, _ = manager.restore(step, abstract_subtree)
    else:
      restored = manager.restore_subtree(step, abstract_subtree, subtree)
    restored_leaves = treedef.flatten_up_to(restored)
    values = [x for x, is_float in zip(restored_leaves, floating) if is_float]
    if mean is None:
      mean = _to_accumulator(values)
    else:
      mean = _update_mean(mean, values, np.float32(count))
    newest = restored_leaves
  shardings = [leaf.sharding for leaf, is_float in zip(leaves, floating) if is_float]
  dtypes = [leaf.dtype for leaf, is_float in zip(leaves, floating) if is_float]
  averaged = iter(_cast(mean, dtypes, shardings))
  return treedef.unflatten(
      [next(averaged) if is_float else x for x, is_float in zip(newest, floating)])


# eval.checkpoint_selection: which checkpoints give the parameters the final evaluation uses (§6.1).
SELECTIONS = ('average_last', 'best', 'average_best')


def save_best(manager: CheckpointManager, step: int, params: PyTree, bleu: float) -> None:
  """Offers step's parameters to the best-by-BLEU manager (`<workdir>/best_checkpoints`), which keeps the
  max_to_keep (eval.average_best_n) with the highest validation BLEU (or the validation F1 of a parser,
  eval.metric='f1', stored under the same name)."""
  manager.save(step, {'params': params}, {}, force=True, metrics={'bleu': bleu})


def select_params(eval_config: Any, last: CheckpointManager, best: CheckpointManager | None,
                  abstract_params: PyTree) -> tuple[PyTree, list[int]]:
  """The parameters of the checkpoints eval.checkpoint_selection chooses (one of SELECTIONS), averaged (§6.1).

  'average_last': the mean of the last eval.average_last_n checkpoints of `last`; 'best': the checkpoint of
  `best` with the best validation BLEU; 'average_best': the mean of the eval.average_best_n best.

  Args:
    eval_config: config.eval.
    last: the run's checkpoints (`<workdir>/checkpoints`).
    best: the best-by-BLEU checkpoints (`<workdir>/best_checkpoints`), or None for a run without them.
    abstract_params: ShapeDtypeStructs with shardings of the parameters (`Build.abstract_state().params`).

  Returns:
    (params, steps): the (averaged) parameters, placed as `abstract_params`, and their steps, ascending.

  Raises:
    errors.MissingFileError: if the chosen manager holds no checkpoint.
    errors.ConfigError: for 'best' or 'average_best' without `best`.
  """
  selection = eval_config.checkpoint_selection
  if selection == 'average_last':
    manager = last
    steps = manager.all_steps()[-eval_config.average_last_n:]
  else:
    if best is None:
      raise errors.ConfigError(
          f'eval.checkpoint_selection={selection!r} chooses among the best checkpoints, which a run '
          'keeps only with train.eval_bleu_every_steps > 0')
    manager = best
    steps = sorted(manager.best_steps()[:1 if selection == 'best' else eval_config.average_best_n])
  if not steps:
    raise errors.MissingFileError(f'no checkpoint in {manager.directory}: train first (--mode=train)')
  logging.info('Using the parameters of checkpoint steps %s, averaged (eval.checkpoint_selection=%s).', steps,
               selection)
  return average_checkpoints(manager, steps, abstract_params), steps


@jax.jit
def _to_accumulator(values: list[jax.Array]) -> list[jax.Array]:
  return [x.astype(jnp.promote_types(x.dtype, jnp.float32)) for x in values]


@jax.jit
def _update_mean(mean: list[jax.Array], values: list[jax.Array],
                 count: jax.Array) -> list[jax.Array]:
  # Where x equals the mean, keep the mean's bits: m + (x - m) / k would turn -0.0 into +0.0.
  values = [x.astype(m.dtype) for m, x in zip(mean, values)]
  return [jnp.where(x == m, m, m + (x - m) / count.astype(m.dtype)) for m, x in zip(mean, values)]


def _cast(mean: list[jax.Array], dtypes: list[np.dtype],
          shardings: list[jax.sharding.Sharding]) -> list[jax.Array]:
  cast = jax.jit(lambda xs: [x.astype(d) for x, d in zip(xs, dtypes)],
                 out_shardings=shardings)
  return cast(mean)
