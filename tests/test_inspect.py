"""Tests for transformer_jax.tools.inspection and transformer_jax.tools.plots on tiny models and synthetic runs."""
import json
import os
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import tensorboardX

from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.model import transformer as model_lib
from transformer_jax.storage import checkpoints
from transformer_jax.storage import workdir as workdir_lib
from transformer_jax.tools import inspection
from transformer_jax.tools import plots
from transformer_jax.training.state import TrainState
import tiny_runs  # pylint: disable=g-bad-import-order

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = tiny_runs.tiny_model_fields()  # configs/smoke.py's model.
SOURCE = [5, 6, 7, 8, tokenizer_lib.EOS_ID, 0, 0]       # Two padding positions.
DECODER_INPUT = [tokenizer_lib.BOS_ID, 9, 10, 11, 0]    # One padding position.


def init_params(cfg, seed=0):
  tokens = jnp.ones((1, 4), jnp.int32)
  return nn.unbox(model_lib.Transformer(cfg).init(jax.random.key(seed), tokens, tokens)['params'])


@pytest.fixture(scope='module')
def tiny():
  """(ModelConfig, params, AttentionMaps of SOURCE and DECODER_INPUT)."""
  cfg = model_lib.ModelConfig(vocab_size=64, **TINY)
  params = init_params(cfg)
  return cfg, params, inspection.attention_maps(cfg, params, SOURCE, DECODER_INPUT)


def test_attention_shapes(tiny):
  _, _, maps = tiny
  assert maps.encoder_self.shape == (2, 4, 7, 7)
  assert maps.decoder_self.shape == (2, 4, 5, 5)
  assert maps.encoder_decoder.shape == (2, 4, 5, 7)  # [layers, heads, target, source].
  assert maps.encoder_self.dtype == np.float32
  assert maps.source_labels == ['5', '6', '7', '8', '2', '0', '0']
  assert maps.labels('encoder_decoder') == (maps.target_labels, maps.source_labels)
  assert maps.labels('decoder_self') == (maps.target_labels, maps.target_labels)


