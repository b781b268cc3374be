"""--mode=export: a trained model as a CTranslate2 model directory, for serving (the C++ inference engine that
OpenNMT, fairseq, Marian and Hugging Face models are converted into).

  python -m transformer_jax.main --workdir=runs/multi30k --mode=export --output=runs/multi30k/ct2 \
      [--config.export.quantization=int8]

The parameters are the ones the final evaluation uses (`eval.checkpoint_selection`: by default the average of
the last `eval.average_last_n` checkpoints, §6.1). The directory holds CTranslate2's `model.bin`, `config.json`
and the shared vocabulary in our id order (`shared_vocabulary.json`), plus a copy of the SentencePiece model
(`sentencepiece.model`) to cut text into pieces; README "Serving a trained model" has the five lines that
translate with it.

What maps onto what (CTranslate2's `TransformerSpec`):
  - embeddings: the one shared table (§3.4) as the source and target embeddings and the output projection, scaled
    by sqrt(d_model) (`model.scale_embeddings`); the sinusoidal table (§3.5) is passed explicitly, 1,024
    positions in our sin/cos interleaving, or the learned table (Table 3 row E);
  - attention: W^Q, W^K, W^V [d_model, heads, d_k] as CTranslate2's [heads * d_k, d_model] kernels, fused Q|K|V
    in self-attention and K|V in encoder-decoder attention, W^O [heads, d_v, d_model] as [d_model, heads * d_v];
    no biases (the paper's projections have none);
  - feed-forward: W1, b1, W2, b2 transposed to [out, in];
  - norms: post-LN (the paper's) or pre-LN with the final norm, LayerNorm or RMSNorm, epsilon 1e-6;
  - sources get EOS appended by CTranslate2 (`add_source_eos`), as our input pipeline does; the target starts
    from `<s>` (BOS, id 1).
Fields CTranslate2's encoder-decoder cannot represent are refused before anything is written (`check_exportable`).
"""
import importlib.util
import json
import shutil
import tempfile

from absl import logging
from etils import epath
import jax
import numpy as np

from transformer_jax import errors
from transformer_jax.model import layers
from transformer_jax.model import transformer as model_lib
from transformer_jax.storage import workdir as workdir_lib

QUANTIZATIONS = ('int8', 'int8_float32', 'float32', 'bfloat16')
LAYER_NORM_EPSILON = 1e-6  # layers.make_norm's.
# Rows of the exported sinusoid table: CTranslate2 decodes no position beyond it (its default maximum output is
# 256 tokens; ours, the source length + decode.extra_length).
SINUSOID_POSITIONS = 1024


def check_exportable(cfg: model_lib.ModelConfig) -> None:
  """Raises errors.ConfigError naming the first `model.<field>` whose value CTranslate2's Transformer cannot
  represent."""
  refusals = [
      (cfg.position_embedding in ('rope', 'none'), 'model.position_embedding', cfg.position_embedding,
       "CTranslate2's encoder-decoder has no rotary positions; 'sinusoidal' and 'learned' export"),
      (cfg.feed_forward in layers.GATED_FEED_FORWARDS, 'model.feed_forward', cfg.feed_forward,
       'gated feed-forward layers are not exported yet; relu and gelu are'),
      (cfg.num_kv_heads not in (None, cfg.num_heads), 'model.num_kv_heads', cfg.num_kv_heads,
       "grouped- and multi-query attention are not exported yet (CTranslate2's encoder-decoder takes one query "
       'head count)'),
      (cfg.d_k != cfg.d_v or cfg.num_heads * cfg.d_k != cfg.d_model, 'model.d_k', cfg.d_k,
       f'CTranslate2 needs d_k = d_v = d_model / num_heads (here d_v={cfg.d_v}, d_model / num_heads='
       f'{cfg.d_model / cfg.num_heads:g})'),
  ]
  for refused, key, value, why in refusals:
    if refused:
      raise errors.ConfigError(f'{key}={value!r} cannot be exported to CTranslate2: {why}.')


def _kernel(w: np.ndarray) -> np.ndarray:
  """[in, ...out] (ours) -> [out, in] (CTranslate2's `LinearSpec.weight`), float32."""
  return np.array(np.asarray(w, np.float32).reshape(w.shape[0], -1).T, order='C')


