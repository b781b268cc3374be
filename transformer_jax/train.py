"""Training state, the pure train and eval steps, and sharded state creation (§5)."""
import dataclasses
import datetime
import functools
import os
import sys
import time
from typing import Any

from absl import logging
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
import numpy as np
import optax
import tensorboardX

from transformer_jax import bleu
from transformer_jax import checkpoints as checkpoints_lib
from transformer_jax import evaluate as evaluate_lib
from transformer_jax import input_pipeline
from transformer_jax import losses
from transformer_jax import model as model_lib
from transformer_jax import optim
from transformer_jax import sharding
from transformer_jax import tokenizer as tokenizer_lib

Array = jax.Array
Batch = dict[str, Array]


@flax.struct.dataclass
class TrainState:
  """Everything a checkpoint needs to resume training exactly.

  Attributes:
    step: int32 scalar, number of updates applied.
    params: float32 parameter tree.
    opt_state: Adam moments and count.
    rng: uint32 [2] raw PRNG key data; dropout at step s uses fold_in(rng, s).
  """
  step: Array
  params: Any
  opt_state: Any
  rng: Array


def _model_inputs(batch: Batch) -> dict[str, Array]:
  """Model keyword arguments from a batch dict (segment ids and positions only for packed batches)."""
  keys = ('source_segment_ids', 'target_segment_ids', 'source_positions', 'target_positions')
  return {key: batch[key] for key in keys if key in batch}


def target_weights(batch: Batch) -> Array:
  """float32 [batch, tgt_len]: 1 on real target tokens (including EOS), 0 on padding."""
  return (batch['target_tokens'] != 0).astype(jnp.float32)


def create_train_state(rng: Array, model: model_lib.Transformer, tx: optax.GradientTransformation,
                       batch: Batch) -> TrainState:
  """Initialises parameters (boxed with logical axis names) and the optimiser state.

  Args:
    rng: a PRNG key.
    model: the Transformer.
    tx: the optimiser.
    batch: an example batch (only shapes matter).

  Returns:
    A TrainState at step 0 whose params are `LogicallyPartitioned` boxes.
  """
  init_rng, dropout_rng = jax.random.split(rng)
  variables = model.init({'params': init_rng}, batch['source_tokens'], batch['decoder_input_tokens'],
                         **_model_inputs(batch))
  params = variables['params']
  return TrainState(step=jnp.array(0, jnp.int32), params=params, opt_state=tx.init(params),
                    rng=jax.random.key_data(dropout_rng))


def sharded_train_state(rng, model, tx, batch, mesh, rules) -> tuple[TrainState, Any]:
  """Creates the TrainState directly in its sharded layout (jit of the initialiser with out_shardings).

  Returns:
    (state with unboxed params, the matching tree of NamedShardings).
  """
  init_fn = functools.partial(create_train_state, model=model, tx=tx, batch=batch)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    abstract = jax.eval_shape(init_fn, rng)
    state_sharding = sharding.logical_to_sharding(abstract, mesh, rules)
    state = jax.jit(lambda r: nn.unbox(init_fn(r)), out_shardings=state_sharding)(rng)
  return state, state_sharding


