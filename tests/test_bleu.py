"""Tests for transformer_jax.evaluation.bleu."""
import pytest
import sacrebleu

from transformer_jax.evaluation import bleu

REFERENCES = ['Ein Mann fährt mit seinem Haus-Boot über den See.',
              'Zwei Kinder spielen im Garten, während die Sonne scheint.']


def test_identical_is_100():
  score, signature = bleu.sacrebleu_score(REFERENCES, REFERENCES, 'de')
  assert score == pytest.approx(100.0)
  assert 'tok:13a' in signature and 'case:mixed' in signature
  assert bleu.tokenized_bleu(REFERENCES, REFERENCES, 'de') == pytest.approx(100.0)


def test_disjoint_is_0():
  hypotheses = ['xx yy zz ww vv uu tt', 'qq rr ss pp oo nn mm ll']
  assert bleu.sacrebleu_score(hypotheses, REFERENCES, 'de')[0] == pytest.approx(0.0)
  assert bleu.tokenized_bleu(hypotheses, REFERENCES, 'de') == pytest.approx(0.0)


def test_compound_splitting():
  tokens = bleu.split_compounds(bleu.moses_tokenize('Ein Haus-Boot.', 'de')).split()
  assert tokens == ['Ein', 'Haus', '##AT##-##AT##', 'Boot', '.']
  # As Perl's s{(\S)-(\S)}{...}g: matches do not overlap; a lone or spaced dash stays.
  assert bleu.split_compounds('a-b-c d - e') == 'a ##AT##-##AT## b-c d - e'


def test_compound_splitting_credits_a_partly_right_compound():
  # A compound counts as three tokens after splitting, so getting only its head right scores higher.
  hypotheses = ['Ein Mann fährt mit seinem Haus-Schiff über den See.']
  references = REFERENCES[:1]
  assert (bleu.tokenized_bleu(hypotheses, references, 'de')
          > bleu.sacrebleu_score(hypotheses, references, 'de')[0])


@pytest.mark.parametrize('fn', [bleu.sacrebleu_score, bleu.tokenized_bleu, bleu.lowercased_tokenized_bleu,
                                bleu.all_bleu])
def test_every_reference_stream_must_match_the_hypotheses(fn):
  """sacreBLEU itself scores the common prefix when a stream is shorter or longer (#16 item 7)."""
  with pytest.raises(ValueError, match='1 hypotheses but 2 references in reference stream 1 of 1'):
    fn(['a b c'], REFERENCES, 'de')
  two_streams = [REFERENCES, REFERENCES[:1]]  # The second reference stream lacks a line.
  with pytest.raises(ValueError, match='2 hypotheses but 1 references in reference stream 2 of 2'):
    fn(REFERENCES, two_streams, 'de')
  per_sentence = [[line] for line in REFERENCES]  # Nested the wrong way: one list per sentence.
  with pytest.raises(ValueError, match='2 hypotheses but 1 references in reference stream 1 of 2'):
    fn(REFERENCES, per_sentence, 'de')
  with pytest.raises(ValueError, match='references must be a list of str'):
    fn(REFERENCES, REFERENCES[0], 'de')
  with pytest.raises(ValueError, match='hypotheses must be a list of str'):
    fn(REFERENCES[0], REFERENCES, 'de')
  with pytest.raises(ValueError, match='at least one sentence'):
    fn([], [], 'de')


def test_two_reference_streams():
  other = ['Ein Mann fährt über den See.', 'Zwei Kinder spielen.']
  assert bleu.sacrebleu_score(other, [REFERENCES, other], 'de')[0] == pytest.approx(100.0)
  score, signature = bleu.sacrebleu_score(other, [REFERENCES], 'de')
  assert score < 50 and 'nrefs:1' in signature
  assert 'nrefs:2' in bleu.sacrebleu_score(other, [REFERENCES, other], 'de')[1]


@pytest.mark.parametrize('lang, tokenize', [('de', '13a'), ('en', '13a'), ('zh', 'zh'), ('zh-CN', 'zh'),
                                            ('ja', 'ja-mecab'), ('ko', 'ko-mecab'), ('fr', '13a')])
def test_tokenizer_follows_the_target_language(lang, tokenize):
  assert bleu.sacrebleu_tokenizer(lang) == tokenize
  assert bleu.check_sacrebleu_tokenizer(lang) == tokenize  # The MeCab packages are installed (pyproject.toml).
  assert f'tok:{tokenize}' in bleu.sacrebleu_score(REFERENCES, REFERENCES, lang)[1]


def test_missing_mecab_names_the_packages(monkeypatch):
  def missing(*args, **kwargs):
    raise RuntimeError('Japanese tokenization requires extra dependencies')
  bleu._metric.cache_clear()
  monkeypatch.setattr(bleu.sacrebleu.metrics, 'BLEU', missing)
  with pytest.raises(ImportError, match=r"'ja-mecab' needs mecab-python3 and ipadic \(pip install 'sacrebleu\[ja\]'\)"):
    bleu.check_sacrebleu_tokenizer('ja')
  monkeypatch.undo()
  bleu._metric.cache_clear()


