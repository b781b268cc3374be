"""Feed-forward networks (§3.3), positional encodings (§3.5), normalisation and the encoder and decoder
layers (§3.1); with the later variants ModelConfig offers (RMSNorm, gated feed-forward, rotary positions).
"""
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.model import attention
from transformer_jax.model import numerics
from transformer_jax.model import sharding

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
    kind: 'sinusoidal', 'learned', 'rope' or 'none' (for invariance tests). 'rope' adds nothing here:
      rotary positions rotate the queries and keys of every self-attention (`apply_rope`).
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
    if self.kind in ('none', 'rope'):
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


def apply_rope(x: Array, positions: Array | None) -> Array:
  """Rotary position embedding (Su et al., 2021): rotates feature pairs by position-dependent angles.

  Feature i < d/2 is paired with feature i + d/2 and the pair is rotated by positions * 10000^(-2i/d), so a
  query at position m and a key at position n score q R(m)^T R(n) k = q R(n - m) k: the product depends on
  the offset n - m only. Computed in float32.

  Args:
    x: [batch, length, num_heads, d] queries or keys, d even.
    positions: int [batch, length] (restarting per packed sentence; the cache index when decoding), or
      None for 0..length-1.

  Returns:
    x's shape and dtype.
  """
  length, d = x.shape[1], x.shape[-1]
  if positions is None:
    positions = jnp.arange(length)[None, :]  # [1, length]
  inverse_frequency = jnp.power(10000.0, -jnp.arange(0, d, 2, dtype=jnp.float32) / d)  # [d / 2]
  angle = positions.astype(jnp.float32)[:, :, None, None] * inverse_frequency[None, None, None, :]
  # angle: [batch, length, 1, d / 2]
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
  return rotated.astype(x.dtype)


def make_norm(kind: str, dtype: Any, name: str) -> nn.Module:
  """LayerNorm (Ba et al., 2016; the paper's) or RMSNorm (Zhang & Sennrich, 2019: x / RMS(x) * scale, no bias
  and no mean subtraction), epsilon 1e-6, parameters [d_model] sharded as EMBED."""
  scale_init = nn.with_logical_partitioning(nn.initializers.ones, (sharding.EMBED,))
  if kind == 'rms_norm':
    return nn.RMSNorm(epsilon=1e-6, dtype=dtype, name=name, scale_init=scale_init)
  return nn.LayerNorm(epsilon=1e-6, dtype=dtype, name=name, scale_init=scale_init,
                      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (sharding.EMBED,)))


GATED_FEED_FORWARDS = ('swiglu', 'geglu')  # Kinds with a third d_model x d_ff matrix V (Shazeer, 2020).


class FeedForward(nn.Module):
  """The position-wise feed-forward network (§3.3), x: [batch, length, d_model] -> same shape.

  kind 'relu': FFN(x) = max(0, x W1 + b1) W2 + b2 (Eq. 2); 'gelu': the same with GELU. The gated variants of
  Shazeer (2020), without biases: 'swiglu': (Swish(x W1) * x V) W2, 'geglu': (GELU(x W1) * x V) W2. A gated
  FFN has three d_model x d_ff matrices: d_ff = 2/3 of the paper's keeps its parameter count.
  activation_dropout_rate drops the [batch, length, d_ff] input of W2 in training (the activations; for the gated
  kinds, their product with x V): not in the paper, tensor2tensor's relu_dropout and fairseq's activation
  dropout. 0 draws no random numbers.
  """
  d_ff: int
  dtype: Any = jnp.float32
  kind: str = 'relu'
  activation_dropout_rate: float = 0.0

  @nn.compact
  def __call__(self, x: Array, *, deterministic: bool) -> Array:
    """x: [batch, length, d_model] in any float dtype; deterministic: no dropout (evaluation, decoding).
    Returns [batch, length, d_model] in the module's dtype."""
    d_model = x.shape[-1]
    param = lambda name, init, shape, axes: self.param(name, nn.with_logical_partitioning(init, axes), shape)
    w1 = param('w1', numerics.default_kernel_init(), (d_model, self.d_ff), (sharding.EMBED, sharding.MLP))
    gated = self.kind in GATED_FEED_FORWARDS
    if gated:
      v = param('v', numerics.default_kernel_init(), (d_model, self.d_ff), (sharding.EMBED, sharding.MLP))
    else:
      b1 = param('b1', nn.initializers.zeros, (self.d_ff,), (sharding.MLP,))
    w2 = param('w2', numerics.default_kernel_init(), (self.d_ff, d_model), (sharding.MLP, sharding.EMBED))
    # Biases are added to the float32 accumulator, so their gradients are float32 sums over the tokens. A bf16
    # sum would lose precision (measured: b2's gradient 1.0% off the float32 reference over 2,048 tokens, against
    # 0.11% this way), and XLA:CPU runs it as a reduce-window ~50x slower (17 ms per b1 at SMALL shapes).
    hidden = numerics.einsum('blm,mf->blf', x, w1.astype(self.dtype), jnp.float32)  # [batch, length, d_ff]
    activation = {'relu': nn.relu, 'gelu': nn.gelu, 'swiglu': nn.swish, 'geglu': nn.gelu}[self.kind]
    if gated:
      hidden = activation(hidden) * numerics.einsum('blm,mf->blf', x, v.astype(self.dtype), jnp.float32)
    else:
      hidden = activation(hidden + b1[None, None, :])
    hidden = numerics.Dropout(self.activation_dropout_rate)(hidden.astype(self.dtype), deterministic)
    hidden = nn.with_logical_constraint(hidden, (sharding.BATCH, sharding.LENGTH, sharding.MLP))
    output = numerics.einsum('blf,fm->blm', hidden, w2.astype(self.dtype), jnp.float32)
    if not gated:
      b2 = param('b2', nn.initializers.zeros, (d_model,), (sharding.EMBED,))
      output = output + b2[None, None, :]
    return output.astype(self.dtype)


