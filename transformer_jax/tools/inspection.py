"""Inspecting a trained run: its parameters, attention weights (§3.2), positional encodings (§3.5), schedule
(§5.3) and the curves it logged.

Everything here reads a workdir without writing to it, so it is safe on a run that is still training:
checkpoints are found and read with orbax's read-only calls (`restore_params`), TensorBoard event files are
parsed as they grow (`read_scalars`). The module is named `inspection`, not `inspect`, so that running a file
of this package as a script cannot shadow the standard library's `inspect`.

  run = inspection.load_run('runs/multi30k')  # Latest checkpoint, with the run's own config.json.
  print(inspection.parameter_table(run.params))
  maps = inspection.sentence_attention(run, 'A dog runs.', 'Ein Hund rennt.')
  maps.encoder_decoder  # float32 [num_layers, num_heads, tgt_len, src_len]
  hypothesis, maps = inspection.translation_attention(run, 'A dog runs.')  # On its own translation.
"""
import dataclasses
import functools
import os
import re
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import flax.linen as nn
from flax import traverse_util
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import sentencepiece as spm
from tensorboardX import record_writer
from tensorboardX.proto import event_pb2

from transformer_jax import errors
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.decoding import translate
from transformer_jax.model import layers
from transformer_jax.model import transformer as model_lib
from transformer_jax.storage import checkpoint_checks
from transformer_jax.storage import checkpoints
from transformer_jax.storage import workdir as workdir_lib
from transformer_jax.tools import summary
from transformer_jax.training import optim

PyTree = Any
KINDS = ('encoder_self', 'decoder_self', 'encoder_decoder')
_SOWN = {'encoder_self': ('encoder', 'self_attention'), 'decoder_self': ('decoder', 'self_attention'),
         'encoder_decoder': ('decoder', 'encoder_decoder_attention')}


def checkpoint_steps(workdir: str | os.PathLike[str]) -> list[int]:
  """The committed checkpoint steps of a run, ascending ([] if none); reads only."""
  return checkpoint_checks.committed_steps(workdir_lib.path(workdir, workdir_lib.CHECKPOINTS))


def abstract_params(model_cfg: model_lib.ModelConfig) -> PyTree:
  """The unboxed parameter tree as jax.ShapeDtypeStructs placed on one device (for restoring)."""
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                      nn.unbox(summary.abstract_params(model_cfg)))


def restore_params(workdir: str | os.PathLike[str], model_cfg: model_lib.ModelConfig,
                   step: int | None = None) -> tuple[PyTree, int]:
  """Reads `state['params']` of one checkpoint (the Adam moments stay on disk) onto one device.

  Opens the checkpoints read-only, so a save still in progress in a run that is training is left alone.

  Args:
    workdir: the run's directory (checkpoints in `<workdir>/checkpoints/<step>/state`).
    model_cfg: the run's architecture; the shapes must match the checkpoint's.
    step: a committed step; None means the latest.

  Returns:
    (params: nested dict of float32 jax arrays, the step read).

  Raises:
    errors.MissingFileError: if the workdir holds no checkpoint.
    ValueError: if `step` is not committed or the checkpoint lacks a parameter of `model_cfg`.
  """
  manager = checkpoints.CheckpointManager(workdir, read_only=True)
  steps = manager.all_steps()
  if not steps:
    raise errors.MissingFileError(f'no checkpoint in {manager.directory}')
  step = steps[-1] if step is None else step
  return manager.restore_subtree(step, abstract_params(model_cfg), 'params'), step


@dataclasses.dataclass(frozen=True)
class Run:
  """A trained run, loaded for inspection.

  Attributes:
    workdir: the run's directory.
    step: the checkpoint step the parameters come from.
    config: the run's ConfigDict.
    model_cfg: ModelConfig(vocab_size=<the tokenizer's size>, **config.model), as in training.
    params: nested dict of float32 jax arrays, as `Transformer.init` makes them.
    tokenizer: the run's shared vocabulary.
    tokenizer_path: `<workdir>/spm_<data.vocab_size>.model`.
  """
  workdir: str
  step: int
  config: ml_collections.ConfigDict
  model_cfg: model_lib.ModelConfig
  params: PyTree
  tokenizer: tokenizer_lib.Tokenizer
  tokenizer_path: str


