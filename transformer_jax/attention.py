"""Scaled dot-product attention (§3.2.1) and multi-head attention (§3.2.2), with their masks.

Einsum letters as in `numerics` (b batch, l length, q query length, k key length, h heads, g query heads per
key/value head, d d_k, v d_v, m d_model). The matrix products, dropout and initialiser are `numerics`'.
Masks are bool and broadcast to [batch, num_heads, q_len, kv_len]; True means "may attend".
"""
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.cpu import kernels as cpu_kernels
from transformer_jax import numerics
from transformer_jax import sharding

Array = jax.Array

def padding_mask(query_segment_ids: Array, key_segment_ids: Array) -> Array:
  """Mask that keeps each query inside its own sentence (segment) and away from padding.

  Args:
    query_segment_ids: int [batch, q_len]; 0 marks padding, 1..n number the packed sentences of a row
      (an unpacked batch has segment id 1 on every real token).
    key_segment_ids: int [batch, kv_len], same convention.

  Returns:
    bool [batch, 1, q_len, kv_len]: True where query and key share a non-zero segment id. Padded queries
    attend to nothing (their outputs are zeros, see `dot_product_attention`).
  """
  same = query_segment_ids[:, :, None] == key_segment_ids[:, None, :]
  return (same & (key_segment_ids[:, None, :] != 0))[:, None, :, :]


def causal_mask(length: int) -> Array:
  """bool [1, 1, length, length]: query t may attend to keys 0..t (§3.2.3, decoder self-attention)."""
  return jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))[None, None, :, :]


def _masked_softmax(scores: Array, mask: Array | None) -> Array:
  """softmax over the last axis of float32 scores where mask allows (broadcast), 0 where it does not.

  A fully masked row has a uniform softmax over -inf-like scores: it is zeroed (and its gradient).
  """
  if mask is None:
    return jax.nn.softmax(scores, axis=-1)
  weights = jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(jnp.float32).min), axis=-1)
  return jnp.where(mask, weights, 0.0)


def dot_product_attention(query: Array, key: Array, value: Array, mask: Array | None, *,
                          dropout_rate: float = 0.0, dropout_rng: Array | None = None,
                          deterministic: bool = True, product_dtype: Any = None) -> tuple[Array, Array]:
  """Scaled dot-product attention, softmax(Q K^T / sqrt(d_k)) V (§3.2.1, Eq. 1).

  The mask is applied before the softmax; the softmax runs in float32. A query whose keys are all masked
  gets zero weights (so a zero output and no gradient), never NaN.

  With fewer key/value heads than query heads (multi-query or grouped-query attention), query head i reads
  key/value head i // (num_heads // num_kv_heads).

  Args:
    query: [batch, q_len, num_heads, d_k], compute dtype.
    key: [batch, kv_len, num_kv_heads, d_k]; num_kv_heads divides num_heads (equal in the paper).
    value: [batch, kv_len, num_kv_heads, d_v].
    mask: bool, broadcastable to [batch, num_heads, q_len, kv_len]; True where attention is allowed.
      None allows everything.
    dropout_rate: dropout on the attention weights (not in the paper; 0 by default).
    dropout_rng: PRNG key for that dropout.
    deterministic: disables dropout.
    product_dtype: the dtype Q K^T and weights x V multiply in (float32 accumulation either way); None:
      query.dtype. `ModelConfig.attention_product_dtype` chooses it.

  Returns:
    (output [batch, q_len, num_heads, d_v] in value.dtype,
     weights float32 [batch, num_heads, q_len, kv_len]).

  Raises:
    ValueError: if query and key disagree on d_k or key and value on kv_len.
  """
  if query.shape[-1] != key.shape[-1]:
    raise ValueError(f'query d_k={query.shape[-1]} differs from key d_k={key.shape[-1]}')
  if key.shape[1] != value.shape[1]:
    raise ValueError(f'key length {key.shape[1]} differs from value length {value.shape[1]}')
  if query.shape[2] % key.shape[2]:
    raise ValueError(f'{key.shape[2]} key/value heads do not divide {query.shape[2]} query heads')
  batch, q_len, num_heads, _ = query.shape
  groups = num_heads // key.shape[2]
  out_dtype = value.dtype
  product_dtype = jnp.dtype(product_dtype or query.dtype)
  query, key, value = (x.astype(product_dtype) for x in (query, key, value))
  query = query / jnp.sqrt(query.shape[-1]).astype(query.dtype)
  query = query.reshape(batch, q_len, key.shape[2], groups, query.shape[-1])  # Head i = (i // groups, i % groups).
  scores = numerics.einsum('bqhgd,bkhd->bhgqk', query, key, jnp.float32)
  scores = scores.reshape(batch, num_heads, q_len, key.shape[1])  # [batch, num_heads, q_len, kv_len]
  weights = _masked_softmax(scores, mask)
  if not deterministic and dropout_rate > 0.0:
    weights = numerics.dropout(weights, dropout_rate, dropout_rng)
  grouped_weights = weights.astype(value.dtype).reshape(batch, key.shape[2], groups, q_len, key.shape[1])
  output = numerics.einsum('bhgqk,bkhv->bqhgv', grouped_weights, value)  # [batch, q_len, kv_heads, groups, d_v]
  output = output.reshape(batch, q_len, num_heads, value.shape[-1])
  return output.astype(out_dtype), weights