def _out_kernel(w: np.ndarray) -> np.ndarray:
  """W^O [heads, d_v, d_model] -> [d_model, heads * d_v]."""
  return np.array(np.asarray(w, np.float32).reshape(-1, w.shape[-1]).T, order='C')


def _set_norm(spec, params: dict) -> None:
  spec.gamma = np.array(params['scale'], np.float32)
  if 'bias' in params:
    spec.beta = np.array(params['bias'], np.float32)


def _set_feed_forward(spec, residual: dict, feed_forward: dict) -> None:
  _set_norm(spec.layer_norm, residual['layer_norm'])
  spec.linear_0.weight, spec.linear_0.bias = _kernel(feed_forward['w1']), np.array(feed_forward['b1'], np.float32)
  spec.linear_1.weight, spec.linear_1.bias = _kernel(feed_forward['w2']), np.array(feed_forward['b2'], np.float32)


def _set_attention(spec, residual: dict, attention: dict, self_attention: bool) -> None:
  _set_norm(spec.layer_norm, residual['layer_norm'])
  query, key, value = (_kernel(attention[name]) for name in ('query', 'key', 'value'))
  if self_attention:
    spec.linear[0].weight = np.concatenate([query, key, value])
  else:
    spec.linear[0].weight, spec.linear[1].weight = query, np.concatenate([key, value])
  spec.linear[-1].weight = _out_kernel(attention['output'])


def _position_table(cfg: model_lib.ModelConfig, params: dict) -> np.ndarray:
  """[positions, d_model] float32: our sinusoids (§3.5) for SINUSOID_POSITIONS positions, or the learned table
  (model.max_length rows: CTranslate2 then refuses to decode further, as our decoding does)."""
  if cfg.position_embedding == 'learned':
    return np.array(params['encoder']['embedder']['position']['position_embedding'], np.float32)
  positions = max(cfg.max_length, SINUSOID_POSITIONS)
  return np.array(layers.sinusoidal_position_encoding(jax.numpy.arange(positions), cfg.d_model), np.float32)


def build_spec(params: dict, cfg: model_lib.ModelConfig, pieces: list[str]):
  """The `ctranslate2.specs.TransformerSpec` of our parameters (see the module docstring for the mapping).

  Args:
    params: the model's parameters (numpy or jax arrays, float32).
    cfg: its ModelConfig.
    pieces: the vocabulary's pieces in id order (source and target share it).

  Raises:
    ValueError: from `check_exportable`.
  """
  import ctranslate2  # pylint: disable=g-import-not-at-top  (the `ctranslate2` extra)
  check_exportable(cfg)
  activation = {'relu': ctranslate2.specs.Activation.RELU, 'gelu': ctranslate2.specs.Activation.GELUTanh}
  spec = ctranslate2.specs.TransformerSpec.from_config(
      cfg.num_layers, cfg.num_heads, pre_norm=cfg.layer_norm_position == 'pre', activation=activation[cfg.feed_forward],
      rms_norm=cfg.norm == 'rms_norm')
  embedding = np.array(params['shared_embedding']['embedding'], np.float32)  # [vocab, d_model]; a copy CT2 may quantise.
  positions = _position_table(cfg, params)
  for stack, side in ((spec.encoder, 'encoder'), (spec.decoder, 'decoder')):
    stack.scale_embeddings = cfg.scale_embeddings
    stack.position_encodings.encodings = positions
    if cfg.layer_norm_position == 'pre':
      _set_norm(stack.layer_norm, params[side]['final_layer_norm'])
    for i, layer_spec in enumerate(stack.layer):
      layer = params[side][f'layer_{i}']
      _set_attention(layer_spec.self_attention, layer['self_attention_residual'], layer['self_attention'], True)
      if side == 'decoder':
        _set_attention(layer_spec.attention, layer['encoder_decoder_attention_residual'],
                       layer['encoder_decoder_attention'], False)
      _set_feed_forward(layer_spec.ffn, layer['feed_forward_residual'], layer['feed_forward'])
  spec.encoder.embeddings[0].weight = embedding
  spec.decoder.embeddings.weight = embedding
  spec.decoder.projection.weight = embedding
  spec.config.layer_norm_epsilon = LAYER_NORM_EPSILON
  spec.config.add_source_eos = True
  spec.register_source_vocabulary(pieces)
  spec.register_target_vocabulary(pieces)
  return spec


