"""Feed-forward networks (§3.3), positional encodings (§3.5) and the encoder and decoder layers (§3.1)."""
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax import attention
from transformer_jax import sharding

Array = jax.Array


def sinusoidal_position_encoding(positions: Array, d_model: int) -> Array:
  """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)) (§3.5).

  Dimension j uses i = j // 2, sine for even j and cosine for odd j, which is exact for odd d_model too
  (the last dimension is then a sine).

  Args:
    positions: int [...], e.g. `jnp.arange(length)`.
    d_model: model width.

  Returns:
    float32 [..., d_model].
  """
  dims = jnp.arange(d_model).reshape((1,) * positions.ndim + (d_model,))  # [1, ..., 1, d_model]
  inverse_timescale = jnp.power(10000.0, -(2 * (dims // 2)).astype(jnp.float32) / d_model)
  angle = positions.astype(jnp.float32)[..., None] * inverse_timescale  # [..., d_model]
  return jnp.where(dims % 2 == 0, jnp.sin(angle), jnp.cos(angle))


class PositionEmbedding(nn.Module):
  """Adds position information to token embeddings: sinusoids (§3.5) or a learned table (Table 3 row E).

  Attributes:
    kind: 'sinusoidal', 'learned' or 'none' (for invariance tests).
    max_length: number of rows of the learned table.
  """
  kind: str = 'sinusoidal'
  max_length: int = 256

  @nn.compact
  def __call__(self, x: Array, positions: Array | None) -> Array:
    """Returns x + PE. x: [batch, length, d_model]; positions: int [batch, length], None for 0..length-1.

    Raises:
      ValueError: if the input is longer than a learned table.
    """
    length, d_model = x.shape[1], x.shape[2]
    if positions is None:
      positions = jnp.arange(length)[None, :]  # [1, length]
    if self.kind == 'none':
      return x
    if self.kind == 'sinusoidal':
      return x + sinusoidal_position_encoding(positions, d_model).astype(x.dtype)
    if length > self.max_length:
      raise ValueError(f'input length {length} exceeds model.max_length={self.max_length}, the size of the '
                       'learned position embeddings')
    table = self.param('position_embedding', nn.with_logical_partitioning(
        nn.initializers.normal(stddev=d_model ** -0.5), (sharding.LENGTH, sharding.EMBED)),
                       (self.max_length, d_model))
    return x + jnp.take(table, positions, axis=0).astype(x.dtype)


class FeedForward(nn.Module):
  """FFN(x) = max(0, x W1 + b1) W2 + b2 (§3.3, Eq. 2). x: [batch, length, d_model] -> same shape."""
  d_ff: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    d_model = x.shape[-1]
    param = lambda name, init, shape, axes: self.param(name, nn.with_logical_partitioning(init, axes), shape)
    w1 = param('w1', attention.default_kernel_init(), (d_model, self.d_ff), (sharding.EMBED, sharding.MLP))
    b1 = param('b1', nn.initializers.zeros, (self.d_ff,), (sharding.MLP,))
    w2 = param('w2', attention.default_kernel_init(), (self.d_ff, d_model), (sharding.MLP, sharding.EMBED))
    b2 = param('b2', nn.initializers.zeros, (d_model,), (sharding.EMBED,))
    # Biases are added to the float32 accumulator, so their gradients are float32 sums over the tokens: a
    # bf16 sum is less precise (b2's gradient 1.0% off float32 over 2,048 tokens, 0.11% now) and XLA:CPU
    # ran it as a reduce-window ~50x slower than a float32 reduction (17 ms per b1 at SMALL shapes).
    hidden = attention.einsum('blm,mf->blf', x, w1.astype(self.dtype), jnp.float32) + b1[None, None, :]
    hidden = nn.relu(hidden).astype(self.dtype)  # [batch, length, d_ff]
    hidden = nn.with_logical_constraint(hidden, (sharding.BATCH, sharding.LENGTH, sharding.MLP))
    output = attention.einsum('blf,fm->blm', hidden, w2.astype(self.dtype), jnp.float32) + b2[None, None, :]
    return output.astype(self.dtype)


class Residual(nn.Module):
  """A sub-layer with dropout, residual connection and layer normalisation (§3.1, §5.4).

  post: LayerNorm(x + Dropout(Sublayer(x))), as in the paper; pre: x + Dropout(Sublayer(LayerNorm(x))).
  """
  layer_norm_position: str
  dropout_rate: float
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array, sublayer, *, deterministic: bool) -> Array:
    norm = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype, name='layer_norm',
                        scale_init=nn.with_logical_partitioning(nn.initializers.ones, (sharding.EMBED,)),
                        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (sharding.EMBED,)))
    dropout = attention.Dropout(self.dropout_rate)
    if self.layer_norm_position == 'pre':
      return x + dropout(sublayer(norm(x)), deterministic)
    return norm(x + dropout(sublayer(x), deterministic))