def load_run(workdir: str | os.PathLike[str], config=None, step: int | None = None) -> Run:
  """Loads a run's config, vocabulary and the parameters of one checkpoint, writing nothing.

  Args:
    workdir: the run's directory.
    config: a ConfigDict (used as is), or anything else `workdir.load_config` takes; None reads the run's
      config (`workdir.load_run_config`: `<workdir>/config.json` with the changes recorded since). Read
      from a file, fields added to the code after the run was trained take their defaults (the behaviour
      the run had).
    step: a checkpoint step; None means the latest.

  Raises:
    errors.MissingFileError: for a missing config, vocabulary or checkpoint.
  """
  workdir = os.fspath(workdir)
  if config is None:
    config = workdir_lib.load_run_config(workdir)
  elif not isinstance(config, ml_collections.ConfigDict):  # A file: completed as the run's own would be.
    config = workdir_lib.with_defaults(workdir_lib.load_config(config))
  tokenizer_path = workdir_lib.path(workdir, workdir_lib.vocabulary_file(config.data.vocab_size))
  if not os.path.isfile(tokenizer_path):
    raise errors.MissingFileError(f'no vocabulary {tokenizer_path}: is data.vocab_size={config.data.vocab_size} '
                                  'the one the run was trained with?')
  tokenizer = tokenizer_lib.Tokenizer.load(tokenizer_path)
  model_cfg = model_lib.ModelConfig(vocab_size=tokenizer.vocab_size, **config.model)
  params, step = restore_params(workdir, model_cfg, step)
  return Run(workdir, step, config, model_cfg, params, tokenizer, tokenizer_path)


def parameter_table(params: PyTree) -> str:
  """The per-module parameter counts that `--mode=summary` prints (summary.parameter_table)."""
  return summary.parameter_table(params)[0]


@dataclasses.dataclass(frozen=True)
class AttentionMaps:
  """The attention weights of every layer and head for one sentence pair (§3.2.3).

  Rows are queries and columns keys; each row sums to 1 over the keys it may attend to, and is all 0 for a
  padding query. Decoder positions are those of the decoder input (BOS, then the target shifted right):
  query t predicts target token t.

  Attributes:
    encoder_self: float32 [num_layers, num_heads, src_len, src_len].
    decoder_self: float32 [num_layers, num_heads, tgt_len, tgt_len]; 0 above the diagonal (§3.2.3).
    encoder_decoder: float32 [num_layers, num_heads, tgt_len, src_len].
    source_labels: src_len strings, the source pieces (EOS included).
    target_labels: tgt_len strings, the decoder input pieces (BOS first).
  """
  encoder_self: np.ndarray
  decoder_self: np.ndarray
  encoder_decoder: np.ndarray
  source_labels: list[str]
  target_labels: list[str]

  def labels(self, kind: str) -> tuple[list[str], list[str]]:
    """(query labels, key labels) of 'encoder_self', 'decoder_self' or 'encoder_decoder'."""
    _check_kind(kind)
    query = self.source_labels if kind == 'encoder_self' else self.target_labels
    return query, self.target_labels if kind == 'decoder_self' else self.source_labels


def _check_kind(kind: str) -> None:
  if kind not in KINDS:
    raise ValueError(f'attention kind must be one of {KINDS}, got {kind!r}')


