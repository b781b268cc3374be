"""The Transformer (§3): encoder and decoder stacks with one shared embedding (§3.4).

Token id 0 is padding (tokenizer.PAD_ID); unpacked batches derive their segment ids from it.
"""
import dataclasses
import inspect
import typing
from typing import Any, Literal, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.model import attention
from transformer_jax.model import layers
from transformer_jax.model import numerics
from transformer_jax.model import sharding

Array = jax.Array
PositionEmbedding = Literal['sinusoidal', 'learned', 'rope', 'none']
LayerNormPosition = Literal['post', 'pre']
Norm = Literal['layer_norm', 'rms_norm']
FeedForwardKind = Literal['relu', 'gelu', 'swiglu', 'geglu']
Dtype = Literal['float32', 'bfloat16']
AttentionImpl = Literal['xla', 'fused']
DecodingKernel = Literal['auto', 'cpu', 'xla']
AttentionProductDtype = Literal['compute', 'float32']


# The ModelConfig fields that are dropout probabilities (§5.4's P_drop and the later variants).
DROPOUT_RATES = ('dropout_rate', 'attention_dropout_rate', 'activation_dropout_rate')


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture hyperparameters (§3, Table 3); built as ModelConfig(vocab_size=..., **config.model).

  Every default is the paper's model. The fields after the paper's ones are the later variants that
  Table 3's extra rows ablate (configs/table3.py): `layer_norm_position='pre'` (Xiong et al., 2020),
  `norm='rms_norm'` (Zhang & Sennrich, 2019), `position_embedding='rope'` (Su et al., 2021),
  `feed_forward='swiglu'/'geglu'` (Shazeer, 2020) and `num_kv_heads` < num_heads (multi-query, Shazeer, 2019;
  grouped-query, Ainslie et al., 2023).

  Raises:
    ValueError: naming the `model.<field>` key and its allowed values when a value is out of range.
  """
  vocab_size: int
  num_layers: int = 6
  d_model: int = 512
  d_ff: int = 2048
  num_heads: int = 8
  d_k: int = 64
  d_v: int = 64
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.0
  activation_dropout_rate: float = 0.0  # Of the feed-forward's d_ff activations; not in the paper.
  position_embedding: PositionEmbedding = 'sinusoidal'
  layer_norm_position: LayerNormPosition = 'post'
  scale_embeddings: bool = True
  max_length: int = 256
  dtype: Dtype = 'float32'
  attention_impl: AttentionImpl = 'xla'
  remat: bool = False
  norm: Norm = 'layer_norm'
  feed_forward: FeedForwardKind = 'relu'
  num_kv_heads: int | None = None  # Heads of W^K and W^V; None: num_heads (the paper's multi-head attention).
  # The dtype Q K^T and weights x V multiply in: 'compute' (= dtype, what accelerators run) or 'float32'
  # (XLA:CPU multiplies batched bf16 products slowly: the CPU configs set it). Also the dtype of the
  # encoder-decoder attention's decoding cache; the self-attention cache is always dtype.
  attention_product_dtype: AttentionProductDtype = 'compute'
  # A decoding choice, not the model's (no module reads it): the backend a search's steps run on, chosen on the
  # host by `decoding.backends.decoding_backend` ('cpu': the C++ kernels of `transformer_jax.cpu`; 'xla'; 'auto': the
  # kernels on a single CPU device where they build). Kept here for its config key, model.decoding_kernel.
  decoding_kernel: DecodingKernel = 'auto'

  def __post_init__(self):
    for name in ('vocab_size', 'num_layers', 'd_model', 'd_ff', 'num_heads', 'd_k', 'd_v', 'max_length'):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f'model.{name} must be a positive integer, got {value!r}')
    for name in DROPOUT_RATES:
      value = getattr(self, name)
      if not 0.0 <= value < 1.0:
        raise ValueError(f'model.{name} must be in [0, 1), got {value!r}')
    for field in dataclasses.fields(self):
      if typing.get_origin(field.type) is Literal and getattr(self, field.name) not in typing.get_args(field.type):
        raise ValueError(f'model.{field.name} must be one of {typing.get_args(field.type)}, '
                         f'got {getattr(self, field.name)!r}')
    if self.attention_impl == 'fused' and self.d_k != self.d_v:
      raise ValueError(f"model.attention_impl='fused' needs d_k == d_v, got {self.d_k} and {self.d_v}")
    kv_heads = self.num_kv_heads
    if kv_heads is not None and (not isinstance(kv_heads, int) or isinstance(kv_heads, bool) or kv_heads <= 0
                                 or self.num_heads % kv_heads):
      raise ValueError(f'model.num_kv_heads must be a positive divisor of model.num_heads={self.num_heads} '
                       f'(or None for num_heads), got {kv_heads!r}')
    if self.position_embedding == 'rope' and self.d_k % 2:
      raise ValueError(f"model.position_embedding='rope' rotates pairs of query/key features: model.d_k must be "
                       f'even, got {self.d_k}')

  @property
  def key_value_heads(self) -> int:
    """Heads of the key and value projections: num_kv_heads, or num_heads when that is None."""
    return self.num_kv_heads or self.num_heads

  @property
  def compute_dtype(self) -> jnp.dtype:
    """The dtype of activations and matrix products (`dtype`); parameters stay float32."""
    return jnp.dtype(self.dtype)

  @property
  def product_dtype(self) -> jnp.dtype:
    """The dtype of the attention products (`attention_product_dtype`); see `attention.MultiHeadAttention`."""
    return self.compute_dtype if self.attention_product_dtype == 'compute' else jnp.dtype(jnp.float32)


def segment_ids_from_tokens(tokens: Array) -> Array:
  """int32 [batch, length]: 1 on real tokens, 0 on padding (id 0)."""
  return (tokens != 0).astype(jnp.int32)


def grow_decoding_cache(cache: Any, length: int) -> Any:
  """Enlarges every self-attention K/V cache of a 'cache' collection to hold `length` positions.

  Self-attention caches are the modules with a `cache_index`; their `cached_key`/`cached_value` are
  [rows, kv_heads, positions, d] (`attention.MultiHeadAttention.create_cache`). The new positions are zeros,
  masked until decoding writes them. Other entries (encoder-decoder K/V, indices, and what a decoding backend
  adds, which grows them itself) are returned as they are.

  Args:
    cache: the 'cache' collection of a Transformer, or a part of it (nested dicts).
    length: positions to hold.

  Returns:
    The same structure.

  Raises:
    ValueError: if a cache already holds more than `length` positions.
  """
  if not isinstance(cache, Mapping):
    return cache
  if 'cache_index' not in cache:
    return {name: grow_decoding_cache(value, length) for name, value in cache.items()}

  def grow(x, axis):
    if x.shape[axis] > length:
      raise ValueError(f'cannot shrink a decoding cache of {x.shape[axis]} positions to {length}')
    return jnp.pad(x, [(0, length - x.shape[axis]) if i == axis else (0, 0) for i in range(x.ndim)])
  return {name: grow(value, 2) if name in ('cached_key', 'cached_value') else value for name, value in cache.items()}


class Embedder(nn.Module):
  """Shared token embedding times sqrt(d_model) (§3.4), plus positions (§3.5), then dropout (§5.4)."""
  cfg: ModelConfig
  embedding: nn.Embed

  @nn.compact
  def __call__(self, tokens: Array, positions: Array | None, deterministic: bool) -> Array:
    """tokens: int [batch, length] -> [batch, length, d_model] in the compute dtype."""
    x = self.embedding(tokens).astype(self.cfg.compute_dtype)
    if self.cfg.scale_embeddings:
      x = x * jnp.sqrt(self.cfg.d_model).astype(x.dtype)
    x = layers.PositionEmbedding(self.cfg.position_embedding, self.cfg.max_length, name='position')(
        x, positions)
    return numerics.Dropout(self.cfg.dropout_rate)(x, deterministic)


def _layer_kwargs(cfg: ModelConfig) -> dict[str, Any]:
  return dict(d_ff=cfg.d_ff, num_heads=cfg.num_heads, d_k=cfg.d_k, d_v=cfg.d_v,
              dropout_rate=cfg.dropout_rate, attention_dropout_rate=cfg.attention_dropout_rate,
              activation_dropout_rate=cfg.activation_dropout_rate,
              layer_norm_position=cfg.layer_norm_position, dtype=cfg.compute_dtype,
              attention_impl=cfg.attention_impl, norm=cfg.norm, feed_forward=cfg.feed_forward,
              num_kv_heads=cfg.num_kv_heads, rope=cfg.position_embedding == 'rope',
              attention_product_dtype=cfg.product_dtype)


def _remat(layer_cls: type[nn.Module], static: tuple[str, ...]) -> type[nn.Module]:
  """nn.remat of a layer class, its Python-valued call arguments named (their positions are looked up, so a
  changed signature cannot silently make a bool traced)."""
  names = list(inspect.signature(layer_cls.__call__).parameters)  # names[0] is self, which remat counts.
  return nn.remat(layer_cls, static_argnums=tuple(names.index(name) for name in static))


def _final_norm(cfg: ModelConfig, x: Array) -> Array:
  """Pre-LN stacks end with a norm (Xiong et al., 2020); post-LN stacks already end normalised (§3.1)."""
  if cfg.layer_norm_position != 'pre':
    return x
  return layers.make_norm(cfg.norm, cfg.compute_dtype, 'final_layer_norm')(x)


class Encoder(nn.Module):
  """num_layers EncoderLayers over the embedded source (§3.1)."""
  cfg: ModelConfig
  embedding: nn.Embed

  @nn.compact
  def __call__(self, source_tokens: Array, source_segment_ids: Array, source_positions: Array | None,
               deterministic: bool) -> Array:
    """source_tokens, source_segment_ids: int [batch, src_len] -> memory [batch, src_len, d_model]."""
    x = Embedder(self.cfg, self.embedding, name='embedder')(source_tokens, source_positions, deterministic)
    mask = attention.padding_mask(source_segment_ids, source_segment_ids)
    layer_cls = _remat(layers.EncoderLayer, ('deterministic',)) if self.cfg.remat else layers.EncoderLayer
    for i in range(self.cfg.num_layers):
      x = layer_cls(**_layer_kwargs(self.cfg), name=f'layer_{i}')(x, mask, deterministic, source_positions)
    return _final_norm(self.cfg, x)


class Decoder(nn.Module):
  """num_layers DecoderLayers over the embedded, right-shifted target, reading `memory` (§3.1)."""
  cfg: ModelConfig
  embedding: nn.Embed

  @nn.compact
  def __call__(self, decoder_input_tokens: Array, memory: Array, source_segment_ids: Array,
               target_segment_ids: Array | None, target_positions: Array | None,
               deterministic: bool, use_cache: bool) -> Array:
    """Returns the last layer's output, after the final norm of pre-LN stacks (none for the paper's post-LN),
    [batch, tgt_len, d_model] in the compute dtype; see `Transformer.decode`."""
    cfg = self.cfg
    if target_segment_ids is None:
      target_segment_ids = segment_ids_from_tokens(decoder_input_tokens)
    self_mask = attention.padding_mask(target_segment_ids, target_segment_ids) & attention.causal_mask(
        decoder_input_tokens.shape[1])
    if use_cache:
      cache_exists = self.has_variable('cache', 'position')
      position = self.variable('cache', 'position', lambda: jnp.array(0, dtype=jnp.int32))
      if cache_exists:
        # [1, tgt_len]: every row is at this position, so its encoding is computed once and broadcast (per
        # row, the sines and cosines were 4% of a 40-sentence beam step on a CPU).
        target_positions = jnp.full((1, decoder_input_tokens.shape[1]), position.value, dtype=jnp.int32)
        position.value = position.value + 1
    if use_cache:  # Unpacked sentences; the beams of a sentence share its memory row (see MultiHeadAttention).
      memory_mask = (source_segment_ids != 0)[:, None, None, :]  # [memory rows, 1, 1, src_len]
    else:
      memory_mask = attention.padding_mask(target_segment_ids, source_segment_ids)
    x = Embedder(cfg, self.embedding, name='embedder')(decoder_input_tokens, target_positions, deterministic)
    remat = cfg.remat and not use_cache
    layer_cls = _remat(layers.DecoderLayer, ('deterministic', 'use_cache')) if remat else layers.DecoderLayer
    for i in range(cfg.num_layers):
      x = layer_cls(**_layer_kwargs(cfg), name=f'layer_{i}')(
          x, memory, self_mask, memory_mask, deterministic, use_cache, target_positions)
    return _final_norm(cfg, x)


class Transformer(nn.Module):
  """Encoder-decoder Transformer (§3, Figure 1).

  Call-time modes: `deterministic=False` trains with dropout (needs a 'dropout' rng); `use_cache=True` runs
  one target position per call against the 'cache' collection built by `init_cache`.
  """
  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    self.embedding = nn.Embed(
        cfg.vocab_size, cfg.d_model, name='shared_embedding',
        embedding_init=nn.with_logical_partitioning(
            nn.initializers.normal(stddev=cfg.d_model ** -0.5), (sharding.VOCAB, sharding.EMBED)))
    self.encoder = Encoder(cfg, self.embedding)
    self.decoder = Decoder(cfg, self.embedding)

  def encode(self, source_tokens: Array, source_segment_ids: Array | None = None,
             source_positions: Array | None = None, *, deterministic: bool = True) -> Array:
    """Encodes a source batch.

    Args:
      source_tokens: int32 [batch, src_len], 0-padded.
      source_segment_ids: int32 [batch, src_len] for packed rows (0 = padding); None derives it.
      source_positions: int32 [batch, src_len] for packed rows; None means 0..src_len-1.
      deterministic: disables dropout.

    Returns:
      memory: [batch, src_len, d_model] in the compute dtype.
    """
    if source_segment_ids is None:
      source_segment_ids = segment_ids_from_tokens(source_tokens)
    return self.encoder(source_tokens, source_segment_ids, source_positions, deterministic)

  def decode(self, decoder_input_tokens: Array, memory: Array, source_segment_ids: Array,
             target_segment_ids: Array | None = None, target_positions: Array | None = None, *,
             deterministic: bool = True, use_cache: bool = False) -> Array:
    """Decoder stack and the pre-softmax projection tied to the embedding (§3.4).

    Args:
      decoder_input_tokens: int32 [batch, tgt_len]: BOS then the target shifted right; [batch, 1] per
        step when use_cache=True, where batch is sentences x beam_size of `init_cache`.
      memory: encoder output [batch, src_len, d_model]; with use_cache=True, one row per sentence.
      source_segment_ids: int32 [batch, src_len] (0 = padding).
      target_segment_ids, target_positions: int32 [batch, tgt_len] for packed rows, else None.
      deterministic: disables dropout.
      use_cache: incremental decoding through the 'cache' collection (mutable).

    Returns:
      logits: float32 [batch, tgt_len, vocab_size].
    """
    x = self.decoder(decoder_input_tokens, memory, source_segment_ids, target_segment_ids,
                     target_positions, deterministic, use_cache)
    return self.logits(x)

  def logits(self, features: Array) -> Array:
    """The pre-softmax projection tied to the embedding (§3.4): features [batch, length, d_model] (the
    decoder stack's output) -> float32 logits [batch, length, vocab_size]."""
    embedding = self.embedding.embedding.astype(features.dtype)  # [vocab, d_model]
    logits = numerics.einsum('blm,nm->bln', features, embedding, jnp.float32)
    return nn.with_logical_constraint(logits, (sharding.BATCH, sharding.LENGTH, sharding.VOCAB))

  def init_cache(self, memory: Array, source_segment_ids: Array, max_decode_length: int,
                 beam_size: int = 1) -> None:
    """Creates the decoding cache. Apply with mutable=['cache'].

    The self-attention K/V of each layer get max_decode_length empty positions for each of the
    batch * beam_size hypotheses (rows b*beam_size .. b*beam_size + beam_size - 1 belong to sentence b);
    the encoder-decoder attention K/V are projected from `memory` once per sentence and shared by its beams.
    Under jit the dummy decoder pass this takes is dead code and compiled away.

    Args:
      memory: encoder output [batch, src_len, d_model].
      source_segment_ids: int32 [batch, src_len] (0 = padding; unpacked).
      max_decode_length: positions of the self-attention cache.
      beam_size: hypotheses per sentence; decode then takes [batch * beam_size, 1] tokens per step.
    """
    rows = memory.shape[0] * beam_size
    self.decode(jnp.zeros((rows, max_decode_length), jnp.int32), memory, source_segment_ids, use_cache=True)

  def __call__(self, source_tokens: Array, decoder_input_tokens: Array,
               source_segment_ids: Array | None = None, target_segment_ids: Array | None = None,
               source_positions: Array | None = None, target_positions: Array | None = None, *,
               deterministic: bool = True) -> Array:
    """Teacher-forced forward pass: logits float32 [batch, tgt_len, vocab_size]. Args as in encode/decode."""
    return self.logits(self.features(source_tokens, decoder_input_tokens, source_segment_ids, target_segment_ids,
                                     source_positions, target_positions, deterministic=deterministic))

  def features(self, source_tokens: Array, decoder_input_tokens: Array,
               source_segment_ids: Array | None = None, target_segment_ids: Array | None = None,
               source_positions: Array | None = None, target_positions: Array | None = None, *,
               deterministic: bool = True) -> Array:
    """The teacher-forced decoder output before the logits, [batch, tgt_len, d_model] in the compute dtype.

    Training multiplies it with the embedding inside `losses.fused_smoothed_cross_entropy`, which never holds
    the [batch, tgt_len, vocab_size] logits at once. Args as in encode/decode.
    """
    if source_segment_ids is None:
      source_segment_ids = segment_ids_from_tokens(source_tokens)
    memory = self.encode(source_tokens, source_segment_ids, source_positions, deterministic=deterministic)
    return self.decoder(decoder_input_tokens, memory, source_segment_ids, target_segment_ids, target_positions,
                        deterministic, False)