def export_ctranslate2(params: dict, cfg: model_lib.ModelConfig, vocabulary_file: str, output_dir: str,
                       quantization: str = 'int8', record: dict | None = None) -> str:
  """Writes a CTranslate2 model directory and a copy of the SentencePiece model; returns output_dir.

  Everything is checked (the fields, the quantisation, that output_dir is new or empty) before anything is
  written; the directory is written to a new folder beside it (`.<name>.export-<random>`, removed if the export
  fails) and renamed when complete. Nothing that existed before is deleted or overwritten.

  Args:
    params: the parameters (float32).
    cfg: their ModelConfig.
    vocabulary_file: the run's `spm_<vocab_size>.model`.
    output_dir: a folder that does not exist or is empty.
    quantization: CTranslate2's weight type: int8, int8_float32, float32 or bfloat16.
    record: what to note in `<output_dir>/transformer_jax.json` beside the quantisation (e.g. the checkpoints).

  Raises:
    errors.ConfigError: for a field CTranslate2 cannot represent, an unknown quantisation, or a non-empty
      output_dir.
    errors.MissingPackageError: without the `ctranslate2` extra (`pip install -e '.[ctranslate2]'`).
  """
  from transformer_jax.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  if quantization not in QUANTIZATIONS:
    raise errors.ConfigError(f'export.quantization must be one of {QUANTIZATIONS}, got {quantization!r}')
  check_exportable(cfg)
  output = epath.Path(output_dir)
  if output.exists() and (not output.is_dir() or any(output.iterdir())):
    raise errors.ConfigError(f'--output={output_dir} exists and is not an empty folder: choose a new one.')
  if importlib.util.find_spec('ctranslate2') is None:
    raise errors.MissingPackageError("--mode=export needs CTranslate2: pip install -e '.[ctranslate2]'")
  spec = build_spec(jax.device_get(params), cfg, tokenizer_lib.Tokenizer.load(vocabulary_file).pieces())
  spec.validate()
  spec.optimize(quantization=quantization)
  output.parent.mkdir(parents=True, exist_ok=True)
  # A folder of a new name beside output (never one that exists: a user's `<output>.tmp` is left alone), removed
  # again if the export fails.
  tmp = epath.Path(tempfile.mkdtemp(prefix=f'.{output.name}.export-', dir=output.parent))
  try:
    spec.save(str(tmp))
    shutil.copyfile(vocabulary_file, tmp / 'sentencepiece.model')
    (tmp / 'transformer_jax.json').write_text(json.dumps({'quantization': quantization} | (record or {}), indent=2))
    if output.exists():
      output.rmdir()  # Empty (checked above); rmdir fails rather than delete anything put there since.
    tmp.rename(output)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  logging.info('Exported to %s (CTranslate2, %s).', output, quantization)
  return str(output)


def export_run(config, workdir: str, output_dir: str | None) -> str:
  """--mode=export: the parameters `eval.checkpoint_selection` chooses, exported with `export.quantization`.

  Raises:
    errors.ConfigError: without --output, for an export.format other than 'ctranslate2', or from
      `export_ctranslate2`.
    errors.MissingFileError: if the workdir holds no checkpoint.
  """
  from transformer_jax.run import config_checks  # pylint: disable=g-import-not-at-top
  from transformer_jax.evaluation import evaluate  # pylint: disable=g-import-not-at-top
  from transformer_jax.run import experiment  # pylint: disable=g-import-not-at-top
  if not output_dir:
    raise errors.ConfigError('--mode=export needs --output=DIR (a new folder for the CTranslate2 model)')
  if config.export.format != 'ctranslate2':
    raise errors.ConfigError(f"export.format must be 'ctranslate2' (the only format), got {config.export.format!r}")
  cfg = config_checks.model_config(config)
  check_exportable(cfg)  # Before anything is read.
  setup = experiment.setup(config, workdir)
  try:
    params, steps = evaluate.load_params(config.eval, setup)
  finally:
    setup.close()
  vocabulary = workdir_lib.path(workdir, workdir_lib.vocabulary_file(config.data.vocab_size))
  path = export_ctranslate2(params, cfg, vocabulary, output_dir, config.export.quantization,
                            record={'workdir': workdir, 'checkpoint_steps': steps,
                                    'checkpoint_selection': config.eval.checkpoint_selection})
  print(f'exported: {path} (CTranslate2, {config.export.quantization}; checkpoint steps {steps})')
  return path