def decoding_attention(query: Array, cached_key: Array, cached_value: Array, mask: Array | None, *,
                       product_dtype: Any = None) -> tuple[Array, Array]:
  """Eq. 1 for one decoding step: one query position per row against heads-first key/value caches.

  Equal to `dot_product_attention(query, swapaxes(cached_key, 1, 2), swapaxes(cached_value, 1, 2), mask)`
  (the same operations in the same dtypes), written for the caches' layout: the products read the caches as
  stored, [batch, kv_heads, max_len, d], and the query heads that share a key/value head are the rows of one
  product. The layout matters on XLA:CPU beyond speed: with grouped-query attention in bf16, the generic
  layout's weights x V product became a plain bf16 dot that XLA:CPU cannot run ("Unsupported element type for
  DotThunk::Execute: BF16 x BF16 = F32"; Table 3's F7 row, session 15).

  Args:
    query: [batch, 1, num_heads, d_k], compute dtype.
    cached_key: [batch, num_kv_heads, max_len, d_k]; num_kv_heads divides num_heads.
    cached_value: [batch, num_kv_heads, max_len, d_v].
    mask: bool broadcastable to [batch, 1, 1, max_len] (the same positions for every head); True where
      attention is allowed. None allows everything.
    product_dtype: the dtype of the products (float32 accumulation either way); None: query.dtype.

  Returns:
    (output [batch, 1, num_heads, d_v] in cached_value.dtype, weights float32 [batch, num_heads, 1, max_len]).

  Raises:
    ValueError: for more than one query position, a mask that differs between heads or query positions,
      or caches that do not fit the query.
  """
  batch, q_len, num_heads, d_k = query.shape
  kv_heads, max_len = cached_key.shape[1:3]
  if q_len != 1:
    raise ValueError(f'decoding attends from one query position, got {q_len}')
  if mask is not None and (mask.ndim != 4 or mask.shape[1] != 1 or mask.shape[2] != 1
                           or mask.shape[0] not in (1, batch) or mask.shape[3] not in (1, max_len)):
    raise ValueError(f'a decoding mask must broadcast to [batch, 1, 1, max_len], got shape {mask.shape}')
  if (cached_key.shape[0] != batch or cached_key.shape[-1] != d_k or num_heads % kv_heads
      or cached_value.shape[:3] != cached_key.shape[:3]):
    raise ValueError(f'caches {cached_key.shape} and {cached_value.shape} do not fit the query {query.shape}')
  groups = num_heads // kv_heads
  out_dtype = cached_value.dtype
  product_dtype = jnp.dtype(product_dtype or query.dtype)
  query, key, value = (x.astype(product_dtype) for x in (query, cached_key, cached_value))
  query = query / jnp.sqrt(d_k).astype(query.dtype)
  query = query.reshape(batch, kv_heads, groups, d_k)  # Head i = (i // groups, i % groups).
  scores = numerics.einsum('bhgd,bhkd->bhgk', query, key, jnp.float32)  # [batch, kv_heads, groups, max_len]
  weights = _masked_softmax(scores, mask)
  output = numerics.einsum('bhgk,bhkv->bhgv', weights.astype(value.dtype), value)
  output = output.reshape(batch, 1, num_heads, value.shape[-1])
  return output.astype(out_dtype), weights.reshape(batch, num_heads, 1, max_len)


