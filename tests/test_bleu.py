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