def train_step(state: TrainState, batch: Batch, *, model: model_lib.Transformer,
               tx: optax.GradientTransformation, label_smoothing: float) -> tuple[TrainState, dict[str, Array]]:
  """One Adam update on the label-smoothed loss averaged over the batch's real target tokens.

  A non-finite loss or gradient leaves the state unchanged except for the step counter (the parameters
  are never overwritten with NaN) and reports `nonfinite=1`; the caller stops or carries on
  (`train.on_nonfinite`).

  Args:
    state: the TrainState (its buffers are donated by the jitted caller).
    batch: int32 arrays `source_tokens` [batch, src_len], `decoder_input_tokens`, `target_tokens`
      [batch, tgt_len], and for packed batches `*_segment_ids` and `*_positions`.
    model: the Transformer (static).
    tx: the optimiser (static).
    label_smoothing: ε_ls (static).

  Returns:
    (new state, metrics): float32 sums `loss_sum`, `nll_sum`, `correct_sum`, `token_count`, plus
    `grad_norm` and `nonfinite` for this step.
  """
  dropout_rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
  weights = target_weights(batch)

  def loss_fn(params):
    logits = model.apply({'params': params}, batch['source_tokens'], batch['decoder_input_tokens'],
                         **_model_inputs(batch), deterministic=False, rngs={'dropout': dropout_rng})
    sums = losses.smoothed_cross_entropy(logits, batch['target_tokens'], weights, label_smoothing)
    return sums['loss_sum'] / jnp.maximum(sums['token_count'], 1.0), sums

  grads, sums = jax.grad(loss_fn, has_aux=True)(state.params)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  grad_norm = optax.global_norm(grads)
  finite = jnp.isfinite(grad_norm) & jnp.isfinite(sums['loss_sum'])
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  new_state = state.replace(step=state.step + 1, params=keep(params, state.params),
                            opt_state=keep(opt_state, state.opt_state))
  metrics = dict(sums, grad_norm=grad_norm, nonfinite=1.0 - finite.astype(jnp.float32))
  return new_state, metrics


def eval_step(params: Any, batch: Batch, *, model: model_lib.Transformer,
              label_smoothing: float) -> dict[str, Array]:
  """Teacher-forced validation metrics for one batch, as sums (see `losses.smoothed_cross_entropy`)."""
  logits = model.apply({'params': params}, batch['source_tokens'], batch['decoder_input_tokens'],
                       **_model_inputs(batch), deterministic=True)
  return losses.smoothed_cross_entropy(logits, batch['target_tokens'], target_weights(batch), label_smoothing)


def validate_config(config) -> model_lib.ModelConfig:
  """Checks every configuration value at start-up, in one place, before anything is read or written.

  Returns:
    The ModelConfig at the configured vocabulary size (the tokenizer's actual size replaces it later).

  Raises:
    ValueError: naming the first bad key, its value and what is allowed.
  """
  def require(ok: bool, key: str, value, allowed: str):
    if not ok:
      raise ValueError(f'{key} must be {allowed}, got {value!r}')

  train_cfg, data_cfg, decode_cfg = config.train, config.data, config.decode
  for key in ('num_train_steps', 'warmup_steps', 'log_every_steps', 'eval_every_steps',
              'checkpoint_every_steps', 'max_checkpoints_to_keep'):
    value = train_cfg[key]
    require(isinstance(value, int) and value > 0, f'train.{key}', value, 'a positive integer')
  require(0.0 <= train_cfg.label_smoothing < 1.0, 'train.label_smoothing', train_cfg.label_smoothing, 'in [0, 1)')
  require(train_cfg.on_nonfinite in ('stop', 'skip'), 'train.on_nonfinite', train_cfg.on_nonfinite,
          "one of ('stop', 'skip')")
  for key in ('vocab_size', 'tokens_per_batch', 'max_length', 'tokenizer_train_sentences'):
    require(data_cfg[key] > 0, f'data.{key}', data_cfg[key], 'a positive integer')
  require(data_cfg.tokenizer_model_type in ('bpe', 'unigram'), 'data.tokenizer_model_type',
          data_cfg.tokenizer_model_type, "one of ('bpe', 'unigram')")
  require(data_cfg.source_lang != data_cfg.target_lang, 'data.target_lang', data_cfg.target_lang,
          f'different from data.source_lang={data_cfg.source_lang!r}')
  require(decode_cfg.beam_size >= 1, 'decode.beam_size', decode_cfg.beam_size, 'at least 1')
  require(decode_cfg.alpha >= 0.0, 'decode.alpha', decode_cfg.alpha, '>= 0')
  require(decode_cfg.extra_length >= 1, 'decode.extra_length', decode_cfg.extra_length, 'at least 1')
  require(1 <= config.eval.average_last_n <= train_cfg.max_checkpoints_to_keep, 'eval.average_last_n',
          config.eval.average_last_n, f'in [1, train.max_checkpoints_to_keep={train_cfg.max_checkpoints_to_keep}]')
  require(config.model.max_length >= data_cfg.max_length or config.model.position_embedding != 'learned',
          'data.max_length', data_cfg.max_length, f'<= model.max_length={config.model.max_length} with '
          'learned positions')
  sharding.mesh_shape(config.mesh, jax.device_count())
  optim.rsqrt_schedule(config.model.d_model, train_cfg.warmup_steps, train_cfg.learning_rate_scale)
  optim.make_optimizer(optim.rsqrt_schedule(1, 1), b1=train_cfg.adam_b1, b2=train_cfg.adam_b2,
                       eps=train_cfg.adam_eps, grad_clip_norm=train_cfg.grad_clip_norm)
  return model_lib.ModelConfig(vocab_size=data_cfg.vocab_size, **config.model)