CHINESE = ['一个男人在湖上骑自行车。', '两个孩子在花园里玩耍，阳光明媚。', '一只狗在雪地里奔跑。']


def test_chinese_target_from_text_files(tmp_path):
  """dataset='text' with a Chinese target: BLEU uses sacreBLEU's 'zh' tokenizer, as its signature says."""
  from transformer_jax.data import input_pipeline  # pylint: disable=g-import-not-at-top
  from configs import base  # pylint: disable=g-import-not-at-top
  (tmp_path / 'test.en').write_text('A man rides a bike on the lake.\nTwo children play.\nA dog runs.\n')
  (tmp_path / 'test.zh').write_text(''.join(f'{line}\n' for line in CHINESE), encoding='utf-8')
  data = base.get_config().data
  data.update(dataset='text', source_lang='en', target_lang='zh',
              test_files=f'{tmp_path / "test.en"},{tmp_path / "test.zh"}')
  _, references = input_pipeline.load_split(data, data.test_split)
  hypotheses = ['一个男人在湖边骑自行车。', '两个孩子在花园里玩耍，阳光明媚。', '一只猫在雪地里奔跑。']
  score, signature = bleu.sacrebleu_score(hypotheses, references, data.target_lang)
  assert 'tok:zh' in signature
  expected = sacrebleu.metrics.BLEU(tokenize='zh').corpus_score(hypotheses, [references]).score
  assert score == pytest.approx(expected) and 50 < score < 100
  # 13a sees each unsegmented Chinese sentence as one or two words: only the exact line scores.
  assert sacrebleu.metrics.BLEU(tokenize='13a').corpus_score(hypotheses, [references]).score < score / 2
  assert 'tok:zh' in bleu.all_bleu(hypotheses, references, 'zh')['bleu_signature']


@pytest.mark.parametrize('lang', ['de', 'fr'])
def test_lowercased_tokenized_bleu_reproduces_the_official_references(multi30k_dir, lang):
  """Our lowercasing, normalisation and tokenisation of the raw test_2016_flickr references is the official
  tokenised file (Multi30k's *.lc.norm.tok.*), so the literature's BLEU is computed the literature's way."""
  import gzip  # pylint: disable=g-import-not-at-top
  with gzip.open(multi30k_dir / f'test_2016_flickr.{lang}.gz', 'rt', encoding='utf-8') as f:
    raw = [line.rstrip('\n') for line in f]
  official = (multi30k_dir / f'test_2016_flickr.lc.norm.tok.{lang}').read_text(encoding='utf-8').splitlines()
  ours = [bleu.lowercase_normalize_tokenize(line, lang) for line in raw]
  import sacrebleu  # pylint: disable=g-import-not-at-top
  score = sacrebleu.metrics.BLEU(tokenize='none', force=True).corpus_score(ours, [official]).score
  assert score >= 99.5
  assert sum(a == b for a, b in zip(ours, official)) >= 990  # de: all 1,000 lines; fr: 999.


def test_lowercased_tokenized_bleu_ignores_case_and_counts_tokens():
  upper = [r.upper() for r in REFERENCES]
  assert bleu.lowercased_tokenized_bleu(upper, REFERENCES, 'de') == pytest.approx(100.0)
  assert bleu.sacrebleu_score(upper, REFERENCES, 'de')[0] < 10.0
  # 'See.' is two tokens after Moses tokenisation: dropping the full stop costs one unigram of 11 and the
  # n-grams through it, unsmoothed as multi-bleu.perl.
  hypothesis = ['ein mann fährt mit seinem haus-boot über den see', REFERENCES[1]]
  scores = bleu.all_bleu(hypothesis, REFERENCES, 'de')
  assert 0.0 < scores['lowercased_tokenized_bleu'] < 100.0
  assert set(scores) == {'bleu', 'bleu_signature', 'tokenized_bleu', 'lowercased_tokenized_bleu', 'length_ratio'}


@pytest.mark.parametrize('hypothesis, ratio', [('a b c', 0.75), ('a b c d', 1.0), ('a b c d e f', 1.5)])
def test_length_ratio_is_hypothesis_over_reference_tokens(hypothesis, ratio):
  scores = bleu.all_bleu([hypothesis, REFERENCES[0]], ['a b c d', REFERENCES[0]], 'de')
  tokens = len(sacrebleu.tokenizers.tokenizer_13a.Tokenizer13a()(REFERENCES[0]).split())
  assert scores['length_ratio'] == pytest.approx((len(hypothesis.split()) + tokens) / (4 + tokens))
  assert (scores['length_ratio'] < 1) == (ratio < 1)
