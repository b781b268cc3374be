"""Tests for transformer_jax.training.step and transformer_jax.run.train: the steps learn and are deterministic,
main runs end to end, resuming is exact.

End-to-end runs use configs/smoke.py on a synthetic word-for-word "translation" corpus written to a temporary
folder (dataset='text'), so they need neither the network nor the real corpus; one test trains on the real
Multi30k corpus through TFDS. They share a persistent XLA compilation cache: the first run compiles the steps,
the others load them from disk. The corpus, runs and fixtures are shared with test_reliability.py
(tiny_runs.py, conftest.py).
"""
import functools
import json
import logging
import re
import subprocess

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.evaluation import evaluate
from transformer_jax.model import sharding
from transformer_jax.model import transformer as model_lib
from transformer_jax.run import config_checks
from transformer_jax.run import experiment
from transformer_jax.training import build
from transformer_jax.training import goodput
from transformer_jax.training import optim
from transformer_jax.training import state as state_lib
from transformer_jax.run import train
from transformer_jax.training import step as step_lib

from tiny_runs import assert_same_batches  # pylint: disable=g-bad-import-order
from tiny_runs import checkpoint_steps
from tiny_runs import compared
from tiny_runs import config_flags
from tiny_runs import main_command
from tiny_runs import read_events
from tiny_runs import record_batches
from tiny_runs import REPO_ROOT
from tiny_runs import smoke
from tiny_runs import SPLITS
from tiny_runs import subprocess_env
from tiny_runs import text_config
from tiny_runs import VOCAB_SIZE

pytestmark = pytest.mark.usefixtures('persistent_compilation_cache')


def tiny_model_config(**overrides) -> model_lib.ModelConfig:
  fields = dict(vocab_size=32, num_layers=2, d_model=32, d_ff=64, num_heads=4, d_k=8, d_v=8, max_length=16)
  return model_lib.ModelConfig(**(fields | overrides))


def copy_task_batch(rng, batch_size, length, vocab_size) -> dict[str, np.ndarray]:
  """Random sources of different lengths, each target the reversed source; EOS and padding as the pipeline."""
  source = np.zeros((batch_size, length), np.int32)
  target = np.zeros((batch_size, length), np.int32)
  for row, size in enumerate(np.linspace(length - 1, 2, batch_size).astype(int)):
    ids = rng.integers(tokenizer_lib.UNK_ID + 1, vocab_size, size=size)
    source[row, :size + 1] = [*ids, tokenizer_lib.EOS_ID]
    target[row, :size + 1] = [*ids[::-1], tokenizer_lib.EOS_ID]
  decoder_input = np.where(target != 0, np.roll(target, 1, axis=1), 0)
  decoder_input[:, 0] = tokenizer_lib.BOS_ID
  return {'source_tokens': source, 'target_tokens': target, 'decoder_input_tokens': decoder_input}


@pytest.mark.integration
def test_tiny_model_overfits_one_batch():
  model = model_lib.Transformer(tiny_model_config(dropout_rate=0.0))
  batch = jax.tree.map(jnp.asarray, copy_task_batch(np.random.default_rng(0), 4, 10, 32))
  tx = optim.make_optimizer(optim.rsqrt_schedule(32, 20, learning_rate_scale=0.3))
  state = jax.jit(lambda rng: nn.unbox(state_lib.create_train_state(rng, model, tx, batch)))(jax.random.key(0))
  step_fn = jax.jit(functools.partial(step_lib.train_step, model=model, tx=tx, label_smoothing=0.0))
  eval_fn = jax.jit(functools.partial(step_lib.eval_step, model=model, label_smoothing=0.0))
  first = eval_fn(state.params, batch)
  for _ in range(60):
    state, metrics = step_fn(state, batch)
  last = eval_fn(state.params, batch)
  tokens = float(first['token_count'])
  assert tokens == 25.0  # Rows of 9, 6, 4 and 2 ids, each with EOS.
  assert float(first['nll_sum']) / tokens > 2.5  # Untrained: about ln(32) = 3.5.
  assert float(last['nll_sum']) / tokens < 0.05
  assert float(last['correct_sum']) == tokens
  assert int(state.step) == 60 and float(metrics['nonfinite']) == 0.0