@dataclasses.dataclass
class Setup:
  """What every mode builds from the config: mesh, vocabulary, model, optimiser and sharded steps."""
  config: Any
  workdir: str
  mesh: Mesh
  rules: Any
  tokenizer: tokenizer_lib.Tokenizer
  model: model_lib.Transformer
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  checkpoints: checkpoints_lib.CheckpointManager

  @property
  def data_shards(self) -> int:
    return self.mesh.shape['data'] * self.mesh.shape['fsdp']

  def abstract_state(self):
    """ShapeDtypeStructs with shardings of the TrainState (for restoring without initialising)."""
    batch = {key: jnp.zeros((self.data_shards, 8), jnp.int32)
             for key in ('source_tokens', 'decoder_input_tokens', 'target_tokens')}
    init_fn = functools.partial(create_train_state, model=self.model, tx=self.tx, batch=batch)
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      abstract = jax.eval_shape(init_fn, jax.random.key(0))
      shardings = sharding.logical_to_sharding(abstract, self.mesh, self.rules)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        nn.unbox(abstract), shardings)

  def device_batch(self, batch: dict[str, np.ndarray]) -> Batch:
    """This host's rows of a global batch as global arrays split over the data axes."""
    batch_sharding = sharding.batch_sharding(self.mesh)
    return {key: jax.make_array_from_process_local_data(batch_sharding, value)
            for key, value in batch.items() if key != 'example_index'}


def setup(config, workdir: str) -> Setup:
  """Validates the config, checks the workdir, loads or trains the vocabulary and builds the model.

  Raises:
    ValueError: for a bad config value, or a workdir holding a run with an incompatible config.
    OSError: if the workdir cannot be created or written.
  """
  validate_config(config)
  _check_writable(workdir)
  mesh = sharding.make_mesh(config.mesh)
  rules = sharding.logical_axis_rules(config.mesh)
  tokenizer = input_pipeline.get_tokenizer(config.data, workdir, jax.process_index())
  model_cfg = model_lib.ModelConfig(vocab_size=tokenizer.vocab_size, **config.model)
  schedule = optim.rsqrt_schedule(model_cfg.d_model, config.train.warmup_steps,
                                  config.train.learning_rate_scale)
  tx = optim.make_optimizer(schedule, b1=config.train.adam_b1, b2=config.train.adam_b2,
                            eps=config.train.adam_eps, grad_clip_norm=config.train.grad_clip_norm)
  fingerprint = {'model': dataclasses.asdict(model_cfg) | {'dtype': None, 'attention_impl': None,
                                                            'remat': None},
                 'data': {'vocab_size': tokenizer.vocab_size, 'source_lang': config.data.source_lang,
                          'target_lang': config.data.target_lang}}
  manager = checkpoints_lib.CheckpointManager(
      workdir, max_to_keep=config.train.max_checkpoints_to_keep,
      save_interval_steps=config.train.checkpoint_every_steps, fingerprint=fingerprint)
  return Setup(config, workdir, mesh, rules, tokenizer, model_lib.Transformer(model_cfg), tx, schedule, manager)


