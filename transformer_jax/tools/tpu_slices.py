"""Cloud TPU slices by the names users rent them under, as compile-only devices on any machine.

  slice_ = tpu_slices.parse('v5e-8')        # 8 TPU v5 lite chips, JAX topology 'v5e:2x4'
  devices = tpu_slices.devices(slice_)      # needs libtpu: pip install -e '.[tpu]'

With libtpu installed (the `tpu` extra), `jax.experimental.topologies.get_topology_desc` describes a slice
without one: its devices cannot hold arrays or run programs, but a mesh of them lowers and compiles a sharded
step with the TPU compiler, whose memory and cost analyses are those of the real slice (`aot.py`,
`--config.compile.topology`). The chips' capacities below are Google's published figures; each cites its page.

Cloud TPU names count TensorCores for v4 and v5p (two per chip, used as one "megacore" device: v4-8 is 4 chips)
and chips for v5e (also called v5litepod) and v6e (v5e-8 is 8 chips).
"""
import dataclasses
import os
import re

import jax

from transformer_jax import errors

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation's chip: what the compiler targets and what a step is measured against.

  Attributes:
    generation: 'v4', 'v5e', 'v5p' or 'v6e' (also the prefix of JAX's topology names).
    device_kind: `jax.Device.device_kind` of its devices.
    hbm_bytes: high-bandwidth memory per chip, bytes (Google's "16 GB" read as GiB, as HBM is sized; the v5e
      compiler reports 15.75 GiB of its 16 usable, and checks that limit itself).
    peak_flops: dense bf16 peak per chip, FLOP/s.
    hbm_bytes_per_second: HBM bandwidth per chip, bytes/s.
    cores_per_chip: TensorCores per chip, which v4 and v5p slice names count (2; v5e and v6e names count chips).
    torus_dims: 3 (v4, v5p) or 2 (v5e, v6e).
    chip_config: libtpu's chip configuration ('megacore': both TensorCores as one device).
    host_bounds: the chips of one host (TPU VM) in a multi-host slice, as (x, y, z); only the processes'
      layout depends on it, not the compiled step.
    source: the page the figures come from.
  """
  generation: str
  device_kind: str
  hbm_bytes: int
  peak_flops: float
  hbm_bytes_per_second: float
  cores_per_chip: int
  torus_dims: int
  chip_config: str
  host_bounds: tuple[int, int, int]
  source: str


CHIPS = {
    # https://cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16, 32 GiB HBM2 at 1,200 GB/s per chip.
    'v4': Chip('v4', 'TPU v4', 32 * GiB, 275e12, 1200e9, 2, 3, 'megacore', (2, 2, 1),
               'https://cloud.google.com/tpu/docs/v4'),
    # https://cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s per chip.
    'v5e': Chip('v5e', 'TPU v5 lite', 16 * GiB, 197e12, 819e9, 1, 2, 'default', (2, 4, 1),
                'https://cloud.google.com/tpu/docs/v5e'),
    # https://cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 95 GB HBM2e at 2,765 GB/s per chip.
    'v5p': Chip('v5p', 'TPU v5', 95 * GiB, 459e12, 2765e9, 2, 3, 'megacore', (2, 2, 1),
                'https://cloud.google.com/tpu/docs/v5p'),
    # https://cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, 32 GB HBM at 1,640 GB/s per chip.
    'v6e': Chip('v6e', 'TPU v6 lite', 32 * GiB, 918e12, 1640e9, 1, 2, 'default', (2, 2, 1),
                'https://cloud.google.com/tpu/docs/v6e'),
}
_ALIASES = {'v5litepod': 'v5e'}

# Chips -> torus shape of the slices Cloud TPU offers (the v5e/v6e 2D shapes and the v4/v5p cubes).
_SHAPES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}
_SHAPES_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8),
              256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16), 4096: (16, 16, 16)}


@dataclasses.dataclass(frozen=True)
class Slice:
  """A TPU slice: `name` as given (e.g. 'v5e-8'), its chip, chip count, torus shape ((2, 4)) and JAX topology
  name ('v5e:2x4')."""
  name: str
  chip: Chip
  num_chips: int
  shape: tuple[int, ...]

  @property
  def topology(self) -> str:
    """JAX's (libtpu's) name of the slice's topology, e.g. 'v5e:2x4' or 'v4:2x2x1'."""
    return f'{self.chip.generation}:{"x".join(map(str, self.shape))}'

  @property
  def chips_per_host(self) -> tuple[int, int, int]:
    """The chips of one host: all of a single-host slice (up to 4 chips of v4/v5p, 8 of v5e/v6e), else the
    chip's `host_bounds`."""
    single_host = 4 if self.chip.torus_dims == 3 else 8
    return (*self.shape, 1)[:3] if self.num_chips <= single_host else self.chip.host_bounds


