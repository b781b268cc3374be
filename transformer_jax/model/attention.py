"""Scaled dot-product attention (§3.2.1) and multi-head attention (§3.2.2), with their masks.

Einsum letters as in `numerics` (b batch, l length, q query length, k key length, h heads, g query heads per
key/value head, d d_k, v d_v, m d_model). The matrix products, dropout and initialiser are `numerics`'.
Masks are bool and broadcast to [batch, num_heads, q_len, kv_len]; True means "may attend".
"""
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.model import numerics
from transformer_jax.model import sharding

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
  DotThunk::Execute: BF16 x BF16 = F32"; Table 3's F7 row).

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
  """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V) (§3.2.2).

  num_heads, d_k and d_v are independent (Table 3 rows A and B); the projections have no bias, as in the
  paper's equations. Training and teacher-forced passes are `__call__` alone. Incremental decoding
  (`use_cache=True`) keeps keys and values in the 'cache' collection: the first call (`Transformer.init_cache`)
  runs `create_cache`, every later call one step, `self_attention_step` (the step's key and value appended,
  attention over the positions so far, §3.2.3's masking) or `cross_attention_step` (the encoder output's keys
  and values, projected once per sentence). Cached keys and values are stored heads-first, [batch, kv_heads,
  length, d_k or d_v], the layout the one-query products read in place (stored [batch, length, kv_heads, d],
  XLA:CPU transposed the whole cache at every step). Those three methods are this layer's decoding contract: a
  decoding backend may replace them (`decoding.backends.decoding_backend`); the parameters are the same either way.

  Attributes:
    num_heads: h.
    d_k: query/key size per head.
    d_v: value size per head.
    dropout_rate: dropout on the attention weights (not in the paper; 0 by default).
    cross_attention: keys and values come from `memory` (encoder-decoder attention, §3.2.3).
    dtype: compute dtype; parameters are float32.
    attention_impl: 'xla' (`dot_product_attention`; sows the weights for inspection) or 'fused'
      (`fused_dot_product_attention`; used where dropout_rate is 0). A self-attention decoding step uses
      `decoding_attention` either way.
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

  @property
  def _product_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.product_dtype or self.dtype)

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array, mask: Array | None, *,
               deterministic: bool, use_cache: bool = False, positions: Array | None = None) -> Array:
    """Attends from inputs_q to inputs_kv.

    Args:
      inputs_q: [batch, q_len, d_model].
      inputs_kv: [batch, kv_len, d_model]; the same array as inputs_q for self-attention, `memory` for
        cross-attention. In decoding mode cross-attention also takes fewer rows, batch / n: then n consecutive
        query rows (the beams of one sentence) share each memory row.
      mask: bool broadcastable to [batch, num_heads, q_len, kv_len] (decoding cross-attention with shared
        memory rows: [batch / n, num_heads, n * q_len, kv_len]), or None. A self-attention decoding step
        ignores it and masks the positions not yet decoded.
      deterministic: disables dropout.
      use_cache: incremental decoding through the 'cache' collection (q_len 1 per step of self-attention, whose
        weights then get no dropout).
      positions: int [batch, q_len] positions of the queries (self-attention: also of the keys) for
        `position_transform`; None means 0..q_len-1.

    Returns:
      [batch, q_len, d_model] in the compute dtype.

    Raises:
      ValueError: for query rows that do not share key rows as above, or a self-attention step of several
        positions.
    """
    d_model = inputs_q.shape[-1]
    query = self._project(inputs_q, self.d_k, 'query', self.num_heads, sharding.HEADS)  # Q W^Q: [b, q, h, d_k]
    if self.position_transform is not None:
      query = self.position_transform(query, positions)
    decoding_step = use_cache and self.has_variable('cache', 'cached_key')
    if decoding_step and self.cross_attention:
      return self._output_projection(self.cross_attention_step(query, mask, deterministic=deterministic), d_model)
    key, value = self._project_key_value(inputs_kv, positions)  # K W^K, V W^V: [b, kv_len, kv_heads, d_k or d_v]
    if decoding_step:
      return self._output_projection(self.self_attention_step(query, key, value), d_model)
    if use_cache:
      self.create_cache(key, value)
    output = self._attend(query, key, value, mask, deterministic,
                          beams_share_keys=use_cache and self.cross_attention)  # [batch, q_len, heads, d_v]
    return self._output_projection(output, d_model)

  def _project(self, x: Array, features: int, name: str, num_heads: int, heads_axis: str) -> Array:
    """x [batch, length, d_model] @ W [d_model, num_heads, features] -> [batch, length, num_heads, features]."""
    init = numerics.default_kernel_init(in_axis=0, out_axis=(1, 2))
    kernel = self.param(name, nn.with_logical_partitioning(init, (sharding.EMBED, heads_axis, sharding.KV)),
                        (x.shape[-1], num_heads, features))
    return numerics.einsum('blm,mhd->blhd', x.astype(self.dtype), kernel.astype(self.dtype))

  def _project_key_value(self, inputs_kv: Array, positions: Array | None) -> tuple[Array, Array]:
    """K W^K [batch, kv_len, kv_heads, d_k] (position_transform applied) and V W^V [batch, kv_len, kv_heads, d_v]."""
    kv_heads = self.num_kv_heads or self.num_heads
    kv_axis = sharding.HEADS if kv_heads == self.num_heads else sharding.KV_HEADS
    key = self._project(inputs_kv, self.d_k, 'key', kv_heads, kv_axis)
    value = self._project(inputs_kv, self.d_v, 'value', kv_heads, kv_axis)
    if self.position_transform is not None:  # Self-attention: the keys are at the queries' positions.
      key = self.position_transform(key, positions)
    return key, value

  def _attend(self, query: Array, key: Array, value: Array, mask: Array | None, deterministic: bool, *,
              beams_share_keys: bool) -> Array:
    """head_1..head_h = Attention(Q W^Q, K W^K, V W^V) (Eq. 1): [rows, q_len, num_heads, d_v].

    query [rows, q_len, num_heads, d_k]; key, value [key rows, kv_len, kv_heads, d]. With beams_share_keys, rows
    may be a multiple n of the key rows: the n consecutive query rows of a sentence (its beams) are folded into
    its query length instead of copying its keys and values for every beam.

    Raises:
      ValueError: if the rows differ otherwise.
    """
    rows, q_len = query.shape[:2]
    if key.shape[0] != rows:
      if not (beams_share_keys and rows % key.shape[0] == 0):
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
    return output.reshape(rows, q_len, *output.shape[2:])

  def _output_projection(self, output: Array, d_model: int) -> Array:
    """Concat(head_1..head_h) W^O: [batch, q_len, num_heads, d_v] -> [batch, q_len, d_model]."""
    init = numerics.default_kernel_init(in_axis=(0, 1), out_axis=2)
    kernel = self.param('output', nn.with_logical_partitioning(init, (sharding.HEADS, sharding.KV, sharding.EMBED)),
                        (self.num_heads, self.d_v, d_model))  # W^O
    return numerics.einsum('bqhv,hvm->bqm', output, kernel.astype(self.dtype))

  def create_cache(self, key: Array, value: Array) -> None:
    """Creates this layer's decoding cache: the first `use_cache` call (`Transformer.init_cache`).

    Cross-attention stores the encoder output's keys and values, heads-first in the product dtype (never
    reordered by beam search: cast once per sentence). Self-attention creates zero caches in the compute
    dtype, as wide as the call's length (`Transformer.init_cache` passes max_decode_length positions), and
    `cache_index`, int32 [], the next position to write.

    Args:
      key: [batch, kv_len, kv_heads, d_k] (position_transform applied).
      value: [batch, kv_len, kv_heads, d_v].
    """
    if self.cross_attention:
      self.put_variable('cache', 'cached_key', jnp.swapaxes(key, 1, 2).astype(self._product_dtype))
      self.put_variable('cache', 'cached_value', jnp.swapaxes(value, 1, 2).astype(self._product_dtype))
      return
    self.variable('cache', 'cached_key', jnp.zeros, jnp.swapaxes(key, 1, 2).shape, key.dtype)
    self.variable('cache', 'cached_value', jnp.zeros, jnp.swapaxes(value, 1, 2).shape, value.dtype)
    self.variable('cache', 'cache_index', lambda: jnp.array(0, dtype=jnp.int32))

  def self_attention_step(self, query: Array, key: Array, value: Array) -> Array:
    """One decoding step of masked self-attention (§3.2.3): writes this step's key and value at the cache index
    and attends over the positions 0..index (`decoding_attention`; the weights are sown).

    Args:
      query: [batch, 1, num_heads, d_k].
      key: [batch, 1, kv_heads, d_k] (position_transform applied); value: [batch, 1, kv_heads, d_v].

    Returns:
      [batch, 1, num_heads, d_v] in the compute dtype.

    Raises:
      ValueError: for more than one position.
    """
    cached_key, cached_value, mask = self._update_self_attention_cache(key, value)
    output, weights = decoding_attention(query, cached_key, cached_value, mask, product_dtype=self._product_dtype)
    self.sow('intermediates', 'attention_weights', weights)
    return output.astype(self.dtype)

  def cross_attention_step(self, query: Array, mask: Array | None, *, deterministic: bool) -> Array:
    """Decoding's encoder-decoder attention (§3.2.3) against the keys and values `create_cache` stored.

    Args:
      query: [rows, q_len, num_heads, d_k]; rows is a multiple of the cache's sentences (their beams).
      mask: bool broadcastable to [sentences, num_heads, rows / sentences * q_len, src_len], or None.
      deterministic: disables dropout on the weights.

    Returns:
      [rows, q_len, num_heads, d_v] in the product dtype.

    Raises:
      ValueError: where the rows are not a multiple of the cache's.
    """
    key = jnp.swapaxes(self.get_variable('cache', 'cached_key'), 1, 2)  # [sentences, src_len, kv_heads, d_k]
    value = jnp.swapaxes(self.get_variable('cache', 'cached_value'), 1, 2)
    return self._attend(query, key, value, mask, deterministic, beams_share_keys=True)

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