def _check_writable(workdir: str) -> None:
  """Fails before training when the workdir cannot be written (read-only, missing permissions, full)."""
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = os.path.join(workdir, f'.write_probe_{jax.process_index()}')
    with open(probe, 'w') as f:
      f.write('x' * 4096)
      f.flush()
      os.fsync(f.fileno())
    os.remove(probe)
  except OSError as e:
    raise OSError(f'--workdir={workdir} is not writable: {e}') from e


def encode_split(s: Setup, split: str):
  """(source texts, target texts, source ids, target ids) of one split, in file order."""
  source, target = input_pipeline.load_split(s.config.data, split)
  return (source, target, input_pipeline.encode(s.tokenizer, source),
          input_pipeline.encode(s.tokenizer, target))


def make_eval_batches(s: Setup, source_ids, target_ids) -> list[dict[str, np.ndarray]]:
  data_cfg = s.config.data
  return input_pipeline.eval_batches(
      source_ids, target_ids, tokens_per_batch=data_cfg.tokens_per_batch, max_length=data_cfg.max_length,
      bucket_lengths=data_cfg.bucket_lengths, batch_size_multiple=s.data_shards,
      process_index=jax.process_index(), process_count=jax.process_count())


def _jit_steps(s: Setup, state_sharding):
  """The jitted train and eval steps with their shardings; the state's buffers are donated."""
  batch_sharding = sharding.batch_sharding(s.mesh)
  train_fn = jax.jit(
      functools.partial(train_step, model=s.model, tx=s.tx, label_smoothing=s.config.train.label_smoothing),
      in_shardings=(state_sharding, batch_sharding), out_shardings=(state_sharding, None), donate_argnums=0)
  eval_fn = jax.jit(
      functools.partial(eval_step, model=s.model, label_smoothing=s.config.train.label_smoothing),
      in_shardings=(state_sharding.params, batch_sharding))
  return train_fn, eval_fn


class _Progress:
  """Sums metrics on the device between reports; fetches them one step late (no sync per step)."""

  def __init__(self, s: Setup, writer, first_step: int):
    self.s, self.writer = s, writer
    self.sums, self.tokens, self.pending = None, 0, None
    self.time, self.step = time.perf_counter(), first_step
    self.start_time, self.start_step = self.time, first_step

  def update(self, step: int, metrics, batch: dict[str, np.ndarray]) -> None:
    """Records step `step`'s metrics, then checks the previous step's for non-finite values."""
    previous, self.pending = self.pending, (step, metrics)
    keys = ('loss_sum', 'nll_sum', 'correct_sum', 'token_count')
    sums = {k: metrics[k] for k in keys}
    self.sums = sums if self.sums is None else jax.tree.map(jnp.add, self.sums, sums)
    self.tokens += sum(int(np.count_nonzero(batch[k])) for k in ('source_tokens', 'target_tokens'))
    if previous is not None:
      self.check_finite(*previous)

  def check_finite(self, step: int, metrics) -> None:
    if float(metrics['nonfinite']) == 0.0:
      return
    latest = self.s.checkpoints.latest_step()
    message = (f'non-finite loss or gradient at step {step}; that update was not applied. Resume from '
               f'checkpoint step {latest} in {self.s.checkpoints.directory}' if latest is not None
               else f'non-finite loss or gradient at step {step}; no checkpoint written yet')
    if self.s.config.train.on_nonfinite == 'stop':
      raise FloatingPointError(message + ' (or set train.on_nonfinite=skip).')
    logging.warning('%s; skipped.', message)

  def report(self, step: int) -> None:
    now = time.perf_counter()
    summary = evaluate_lib.summarize_metrics(jax.device_get(self.sums))
    steps_per_sec = (step - self.step) / (now - self.time)
    remaining = (self.s.config.train.num_train_steps - step) / max(steps_per_sec, 1e-9)
    summary |= {'learning_rate': float(self.s.schedule(step - 1)), 'steps_per_sec': steps_per_sec,
                'tokens_per_sec': self.tokens / (now - self.time)}
    logging.info('step %d/%d | loss %.4f | nll %.4f | acc %.3f | lr %.3g | %.2f steps/s | %.0f tokens/s | '
                 '%s left', step, self.s.config.train.num_train_steps, summary['loss'], summary['nll'],
                 summary['accuracy'], summary['learning_rate'], steps_per_sec, summary['tokens_per_sec'],
                 datetime.timedelta(seconds=int(remaining)))
    write_scalars(self.writer, step, summary, prefix='train')
    self.sums, self.tokens, self.time, self.step = None, 0, now, step