def fused_dot_product_attention(query: Array, key: Array, value: Array, mask: Array | None) -> Array:
  """Eq. 1 through `jax.nn.dot_product_attention` (cuDNN flash attention on GPUs); inference and training.

  Same arguments as `dot_product_attention`, except d_v must equal d_k and there is no weight dropout. Fully
  masked query rows are zeroed afterwards, as in the reference path.
  """
  output = jax.nn.dot_product_attention(query, key, value, mask=mask)
  if mask is None:
    return output
  any_key = jnp.any(mask, axis=-1)  # [batch or 1, heads or 1, q_len]
  any_key = jnp.broadcast_to(any_key, (any_key.shape[0], any_key.shape[1], query.shape[1]))
  return output * jnp.swapaxes(any_key, 1, 2)[..., None].astype(output.dtype)


class MultiHeadAttention(nn.Module):
  """Multi-head attention, Concat(head_1..head_h) W^O with head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

  §3.2.2, with num_heads, d_k and d_v independent (Table 3 rows A and B). The projections have no bias,
  as in the paper's equations. In decoding mode (`use_cache=True`) a self-attention layer appends each step's
  key and value to a cache; a cross-attention layer projects the encoder output once per sentence and keeps
  the result in the cache (`cross_attention=True`). Cached keys and values are stored heads-first,
  [batch, num_heads, length, d_k or d_v]: the layout the per-step attention products read in place (stored
  [batch, length, num_heads, d], XLA:CPU transposed the whole cache at every step, 4x slower).

  Attributes:
    num_heads: h.
    d_k: query/key size per head.
    d_v: value size per head.
    dropout_rate: dropout on the attention weights (not in the paper).
    cross_attention: keys and values come from `memory` (encoder-decoder attention, §3.2.3).
    dtype: compute dtype; parameters are float32.
    attention_impl: 'xla' (einsum; returns weights for inspection) or 'fused'. A decoding step of
      self-attention uses `decoding_attention` (einsum, weights returned) either way, or
      `cpu_kernels.decoding_self_attention` under `decoding_kernel` (no weights).
    num_kv_heads: heads of W^K and W^V (None: num_heads). Fewer is multi-query (1) or grouped-query
      attention; the decoding cache then holds num_kv_heads heads. Their head axis is the logical
      KV_HEADS, replicated by the default rules (a count below mesh.tensor could not be split), while
      queries and W^O stay split over HEADS.
    position_transform: f(x [batch, length, heads, d], positions) applied to queries and keys before the
      product and before keys enter the cache (rotary positions, `layers.apply_rope`), or None.
    product_dtype: the dtype of the attention products; None: dtype (`ModelConfig.attention_product_dtype`).
      The encoder-decoder attention's cache holds its keys and values in the product dtype (cast once per
      sentence); the self-attention cache holds them in `dtype`, as the projections produce them: a float32
      copy of bf16 values holds no more information, and beam search reorders that cache at every step
      (its costliest part), which copies half the bytes in bf16.
    decoding_kernel: how a decoding step's attention runs (`ModelConfig.decoding_kernel`): 'xla'
      (`decoding_attention`, `dot_product_attention`); 'cpu' (`cpu_kernels.decoding_self_attention`, whose
      cache is never reordered, its `ancestry` is; `cpu_kernels.cross_attention`; no attention weights are
      sown); 'auto': 'cpu' where JAX's default backend is a single CPU device, the products are in `dtype`
      and the kernels build, else 'xla'. Encoder-decoder attention takes the kernel only with
      attention_impl='xla' (whose numbers it keeps) and no attention dropout (deterministic, or
      dropout_rate 0: the kernel applies none). For self-attention decided when the cache is created (its
      layout says which).
  """
  num_heads: int
  d_k: int
  d_v: int
  dropout_rate: float = 0.0
  cross_attention: bool = False
  dtype: Any = jnp.float32
  attention_impl: str = 'xla'
  num_kv_heads: int | None = None
  position_transform: Any = None
  product_dtype: Any = None
  decoding_kernel: str = 'auto'

  @property
  def _product_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.product_dtype or self.dtype)

  def _project(self, x: Array, features: int, name: str, num_heads: int, heads_axis: str) -> Array:
    """x [batch, length, d_model] @ W [d_model, num_heads, features] -> [batch, length, num_heads, features]."""
    init = numerics.default_kernel_init(in_axis=0, out_axis=(1, 2))
    kernel = self.param(name, nn.with_logical_partitioning(init, (sharding.EMBED, heads_axis, sharding.KV)),
                        (x.shape[-1], num_heads, features))
    return numerics.einsum('blm,mhd->blhd', x.astype(self.dtype), kernel.astype(self.dtype))

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array, mask: Array | None, *,
               deterministic: bool, use_cache: bool = False, positions: Array | None = None) -> Array:
    """Attends from inputs_q to inputs_kv.

    Args:
      inputs_q: [batch, q_len, d_model].
      inputs_kv: [batch, kv_len, d_model]; the same array as inputs_q for self-attention, `memory` for
        cross-attention.
      mask: bool broadcastable to [batch, num_heads, q_len, kv_len], or None. In decoding mode a
        self-attention layer builds its causal mask itself and ignores this.
        In decoding mode a cross-attention layer also takes `inputs_kv` with fewer rows, batch / n: then
        n consecutive query rows (the beams of one sentence) share each memory row, and the mask is
        broadcastable to [batch / n, num_heads, n * q_len, kv_len].
      deterministic: disables dropout.
      use_cache: incremental decoding with the 'cache' collection (q_len is 1 after the cache exists; a
        decoding step of self-attention applies no dropout to its weights).
      positions: int [batch, q_len] positions of the queries (self-attention: also of the keys) for
      `position_transform`; None means 0..q_len-1.

    Returns:
      [batch, q_len, d_model] in the compute dtype.
    """
    d_model = inputs_q.shape[-1]
    kv_heads = self.num_kv_heads or self.num_heads
    kv_axis = sharding.HEADS if kv_heads == self.num_heads else sharding.KV_HEADS
    query = self._project(inputs_q, self.d_k, 'query', self.num_heads, sharding.HEADS)  # [b, q_len, heads, d_k]
    if self.position_transform is not None:
      query = self.position_transform(query, positions)
    if use_cache and self.cross_attention and self.has_variable('cache', 'cached_key'):
      cached_key, cached_value = self.get_variable('cache', 'cached_key'), self.get_variable('cache', 'cached_value')
      if (query.shape[1] == 1 and self.attention_impl == 'xla'
          and (deterministic or self.dropout_rate == 0.0)  # The kernel applies no dropout to its weights.
          and (mask is None or (mask.ndim == 4 and mask.shape[1] == mask.shape[2] == 1))
          and self._use_decoding_kernel(cached_key.dtype)):  # A decoding step on the CPU kernel.
        valid = (jnp.ones((cached_key.shape[0], cached_key.shape[2]), bool) if mask is None
                 else jnp.broadcast_to(mask[:, 0, 0, :], (cached_key.shape[0], cached_key.shape[2])))
        output = cpu_kernels.cross_attention(query[:, 0].astype(cached_key.dtype), cached_key, cached_value, valid)
        return self._output_projection(output[:, None].astype(self.dtype), d_model)
      key, value = jnp.swapaxes(cached_key, 1, 2), jnp.swapaxes(cached_value, 1, 2)
    else:
      key = self._project(inputs_kv, self.d_k, 'key', kv_heads, kv_axis)      # [batch, kv_len, kv_heads, d_k]
      value = self._project(inputs_kv, self.d_v, 'value', kv_heads, kv_axis)  # [batch, kv_len, kv_heads, d_v]
      if self.position_transform is not None:  # Self-attention: the keys are at the queries' positions.
        key = self.position_transform(key, positions)
      if use_cache and self.cross_attention:  # Never reordered: kept in the product dtype, cast once.
        self.put_variable('cache', 'cached_key', jnp.swapaxes(key, 1, 2).astype(self._product_dtype))
        self.put_variable('cache', 'cached_value', jnp.swapaxes(value, 1, 2).astype(self._product_dtype))
      elif use_cache and self.has_variable('cache', 'ancestry'):  # A decoding step on the CPU kernel.
        return self._output_projection(self._kernel_decoding_step(query, key, value).astype(self.dtype), d_model)
      elif use_cache and self.has_variable('cache', 'cached_key'):  # A decoding step of self-attention.
        cached_key, cached_value, mask = self._update_self_attention_cache(key, value)
        output, weights = decoding_attention(query, cached_key, cached_value, mask,
                                             product_dtype=self._product_dtype)
        self.sow('intermediates', 'attention_weights', weights)
        return self._output_projection(output.astype(self.dtype), d_model)
      elif use_cache:
        self._create_self_attention_cache(key, value)

    rows, q_len = query.shape[:2]
    if key.shape[0] != rows:
      # Decoding: the hypotheses (beams) of a sentence are consecutive query rows and share its memory row;
      # fold them into the query length instead of copying the memory for every beam.
      if not (use_cache and self.cross_attention and rows % key.shape[0] == 0):
        raise ValueError(f'{rows} query rows cannot attend to {key.shape[0]} key rows')
      query = query.reshape(key.shape[0], rows // key.shape[0] * q_len, *query.shape[2:])

    dropout_rng = None
    if not deterministic and self.dropout_rate > 0.0:
      dropout_rng = self.make_rng('dropout')
    if self.attention_impl == 'fused' and self.dropout_rate == 0.0:
      # One dtype for the three (jax.nn.dot_product_attention requires it).
      output = fused_dot_product_attention(*(x.astype(self._product_dtype) for x in (query, key, value)), mask)
      output = output.astype(self.dtype)
    else:
      output, weights = dot_product_attention(
          query, key, value, mask, dropout_rate=self.dropout_rate, dropout_rng=dropout_rng,
          deterministic=deterministic, product_dtype=self._product_dtype)
      self.sow('intermediates', 'attention_weights', weights)
    return self._output_projection(output.reshape(rows, q_len, *output.shape[2:]), d_model)

  def _output_projection(self, output: Array, d_model: int) -> Array:
    """Concat(head_1..head_h) W^O: [batch, q_len, num_heads, d_v] -> [batch, q_len, d_model]."""
    init = numerics.default_kernel_init(in_axis=(0, 1), out_axis=2)
    kernel = self.param('output', nn.with_logical_partitioning(init, (sharding.HEADS, sharding.KV, sharding.EMBED)),
                        (self.num_heads, self.d_v, d_model))  # W^O
    return numerics.einsum('bqhv,hvm->bqm', output, kernel.astype(self.dtype))

  def _create_self_attention_cache(self, key: Array, value: Array) -> None:
    """Creates the zero K/V cache [batch, kv_heads, max_decode_length, d] in the compute dtype, and its index
    (the first call, normally under `Transformer.init_cache`, which sees the full [batch, max_decode_length,
    ...] shapes)."""
    self.variable('cache', 'cached_key', jnp.zeros, jnp.swapaxes(key, 1, 2).shape, key.dtype)
    self.variable('cache', 'cached_value', jnp.zeros, jnp.swapaxes(value, 1, 2).shape, value.dtype)
    self.variable('cache', 'cache_index', lambda: jnp.array(0, dtype=jnp.int32))
    if self._use_decoding_kernel(key.dtype):  # Row r's position j is in row r + ancestry[r, j].
      self.variable('cache', 'ancestry', jnp.zeros, key.shape[:2], jnp.int32)

  def _use_decoding_kernel(self, cache_dtype: Any) -> bool:
    """Whether this layer's decoding steps run on `cpu_kernels` (`decoding_kernel`).

    Raises:
      ValueError: for an unknown setting, or 'cpu' where the kernel does not take the dtypes.
      cpu_kernels.KernelUnavailable: 'cpu' where the kernel cannot be built.
    """
    fits = (self._product_dtype == jnp.dtype(cache_dtype) == jnp.dtype(self.dtype)
            and self._product_dtype in cpu_kernels.DTYPES)
    if self.decoding_kernel == 'cpu' and not fits:
      raise ValueError(f"model.decoding_kernel='cpu' needs the attention products in the compute dtype "
                       f"(bfloat16 or float32), got products {self._product_dtype}, compute {self.dtype}")
    return fits and cpu_kernels.wanted(self.decoding_kernel)

  def _kernel_decoding_step(self, query: Array, key: Array, value: Array) -> Array:
    """One step on `cpu_kernels.decoding_self_attention`: query [batch, 1, num_heads, d_k], this step's key
    and value [batch, 1, kv_heads, d]; writes them at the cache index and returns [batch, 1, num_heads, d_v].

    Raises:
      ValueError: for more than one position.
    """
    if key.shape[1] != 1:
      raise ValueError(f'decoding takes one position per step, got {key.shape[1]}')
    cached_key, cached_value, ancestry, cache_index = (
        self.variable('cache', name) for name in ('cached_key', 'cached_value', 'ancestry', 'cache_index'))
    dtype = cached_key.value.dtype
    output, cached_key.value, cached_value.value, ancestry.value = cpu_kernels.decoding_self_attention(
        query[:, 0].astype(dtype), cached_key.value, cached_value.value, ancestry.value, key[:, 0].astype(dtype),
        value[:, 0].astype(dtype), cache_index.value)
    cache_index.value = cache_index.value + 1
    return output[:, None]

  def _update_self_attention_cache(self, key: Array, value: Array) -> tuple[Array, Array, Array]:
    """Writes this step's key and value ([batch, 1, kv_heads, d]) at the cache index.

    Returns:
      (the key cache [batch, kv_heads, max_len, d_k], the value cache [batch, kv_heads, max_len, d_v], and the
      causal mask bool [1, 1, 1, max_len]).

    Raises:
      ValueError: for more than one position.
    """
    if key.shape[1] != 1:
      raise ValueError(f'decoding takes one position per step, got {key.shape[1]}')
    cached_key, cached_value = self.variable('cache', 'cached_key'), self.variable('cache', 'cached_value')
    cache_index = self.variable('cache', 'cache_index')
    index = cache_index.value
    for cache, x in ((cached_key, key), (cached_value, value)):
      cache.value = jax.lax.dynamic_update_slice(cache.value, jnp.swapaxes(x, 1, 2).astype(cache.value.dtype),
                                                 (0, 0, index, 0))
    cache_index.value = index + 1
    mask = (jnp.arange(cached_key.value.shape[2]) <= index)[None, None, None, :]
    return cached_key.value, cached_value.value, mask
