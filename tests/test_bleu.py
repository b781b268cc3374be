"""Tests for transformer_jax.bleu."""
import pytest

from transformer_jax import bleu

REFERENCES = ['Ein Mann fährt mit seinem Haus-Boot über den See.',
              'Zwei Kinder spielen im Garten, während die Sonne scheint.']


def test_identical_is_100():
  score, signature = bleu.sacrebleu_score(REFERENCES, REFERENCES)
  assert score == pytest.approx(100.0)
  assert 'tok:13a' in signature and 'case:mixed' in signature
  assert bleu.tokenized_bleu(REFERENCES, REFERENCES, 'de') == pytest.approx(100.0)


def test_disjoint_is_0():
  hypotheses = ['xx yy zz ww vv uu tt', 'qq rr ss pp oo nn mm ll']
  assert bleu.sacrebleu_score(hypotheses, REFERENCES)[0] == pytest.approx(0.0)
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
          > bleu.sacrebleu_score(hypotheses, references)[0])


def test_format_bleu_labels_both_scores():
  lines = bleu.format_bleu(REFERENCES, REFERENCES, 'de').splitlines()
  assert lines[0].startswith('bleu: 100.00') and 'tok:13a' in lines[0]
  assert lines[1].startswith('tokenized_bleu: 100.00')


@pytest.mark.parametrize('fn', [bleu.sacrebleu_score, bleu.tokenized_bleu, bleu.format_bleu])
def test_unequal_sizes_raise(fn):
  args = (['a b c'], REFERENCES) if fn is bleu.sacrebleu_score else (['a b c'], REFERENCES, 'de')
  with pytest.raises(ValueError, match='1 hypotheses but 2 references'):
    fn(*args)


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
  assert bleu.sacrebleu_score(upper, REFERENCES)[0] < 10.0
  # 'See.' is two tokens after Moses tokenisation: dropping the full stop costs one unigram of 11 and the
  # n-grams through it, unsmoothed as multi-bleu.perl.
  hypothesis = ['ein mann fährt mit seinem haus-boot über den see', REFERENCES[1]]
  scores = bleu.all_bleu(hypothesis, REFERENCES, 'de')
  assert 0.0 < scores['lowercased_tokenized_bleu'] < 100.0
  assert set(scores) == {'bleu', 'bleu_signature', 'tokenized_bleu', 'lowercased_tokenized_bleu'}
