"""--mode=export to CTranslate2: the exported model scores and translates as ours does (issue #31)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.decoding import translate
from transformer_jax.evaluation import evaluate
from transformer_jax.model import transformer as model_lib
from transformer_jax.storage import workdir as workdir_lib
from transformer_jax.tools import export
from transformer_jax.run import experiment

from tiny_runs import text_config  # pylint: disable=g-bad-import-order
from tiny_runs import VOCAB_SIZE

ctranslate2 = pytest.importorskip('ctranslate2', reason="the ctranslate2 extra: pip install -e '.[ctranslate2]'")
pytestmark = pytest.mark.usefixtures('persistent_compilation_cache')

STEPS = 300  # Enough for the tiny model to translate the synthetic corpus (word for word) mostly right.


@pytest.fixture(scope='module')
def trained(tmp_path_factory, corpus):
  """A tiny run trained STEPS steps, its averaged parameters and a float32 export of them."""
  from transformer_jax.run import train  # pylint: disable=g-import-not-at-top  (imports TensorFlow)
  workdir = tmp_path_factory.mktemp('export_run')
  config = text_config(corpus, num_train_steps=STEPS, warmup_steps=50, eval_every_steps=STEPS,
                       checkpoint_every_steps=STEPS // 2)
  config.model.dropout_rate = 0.0
  train.train_and_evaluate(config, str(workdir))
  setup = experiment.setup(config, str(workdir))
  try:
    params, _ = evaluate.load_params(config.eval, setup)
  finally:
    setup.close()
  output = workdir / 'ct2_float32'
  export.export_ctranslate2(params, setup.model.cfg, workdir_lib.path(workdir, f'spm_{VOCAB_SIZE}.model'),
                            str(output), quantization='float32')
  return config, setup.model, jax.device_get(params), tokenizer_lib.Tokenizer.load(
      workdir / f'spm_{VOCAB_SIZE}.model'), output


def source_lines(corpus, count):
  """The first `count` sources of the test, validation and training splits, in that order."""
  lines = []
  for key in ('test_files', 'eval_files', 'train_files'):
    lines += open(corpus[key].split(',')[0], encoding='utf-8').read().splitlines()
  return lines[:count]


def pad(rows: list[list[int]]) -> np.ndarray:
  out = np.zeros((len(rows), max(map(len, rows))), np.int32)
  for i, row in enumerate(rows):
    out[i, :len(row)] = row
  return out


def test_score_batch_equals_our_teacher_forced_log_probabilities(trained, corpus):
  config, model, params, tokenizer, output = trained
  sources = source_lines(corpus, 20)
  targets = open(corpus['test_files'].split(',')[1], encoding='utf-8').read().splitlines()[:12] + open(
      corpus['eval_files'].split(',')[1], encoding='utf-8').read().splitlines()[:8]
  src_ids = [ids + [tokenizer_lib.EOS_ID] for ids in tokenizer.encode(sources)]
  tgt_ids = [ids + [tokenizer_lib.EOS_ID] for ids in tokenizer.encode(targets)]
  decoder_input = [[tokenizer_lib.BOS_ID] + ids[:-1] for ids in tgt_ids]
  logits = model.apply({'params': params}, jnp.asarray(pad(src_ids)), jnp.asarray(pad(decoder_input)))
  log_probs = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
  ours = [log_probs[i, np.arange(len(ids)), ids] for i, ids in enumerate(tgt_ids)]

  translator = ctranslate2.Translator(str(output), device='cpu', compute_type='float32')
  pieces = lambda ids: [tokenizer.pieces()[i] for i in ids]
  results = translator.score_batch([pieces(ids[:-1]) for ids in src_ids], [pieces(ids[:-1]) for ids in tgt_ids])
  for mine, theirs in zip(ours, results):
    np.testing.assert_allclose(np.asarray(theirs.log_probs), mine, atol=1e-4)  # EOS's included.
  assert float(np.mean([np.exp(x.mean()) for x in ours])) > 10 / VOCAB_SIZE  # Trained: 10x a uniform guess.


def next_token_log_probs(model, params, source: list[int], prefix: list[int]) -> np.ndarray:
  """Our log-probabilities of the token after `prefix` (teacher-forced), float32 [vocab]."""
  logits = model.apply({'params': params}, jnp.asarray([source]), jnp.asarray([[tokenizer_lib.BOS_ID] + prefix]))
  return np.asarray(jax.nn.log_softmax(logits[0, -1].astype(jnp.float32)))


def test_greedy_translations_equal_ours_token_for_token(trained, corpus):
  """Equal on 50 sentences, except where the two part at a numerical tie (the tiny model repeats words, so two
  next-token log-probabilities can agree to 1e-5): there the parting step must be such a tie."""
  config, model, params, tokenizer, output = trained
  sources = source_lines(corpus, 50)
  src_ids = [ids + [tokenizer_lib.EOS_ID] for ids in tokenizer.encode(sources)]
  ours = ours_best(params, model, src_ids, 1, config.decode.extra_length)
  theirs = ctranslate2_best(output, tokenizer, src_ids, 1, config.decode.extra_length)
  ties = 0
  for source, a, b in zip(src_ids, ours, theirs):
    if a == b:
      continue
    k = next(i for i in range(min(len(a), len(b)) + 1) if i == min(len(a), len(b)) or a[i] != b[i])
    log_probs = next_token_log_probs(model, params, source, a[:k])
    token = lambda hypothesis: hypothesis[k] if k < len(hypothesis) else tokenizer_lib.EOS_ID
    assert abs(log_probs[token(a)] - log_probs[token(b)]) < 1e-4, (a, b, k)
    ties += 1
  assert ties <= 5, ties  # 45 or more of the 50 equal token for token.


def test_beam_search_finds_hypotheses_of_our_score(trained, corpus):
  """Beam 4 with no length penalty on either side (CTranslate2 divides a hypothesis's log-probability by
  length^length_penalty, ours by ((5 + length) / 6)^alpha, Wu et al. (§6.1): both are 1 at 0): the best
  hypotheses have the same log-probability under our model."""
  config, model, params, tokenizer, output = trained
  src_ids = [ids + [tokenizer_lib.EOS_ID] for ids in tokenizer.encode(source_lines(corpus, 50))]
  ours = ours_best(params, model, src_ids, 4, config.decode.extra_length)
  theirs = ctranslate2_best(output, tokenizer, src_ids, 4, config.decode.extra_length)

  def score(source, hypothesis):
    target = hypothesis + [tokenizer_lib.EOS_ID]
    logits = model.apply({'params': params}, jnp.asarray([source]), jnp.asarray([[tokenizer_lib.BOS_ID] + hypothesis]))
    log_probs = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32)))
    return float(log_probs[np.arange(len(target)), target].sum())
  same = sum(a == b for a, b in zip(ours, theirs))
  for source, a, b in zip(src_ids, ours, theirs):
    if a != b:
      assert score(source, a) == pytest.approx(score(source, b), abs=1e-3), (a, b)
  assert same >= 40, same


def ours_best(params, model, src_ids, beam_size, extra_length) -> list[list[int]]:
  """Our best hypothesis per sentence, without EOS."""
  rows = np.asarray(translate.decode_batch(params, jnp.asarray(pad(src_ids)), model=model, beam_size=beam_size,
                                           alpha=0.0, extra_length=extra_length))
  return [[int(t) for t in row[:list(row).index(tokenizer_lib.EOS_ID)]] if tokenizer_lib.EOS_ID in row
          else [int(t) for t in row if t] for row in rows]


def ctranslate2_best(output, tokenizer, src_ids, beam_size, extra_length) -> list[list[int]]:
  """CTranslate2's best hypothesis per sentence, as our ids. Its defaults differ from ours in two ways: it forbids
  EOS first (min_decoding_length=1), and its maximum length is one per call, where ours is each sentence's
  source length (EOS included) + extra_length (decoding/translate.py): one call per sentence."""
  translator = ctranslate2.Translator(str(output), device='cpu', compute_type='float32')
  pieces = tokenizer.pieces()
  best = []
  for ids in src_ids:
    result, = translator.translate_batch([[pieces[i] for i in ids[:-1]]], beam_size=beam_size, length_penalty=0.0,
                                         min_decoding_length=0, max_decoding_length=len(ids) + extra_length)
    best.append([pieces.index(p) for p in result.hypotheses[0]])
  return best


def test_int8_export_writes_the_serving_files(trained, tmp_path):
  config, model, params, _, output = trained
  int8 = tmp_path / 'ct2_int8'
  export.export_ctranslate2(params, model.cfg, str(output / 'sentencepiece.model'), str(int8))
  assert {'model.bin', 'config.json', 'shared_vocabulary.json', 'sentencepiece.model',
          'transformer_jax.json'} <= {p.name for p in int8.iterdir()}
  assert json.loads((int8 / 'transformer_jax.json').read_text())['quantization'] == 'int8'
  # int8 kernels: a quarter of float32's bytes; the float32 sinusoid table (1,024 x 32) is not quantised.
  assert (int8 / 'model.bin').stat().st_size < 0.7 * (output / 'model.bin').stat().st_size
  with pytest.raises(ValueError, match=r'--output=.* exists and is not an empty folder'):
    export.export_ctranslate2(params, model.cfg, str(output / 'sentencepiece.model'), str(int8))


@pytest.mark.parametrize(('field', 'value', 'match'), [
    ('position_embedding', 'rope', r"model\.position_embedding='rope' cannot be exported"),
    ('feed_forward', 'swiglu', r"model\.feed_forward='swiglu' cannot be exported"),
    ('num_kv_heads', 1, r'model\.num_kv_heads=1 cannot be exported'),
    ('d_k', 16, r'model\.d_k=16 cannot be exported to CTranslate2: CTranslate2 needs d_k = d_v = d_model'),
])
def test_fields_ctranslate2_cannot_represent_are_refused_before_writing(tmp_path, field, value, match):
  fields = dict(vocab_size=64, num_layers=1, d_model=32, d_ff=64, num_heads=4, d_k=8, d_v=8) | {field: value}
  cfg = model_lib.ModelConfig(**fields)
  with pytest.raises(ValueError, match=match):
    export.export_ctranslate2({}, cfg, str(tmp_path / 'missing.model'), str(tmp_path / 'out'))
  assert not (tmp_path / 'out').exists()
