"""transformer_jax: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017) in JAX/Flax linen."""
import importlib.metadata
import importlib.util
import os


def _cpu_only_with_libtpu() -> bool:
  """Whether libtpu (the `tpu` extra, for compiling TPU steps anywhere) is installed on a machine that has no
  TPU chip and no other accelerator plugin, so that the CPU is the only backend JAX can start.

  There JAX would still try the TPU backend first, and libtpu logs five lines of errors on every start before
  JAX falls back to the CPU. Compiling for a TPU slice (`tpu_slices`) does not need that backend.
  """
  if os.environ.get('JAX_PLATFORMS') or importlib.util.find_spec('libtpu') is None:
    return False
  if importlib.util.find_spec('jax_plugins') or list(importlib.metadata.entry_points(group='jax_plugins')):
    return False  # A GPU plugin: leave the choice of backend to JAX.
  try:
    from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
    return hardware_utils.num_available_tpu_chips_and_device_id()[0] == 0
  except (ImportError, AttributeError, OSError):
    return False


if _cpu_only_with_libtpu():
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update('jax_platforms', 'cpu')