def attention_maps(model_cfg: model_lib.ModelConfig, params: PyTree, source_tokens: Sequence[int],
                   decoder_input_tokens: Sequence[int], source_labels: Sequence[str] | None = None,
                   target_labels: Sequence[str] | None = None) -> AttentionMaps:
  """Applies the model once, teacher-forced and without dropout, and collects its attention weights.

  The weights are the ones `MultiHeadAttention` sows into the 'intermediates' collection, which is only
  written when the apply makes it mutable, so training never pays for it. `attention_impl` is set to 'xla'
  (the fused kernel returns no weights; the parameters are the same) and `remat` off.

  Args:
    model_cfg: the run's architecture.
    params: its parameters.
    source_tokens: src_len int ids (EOS last; trailing PAD_ID 0 pads, as in a batch row).
    decoder_input_tokens: tgt_len int ids (BOS first; trailing 0 pads).
    source_labels, target_labels: one string per position; None labels each position with its id.

  Returns:
    AttentionMaps with numpy arrays.

  Raises:
    ValueError: if a label list does not match its sequence's length.
  """
  source = np.asarray(source_tokens, np.int32)[None, :]  # [1, src_len]
  target = np.asarray(decoder_input_tokens, np.int32)[None, :]  # [1, tgt_len]
  source_labels = [str(i) for i in source[0]] if source_labels is None else list(source_labels)
  target_labels = [str(i) for i in target[0]] if target_labels is None else list(target_labels)
  if len(source_labels) != source.shape[1] or len(target_labels) != target.shape[1]:
    raise ValueError(f'{len(source_labels)} source and {len(target_labels)} target labels for '
                     f'{source.shape[1]} source and {target.shape[1]} decoder input tokens')
  sown = _sown_weights(dataclasses.replace(model_cfg, attention_impl='xla', remat=False), params,
                       source, target)
  weights = {kind: np.stack([np.asarray(sown[(stack, f'layer_{i}', module, 'attention_weights')][0][0])
                             for i in range(model_cfg.num_layers)])
             for kind, (stack, module) in _SOWN.items()}
  return AttentionMaps(**weights, source_labels=source_labels, target_labels=target_labels)


@functools.partial(jax.jit, static_argnums=0)
def _sown_weights(model_cfg, params, source, target):
  """{(stack, layer, module, 'attention_weights'): ([batch, num_heads, q_len, kv_len],)}."""
  _, state = model_lib.Transformer(model_cfg).apply(
      {'params': params}, source, target, deterministic=True, mutable=['intermediates'])
  return traverse_util.flatten_dict(state['intermediates'])


def sentence_attention(run: Run, source: str, target: str) -> AttentionMaps:
  """Attention weights of `run` reading `source` and teacher-forced on `target` (raw text).

  Both are encoded as in training: pieces then EOS; the decoder input is BOS then the target pieces.
  """
  source_ids = run.tokenizer.encode([source])[0] + [tokenizer_lib.EOS_ID]
  target_ids = [tokenizer_lib.BOS_ID] + run.tokenizer.encode([target])[0]
  pieces = _pieces(run.tokenizer_path)
  return attention_maps(run.model_cfg, run.params, source_ids, target_ids,
                        pieces.id_to_piece(source_ids), pieces.id_to_piece(target_ids))


def translate_sentence(run: Run, source: str, beam_size: int | None = None) -> str:
  """The run's own translation of `source` (raw text), decoded as evaluation does: beam search with the run's
  decode.beam_size (or `beam_size`; 1 is greedy), decode.alpha, decode.extra_length (§6.1) and
  decode.early_stopping."""
  source_ids = run.tokenizer.encode([source])[0] + [tokenizer_lib.EOS_ID]
  decode = run.config.decode
  tokens = translate.decode_batch(run.params, jnp.asarray([source_ids], jnp.int32),
                                  model=model_lib.Transformer(run.model_cfg),
                                  beam_size=beam_size or decode.beam_size, alpha=decode.alpha,
                                  extra_length=decode.extra_length, early_stopping=decode.early_stopping)
  return run.tokenizer.decode(np.asarray(tokens))[0]