def test_attention_rows_sum_to_one_and_padding_gets_zero(tiny):
  _, _, maps = tiny
  source_real, target_real = 5, 4
  for weights, q_real, k_real in ((maps.encoder_self, source_real, source_real),
                                  (maps.decoder_self, target_real, target_real),
                                  (maps.encoder_decoder, target_real, source_real)):
    np.testing.assert_allclose(weights[:, :, :q_real].sum(-1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(weights[:, :, :, k_real:], 0.0)  # Padding keys.
    np.testing.assert_array_equal(weights[:, :, q_real:], 0.0)     # Padding queries attend to nothing.
  assert (maps.encoder_self[:, :, :5, :5] > 0).all() and (maps.encoder_decoder[:, :, :4, :5] > 0).all()


def test_decoder_self_attention_is_causal(tiny):
  _, _, maps = tiny
  upper = np.triu(np.ones((5, 5), bool), k=1)
  np.testing.assert_array_equal(maps.decoder_self[:, :, upper], 0.0)
  np.testing.assert_allclose(maps.decoder_self[:, :, 0, 0], 1.0, rtol=1e-6)  # BOS sees only itself.
  assert (maps.decoder_self[:, :, :4, :4][:, :, ~upper[:4, :4]] > 0).all()


def test_encoder_attention_matches_a_numpy_recomputation(tiny):
  """Layer 0 of the encoder: softmax(Q K^T / sqrt(d_k)) from the embedded source (§3.2.1, §3.4, §3.5)."""
  cfg, params, maps = tiny
  tokens = np.array(SOURCE)
  x = np.asarray(params['shared_embedding']['embedding'])[tokens] * np.sqrt(cfg.d_model)
  x = x + inspection.positional_encoding(len(tokens), cfg.d_model)
  attention = params['encoder']['layer_0']['self_attention']
  query = np.einsum('lm,mhd->hld', x, np.asarray(attention['query']))
  key = np.einsum('lm,mhd->hld', x, np.asarray(attention['key']))
  scores = np.einsum('hqd,hkd->hqk', query, key) / np.sqrt(cfg.d_k)
  scores[:, :, 5:] = -np.inf
  expected = np.exp(scores - scores.max(-1, keepdims=True))
  expected /= expected.sum(-1, keepdims=True)
  np.testing.assert_allclose(maps.encoder_self[0, :, :5], expected[:, :5], atol=1e-5)


def test_fused_config_gives_the_same_maps_and_training_path_sows_nothing(tiny):
  cfg, params, maps = tiny
  fused_cfg = model_lib.ModelConfig(**(TINY | dict(vocab_size=64, attention_impl='fused')))
  fused = inspection.attention_maps(fused_cfg, params, SOURCE, DECODER_INPUT)
  np.testing.assert_array_equal(fused.encoder_decoder, maps.encoder_decoder)
  # The maps (computed on the einsum path, since the fused kernel returns no weights) describe the fused model
  # only because it computes the same function of the same parameters: check that it does.
  source, target = jnp.array([SOURCE]), jnp.array([DECODER_INPUT])
  np.testing.assert_allclose(model_lib.Transformer(fused_cfg).apply({'params': params}, source, target),
                             model_lib.Transformer(cfg).apply({'params': params}, source, target), atol=2e-5)
  # Without mutable=['intermediates'] (the training and eval path) apply returns the logits alone.
  logits = model_lib.Transformer(cfg).apply({'params': params}, jnp.array([SOURCE]), jnp.array([DECODER_INPUT]))
  assert isinstance(logits, jax.Array) and logits.shape == (1, 5, 64)


def test_attention_maps_rejects_wrong_labels(tiny):
  cfg, params, _ = tiny
  with pytest.raises(ValueError, match='3 source and 5 target labels for 7 source'):
    inspection.attention_maps(cfg, params, SOURCE, DECODER_INPUT, ['a', 'b', 'c'], list('abcde'))
  with pytest.raises(ValueError, match="kind must be one of .* got 'cross'"):
    plots.attention_figure(tiny[2], 'cross')


def test_positional_encoding_follows_section_3_5():
  d_model = 16
  pe = inspection.positional_encoding(50, d_model)
  assert pe.shape == (50, d_model) and pe.dtype == np.float32
  np.testing.assert_allclose(pe[0], np.tile([0.0, 1.0], d_model // 2))
  for pos, i in ((1, 0), (3, 2), (49, 7)):
    angle = pos / 10000 ** (2 * i / d_model)
    np.testing.assert_allclose(pe[pos, [2 * i, 2 * i + 1]], [np.sin(angle), np.cos(angle)], rtol=1e-5,
                               atol=1e-6)


def test_learning_rates_follow_section_5_3():
  config = ml_collections.ConfigDict({'model': {'d_model': 512},
                                      'train': {'warmup_steps': 4000, 'learning_rate_scale': 1.0,
                                                'num_train_steps': 40_000}})
  steps, rates = inspection.learning_rates(config)
  assert steps[0] == 1 and steps[-1] == 40_000
  for step in (1, 4000, 40_000):
    expected = 512 ** -0.5 * min(step ** -0.5, step * 4000 ** -1.5)
    np.testing.assert_allclose(rates[step - 1], expected, rtol=1e-5)
  assert steps[np.argmax(rates)] == 4000


def save_run(workdir, cfg, params_by_step):
  """Saves TrainStates as train.py does (CheckpointManager, async); returns the manager's restore."""
  with checkpoints.CheckpointManager(workdir, max_to_keep=5) as manager:
    for step, params in params_by_step.items():
      state = TrainState(step=jnp.array(step, jnp.int32), params=params,
                         opt_state={'mu': jax.tree.map(jnp.zeros_like, params)},
                         rng=jnp.array([0, step], jnp.uint32))
      manager.save(step, state, {'epoch': 0, 'position': step}, force=True)
    manager.wait_until_finished()
    return {step: manager.restore_subtree(step, inspection.abstract_params(cfg)) for step in params_by_step}


def assert_trees_equal(actual, expected):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    assert a.dtype == e.dtype and a.shape == e.shape
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def test_restored_params_equal_the_saved_ones(tmp_path, monkeypatch):
  cfg = model_lib.ModelConfig(vocab_size=64, **TINY)
  saved = {2: init_params(cfg, seed=1), 4: init_params(cfg, seed=2)}
  by_manager = save_run(tmp_path / 'run', cfg, saved)
  monkeypatch.chdir(tmp_path)
  assert inspection.checkpoint_steps('run') == [2, 4]
  params, step = inspection.restore_params('run', cfg)  # A relative workdir.
  assert step == 4
  assert_trees_equal(params, saved[4])
  assert_trees_equal(params, by_manager[4])
  params, step = inspection.restore_params(tmp_path / 'run', cfg, step=2)
  assert step == 2
  assert_trees_equal(params, saved[2])
  assert not np.array_equal(params['shared_embedding']['embedding'], saved[4]['shared_embedding']['embedding'])


def test_restore_params_writes_nothing(tmp_path):
  """Opening an orbax CheckpointManager deletes temporary directories: a save in progress would be lost."""
  cfg = model_lib.ModelConfig(vocab_size=64, **TINY)
  save_run(tmp_path, cfg, {2: init_params(cfg)})
  in_progress = tmp_path / 'checkpoints' / '4.orbax-checkpoint-tmp'
  (in_progress / 'state').mkdir(parents=True)
  listing = lambda: sorted((str(p), p.stat().st_mtime_ns) for p in tmp_path.rglob('*'))
  before = listing()
  inspection.restore_params(tmp_path, cfg)
  assert inspection.checkpoint_steps(tmp_path) == [2]
  assert listing() == before


def test_restore_params_errors(tmp_path):
  cfg = model_lib.ModelConfig(vocab_size=64, **TINY)
  with pytest.raises(FileNotFoundError, match='no checkpoint in'):
    inspection.restore_params(tmp_path, cfg)
  save_run(tmp_path, cfg, {2: init_params(cfg)})
  with pytest.raises(ValueError, match=r'(?i)no checkpoint for step 3 .* steps: \[2\]'):
    inspection.restore_params(tmp_path, cfg, step=3)
  deeper = model_lib.ModelConfig(vocab_size=64, **(TINY | {'num_layers': 3}))
  with pytest.raises(ValueError, match="has no leaves .*layer_2"):
    inspection.restore_params(tmp_path, deeper)


def test_load_config_from_files_and_workdir(tmp_path):
  b1 = workdir_lib.load_config(f'{REPO_ROOT}/configs/table3.py:B1')
  assert (b1.model.d_k, b1.model.d_v) == (16, 64)
  tiny = workdir_lib.load_config(REPO_ROOT / 'configs' / 'smoke.py')
  assert workdir_lib.load_config(tiny) is tiny
  workdir_lib.save_config(tiny, tmp_path)
  for source in (tmp_path, tmp_path / 'config.json'):
    loaded = workdir_lib.load_config(source)
    assert loaded.model.to_dict() == tiny.model.to_dict()
    assert list(loaded.data.bucket_lengths) == list(tiny.data.bucket_lengths)
  with pytest.raises(FileNotFoundError, match='no config file'):
    workdir_lib.load_config(tmp_path / 'missing.py')


def test_load_run_and_sentence_attention(tmp_path):
  words = ['a', 'dog', 'runs', 'the', 'cat', 'sleeps', 'ein', 'hund', 'rennt', 'die', 'katze', 'schläft']
  sentences = [' '.join(words[(i + j) % len(words)] for j in range(4)) for i in range(200)]
  tokenizer = tokenizer_lib.train_or_load(tmp_path / 'spm_300.model', lambda: sentences, vocab_size=300,
                                          max_sentences=1000)
  config = workdir_lib.load_config(REPO_ROOT / 'configs' / 'smoke.py')
  config.data.vocab_size = 300
  workdir_lib.save_config(config, tmp_path)
  # As a run trained before decode.early_stopping and decode.tokens_per_batch existed stored it.
  stored = json.loads((tmp_path / 'config.json').read_text())
  del stored['decode']['early_stopping'], stored['decode']['tokens_per_batch']
  (tmp_path / 'config.json').write_text(json.dumps(stored))
  cfg = model_lib.ModelConfig(vocab_size=tokenizer.vocab_size, **config.model)
  params = init_params(cfg, seed=3)
  save_run(tmp_path, cfg, {4: params})

  run = inspection.load_run(tmp_path)  # Config from config.json, completed with today's defaults.
  assert run.config.decode.early_stopping == 'bound'
  assert (run.step, run.model_cfg, run.tokenizer.vocab_size) == (4, cfg, 300)
  assert_trees_equal(run.params, params)
  assert 'total_params:' in inspection.parameter_table(run.params)

  maps = inspection.sentence_attention(run, 'the dog runs', 'der hund rennt')
  source_ids = tokenizer.encode(['the dog runs'])[0]
  assert maps.source_labels[-1] == '</s>' and maps.target_labels[0] == '<s>'
  assert ''.join(maps.source_labels[:-1]).replace('\u2581', ' ').strip() == 'the dog runs'
  assert maps.encoder_self.shape == (2, 4, len(source_ids) + 1, len(source_ids) + 1)
  assert maps.encoder_decoder.shape[2:] == (len(maps.target_labels), len(maps.source_labels))

  # On its own translation: the maps' target rows are BOS and the pieces of what the model wrote.
  hypothesis, own = inspection.translation_attention(run, 'the dog runs', beam_size=2)
  assert hypothesis == inspection.translate_sentence(run, 'the dog runs', beam_size=2)
  forced = inspection.sentence_attention(run, 'the dog runs', hypothesis)
  assert own.target_labels == forced.target_labels and own.target_labels[0] == '<s>'
  np.testing.assert_array_equal(own.encoder_decoder, forced.encoder_decoder)
  assert own.encoder_decoder.shape[2:] == (len(own.target_labels), len(source_ids) + 1)

  config.data.vocab_size = 512
  with pytest.raises(FileNotFoundError, match='spm_512.model'):
    inspection.load_run(tmp_path, config)


def write_events(path, steps, offset=0.0):
  """Writes an event file as train.py does (tensorboardX), then names it `path`."""
  scratch = path.parent / f'scratch_{path.name}'
  writer = tensorboardX.SummaryWriter(os.fspath(scratch))
  for step in steps:
    writer.add_scalar('train/loss', 10.0 - step + offset, step)
    if step % 4 == 0:
      writer.add_scalar('eval/perplexity', 100.0 / step, step)
  writer.close()
  (written,) = scratch.iterdir()
  written.rename(path)
  scratch.rmdir()


def test_read_scalars_merges_resumed_runs_and_skips_a_partial_record(tmp_path):
  first = tmp_path / 'events.out.tfevents.900.host'
  second = tmp_path / 'events.out.tfevents.1000.host'  # Created later (the number sorts as an integer).
  write_events(first, range(1, 7))
  write_events(second, range(5, 9), offset=0.5)  # A resume from step 4 logs steps 5 and 6 again.
  with open(second, 'ab') as f:
    f.write(b'\x10\x00\x00')  # A record the writer has only begun.
  scalars = inspection.read_scalars(tmp_path)
  assert sorted(scalars) == ['eval/perplexity', 'train/loss']
  np.testing.assert_array_equal(scalars['train/loss'].steps, np.arange(1, 9))
  np.testing.assert_allclose(scalars['train/loss'].values, [9, 8, 7, 6, 5.5, 4.5, 3.5, 2.5])
  np.testing.assert_allclose(scalars['eval/perplexity'].values, [25.0, 12.5])

  data = bytearray(first.read_bytes())
  data[-6] ^= 0xFF  # Inside the last record's payload.
  first.write_bytes(bytes(data))
  with pytest.raises(ValueError, match='corrupt TensorBoard record at byte'):
    inspection.read_scalars(tmp_path)


def figure_titles(figure):
  return [t.get_text() for t in figure.texts] + [a.get_title() for a in figure.axes]


def test_plots_write_pngs(tiny, tmp_path):
  cfg, _, maps = tiny
  write_events(tmp_path / 'events.out.tfevents.1.host', range(1, 9))
  config = workdir_lib.load_config(REPO_ROOT / 'configs' / 'smoke.py')
  scalars = inspection.read_scalars(tmp_path)
  figures = {
      'positional_encoding': plots.positional_encoding_figure(60, cfg.d_model),
      'curves': plots.training_curves_figure(scalars),
      'learning_rate': plots.learning_rate_figure(config),
      **{kind: plots.attention_figure(maps, kind, title='tiny: ') for kind in inspection.KINDS},
      'decoder_layer_1': plots.attention_figure(maps, 'decoder_self', layers=[1]),
  }
  assert 'Sinusoidal positional encoding (§3.5), 60 positions x d_model=32' in figure_titles(
      figures['positional_encoding'])
  assert 'tiny: encoder-decoder attention: rows = target queries, columns = source keys' in figure_titles(
      figures['encoder_decoder'])
  assert len(figures['encoder_self'].axes) == 2 * 4 + 1  # Layers x heads, and the colour bar.
  assert len(figures['decoder_layer_1'].axes) == 4 + 1
  assert figures['learning_rate'].axes[0].get_title().endswith(f'peak {inspection.learning_rates(config)[1].max():.3g}')
  out = os.environ.get('INSPECT_TEST_PNG_DIR', tmp_path / 'png')
  for name, figure in figures.items():
    path = plots.save_figure(figure, os.path.join(out, f'{name}.png'))
    assert open(path, 'rb').read(8) == b'\x89PNG\r\n\x1a\n'
  with pytest.raises(ValueError, match='layers must be a non-empty list in \\[0, 2\\), got \\[2\\]'):
    plots.attention_figure(maps, 'encoder_self', layers=[2])
  with pytest.raises(ValueError, match='no training or validation curves'):
    plots.training_curves_figure({})
  # A run with a single logged point still shows it (a marker; a line of one point draws nothing).
  single = plots.training_curves_figure({'train/loss': inspection.Scalars([100], [5.0])})
  assert single.axes[0].lines[0].get_marker() == 'o'
