"""The decoding backend on the C++ kernels (`kernels`): the one seam through which they reach a search.

A search asks its backend for four things (`decoding.backends.DecodingBackend`; the default, `backends.XlaDecoding`,
is the model's own XLA ops). `CpuDecoding` answers:
  * `attention()`: a context for the model's decoding calls (`Transformer.init_cache`, then `decode` with
    use_cache) in which the three decoding methods of `attention.MultiHeadAttention` (`create_cache`,
    `self_attention_step`, `cross_attention_step`) run on the kernels where a layer's dtypes fit them;
  * `grow_cache` and `reorder_cache`: its cache layout. The self-attention cache is never moved: each row writes
    its own key and value once per position, and beam search reorders a small int32 `ancestry` [rows, max_len]
    beside it instead (row r's position j lives in row r + ancestry[r, j]), which the kernel follows when it
    reads. A reorder then moves 4 bytes per position instead of the keys and values;
  * `extension_scores`: `kernels.beam_scores`, what a beam step reads of the logits in one pass over each row.

Why a method interceptor (`flax.linen.intercept_methods`) rather than a step function handed down through
`Transformer.decode`: the model stays the paper's, with no backend in any constructor or call signature, and
what is replaced is exactly the attention layer's documented decoding contract, only inside the apply calls the
backend wraps; the parameters and their names are the model's. Whether to use this backend is decided on the
host, once, before a search is traced (`decoding.backends.decoding_backend`, which calls `wanted`): building the
kernels starts a C++ compiler, which never happens while a module traces.
"""
import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.cpu import kernels
from transformer_jax.decoding import beam
from transformer_jax.model import attention
from transformer_jax.model import transformer as model_lib

Array = jax.Array
ANCESTRY = 'ancestry'  # The self-attention cache entry this backend adds: int32 [rows, max_len].


def wanted(cfg: model_lib.ModelConfig) -> bool:
  """Whether a search of this model decodes on the kernels, for its `model.decoding_kernel` setting.

  'cpu': yes (building the kernels now where they are not yet); 'xla': no; 'auto': where JAX's default backend
  is a single CPU device, the attention products are in the compute dtype (bfloat16 or float32) and the kernels
  build. Runs on the host: call it before tracing a search.

  Raises:
    ValueError: for another setting; for 'cpu' where JAX's default backend is not the CPU or the products are
      not in the compute dtype.
    kernels.KernelUnavailable: for 'cpu' where the kernels cannot be built or loaded here.
  """
  setting = cfg.decoding_kernel
  fits = cfg.product_dtype == cfg.compute_dtype and cfg.compute_dtype in kernels.DTYPES
  if setting == 'cpu':
    if not fits:
      raise ValueError(f"model.decoding_kernel='cpu' needs the attention products in the compute dtype "
                       f"(bfloat16 or float32), got products {cfg.product_dtype}, compute {cfg.compute_dtype}")
    if jax.default_backend() != 'cpu':
      raise ValueError(f"model.decoding_kernel='cpu' runs on CPUs only; JAX's default backend is "
                       f"{jax.default_backend()!r} (use 'auto' or 'xla')")
    try:
      kernels.load()
    except kernels.KernelUnavailable as e:
      raise kernels.KernelUnavailable(f"model.decoding_kernel='cpu', but the C++ kernels cannot be built here "
                                      f"('auto' decodes with XLA where they cannot, 'xla' always): {e}") from e
    return True
  if setting == 'xla':
    return False
  if setting != 'auto':
    raise ValueError(f"decoding_kernel must be 'auto', 'cpu' or 'xla', got {setting!r}")
  return fits and jax.default_backend() == 'cpu' and jax.device_count() == 1 and kernels.available()


