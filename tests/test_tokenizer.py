"""Tests for transformer_jax.data.tokenizer on the real Multi30k corpus (vocabulary 8000, trained in about 1 s)."""
import io
import pathlib
import re
import subprocess
import sys
import threading
import unicodedata

import numpy as np
import pytest
import sentencepiece as spm

from transformer_jax.data import multi30k
from transformer_jax.data import tokenizer as tokenizer_lib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
UNSEEN = ['Ein Mann 🙂 mit 日本語 und naïve café.', '東京で猫が寝ている。', 'مرحبا بالعالم', 'Ωμέγα ∑ ≠ 😀👍🏽', 'Straße Ærø']


def training_sentences(multi30k_dir, num_lines=None):
  def sentences():
    for lang in ('en', 'de'):
      yield from multi30k.read_lines(multi30k_dir / f'train.{lang}.gz')[:num_lines]
  return sentences


@pytest.fixture(scope='module')
def tokenizer(multi30k_dir, tmp_path_factory) -> tokenizer_lib.Tokenizer:
  return tokenizer_lib.train_or_load(tmp_path_factory.mktemp('vocab') / 'spm_8000.model',
                                     training_sentences(multi30k_dir), 8000)


def normalized(text: str) -> str:
  """The documented policy: NFKC, whitespace trimmed and collapsed to single spaces."""
  return ' '.join(unicodedata.normalize('NFKC', text).split())


def test_special_ids_and_size(tokenizer):
  assert tokenizer.vocab_size == 8000
  ids = tokenizer.encode(['A man in a blue shirt.', 'Ein Mann in einem blauen Hemd.', ''])
  assert ids[2] == []
  flat = [i for row in ids for i in row]
  assert min(flat) > tokenizer_lib.UNK_ID and max(flat) < 8000


def test_a_model_with_other_special_ids_is_refused():
  # SentencePiece's defaults (unk 0, bos 1, eos 2, no pad) are not the ids the model and the batches assume
  # (pad 0, bos 1, eos 2, unk 3): such a vocabulary must not load.
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(sentence_iterator=iter(['a man sits on a bench'] * 50), model_writer=model,
                                 vocab_size=12, model_type='char', minloglevel=2)
  with pytest.raises(ValueError, match=re.escape('(pad, bos, eos, unk) ids (-1, 1, 2, 0); expected (0, 1, 2, 3)')):
    tokenizer_lib.Tokenizer(model.getvalue())


def test_round_trip_validation_set(tokenizer, multi30k_dir):
  for lang in ('en', 'de', 'fr'):  # French is not in the training sentences: byte fallback covers its letters.
    lines = multi30k.read_lines(multi30k_dir / f'val.{lang}.gz')
    assert tokenizer.decode(tokenizer.encode(lines)) == [normalized(line) for line in lines]


def test_round_trip_unseen_characters_exact(tokenizer):
  ids = tokenizer.encode(UNSEEN)
  assert tokenizer.decode(ids) == UNSEEN
  assert all(tokenizer_lib.UNK_ID not in row for row in ids)
  assert any(4 <= i < 4 + 256 for i in ids[1])  # Byte pieces <0x00>..<0xFF> follow the special ids.


def test_normalisation_policy(tokenizer):
  texts = ['ﬁne ｆｕｌｌ ＡＢＣ', '  two   spaces\tand a tab  ', 'x\u00a0y', 'Ǆ ŀ ²']
  expected = ['fine full ABC', 'two spaces and a tab', 'x y', 'DŽ l· 2']
  assert tokenizer.decode(tokenizer.encode(texts)) == expected
  assert [normalized(text) for text in texts] == expected


def test_decode_stops_at_eos_and_drops_pad_bos(tokenizer):
  ids = tokenizer.encode(['Zwei Hunde spielen im Schnee.'])[0]
  eos, bos, pad = tokenizer_lib.EOS_ID, tokenizer_lib.BOS_ID, tokenizer_lib.PAD_ID
  rows = [[bos] + ids + [eos] + ids + [pad], [bos, pad] + ids + [pad, pad, eos]]
  assert tokenizer.decode(rows) == ['Zwei Hunde spielen im Schnee.'] * 2
  padded = np.zeros((2, len(ids) + 5), np.int32)  # Rows of a [batch, length] array, as decoding returns them.
  padded[0, :len(ids) + 2] = [bos] + ids + [eos]
  padded[1, 1:len(ids) + 1] = ids
  assert tokenizer.decode(padded) == ['Zwei Hunde spielen im Schnee.'] * 2
  assert tokenizer.decode([[eos] + ids, []]) == ['', '']


