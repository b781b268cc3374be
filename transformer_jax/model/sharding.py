"""Logical axis names for parameters and activations, the device mesh they map onto, and the sharding rules.

Model code names axes only through the constants below; `config.mesh.logical_axis_rules` maps them to the
mesh axes `data`, `fsdp` and `tensor`, so the parallelism layout changes by configuration alone:

  data parallel (default)   mesh.data=-1: parameters replicated, the batch split over 'data'; gradients are
                            all-reduced.
  FSDP (ZeRO-3 style)       mesh.fsdp=N: the batch is split over ('data', 'fsdp') and every parameter's
                            d_model (EMBED) dimension over 'fsdp'; XLA all-gathers weights before use and
                            reduces their gradients onto the shards, so parameters and Adam moments take 1/N
                            of memory (the CPU backend does the reduction as all-reduce, then a slice).
  tensor parallel           mesh.tensor=N: heads (HEADS), d_ff (MLP) and the vocabulary (VOCAB) split over
                            'tensor' (Megatron-style, Shoeybi et al. 2019); the batch is replicated over it.

The rules are in order of precedence (flax semantics): a mesh axis already used by an earlier dimension of the
same array is skipped, so activations [batch, length, embed] keep EMBED unsplit (the batch took 'fsdp').

Joining the processes of a multi-host job (launcher detection, jax.distributed) is `distributed.py`'s: model
code imports this module, which stays free of absl and of process start-up.
"""
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
import numpy as np

BATCH = 'batch'    # Sentences (rows) in a batch.
LENGTH = 'length'  # Token positions.
EMBED = 'embed'    # d_model.
MLP = 'mlp'        # d_ff.
HEADS = 'heads'    # num_heads.
KV = 'kv'          # d_k or d_v.
KV_HEADS = 'kv_heads'  # Key/value heads when fewer than num_heads (model.num_kv_heads): too few to split.
VOCAB = 'vocab'    # Shared vocabulary.

LOGICAL_AXES = (BATCH, LENGTH, EMBED, MLP, HEADS, KV, KV_HEADS, VOCAB)
MESH_AXES = ('data', 'fsdp', 'tensor')
BATCH_MESH_AXES = ('data', 'fsdp')  # The input pipeline and `batch_sharding` split rows over these.


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


def make_mesh(mesh_config, devices=None, dimensions: dict[str, list[tuple[str, int]]] | None = None) -> Mesh:
  """A Mesh with axes ('data', 'fsdp', 'tensor') of Auto type (so logical constraints apply).

  Devices are ordered by `jax.make_mesh` for the physical topology (TPU torus, GPU NVLink islands), with
  'tensor' the innermost (fastest-varying) axis, so tensor-parallel collectives stay within a host.

  Args:
    mesh_config: `config.mesh` (data, fsdp, tensor).
    devices: devices to use; all of `jax.devices()` by default.
    dimensions: logical axis -> [(config key, size)] of the dimensions that carry it (e.g.
      `{HEADS: [('model.num_heads', 8)]}`); each split over mesh axes (`mesh_config.logical_axis_rules`) must divide
      by their size. None: not checked.

  Raises:
    ValueError: for bad axis sizes (see `mesh_shape`); with `dimensions`, for bad rules (see
      `logical_axis_rules`) or a dimension that does not divide by its mesh axes (naming its key and the mesh
      keys); for a layout in which processes would share batch rows (see `check_process_layout`).
  """
  devices = jax.devices() if devices is None else list(devices)
  shape = mesh_shape(mesh_config, len(devices))
  if dimensions:
    _check_divisible(dict(zip(MESH_AXES, shape)), logical_axis_rules(mesh_config), dimensions)
  mesh = jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)
  check_process_layout(np.vectorize(lambda d: d.process_index)(mesh.devices))
  return mesh


def _check_divisible(sizes: dict[str, int], rules, dimensions: dict[str, list[tuple[str, int]]]) -> None:
  """Raises ValueError naming the key and mesh keys of a dimension that its mesh axes do not divide, e.g.
  model.num_heads=3 with mesh.tensor=2."""
  for name, axes in rules:
    axes = axes if isinstance(axes, tuple) else (axes,)
    axes = tuple(axis for axis in axes if axis is not None and sizes[axis] > 1)
    split = int(np.prod([sizes[axis] for axis in axes]))
    for key, value in dimensions.get(name, []):
      if split > 1 and value % split:
        mesh_keys = ' x '.join(f'mesh.{axis}={sizes[axis]}' for axis in axes)
        raise ValueError(f'{key}={value} does not divide by {mesh_keys} ({name!r} is split over {axes} by '
                         f'mesh.logical_axis_rules): change {key} or the mesh')


