"""Decoding backends (§6.1's search, run on one machine's kernels): what a search's steps run on.

A search asks its backend for four things (`DecodingBackend`): the context the model's decoding calls run in,
how the self-attention cache grows and moves to the chosen beams, and what a beam step reads of the logits.
`XlaDecoding` is the model's own operations and `beam`'s defaults, on any platform; the C++ kernels of
`transformer_jax.cpu.backend.CpuDecoding` are the other. `decoding_backend` chooses between them on the host,
before a search is traced: the model and the searches know nothing of the kernels.
"""
import contextlib
import dataclasses
from typing import Any, Protocol

import jax

from transformer_jax.cpu import backend as cpu_backend
from transformer_jax.decoding import beam
from transformer_jax.model import transformer as model_lib

Array = jax.Array


class DecodingBackend(Protocol):
  """What a search asks of the backend its steps run on. Hashable: a static argument of the jitted searches."""

  def attention(self) -> contextlib.AbstractContextManager:
    """The context the model's decoding calls (`Transformer.init_cache`, `decode` with use_cache) run in."""

  def grow_cache(self, cache: Any, length: int) -> Any:
    """The search's cache enlarged to `length` positions (`beam.beam_search`'s grow_cache)."""

  def reorder_cache(self, cache: Any, parent: Array, beam_size: int) -> Any:
    """The cache moved to the chosen beams (`beam.reorder_cache`'s contract)."""

  def extension_scores(self, logits: Array, k: int, *, eos_id: int, bos_id: int,
                       pad_id: int) -> tuple[Array, Array, Array, Array]:
    """What a beam step reads of the logits (`beam.extension_scores`' contract)."""


@dataclasses.dataclass(frozen=True)
class XlaDecoding:
  """The default backend: the model's decoding methods as written and `beam`'s defaults (any platform)."""

  def attention(self) -> contextlib.AbstractContextManager:
    """No change: the model's own decoding methods (`attention.MultiHeadAttention`)."""
    return contextlib.nullcontext()

  def grow_cache(self, cache: Any, length: int) -> Any:
    """`transformer.grow_decoding_cache`."""
    return model_lib.grow_decoding_cache(cache, length)

  def reorder_cache(self, cache: Any, parent: Array, beam_size: int) -> Any:
    """`beam.reorder_cache`: every leaf's rows gathered."""
    return beam.reorder_cache(cache, parent, beam_size)

  def extension_scores(self, logits: Array, k: int, *, eos_id: int, bos_id: int,
                       pad_id: int) -> tuple[Array, Array, Array, Array]:
    """`beam.extension_scores`."""
    return beam.extension_scores(logits, k, eos_id=eos_id, bos_id=bos_id, pad_id=pad_id)


def decoding_backend(cfg: model_lib.ModelConfig) -> DecodingBackend:
  """The backend for a search of this model, from `cfg.decoding_kernel` ('auto', 'cpu' or 'xla').

  'xla': `XlaDecoding`; 'cpu': `CpuDecoding` (the kernels built now where they are not yet); 'auto': the kernels
  on a single CPU device where the attention products are in the compute dtype and the kernels build, else
  XLA (`transformer_jax.cpu.backend.wanted`). Runs on the host: call it before a search is traced.

  Raises:
    ValueError: for 'cpu' off the CPU or with products in another dtype than the compute dtype.
    transformer_jax.cpu.kernels.KernelUnavailable: for 'cpu' where the kernels cannot be built here.
  """
  return cpu_backend.CpuDecoding() if cpu_backend.wanted(cfg) else XlaDecoding()
