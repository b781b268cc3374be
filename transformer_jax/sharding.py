"""Logical axis names for parameters and activations, and the device mesh they map onto.

Model code names axes only through the constants below; `config.mesh.logical_axis_rules` maps them to the
mesh axes `data`, `fsdp` and `tensor`, so the parallelism layout changes by configuration alone.
"""
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import numpy as np

BATCH = 'batch'    # Sentences (rows) in a batch.
LENGTH = 'length'  # Token positions.
EMBED = 'embed'    # d_model.
MLP = 'mlp'        # d_ff.
HEADS = 'heads'    # num_heads.
KV = 'kv'          # d_k or d_v.
VOCAB = 'vocab'    # Shared vocabulary.

MESH_AXES = ('data', 'fsdp', 'tensor')


def mesh_shape(mesh_config, num_devices: int) -> tuple[int, int, int]:
  """Sizes of the (data, fsdp, tensor) axes; one of them may be -1 to take the remaining devices.

  Raises:
    ValueError: naming `mesh.<axis>` when sizes are not positive, more than one is -1, or the product
      differs from the number of devices.
  """
  sizes = [mesh_config[name] for name in MESH_AXES]
  if sum(size == -1 for size in sizes) > 1:
    raise ValueError(f'at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1, got {sizes}')
  for name, size in zip(MESH_AXES, sizes):
    if size != -1 and (not isinstance(size, int) or size <= 0):
      raise ValueError(f'mesh.{name} must be a positive integer or -1, got {size!r}')
  known = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(f'{num_devices} devices do not divide by the fixed mesh axes {sizes}')
    sizes[sizes.index(-1)] = num_devices // known
  if int(np.prod(sizes)) != num_devices:
    raise ValueError(f'mesh data*fsdp*tensor = {sizes} needs {int(np.prod(sizes))} devices, '
                     f'{num_devices} are available')
  return tuple(sizes)


def make_mesh(mesh_config, devices=None) -> Mesh:
  """A Mesh with axes ('data', 'fsdp', 'tensor') of Auto type (so logical constraints apply).

  Args:
    mesh_config: `config.mesh` (data, fsdp, tensor).
    devices: devices to use; all of `jax.devices()` by default.
  """
  devices = jax.devices() if devices is None else devices
  shape = mesh_shape(mesh_config, len(devices))
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def logical_axis_rules(mesh_config) -> tuple[tuple[str, Any], ...]:
  """`config.mesh.logical_axis_rules` as the tuple of (logical name, mesh axes) pairs flax expects."""
  return tuple((name, tuple(axes) if isinstance(axes, (list, tuple)) else axes)
               for name, axes in mesh_config.logical_axis_rules)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batches are split along their first (batch) dimension over the data and fsdp axes."""
  return NamedSharding(mesh, PartitionSpec(('data', 'fsdp')))


def logical_to_sharding(abstract_tree, mesh: Mesh, rules):
  """NamedShardings for a tree of (possibly LogicallyPartitioned) arrays; unannotated leaves replicate."""
  specs = nn.get_partition_spec(abstract_tree)
  return nn.logical_to_mesh_sharding(specs, mesh, rules)