def known_slices() -> list[str]:
  """Every slice name `parse` accepts, in the Cloud TPU spelling (v4-8 ... v6e-256)."""
  names = []
  for generation, chip in CHIPS.items():
    shapes = _SHAPES_3D if chip.torus_dims == 3 else _SHAPES_2D
    names += [f'{generation}-{chips * chip.cores_per_chip}' for chips in shapes]
  return names


def parse(name: str) -> Slice:
  """The slice of a Cloud TPU accelerator type: 'v4-8', 'v5e-8' (or 'v5litepod-8'), 'v5p-8', 'v6e-8', ...

  Raises:
    errors.ConfigError: for a name that is not a known slice, listing the known ones.
  """
  generation, _, count = name.strip().lower().partition('-')
  generation = _ALIASES.get(generation, generation)
  chip = CHIPS.get(generation)
  shapes = (_SHAPES_3D if chip.torus_dims == 3 else _SHAPES_2D) if chip else {}
  count = count if re.fullmatch('[0-9]{1,6}', count) else ''  # ASCII digits: str.isdigit also takes '²' and '٣'.
  chips = int(count) // chip.cores_per_chip if chip and count else None
  if chips not in shapes or int(count) % chip.cores_per_chip:
    raise errors.ConfigError(f'compile.topology={name!r} is not a known TPU slice; known: {", ".join(known_slices())} '
                             '(v4 and v5p count TensorCores, two per chip; v5e, alias v5litepod, and v6e count chips)')
  return Slice(name, chip, chips, shapes[chips])


class LibtpuMissingError(errors.UserError, RuntimeError):
  """The TPU compiler (libtpu) is not installed."""


def devices(slice_: Slice) -> list[jax.Device]:
  """The slice's compile-only devices (one per chip), ordered as libtpu lists them.

  Raises:
    LibtpuMissingError: naming the extra to install, when libtpu is absent.
  """
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  try:
    import libtpu  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    raise LibtpuMissingError(
        f'compiling for {slice_.name} needs the TPU compiler (libtpu), which is not installed: '
        "pip install -e '.[tpu]' (any machine: it compiles without a TPU)") from None
  # libtpu reads these once, when it loads; on a machine that is not a TPU VM they only quiet its start-up
  # (which otherwise logs that it could not determine them), whatever slice is compiled for later. A real TPU
  # VM's values are kept.
  os.environ.setdefault('TPU_SKIP_MDS_QUERY', '1')
  os.environ.setdefault('TPU_ACCELERATOR_TYPE', slice_.name)
  os.environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')
  # libtpu takes /tmp/libtpu_lockfile for the chips of the host; compiling claims none, and a second compile
  # on the same machine (another slice, a test run) would otherwise stop with "Internal error when accessing
  # libtpu multi-process lockfile".
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  topology = topologies.get_topology_desc(
      platform='tpu', topology_name=slice_.topology, chip_config_name=slice_.chip.chip_config,
      chips_per_host_bounds=slice_.chips_per_host, num_slices=1)
  return list(topology.devices)