def test_train_or_load_loads_existing_file(tokenizer, multi30k_dir, tmp_path):
  def fail():
    raise AssertionError('must not train again')
  first = tokenizer_lib.train_or_load(tmp_path / 'spm_1000.model', training_sentences(multi30k_dir, 2000), 1000)
  second = tokenizer_lib.train_or_load(tmp_path / 'spm_1000.model', fail, 1000)
  assert [p.name for p in tmp_path.iterdir()] == ['spm_1000.model']  # No temporary file left.
  assert second.encode(UNSEEN) == first.encode(UNSEEN)


def test_other_processes_wait_for_process_0(multi30k_dir, tmp_path):
  results = {}
  waiter = threading.Thread(target=lambda: results.update(
      waiter=tokenizer_lib.train_or_load(tmp_path / 'spm_1000.model', None, 1000, process_index=1, poll_secs=0.05,
                                         timeout_secs=60)))
  waiter.start()
  trained = tokenizer_lib.train_or_load(tmp_path / 'spm_1000.model', training_sentences(multi30k_dir, 2000), 1000,
                                        process_index=0)
  waiter.join(timeout=60)
  assert results['waiter'].encode(UNSEEN) == trained.encode(UNSEEN)


def test_wait_times_out(tmp_path):
  with pytest.raises(TimeoutError, match='Process 3: .*spm_500.model did not appear within 0.1 s'):
    tokenizer_lib.train_or_load(tmp_path / 'spm_500.model', None, 500, process_index=3, timeout_secs=0.1,
                                poll_secs=0.02)


def test_a_vocabulary_the_corpus_cannot_fill_names_data_vocab_size(tmp_path):
  sentences = lambda: ['A man rides a bike.', 'Ein Mann fährt Rad.'] * 20
  with pytest.raises(ValueError, match=r'data.vocab_size=100 does not fit this corpus: .*smaller than required'):
    tokenizer_lib.train_or_load(tmp_path / 'spm_100.model', sentences, 100)  # Fewer than 256 bytes + characters + specials.
  with pytest.raises(ValueError, match=r'data.vocab_size=5000 does not fit this corpus: .*too high'):
    tokenizer_lib.train_or_load(tmp_path / 'spm_5000.model', sentences, 5000)
  assert not list(tmp_path.iterdir())  # Nothing written.


_TRAIN_IN_A_PROCESS = """
import hashlib, pathlib, sys
from transformer_jax.data import multi30k, tokenizer
folder, workdir, seed = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
lines = lambda: [line for lang in ('en', 'de') for line in multi30k.read_lines(folder / f'train.{lang}.gz')[:4000]]
tokenizer.train_or_load(pathlib.Path(workdir, 'spm_1000.model'), lines, 1000, max_sentences=1500, seed=seed)
print(hashlib.sha256(pathlib.Path(workdir, 'spm_1000.model').read_bytes()).hexdigest())
"""


def train_in_subprocess(multi30k_dir, workdir, seed=0) -> str:
  """sha256 of the model trained in a fresh Python process (SentencePiece's state starts anew in each)."""
  result = subprocess.run([sys.executable, '-c', _TRAIN_IN_A_PROCESS, str(multi30k_dir), str(workdir), str(seed)],
                          capture_output=True, text=True, check=True, cwd=REPO_ROOT, timeout=120)
  return result.stdout.split()[-1]


def test_sampled_training_is_reproducible(multi30k_dir, tmp_path):
  """At most max_sentences sentences train the model; the sample, so the file, is the same in every process
  (#14 item 2: SentencePiece's own sampler gave another file in every process, seeded or not)."""
  hashes = [train_in_subprocess(multi30k_dir, tmp_path / name) for name in ('a', 'b')]
  assert hashes[0] == hashes[1]
  assert train_in_subprocess(multi30k_dir, tmp_path / 'c', seed=1) != hashes[0]  # The seed chooses the sample.