def check_process_layout(process_grid: np.ndarray) -> None:
  """Each process must hold 1/process_count of the batch shards, none shared with another process: the input
  pipeline gives each process that many rows, which `jax.make_array_from_process_local_data` places on them.

  Args:
    process_grid: int [data, fsdp, tensor], the process index of the device at each mesh position.

  Raises:
    ValueError: if a process holds more or fewer batch shards than that (when 'tensor' spans hosts, two
      processes would need the same rows).
  """
  processes = np.unique(process_grid)
  if len(processes) == 1:
    return
  data, fsdp, tensor = process_grid.shape
  by_shard = process_grid.reshape(data * fsdp, tensor)  # Row i: the processes holding batch shard i.
  if (data * fsdp) % len(processes):
    raise ValueError(f'mesh.data*mesh.fsdp={data * fsdp} batch shards do not divide among {len(processes)} '
                     'processes; make the data or fsdp axis span the hosts (tensor within a host)')
  per_process = data * fsdp // len(processes)
  for p in processes:
    shards = np.flatnonzero((by_shard == p).any(axis=1))
    if len(shards) != per_process:
      raise ValueError(f'process {p} holds batch shards {shards.tolist()} of {data * fsdp}; each process must '
                       f'hold {per_process} of its own: keep mesh.tensor within a host (mesh.tensor <= local '
                       'devices)')


def logical_axis_rules(mesh_config) -> tuple[tuple[str, Any], ...]:
  """`config.mesh.logical_axis_rules` as the tuple of (logical name, mesh axes) pairs flax expects.

  Raises:
    ValueError: naming `mesh.logical_axis_rules` when a rule names an unknown logical axis or mesh axis, or
      when `batch` does not map to ('data', 'fsdp') first (batches are placed by `batch_sharding`).
  """
  rules = []
  for rule in mesh_config.logical_axis_rules:
    if len(rule) != 2:
      raise ValueError(f'mesh.logical_axis_rules entries must be (logical name, mesh axes) pairs, got {rule!r}')
    name, axes = rule
    if name not in LOGICAL_AXES:
      raise ValueError(f'mesh.logical_axis_rules: unknown logical axis {name!r}; allowed: {LOGICAL_AXES}')
    axes = tuple(axes) if isinstance(axes, (list, tuple)) else axes
    for axis in (axes if isinstance(axes, tuple) else (axes,)):
      if axis is not None and axis not in MESH_AXES:
        raise ValueError(f'mesh.logical_axis_rules: {name!r} maps to unknown mesh axis {axis!r}; allowed: '
                         f'{MESH_AXES} or None')
    rules.append((name, axes))
  batch_axes = next((axes for name, axes in rules if name == BATCH), None)
  if batch_axes != BATCH_MESH_AXES:
    raise ValueError(f"mesh.logical_axis_rules: 'batch' must map to {BATCH_MESH_AXES} (the input pipeline "
                     f'and batch_sharding split rows over them), got {batch_axes!r}')
  return tuple(rules)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batches are split along their first (batch) dimension over the data and fsdp axes."""
  return NamedSharding(mesh, PartitionSpec(BATCH_MESH_AXES))


def logical_to_sharding(abstract_tree, mesh: Mesh, rules):
  """NamedShardings for a tree of (possibly LogicallyPartitioned) arrays; unannotated leaves replicate.

  Args:
    abstract_tree: arrays or ShapeDtypeStructs, boxed with logical names (e.g. `jax.eval_shape` of an init).
    mesh: the device mesh.
    rules: `logical_axis_rules(config.mesh)`.

  Returns:
    The matching tree (unboxed) of NamedShardings.

  Raises:
    ValueError: naming the parameter, its shape and the mesh axes when a dimension does not divide by the
      number of shards the rules give it (e.g. num_heads=8 with mesh.tensor=16).
  """
  specs = nn.get_partition_spec(abstract_tree)
  shardings = nn.logical_to_mesh_sharding(specs, mesh, rules)
  check_divisible(abstract_tree, shardings)
  return shardings


def _leaves_with_path(tree) -> list[tuple[Any, Any]]:
  """(path, array) pairs, looking through flax's boxes without applying their constraints."""
  is_box = lambda x: isinstance(x, nn.spmd.LogicallyPartitioned)
  return [(path, leaf.value if is_box(leaf) else leaf)
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_box)]


def check_divisible(abstract_tree, shardings) -> None:
  """Raises ValueError for the first leaf whose shape does not divide evenly by its sharding."""
  for (path, leaf), leaf_sharding in zip(_leaves_with_path(abstract_tree), jax.tree.leaves(shardings)):
    spec = leaf_sharding.spec
    for dim, axes in zip(np.shape(leaf), spec):
      axes = axes if isinstance(axes, tuple) else (axes,)
      shards = int(np.prod([leaf_sharding.mesh.shape[a] for a in axes if a is not None]))
      if dim % shards:
        raise ValueError(f'{jax.tree_util.keystr(path)} has shape {tuple(np.shape(leaf))} and partition '
                         f'spec {spec}: dimension {dim} does not divide by {shards} shards of mesh axes '
                         f'{axes}; change config.mesh (data, fsdp, tensor) or the model size')


def describe(abstract_tree, shardings) -> str:
  """One line per leaf: path, global shape, partition spec and per-device shape (for logs and reports)."""
  lines = []
  for (path, leaf), leaf_sharding in zip(_leaves_with_path(abstract_tree), jax.tree.leaves(shardings)):
    shape = tuple(np.shape(leaf))
    lines.append(f'{jax.tree_util.keystr(path)}  {shape}  {leaf_sharding.spec}  '
                 f'per device {leaf_sharding.shard_shape(shape)}')
  return '\n'.join(lines)


def shardings_of(tree: Any) -> Any:
  """The tree of `.sharding`s of a tree of arrays or ShapeDtypeStructs (e.g. `Build.abstract_state()`'s), as
  jit's in_shardings and out_shardings take them."""
  return jax.tree.map(lambda x: x.sharding, tree)