def write_scalars(writer, step: int, scalars: dict[str, float], prefix: str) -> None:
  if writer is not None:
    for key, value in scalars.items():
      writer.add_scalar(f'{prefix}/{key}', value, step)
    writer.flush()


def train_and_evaluate(config, workdir: str) -> dict[str, float]:
  """Trains (resuming from the latest checkpoint in workdir), evaluates periodically, then translates.

  Returns:
    The final metrics: validation loss/nll/perplexity/accuracy, and `bleu` when train.translate_at_end.
  """
  s = setup(config, workdir)
  train_source, train_target = input_pipeline.load_split(config.data, config.data.train_split)
  train_iter = input_pipeline.TrainIterator.from_config(
      config.data, input_pipeline.encode(s.tokenizer, train_source), input_pipeline.encode(s.tokenizer, train_target),
      batch_size_multiple=s.data_shards, process_index=jax.process_index(), process_count=jax.process_count())
  del train_source, train_target
  _, _, eval_source_ids, eval_target_ids = encode_split(s, config.data.eval_split)
  eval_batches = make_eval_batches(s, eval_source_ids, eval_target_ids)

  state, state_sharding = sharded_train_state(
      jax.random.key(config.train.seed), s.model, s.tx, s.device_batch(next(iter(eval_batches))), s.mesh, s.rules)
  restored = s.checkpoints.restore_latest(jax.tree.map(
      lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state, state_sharding))
  if restored is not None:
    state = restored.state
    train_iter.set_state(restored.data_state)
    logging.info('Resumed from checkpoint step %d in %s.', restored.step, s.checkpoints.directory)
  train_fn, eval_fn = _jit_steps(s, state_sharding)
  writer = tensorboardX.SummaryWriter(workdir) if jax.process_index() == 0 else None
  first_step = int(state.step)
  progress = _Progress(s, writer, first_step)
  with jax.set_mesh(s.mesh), nn.logical_axis_rules(s.rules):
    for step in range(first_step + 1, config.train.num_train_steps + 1):
      batch = next(train_iter)
      state, metrics = train_fn(state, s.device_batch(batch))
      progress.update(step, metrics, batch)
      if step % config.train.log_every_steps == 0 or step == config.train.num_train_steps:
        progress.check_finite(*progress.pending)
        progress.report(step)
      if step % config.train.eval_every_steps == 0 or step == config.train.num_train_steps:
        write_scalars(writer, step, _validate(eval_fn, state.params, eval_batches, step), 'eval')
      s.checkpoints.save(step, state, train_iter.get_state(), force=step == config.train.num_train_steps)
  s.checkpoints.wait_until_finished()
  results = final_evaluation(s, eval_fn, eval_batches, writer)
  if writer is not None:
    writer.close()
  s.checkpoints.close()
  return results


def _validate(eval_fn, params, eval_batches, step: int) -> dict[str, float]:
  metrics = evaluate_lib.evaluate(eval_fn, params, eval_batches)
  logging.info('eval at step %d | loss %.4f | nll %.4f | perplexity %.2f | acc %.3f', step, metrics['loss'],
               metrics['nll'], metrics['perplexity'], metrics['accuracy'])
  return metrics


def load_params(s: Setup):
  """The average of the last eval.average_last_n checkpoints' parameters (§6.1), or the latest alone.

  Raises:
    FileNotFoundError: if the workdir holds no checkpoint.
  """
  steps = s.checkpoints.all_steps()
  if not steps:
    raise FileNotFoundError(f'no checkpoint in {s.checkpoints.directory}: train first (--mode=train)')
  steps = steps[-s.config.eval.average_last_n:]
  logging.info('Averaging the parameters of checkpoint steps %s.', steps)
  return checkpoints_lib.average_checkpoints(s.checkpoints, steps, s.abstract_state().params), steps


