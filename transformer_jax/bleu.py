"""BLEU for evaluation (Sec. 6.1, Table 2), three ways.

* `sacrebleu_score`: sacreBLEU on detokenised text with its defaults (13a tokenisation, cased,
  exponential smoothing, one reference). This is the comparable, reproducible number; it returns the
  sacreBLEU signature so the setting travels with the score.
* `tokenized_bleu`: the number the paper's Table 2 reports, computed as tensor2tensor's
  get_ende_bleu.sh does: replace-unicode-punctuation.perl and tokenizer.perl (Moses, here through the
  `sacremoses` port: `MosesPunctNormalizer.replace_unicode_punct` and `MosesTokenizer.tokenize` with
  Moses's defaults, escaping on, no aggressive dash splitting), then split hyphenated compounds
  a-b -> a ##AT##-##AT## b, then multi-bleu.perl. multi-bleu.perl is reproduced by sacreBLEU with
  tokenize='none' (split on whitespace), cased, and no smoothing. Unlike the script, which
  reads an already tokenised reference file, both sides here start detokenised and get the same
  processing. Tokenized BLEU is typically higher than sacreBLEU and is not comparable across
  tokenisations.
* `lowercased_tokenized_bleu`: the number the Multi30k literature reports (e.g. Wu et al., 2021): both
  sides lowercased, Moses-normalised (normalize-punctuation.perl) and Moses-tokenised (tokenizer.perl,
  escaping on), as the official `test_2016_flickr.lc.norm.tok.<lang>` references were made, then
  multi-bleu.perl (sacreBLEU with tokenize='none', no smoothing). Applied to the raw Multi30k references it
  reproduces the official tokenised files (BLEU 100.0 for de, 99.99 for fr; tests/test_bleu.py).
"""
import functools
import re

import sacrebleu
import sacremoses

# get_ende_bleu.sh: perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g' (non-overlapping, as in Perl).
_COMPOUND = re.compile(r'(\S)-(\S)')


def _check_sizes(hypotheses: list[str], references: list[str]) -> None:
  if len(hypotheses) != len(references):
    raise ValueError(f'{len(hypotheses)} hypotheses but {len(references)} references')
  if not hypotheses:
    raise ValueError('BLEU needs at least one sentence, got 0 hypotheses and 0 references')


def sacrebleu_score(hypotheses: list[str], references: list[str]) -> tuple[float, str]:
  """Corpus sacreBLEU on detokenised text (13a tokenisation, cased: sacreBLEU's defaults).

  Args:
    hypotheses: detokenised system outputs, one per sentence.
    references: detokenised references, aligned with hypotheses.

  Returns:
    (score, signature): BLEU in [0, 100] and sacreBLEU's signature, e.g.
    'nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0'.

  Raises:
    ValueError: if the two lists differ in size, or are empty.
  """
  _check_sizes(hypotheses, references)
  metric = sacrebleu.metrics.BLEU()
  result = metric.corpus_score(hypotheses, [references])
  return result.score, str(metric.get_signature())


@functools.lru_cache(maxsize=None)
def _moses(lang: str) -> tuple[sacremoses.MosesPunctNormalizer, sacremoses.MosesTokenizer]:
  return sacremoses.MosesPunctNormalizer(lang=lang), sacremoses.MosesTokenizer(lang=lang)


def split_compounds(text: str) -> str:
  """Splits hyphenated compounds: 'Haus-Boot' -> 'Haus ##AT##-##AT## Boot' (get_ende_bleu.sh)."""
  return _COMPOUND.sub(r'\1 ##AT##-##AT## \2', text)


def moses_tokenize(text: str, lang: str) -> str:
  """replace-unicode-punctuation.perl then tokenizer.perl -l lang, via sacremoses.

  Args:
    text: one detokenised sentence.
    lang: language code of the text, e.g. 'de'.

  Returns:
    The tokens joined by single spaces, with Moses's XML escaping (e.g. '"' -> '&quot;').
  """
  normalizer, tokenizer = _moses(lang)
  return tokenizer.tokenize(normalizer.replace_unicode_punct(text), return_str=True, escape=True)