@pytest.mark.integration
def test_r_drop_step_without_dropout_is_the_plain_step_and_with_dropout_measures_disagreement():
  """R-Drop (train.rdrop_alpha > 0) without dropout runs two identical passes: the divergence is 0 and the update
  is the plain step's (under SGD, whose update is the gradient itself, so the objective's division by twice the
  tokens shows). With dropout the two passes draw different masks, so they disagree (kl_sum > 0), and the step's
  FLOPs are counted twice."""
  batch = jax.tree.map(jnp.asarray, copy_task_batch(np.random.default_rng(0), 4, 10, 32))
  tx = optax.sgd(1.0)
  model = model_lib.Transformer(tiny_model_config(dropout_rate=0.0))
  state = jax.jit(lambda rng: nn.unbox(state_lib.create_train_state(rng, model, tx, batch)))(jax.random.key(0))
  step = functools.partial(step_lib.train_step, model=model, tx=tx, label_smoothing=0.1)
  plain, plain_metrics = jax.jit(step)(state, batch)
  r_drop, r_drop_metrics = jax.jit(functools.partial(step, rdrop_alpha=5.0))(state, batch)
  assert float(r_drop_metrics['kl_sum']) == pytest.approx(0.0, abs=1e-5)
  assert float(r_drop_metrics['token_count']) == 2 * float(plain_metrics['token_count']) == 50.0
  assert float(r_drop_metrics['loss_sum']) == pytest.approx(2 * float(plain_metrics['loss_sum']), rel=1e-5)
  for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(r_drop.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
  dropout_model = model_lib.Transformer(tiny_model_config(dropout_rate=0.3))
  _, metrics = jax.jit(functools.partial(step, model=dropout_model, rdrop_alpha=5.0))(state, batch)
  assert float(metrics['kl_sum']) > 0.1 and float(metrics['nonfinite']) == 0.0
  assert step_lib.passes_per_step(smoke.get_config().train.rdrop_alpha) == 1
  assert step_lib.passes_per_step(5.0) == 2


@pytest.mark.integration
def test_train_step_is_deterministic_and_compiles_once_per_batch_shape(monkeypatch):
  traces = []
  original = step_lib.train_step

  @functools.wraps(original)  # The same name, hence the same compiled program (and cache entry), as training's.
  def counting_train_step(state, batch, **kwargs):
    traces.append(batch['source_tokens'].shape)  # Runs only while jax traces the function.
    return original(state, batch, **kwargs)

  monkeypatch.setattr(step_lib, 'train_step', counting_train_step)
  config = smoke.get_config()
  config.data.vocab_size = VOCAB_SIZE
  model_cfg = config_checks.validate_config(config)
  mesh, rules = sharding.make_mesh(config.mesh), sharding.logical_axis_rules(config.mesh)
  schedule = optim.rsqrt_schedule(model_cfg.d_model, config.train.warmup_steps)
  tx = optim.make_optimizer(schedule)
  s = build.Build(mesh, rules, model_lib.Transformer(model_cfg), tx, schedule, config.train.grad_accum_steps)
  rng = np.random.default_rng(0)
  batch_a, batch_b = (copy_task_batch(rng, 8, 32, VOCAB_SIZE) for _ in range(2))
  batch_c, batch_d = (copy_task_batch(rng, 16, 16, VOCAB_SIZE) for _ in range(2))
  state, state_sharding = state_lib.sharded_train_state(jax.random.key(0), s.model, tx, s.device_batch(batch_a),
                                                        mesh, rules)
  train_fn = step_lib.jit_train_step(s, state_sharding, config.train.label_smoothing)
  copy = lambda tree: jax.tree.map(jnp.copy, tree)  # train_fn donates the state it is given.
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    state_1, metrics_1 = train_fn(copy(state), s.device_batch(batch_a))
    state_2, metrics_2 = train_fn(copy(state), s.device_batch(batch_a))
    assert traces == [(8, 32)]
    for a, b in zip(jax.tree.leaves((state_1, metrics_1)), jax.tree.leaves((state_2, metrics_2))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # Dropout included (rate 0.1).
    assert float(metrics_1['token_count']) > 0 and float(metrics_1['nonfinite']) == 0.0
    state_3, metrics_3 = train_fn(state_1, s.device_batch(batch_b))
    assert traces == [(8, 32)]  # New values, same shape: no new trace.
    assert float(metrics_3['loss_sum']) != float(metrics_1['loss_sum'])
    state_4, _ = train_fn(state_3, s.device_batch(batch_c))
    train_fn(state_4, s.device_batch(batch_d))
  assert traces == [(8, 32), (16, 16)]  # One trace (and compilation) per batch shape.


def run_main(workdir, flags, cache_dir, stdin=None) -> subprocess.CompletedProcess:
  process = subprocess.run(main_command(workdir, flags), cwd=REPO_ROOT, env=subprocess_env(cache_dir),
                           capture_output=True, text=True, timeout=900, check=False, input=stdin)
  assert process.returncode == 0, process.stderr[-5000:]
  return process


def test_main_end_to_end_on_text_files(tmp_path, corpus, compilation_cache_dir):
  workdir = tmp_path / 'run'
  flags = config_flags(corpus, num_train_steps=4, translate_at_end=True)
  process = run_main(workdir, flags, compilation_cache_dir)
  assert re.search(r'^bleu: \d+\.\d\d  \(nrefs:1\|case:mixed\|.*averaged steps \[2, 4\]\)$', process.stdout,
                   re.MULTILINE), process.stdout
  assert re.search(r'^tokenized_bleu: \d+\.\d\d ', process.stdout, re.MULTILINE), process.stdout
  assert checkpoint_steps(workdir) == [2, 4]
  assert (workdir / f'spm_{VOCAB_SIZE}.model').stat().st_size > 0
  hypotheses = (workdir / 'test.hyp.de').read_text(encoding='utf-8')
  assert hypotheses.count('\n') == SPLITS['test']
  events = read_events(workdir)
  assert sorted(events['train/loss']) == [1, 2, 3, 4]
  assert sorted(events['eval/loss']) == [2, 4]
  assert list(events['test/bleu']) == [4] and list(events['eval_averaged/loss']) == [4]
  assert 'Resumed' not in process.stderr
  # MFU in every progress line and TensorBoard, and with the goodput in final_metrics.json and the last line.
  assert sorted(events['train/mfu']) == [1, 2, 3, 4] and all(0 < v < 1 for v in events['train/mfu'].values())
  assert re.search(r'\| MFU \d+\.\d% \|', process.stderr)
  record = json.loads((workdir / 'final_metrics.json').read_text())
  assert 0 < record['mfu'] < 1 and 0 < record['goodput'] < 1 and record['peak_flops'] > 0
  stages = sum(record[f'{name}_seconds'] for name in goodput.STAGES if name != 'final_evaluation')
  assert 0 < record['train_steps_seconds'] and stages <= record['wall_seconds'] + 1e-6
  assert re.search(r'^Wall time \d+ s, goodput \d+\.\d% \(training steps\): train steps', process.stdout,
                   re.MULTILINE), process.stdout

  # --mode=evaluate decodes the same averaged checkpoints again: the same BLEU line.
  evaluated = run_main(workdir, flags + ['--mode=evaluate'], compilation_cache_dir)
  bleu_line = lambda out: re.search(r'^bleu: .*$', out, re.MULTILINE)[0]
  assert bleu_line(evaluated.stdout) == bleu_line(process.stdout)
  # --mode=translate: one output line per input line, a blank line stays blank, the same text as the test split's.
  test_source = corpus['test_files'].split(',')[0]
  lines = open(test_source, encoding='utf-8').read().splitlines()[:2]
  # No --config: the run's own config.json is the config.
  translated = run_main(workdir, ['--mode=translate'], compilation_cache_dir,
                        stdin=f'{lines[0]}\n\n{lines[1]}\n')
  assert translated.stdout.split('\n') == [hypotheses.split('\n')[0], '', hypotheses.split('\n')[1], '']


@pytest.mark.slow  # TFDS prepares Multi30k (29,000 pairs) into a temporary folder first: about a minute.
def test_trains_a_few_steps_on_multi30k(tmp_path, multi30k_dir, caplog):
  config = smoke.get_config()
  config.data.update(manual_dir=str(multi30k_dir), tfds_data_dir=str(tmp_path / 'tfds'), vocab_size=VOCAB_SIZE,
                     max_length=32, bucket_lengths=(32,))
  config.train.update(translate_at_end=False)
  workdir = tmp_path / 'run'
  with caplog.at_level(logging.INFO):
    results = train.train_and_evaluate(config, str(workdir))
  assert 3.0 < results['nll'] < np.log(VOCAB_SIZE) + 1.0 and 0.0 <= results['accuracy'] <= 1.0
  assert checkpoint_steps(workdir) == [2, 4]
  assert (tmp_path / 'tfds' / 'multi30k').is_dir()
  assert (workdir / f'spm_{VOCAB_SIZE}.model').exists()
  assert sorted(read_events(workdir)['train/loss']) == [1, 2, 3, 4]
  counts = [re.fullmatch(r'Training pairs: (\d+) kept; skipped (\d+) with an empty side and (\d+) longer than '
                         r'max_length=32\.', r.getMessage()) for r in caplog.records]
  counts = [tuple(map(int, match.groups())) for match in counts if match]
  assert len(counts) == 1 and sum(counts[0]) == 29_000 and counts[0][0] > 1000, counts  # Every pair accounted for.


def test_bpe_dropout_trains_on_sampled_segmentations(tmp_path, corpus, caplog):
  config = text_config(corpus)
  config.data.bpe_dropout_rate = 0.3
  with caplog.at_level(logging.INFO):
    results = train.train_and_evaluate(config, str(tmp_path / 'run'))
  assert np.isfinite(results['nll'])
  epochs = [re.fullmatch(r'Epoch (\d+): BPE-dropout segmentations for ([\d.]+)% of the sources and ([\d.]+)% of '
                         r'the targets .*; ([\d.]+) source and ([\d.]+) target tokens per pair \(EOS included\), '
                         r'deterministic ([\d.]+) and ([\d.]+)\.', r.getMessage()) for r in caplog.records]
  epochs = [tuple(map(float, match.groups())) for match in epochs if match]
  assert [epoch[0] for epoch in epochs] == [0]  # 6 steps of 8 rows: part of the first epoch of 200 pairs.
  _, sources_sampled, targets_sampled, source, target, source_before, target_before = epochs[0]
  assert sources_sampled > 90 and targets_sampled > 90  # Almost all fit the 32 slots.
  assert source > 1.1 * source_before and target > 1.1 * target_before


def test_run_killed_after_checkpoint_resumes_like_uninterrupted(monkeypatch, tmp_path, corpus, reference_run,
                                                              caplog):
  def crash_at_step_5(index, batch):
    if index == 5:
      raise RuntimeError('simulated crash after checkpoint 4')
    return batch

  config = text_config(corpus)
  record_batches(monkeypatch, crash_at_step_5)
  with pytest.raises(RuntimeError, match='simulated crash'):
    train.train_and_evaluate(config, str(tmp_path))
  assert checkpoint_steps(tmp_path) == [2, 4]

  batches = record_batches(monkeypatch)
  with caplog.at_level(logging.INFO):
    results = train.train_and_evaluate(config, str(tmp_path))
  assert any('Resumed from checkpoint step 4' in r.getMessage() for r in caplog.records)
  assert_same_batches(batches, reference_run.batches[4:])  # Steps 5 and 6: the same batches ...
  assert compared(read_events(tmp_path)) == compared(reference_run.events)  # ... and every metric of every step.
  assert results == reference_run.results
  assert checkpoint_steps(tmp_path) == [4, 6]


def test_validation_bleu_keeps_the_best_checkpoints_and_selection_uses_them(tmp_path, corpus, monkeypatch):
  """train.eval_bleu_every_steps decodes the validation split, logs its BLEU, and keeps the
  eval.average_best_n best steps by it in best_checkpoints/; eval.checkpoint_selection picks from them."""
  scripted = {2: 10.0, 4: 30.0, 6: 20.0}  # Validation BLEU by step, scripted so the ranking is known.
  real = evaluate.validation_bleu

  def scripted_bleu(config, s, params, eval_split, step):
    scores = real(config, s, params, eval_split, step)
    assert 0.0 <= scores['bleu'] <= 100.0 and scores['bleu_seconds'] > 0
    return scores | {'bleu': scripted[step]}

  monkeypatch.setattr(evaluate, 'validation_bleu', scripted_bleu)
  config = text_config(corpus, eval_bleu_every_steps=2, translate_at_end=True)
  config.eval.update(checkpoint_selection='best', average_best_n=2, bleu_beam_size=1)
  results = train.train_and_evaluate(config, str(tmp_path))
  best = sorted(int(p.name) for p in (tmp_path / 'best_checkpoints').iterdir() if p.name.isdigit())
  assert best == [4, 6]  # The two best by BLEU (30 and 20); step 2 (10) was dropped.
  events = read_events(tmp_path)
  assert events['eval/bleu'] == scripted
  assert {'eval/lowercased_tokenized_bleu', 'test/lowercased_tokenized_bleu'} <= set(events)
  saved = json.loads((tmp_path / 'final_metrics.json').read_text())
  assert saved['checkpoint_steps'] == [4] and saved['checkpoint_selection'] == 'best'
  assert saved['bleu'] == pytest.approx(results['bleu']) and 'validation_bleu' in saved
  assert (tmp_path / 'validation.hyp.de').read_text(encoding='utf-8').count('\n') == SPLITS['val']

  # The best checkpoint alone equals checkpoint 4 of the run; the average of the 2 best is their mean.
  s = experiment.setup(config, str(tmp_path))
  try:
    params_best, steps = evaluate.load_params(config.eval, s)
    assert steps == [4]
    params_4 = s.checkpoints.restore_subtree(4, s.abstract_state().params)
    for a, b in zip(jax.tree.leaves(params_best), jax.tree.leaves(params_4)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  finally:
    s.close()
  config.eval.checkpoint_selection = 'average_best'
  s = experiment.setup(config, str(tmp_path))
  try:
    params_avg, steps = evaluate.load_params(config.eval, s)
    assert steps == [4, 6]
    params_6 = s.checkpoints.restore_subtree(6, s.abstract_state().params)
    for a, b, c in zip(jax.tree.leaves(params_avg), jax.tree.leaves(params_4), jax.tree.leaves(params_6)):
      np.testing.assert_allclose(np.asarray(a), (np.asarray(b) + np.asarray(c)) / 2, rtol=1e-6, atol=1e-7)
  finally:
    s.close()


def test_best_checkpoint_selection_needs_validation_bleu(corpus):
  config = text_config(corpus)
  config.eval.checkpoint_selection = 'best'
  with pytest.raises(ValueError, match=r'eval\.checkpoint_selection .*train\.eval_bleu_every_steps > 0'):
    config_checks.validate_config(config)