@dataclasses.dataclass(frozen=True)
class CpuDecoding:
  """A search's steps on the C++ kernels (see the module docstring); equal to the XLA path's up to float32
  summation order. Hashable: a static argument of the jitted searches."""

  def attention(self) -> Any:
    """The context in which the model's decoding calls run their attention on the kernels."""
    return nn.intercept_methods(_intercept)

  def grow_cache(self, cache: Any, length: int) -> Any:
    """`transformer.grow_decoding_cache`, and each `ancestry` [rows, positions] padded with zeros to `length`.

    Raises:
      ValueError: if a cache already holds more than `length` positions.
    """
    def grow(tree):
      if not _follows_ancestry(tree):
        return tree
      ancestry = tree[ANCESTRY]
      return type(tree)({**tree, ANCESTRY: jnp.pad(ancestry, ((0, 0), (0, length - ancestry.shape[1])))})
    return jax.tree.map(grow, model_lib.grow_decoding_cache(cache, length), is_leaf=_follows_ancestry)

  def reorder_cache(self, cache: Any, parent: Array, beam_size: int) -> Any:
    """`beam.reorder_cache`, except that a mapping with an `ancestry` entry keeps its other leaves in place:
    row r is to read what row rows[r] read, so its ancestry becomes rows[r]'s shifted by rows[r] - r."""
    rows = beam.parent_rows(parent, beam_size)
    shift = (rows - jnp.arange(rows.shape[0], dtype=rows.dtype)).astype(jnp.int32)[:, None]

    def reorder(tree):
      if _follows_ancestry(tree):
        return type(tree)({**tree, ANCESTRY: beam.gather_rows(tree[ANCESTRY], rows) + shift})
      return beam.gather_rows(tree, rows)
    return jax.tree.map(reorder, cache, is_leaf=_follows_ancestry)

  def extension_scores(self, logits: Array, k: int, *, eos_id: int, bos_id: int,
                       pad_id: int) -> tuple[Array, Array, Array, Array]:
    """`beam.extension_scores` on the kernel (`kernels.beam_scores`)."""
    return kernels.beam_scores(logits, k, eos_id=eos_id, bos_id=bos_id, pad_id=pad_id)


def _follows_ancestry(tree: Any) -> bool:
  return isinstance(tree, Mapping) and ANCESTRY in tree


def _fits(layer: attention.MultiHeadAttention) -> bool:
  """Whether a layer's decoding can run on the kernels: its products, caches and queries of one dtype they take."""
  dtype = jnp.dtype(layer.dtype)
  return jnp.dtype(layer.product_dtype or dtype) == dtype and dtype in kernels.DTYPES


def _create_cache(layer, create, key: Array, value: Array) -> None:
  """The layer's cache, and for self-attention an ancestry of zeros [rows, max_len] (every row its own)."""
  create(key, value)
  if not layer.cross_attention:
    layer.variable('cache', ANCESTRY, jnp.zeros, key.shape[:2], jnp.int32)


def _self_attention_step(layer, step, query: Array, key: Array, value: Array) -> Array:
  """`MultiHeadAttention.self_attention_step` on `kernels.decoding_self_attention` (no weights are sown).

  Raises:
    ValueError: for more than one position.
  """
  if not layer.has_variable('cache', ANCESTRY):  # A cache created outside this backend: its own step.
    return step(query, key, value)
  if key.shape[1] != 1:
    raise ValueError(f'decoding takes one position per step, got {key.shape[1]}')
  cached_key, cached_value, ancestry, cache_index = (
      layer.variable('cache', name) for name in ('cached_key', 'cached_value', ANCESTRY, 'cache_index'))
  dtype = cached_key.value.dtype
  output, cached_key.value, cached_value.value, ancestry.value = kernels.decoding_self_attention(
      query[:, 0].astype(dtype), cached_key.value, cached_value.value, ancestry.value, key[:, 0].astype(dtype),
      value[:, 0].astype(dtype), cache_index.value)
  cache_index.value = cache_index.value + 1
  return output[:, None].astype(layer.dtype)


def _cross_attention_step(layer, step, query: Array, mask: Array | None, *, deterministic: bool) -> Array:
  """`MultiHeadAttention.cross_attention_step` on `kernels.cross_attention` where it takes the call: one query
  position, attention_impl 'xla' (whose numbers it keeps), no dropout on the weights (it applies none) and a mask
  that is the same for every head and query; else the layer's own step."""
  if not (query.shape[1] == 1 and layer.attention_impl == 'xla' and (deterministic or layer.dropout_rate == 0.0)
          and (mask is None or (mask.ndim == 4 and mask.shape[1] == mask.shape[2] == 1))):
    return step(query, mask, deterministic=deterministic)
  cached_key, cached_value = layer.get_variable('cache', 'cached_key'), layer.get_variable('cache', 'cached_value')
  rows_and_length = (cached_key.shape[0], cached_key.shape[2])
  valid = jnp.ones(rows_and_length, bool) if mask is None else jnp.broadcast_to(mask[:, 0, 0, :], rows_and_length)
  output = kernels.cross_attention(query[:, 0].astype(cached_key.dtype), cached_key, cached_value, valid)
  return output[:, None].astype(layer.dtype)


_STEPS = {'create_cache': _create_cache, 'self_attention_step': _self_attention_step,
          'cross_attention_step': _cross_attention_step}


def _intercept(next_fun, args, kwargs, context: nn.module.InterceptorContext) -> Any:
  """The method interceptor of `CpuDecoding.attention`: the decoding methods of layers that fit the kernels."""
  replacement = _STEPS.get(context.method_name)
  if replacement is None or not isinstance(context.module, attention.MultiHeadAttention) or not _fits(
      context.module):
    return next_fun(*args, **kwargs)
  return replacement(context.module, next_fun, *args, **kwargs)