def final_evaluation(s: Setup, eval_fn, eval_batches, writer=None) -> dict[str, float]:
  """Validation metrics and test BLEU of the averaged checkpoints; hypotheses written to the workdir."""
  params, steps = load_params(s)
  with jax.set_mesh(s.mesh), nn.logical_axis_rules(s.rules):
    results = _validate(eval_fn, params, eval_batches, steps[-1])
    write_scalars(writer, steps[-1], results, 'eval_averaged')
    if not s.config.train.translate_at_end:
      return results
    sources, references, source_ids, target_ids = encode_split(s, s.config.data.test_split)
    start = time.perf_counter()
    hypotheses = translate_ids(s, params, source_ids, target_ids)
  seconds = time.perf_counter() - start
  path = os.path.join(s.workdir, f'{s.config.data.test_split}.hyp.{s.config.data.target_lang}')
  if jax.process_index() == 0:
    with open(path, 'w', encoding='utf-8') as f:
      f.write(''.join(h + '\n' for h in hypotheses))
  score, signature = bleu.sacrebleu_score(hypotheses, references)
  tokenized = bleu.tokenized_bleu(hypotheses, references, s.config.data.target_lang)
  results |= {'bleu': score, 'tokenized_bleu': tokenized, 'decode_sentences_per_sec': len(sources) / seconds}
  write_scalars(writer, steps[-1], {'bleu': score, 'tokenized_bleu': tokenized}, 'test')
  logging.info('Translated %d sentences in %.1f s (%.1f sentences/s); hypotheses in %s', len(sources), seconds,
               len(sources) / seconds, path)
  print(f'bleu: {score:.2f}  ({signature}; beam {s.config.decode.beam_size}, averaged steps {steps})')
  print(f'tokenized_bleu: {tokenized:.2f}  (tokenized, compound-split, as in the paper)')
  return results


def translate_ids(s: Setup, params, source_ids, target_ids=None) -> list[str]:
  """Beam search (decode.*) over tokenised sources; one output per input, in order."""
  if target_ids is None:
    target_ids = input_pipeline.Ragged.from_lists([[] for _ in range(len(source_ids))])
  batches = make_eval_batches(s, source_ids, target_ids)
  decode_cfg = s.config.decode
  return evaluate_lib.translate(params, batches, s.tokenizer, len(source_ids), model=s.model,
                                beam_size=decode_cfg.beam_size, alpha=decode_cfg.alpha,
                                extra_length=decode_cfg.extra_length)


def evaluate_checkpoint(config, workdir: str) -> dict[str, float]:
  """--mode=evaluate: validation metrics and test BLEU of the latest (averaged) checkpoints."""
  s = setup(config, workdir)
  _, _, eval_source_ids, eval_target_ids = encode_split(s, config.data.eval_split)
  abstract = s.abstract_state()
  state_sharding = jax.tree.map(lambda x: x.sharding, abstract)
  _, eval_fn = _jit_steps(s, state_sharding)
  return final_evaluation(s, eval_fn, make_eval_batches(s, eval_source_ids, eval_target_ids))


def translate_file(config, workdir: str, input_path: str | None, output_path: str | None) -> None:
  """--mode=translate: one output line per input line (a blank line stays blank), stdin/stdout by default."""
  s = setup(config, workdir)
  if input_path:
    with open(input_path, encoding='utf-8') as f:
      lines = f.read().splitlines()
  else:
    lines = sys.stdin.read().splitlines()
  params, _ = load_params(s)
  with jax.set_mesh(s.mesh), nn.logical_axis_rules(s.rules):
    hypotheses = translate_ids(s, params, input_pipeline.encode(s.tokenizer, lines))
  hypotheses = [h if line.strip() else '' for line, h in zip(lines, hypotheses)]
  text = ''.join(h + '\n' for h in hypotheses)
  if output_path:
    with open(output_path, 'w', encoding='utf-8') as f:
      f.write(text)
  else:
    sys.stdout.write(text)