def test_sample_is_seeded_and_skips_empty_lines():
  sentences = [f'line {i}' if i % 3 else '' for i in range(300)]
  sample = tokenizer_lib.sample_sentences(sentences, 50, seed=0)
  assert len(sample) == 50 and '' not in sample and len(set(sample)) == 50
  assert sample == tokenizer_lib.sample_sentences(iter(sentences), 50, seed=0)
  assert sample != tokenizer_lib.sample_sentences(sentences, 50, seed=1)
  assert sorted(sample, key=sentences.index) == sample  # Corpus order is kept.
  assert tokenizer_lib.sample_sentences(sentences, 1000, seed=0) == [s for s in sentences if s]


def test_bpe_dropout_samples_other_segmentations_of_the_same_text(tokenizer, multi30k_dir, tmp_path):
  lines = multi30k.read_lines(multi30k_dir / 'val.de.gz')
  deterministic = tokenizer.encode(lines)
  first, second = tokenizer.encode(lines, bpe_dropout_rate=0.1), tokenizer.encode(lines, bpe_dropout_rate=0.1)
  assert tokenizer.decode(first) == tokenizer.decode(second) == tokenizer.decode(deterministic)
  assert first != second and first != deterministic  # A new sample every call.
  pieces = [sum(map(len, ids)) for ids in (deterministic, first)]
  assert 1.2 < pieces[1] / pieces[0] < 1.7  # Rate 0.1 splits ~40% more pieces out of Multi30k.
  assert tokenizer.encode(lines, bpe_dropout_rate=0.0) == deterministic
  with pytest.raises(ValueError, match=r'BPE-dropout rate must be in \[0, 1\), got 1.0'):
    tokenizer.encode(lines, bpe_dropout_rate=1.0)
  unigram = tokenizer_lib.train_or_load(tmp_path / 'spm_1000.model', training_sentences(multi30k_dir, 3000), 1000,
                                        model_type='unigram')
  with pytest.raises(ValueError, match='BPE-dropout needs a BPE vocabulary'):
    unigram.encode(lines, bpe_dropout_rate=0.1)


CHANGED_BY_NFKC = ['Er wartet…', 'Nummer １２３', 'ﬁnden', 'x²']


@pytest.mark.parametrize('normalization, changed', [('nmt_nfkc', [1, 2, 3, 4]), ('identity', [])])
def test_normalization_rule_and_round_trip(multi30k_dir, tmp_path, normalization, changed):
  """nmt_nfkc folds '…', full-width digits, ligatures and superscripts; 'identity' keeps them (#16 item 8)."""
  lines = ['Ein Mann läuft.'] + CHANGED_BY_NFKC
  trained = []
  tokenizer = tokenizer_lib.train_or_load(tmp_path / 'spm_1000.model', training_sentences(multi30k_dir, 2000), 1000,
                                          normalization=normalization, on_trained=trained.append)
  assert tokenizer.normalization == normalization and len(trained) == 1
  assert tokenizer_lib.round_trip(tokenizer, lines) == changed
  if normalization == 'nmt_nfkc':
    assert tokenizer.decode(tokenizer.encode(CHANGED_BY_NFKC)) == ['Er wartet...', 'Nummer 123', 'finden', 'x2']
  other = 'identity' if normalization == 'nmt_nfkc' else 'nmt_nfkc'
  with pytest.raises(ValueError, match=f"trained with normalisation '{normalization}', not "
                                       f"data.tokenizer_normalization='{other}'"):
    tokenizer_lib.train_or_load(tmp_path / 'spm_1000.model', None, 1000, normalization=other)
  assert len(trained) == 1  # Loading an existing file does not call on_trained.


@pytest.mark.parametrize('key, value, match', [
    ('tokenizer_normalization', 'nfc', r"data.tokenizer_normalization must be one of \('nmt_nfkc', .*got 'nfc'"),
    ('tokenizer_seed', -1, r'data.tokenizer_seed must be an integer in \[0, 2\*\*32\), got -1'),
    ('tokenizer_model_type', 'wordpiece', r"data.tokenizer_model_type must be one of \('bpe', 'unigram'\), got "
                                          "'wordpiece'"),
    ('vocab_size', 0, r'data.vocab_size must be .*got 0'),
])
def test_config_checks_the_tokenizer_fields_at_start_up(key, value, match):
  from configs import base  # pylint: disable=g-import-not-at-top
  from transformer_jax.run import config_checks  # pylint: disable=g-import-not-at-top
  config = base.get_config()
  config.data[key] = value
  with pytest.raises(ValueError, match=match):
    config_checks.validate_config(config)