class Residual(nn.Module):
  """A sub-layer with dropout, residual connection and layer normalisation (§3.1, §5.4).

  post: LayerNorm(x + Dropout(Sublayer(x))), as in the paper; pre: x + Dropout(Sublayer(LayerNorm(x))).
  """
  layer_norm_position: str
  dropout_rate: float
  dtype: Any = jnp.float32
  norm: str = 'layer_norm'

  @nn.compact
  def __call__(self, x: Array, sublayer, *, deterministic: bool) -> Array:
    norm = make_norm(self.norm, self.dtype, 'layer_norm')
    dropout = numerics.Dropout(self.dropout_rate)
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
  activation_dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  attention_impl: str = 'xla'
  norm: str = 'layer_norm'
  feed_forward: str = 'relu'
  num_kv_heads: int | None = None
  rope: bool = False  # Rotary positions in self-attention (position_embedding='rope').
  attention_product_dtype: Any = None  # Of the attention products; None: dtype.

  def make_residual(self, name: str) -> Residual:
    return Residual(self.layer_norm_position, self.dropout_rate, self.dtype, self.norm, name=name)

  def make_attention(self, name: str, cross_attention: bool = False) -> attention.MultiHeadAttention:
    # Cross-attention gets no rotary positions: its queries (target) and keys (source) index different
    # sequences, so their offset means nothing; order reaches it through the rotated self-attentions.
    return attention.MultiHeadAttention(
        self.num_heads, self.d_k, self.d_v, self.attention_dropout_rate, cross_attention=cross_attention,
        dtype=self.dtype, attention_impl=self.attention_impl, num_kv_heads=self.num_kv_heads,
        position_transform=apply_rope if self.rope and not cross_attention else None,
        product_dtype=self.attention_product_dtype, name=name)

  def make_feed_forward(self, deterministic: bool) -> Callable[[Array], Array]:
    """The feed-forward sub-layer as a function of x, for `Residual`."""
    feed_forward = FeedForward(self.d_ff, self.dtype, self.feed_forward, self.activation_dropout_rate,
                               name='feed_forward')
    return lambda y: feed_forward(y, deterministic=deterministic)


class EncoderLayer(_Layer):
  """Self-attention then feed-forward, each wrapped in `Residual` (§3.1, encoder)."""

  @nn.compact
  def __call__(self, x: Array, mask: Array, deterministic: bool, positions: Array | None = None) -> Array:
    """x: [batch, src_len, d_model]; mask: bool [batch, 1, src_len, src_len]; positions: int [batch, src_len]
    or None (0..src_len-1), read by rotary positions only. Returns x's shape."""
    residual = self.make_residual
    attend = self.make_attention('self_attention')
    x = residual('self_attention_residual')(
        x, lambda y: attend(y, y, mask, deterministic=deterministic, positions=positions),
        deterministic=deterministic)
    x = residual('feed_forward_residual')(x, self.make_feed_forward(deterministic), deterministic=deterministic)
    return nn.with_logical_constraint(x, (sharding.BATCH, sharding.LENGTH, sharding.EMBED))


class DecoderLayer(_Layer):
  """Masked self-attention, encoder-decoder attention over `memory`, feed-forward (§3.1, decoder)."""

  @nn.compact
  def __call__(self, x: Array, memory: Array, self_mask: Array | None, memory_mask: Array,
               deterministic: bool, use_cache: bool = False, positions: Array | None = None) -> Array:
    """Args:
      x: [batch, tgt_len, d_model] (tgt_len 1 per step when decoding).
      memory: encoder output [batch, src_len, d_model].
      self_mask: bool [batch, 1, tgt_len, tgt_len] (causal and padding); unused when decoding.
      memory_mask: bool [batch, 1, tgt_len or 1, src_len].
      deterministic: disables dropout.
      use_cache: incremental decoding through the 'cache' collection.
      positions: int [batch, tgt_len] target positions (the step's index when decoding), or None for
        0..tgt_len-1; read by rotary positions only.

    Returns:
      [batch, tgt_len, d_model].
    """
    residual = self.make_residual
    self_attend = self.make_attention('self_attention')
    cross_attend = self.make_attention('encoder_decoder_attention', cross_attention=True)
    x = residual('self_attention_residual')(
        x, lambda y: self_attend(y, y, self_mask, deterministic=deterministic, use_cache=use_cache,
                                 positions=positions),
        deterministic=deterministic)
    x = residual('encoder_decoder_attention_residual')(
        x, lambda y: cross_attend(y, memory, memory_mask, deterministic=deterministic, use_cache=use_cache),
        deterministic=deterministic)
    x = residual('feed_forward_residual')(x, self.make_feed_forward(deterministic), deterministic=deterministic)
    return nn.with_logical_constraint(x, (sharding.BATCH, sharding.LENGTH, sharding.EMBED))