def tokenized_bleu(hypotheses: list[str], references: list[str], lang: str) -> float:
  """Tokenized BLEU with compound splitting, as reported in Table 2 (see the module docstring).

  Args:
    hypotheses: detokenised system outputs, one per sentence.
    references: detokenised references, aligned with hypotheses.
    lang: target language code for the Moses tokenizer, e.g. 'de'.

  Returns:
    BLEU in [0, 100] on Moses-tokenised, compound-split text, cased, unsmoothed.

  Raises:
    ValueError: if the two lists differ in size, or are empty.
  """
  _check_sizes(hypotheses, references)
  prepare = lambda text: split_compounds(moses_tokenize(text, lang))
  metric = sacrebleu.metrics.BLEU(tokenize='none', smooth_method='none', force=True)
  return metric.corpus_score([prepare(h) for h in hypotheses],
                             [[prepare(r) for r in references]]).score


def lowercase_normalize_tokenize(text: str, lang: str) -> str:
  """Lowercase, normalize-punctuation.perl -l lang, tokenizer.perl -l lang (Multi30k's preprocessing).

  Args:
    text: one detokenised sentence.
    lang: its language code, e.g. 'de'.

  Returns:
    The lowercased tokens joined by single spaces, with Moses's XML escaping ('"' -> '&quot;').
  """
  normalizer, tokenizer = _moses(lang)
  return tokenizer.tokenize(normalizer.normalize(text.lower()), return_str=True, escape=True)


def lowercased_tokenized_bleu(hypotheses: list[str], references: list[str], lang: str) -> float:
  """The Multi30k literature's BLEU: lowercased, Moses-normalised and -tokenised, multi-bleu.perl.

  Args:
    hypotheses: detokenised system outputs, one per sentence.
    references: detokenised (raw) references, aligned with hypotheses.
    lang: target language code, e.g. 'de'.

  Returns:
    BLEU in [0, 100], unsmoothed, on `lowercase_normalize_tokenize` of both sides.

  Raises:
    ValueError: if the two lists differ in size, or are empty.
  """
  _check_sizes(hypotheses, references)
  prepare = lambda text: lowercase_normalize_tokenize(text, lang)
  metric = sacrebleu.metrics.BLEU(tokenize='none', smooth_method='none', force=True)
  return metric.corpus_score([prepare(h) for h in hypotheses],
                             [[prepare(r) for r in references]]).score


def all_bleu(hypotheses: list[str], references: list[str], lang: str) -> dict[str, float | str]:
  """The three BLEUs of the module docstring, as {'bleu', 'bleu_signature', 'tokenized_bleu',
  'lowercased_tokenized_bleu'}.

  Raises:
    ValueError: if the two lists differ in size, or are empty.
  """
  score, signature = sacrebleu_score(hypotheses, references)
  return {'bleu': score, 'bleu_signature': signature,
          'tokenized_bleu': tokenized_bleu(hypotheses, references, lang),
          'lowercased_tokenized_bleu': lowercased_tokenized_bleu(hypotheses, references, lang)}


def format_bleu(hypotheses: list[str], references: list[str], lang: str) -> str:
  """The lines printed at the end of an evaluation.

  Args:
    hypotheses: detokenised system outputs, one per sentence.
    references: detokenised references, aligned with hypotheses.
    lang: target language code, e.g. 'de'.

  Returns:
    Two lines, e.g.
      bleu: 27.31 (sacreBLEU detokenised, nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0)
      tokenized_bleu: 27.95 (Moses-tokenized de, compound-split, as tensor2tensor get_ende_bleu.sh)

  Raises:
    ValueError: if the two lists differ in size, or are empty.
  """
  score, signature = sacrebleu_score(hypotheses, references)
  tokenized = tokenized_bleu(hypotheses, references, lang)
  return (f'bleu: {score:.2f} (sacreBLEU detokenised, {signature})\n'
          f'tokenized_bleu: {tokenized:.2f} (Moses-tokenized {lang}, compound-split, '
          f'as tensor2tensor get_ende_bleu.sh)')