class _Layer(nn.Module):
  """The fields shared by encoder and decoder layers; they mirror `ModelConfig`."""
  d_ff: int
  num_heads: int
  d_k: int
  d_v: int
  dropout_rate: float
  attention_dropout_rate: float
  layer_norm_position: str
  dtype: Any = jnp.float32
  attention_impl: str = 'xla'

  def make_residual(self, name: str) -> Residual:
    return Residual(self.layer_norm_position, self.dropout_rate, self.dtype, name=name)

  def make_attention(self, name: str, cross_attention: bool = False) -> attention.MultiHeadAttention:
    return attention.MultiHeadAttention(
        self.num_heads, self.d_k, self.d_v, self.attention_dropout_rate, cross_attention=cross_attention,
        dtype=self.dtype, attention_impl=self.attention_impl, name=name)


class EncoderLayer(_Layer):
  """Self-attention then feed-forward, each wrapped in `Residual` (§3.1, encoder)."""

  @nn.compact
  def __call__(self, x: Array, mask: Array, deterministic: bool) -> Array:
    """x: [batch, src_len, d_model]; mask: bool [batch, 1, src_len, src_len]. Returns x's shape."""
    residual = self.make_residual
    attend = self.make_attention('self_attention')
    x = residual('self_attention_residual')(
        x, lambda y: attend(y, y, mask, deterministic=deterministic), deterministic=deterministic)
    x = residual('feed_forward_residual')(
        x, FeedForward(self.d_ff, self.dtype, name='feed_forward'), deterministic=deterministic)
    return nn.with_logical_constraint(x, (sharding.BATCH, sharding.LENGTH, sharding.EMBED))


class DecoderLayer(_Layer):
  """Masked self-attention, encoder-decoder attention over `memory`, feed-forward (§3.1, decoder)."""

  @nn.compact
  def __call__(self, x: Array, memory: Array, self_mask: Array | None, memory_mask: Array,
               deterministic: bool, decode: bool = False) -> Array:
    """Args:
      x: [batch, tgt_len, d_model] (tgt_len 1 per step when decoding).
      memory: encoder output [batch, src_len, d_model].
      self_mask: bool [batch, 1, tgt_len, tgt_len] (causal and padding); unused when decoding.
      memory_mask: bool [batch, 1, tgt_len or 1, src_len].
      deterministic: disables dropout.
      decode: incremental decoding through the 'cache' collection.

    Returns:
      [batch, tgt_len, d_model].
    """
    residual = self.make_residual
    self_attend = self.make_attention('self_attention')
    cross_attend = self.make_attention('encoder_decoder_attention', cross_attention=True)
    x = residual('self_attention_residual')(
        x, lambda y: self_attend(y, y, self_mask, deterministic=deterministic, decode=decode),
        deterministic=deterministic)
    x = residual('encoder_decoder_attention_residual')(
        x, lambda y: cross_attend(y, memory, memory_mask, deterministic=deterministic, decode=decode),
        deterministic=deterministic)
    x = residual('feed_forward_residual')(
        x, FeedForward(self.d_ff, self.dtype, name='feed_forward'), deterministic=deterministic)
    return nn.with_logical_constraint(x, (sharding.BATCH, sharding.LENGTH, sharding.EMBED))