def translation_attention(run: Run, source: str, beam_size: int | None = None) -> tuple[str, AttentionMaps]:
  """(the run's translation of `source`, the attention weights while it produced it): `sentence_attention` on
  its own output (`translate_sentence`) instead of a reference, so the maps show what the model attended to
  when it chose each word."""
  hypothesis = translate_sentence(run, source, beam_size)
  return hypothesis, sentence_attention(run, source, hypothesis)


@functools.lru_cache(maxsize=8)
def _pieces(tokenizer_path: str) -> spm.SentencePieceProcessor:
  # TODO: Tokenizer.id_to_piece, so that labels need no second copy of the model.
  return spm.SentencePieceProcessor(model_file=tokenizer_path)


def positional_encoding(length: int, d_model: int) -> np.ndarray:
  """float32 [length, d_model]: PE of positions 0..length-1 (§3.5, layers.sinusoidal_position_encoding)."""
  return np.asarray(layers.sinusoidal_position_encoding(jnp.arange(length), d_model))


def learning_rates(config: ml_collections.ConfigDict, num_steps: int | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
  """The §5.3 schedule of a config, as training applies it.

  Returns:
    (steps int [num_steps]: 1..num_steps, default train.num_train_steps; learning rates float32
    [num_steps]: the rate of the update that produced step s, which train.py logs at step s as
    'train/learning_rate').
  """
  schedule = optim.rsqrt_schedule(config.model.d_model, config.train.warmup_steps,
                                  config.train.learning_rate_scale)
  steps = np.arange(1, (num_steps or config.train.num_train_steps) + 1)
  return steps, np.asarray(jax.jit(schedule)(steps - 1))


class Scalars(NamedTuple):
  """One TensorBoard tag's values, ascending by step; a step logged twice keeps the newest value."""
  steps: np.ndarray   # int64 [n].
  values: np.ndarray  # float64 [n].


def read_scalars(workdir: str | os.PathLike[str]) -> dict[str, Scalars]:
  """Every scalar of the run's TensorBoard event files ('train/loss', 'eval/perplexity', ...).

  Files are read in the order they were created (a resumed run starts a new one), so a step logged again
  after a resume keeps its newest value. A record still being written at the end of a file is skipped.

  Raises:
    ValueError: naming the file and offset of a record whose checksum is wrong.
  """
  pattern = re.compile(r'events\.out\.tfevents\.(\d+)')
  names = [n for n in os.listdir(workdir) if pattern.match(n)]
  values: dict[str, dict[int, float]] = {}
  for name in sorted(names, key=lambda n: (int(pattern.match(n)[1]), n)):
    for record in _records(os.path.join(workdir, name)):
      event = event_pb2.Event.FromString(record)
      for value in event.summary.value:
        if value.HasField('simple_value'):
          values.setdefault(value.tag, {})[event.step] = value.simple_value
  return {tag: Scalars(np.array(sorted(by_step), np.int64), np.array([by_step[s] for s in sorted(by_step)]))
          for tag, by_step in sorted(values.items())}


def _records(path: str):
  """Yields the payloads of a TFRecord file: [uint64 length, uint32 crc, data, uint32 crc] each."""
  with open(path, 'rb') as f:
    data = f.read()
  offset = 0
  while offset + 12 <= len(data):
    header = data[offset:offset + 8]
    (length,), (header_crc,) = struct.unpack('<Q', header), struct.unpack_from('<I', data, offset + 8)
    end = offset + 12 + length + 4
    if header_crc == record_writer.masked_crc32c(header) and end > len(data):
      return  # The writer has not finished this record.
    payload = data[offset + 12:end - 4]
    if (header_crc != record_writer.masked_crc32c(header)
        or struct.unpack_from('<I', data, end - 4)[0] != record_writer.masked_crc32c(payload)):
      raise ValueError(f'{path}: corrupt TensorBoard record at byte {offset}')
    yield payload
    offset = end
