"""Model FLOPs per step and the device's peak: what MFU (model FLOPs utilisation) divides.

Training (`train`, every progress line and `final_metrics.json`) and `--mode=benchmark` both count a step's
work with `forward_flops`; the benchmark divides by `peak_flops`, training by `Peak` (`peak_flops`, raised
when a re-measurement during the run is faster).
"""
import functools
import os
import time

from absl import logging
import jax
import jax.numpy as jnp

from transformer_jax.model import layers
from transformer_jax.model import transformer as model_lib
from transformer_jax.tools import tpu_slices

# Dense bf16 peaks (FLOP/s per chip) of accelerators whose measured matmul rate would understate the datasheet,
# by exact `device_kind` (v5p reports 'TPU v5'; 'TPU v5 lite' is v5e).
KNOWN_PEAKS = {chip.device_kind: chip.peak_flops for chip in tpu_slices.CHIPS.values()}


def forward_flops(cfg: model_lib.ModelConfig, batch_size: int, source_length: int, target_length: int) -> float:
  """Matrix-product FLOPs of one teacher-forced forward pass (2 per multiply-add).

  Counts projections, attention scores and weighted sums, feed-forward and the output logits over the padded
  (or packed) shapes, as the step computes them; not softmax, layer norm or other elementwise work. W^K and
  W^V have `num_kv_heads` heads (grouped- and multi-query attention: fewer FLOPs than W^Q); a gated
  feed-forward layer ('swiglu', 'geglu') has three d_model x d_ff matrices instead of two. Training costs 3x
  this (forward + two backward products).
  """
  h, d_k, d_v, d_model, d_ff = cfg.num_heads, cfg.d_k, cfg.d_v, cfg.d_model, cfg.d_ff
  kv_heads = cfg.num_kv_heads or h
  query_output = 2 * d_model * h * d_k + 2 * h * d_v * d_model  # W^Q and W^O per token.
  key_value = 2 * d_model * kv_heads * (d_k + d_v)  # W^K and W^V per token.
  projections = query_output + key_value
  feed_forward = (3 if cfg.feed_forward in layers.GATED_FEED_FORWARDS else 2) * 2 * d_model * d_ff

  def attend(queries, keys):
    return 2 * queries * keys * h * (d_k + d_v)

  src, tgt = batch_size * source_length, batch_size * target_length
  encoder = src * (projections + feed_forward) + batch_size * attend(source_length, source_length)
  cross = tgt * query_output + src * key_value + batch_size * attend(target_length, source_length)
  decoder = tgt * (projections + feed_forward) + batch_size * attend(target_length, target_length) + cross
  logits = tgt * 2 * d_model * cfg.vocab_size
  return float(cfg.num_layers * (encoder + decoder) + logits)


def train_step_flops(cfg: model_lib.ModelConfig, batch_size: int, source_length: int, target_length: int,
                     passes: int = 1) -> float:
  """Model FLOPs of one training step on a [batch_size, source_length + target_length] batch: 3x forward, for each
  of `passes` copies of the batch (2 under R-Drop, train.rdrop_alpha > 0)."""
  return 3 * passes * forward_flops(cfg, batch_size, source_length, target_length)


@jax.jit
def _matmul(x, y):
  return jnp.dot(x, y, preferred_element_type=jnp.float32)


def measure_peak_flops(dtype, size: int, repeats: int = 10) -> float:
  """FLOP/s of a [size, size] x [size, size] product in `dtype` with float32 accumulation, on one device.

  The fastest of `repeats` runs: a peak is the best the device reaches, and on a shared machine the
  slower runs measure the neighbours, not the device.
  """
  a = jnp.ones((size, size), dtype)
  jax.block_until_ready(_matmul(a, a))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(_matmul(a, a))
    times.append(time.perf_counter() - start)
  return 2 * size ** 3 / min(times)


@functools.lru_cache
def peak_flops(dtype) -> tuple[float, str]:
  """(peak FLOP/s of all devices together, where it came from): a known accelerator's table value, else measured
  here (a 2048^3 product on CPUs, 8192^3 elsewhere; about a second, once per process and dtype)."""
  kind = jax.devices()[0].device_kind
  if kind in KNOWN_PEAKS:
    return KNOWN_PEAKS[kind] * jax.device_count(), f'table ({kind})'
  size = _peak_size()
  flops = measure_peak_flops(dtype, size) * jax.device_count()
  return flops, f'measured {size}^3 matmul on {kind}{load_note()}'


def load_note() -> str:
  """', at load L on N CPUs (shared: ...)' when the host's 1-minute load average exceeds half its CPUs, else ''.

  A peak measured while other work shares the CPU comes out low, and every MFU divided by it high; the note says
  so wherever the peak is printed. '' where the load cannot be read.
  """
  try:
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
  except OSError:
    return ''
  if load <= cpus / 2:
    return ''
  return f', at load {load:.1f} on {cpus} CPUs (shared: this peak is low and MFU high against a quiet machine\'s)'


def _peak_size() -> int:
  return 2048 if jax.default_backend() == 'cpu' else 8192


class Peak:
  """The peak MFU divides by, for a training run: `peak_flops`, raised whenever a re-measurement is faster.

  A measured peak can only come out low (neighbours sharing the CPU slow the product down, never speed it
  up), so the highest measurement so far is the best estimate. A run started while other jobs use the CPU
  would measure a low peak once and report MFU above 100% when the CPU frees up; `remeasure` (called at
  a progress line at most once a minute; four products of the peak's size, one a warm-up, ~50 ms for
  2048^3 on a 2-core CPU) prevents that.
  Table peaks are fixed.

  Attributes:
    flops: FLOP/s of all devices together.
    source: where it came from, for the log.
  """

  def __init__(self, dtype, every_seconds: float = 60.0):
    self.dtype, self.every_seconds = jnp.dtype(dtype), every_seconds
    self.flops, self.source = peak_flops(self.dtype)
    self.measured = self.source.startswith('measured')
    self._last = time.perf_counter()

  def remeasure(self) -> float:
    """Measures again (a measured peak, `every_seconds` after the last) and keeps the higher; returns `flops`."""
    if self.measured and time.perf_counter() - self._last >= self.every_seconds:
      flops = measure_peak_flops(self.dtype, _peak_size(), repeats=3) * jax.device_count()
      if flops > self.flops:
        self.flops, self.source = flops, f'measured {_peak_size()}^3 matmul again{load_note()}'
        logging.info('MFU peak raised to %.3g TFLOP/s (%s): MFU from this line on divides by it.', flops / 1e12,
                     self.source)
      self._last = time.perf_counter()
    return self.flops
