"""Labelled bracket precision, recall and F1 as EVALB computes them (Sekine & Collins, 1997) with COLLINS.prm:
the parsing score of §6.3 (Table 4: "WSJ 23 F1").

A re-implementation of EVALB's counting rules, written from its README and parameter file, on `nltk.Tree`s:

  - Words: a word whose POS tag is a DELETE_LABEL (COLLINS.prm: -NONE- and the punctuation tags , : `` '' .) is
    removed, from the gold tree by its gold tag and from the test tree by its own tag (EVALB reads each tree
    alone). The remaining words must agree one for one, else the sentence is an error sentence, left out of
    every total (EVALB's "Length unmatch" / "Words unmatch").
  - Brackets: every node above the POS level, as (label, first word, last word + 1) over the remaining words.
    The label is cut at its first '-' or '=' (NP-SBJ-1 -> NP); a bracket whose label is then a DELETE_LABEL (TOP)
    or that spans no remaining word is not counted (an unlabelled root bracket, '( (S ...) )', is counted, as
    in EVALB: give it the label TOP). Labels in an EQ_LABEL pair (ADVP, PRT) are equal.
  - Matching: each gold bracket matches at most one test bracket of the same span and an equal label (a
    multiset intersection: a unary chain NP -> NP counts twice on both sides).
  - Totals over the valid sentences: recall = matched / gold brackets, precision = matched / test brackets,
    F1 = 2PR / (P + R), in percent, summed over sentences before dividing (not averaged per sentence); complete
    match = sentences with matched = gold = test; crossing brackets per test bracket, as EVALB; tagging accuracy
    over the remaining words. The same figures over sentences of at most CUTOFF_LEN (40) words, counted without
    DELETE_LABEL_FOR_LENGTH (-NONE-) words but with punctuation.

Where PYEVALB (pip) differs, measured in tests/test_parsing_evalb.py: it deletes no word or label (punctuation and
the root bracket count), has no ADVP = PRT, and matches brackets as a set (a repeated bracket is matched once but
counted twice), so it agrees with this scorer only on trees without punctuation, root wrapper, PRT or unary
chains of one label. EVALB's QUOTE_LABEL repair (newer versions only, not in COLLINS.prm) is not implemented.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
import dataclasses

import nltk


@dataclasses.dataclass(frozen=True)
class Params:
  """An EVALB parameter file's settings; the defaults are COLLINS.prm's."""
  delete_labels: tuple[str, ...] = ('TOP', '-NONE-', ',', ':', '``', "''", '.')
  delete_labels_for_length: tuple[str, ...] = ('-NONE-',)
  equivalent_labels: tuple[tuple[str, str], ...] = (('ADVP', 'PRT'),)
  cutoff_length: int = 40
  labeled: bool = True


COLLINS = Params()


@dataclasses.dataclass(frozen=True)
class SentenceCounts:
  """One sentence's counts (EVALB's per-sentence line). status: 0 valid, 1 error (words differ), 2 skip (the test
  tree has no word)."""
  status: int
  length: int              # Words, DELETE_LABEL_FOR_LENGTH words left out (the cut-off's length).
  gold_brackets: int = 0
  test_brackets: int = 0
  matched: int = 0
  crossing: int = 0
  words: int = 0           # Words left after deletion.
  correct_tags: int = 0


def _cut(label: str) -> str:
  """A bracket label as EVALB's modify_label leaves it: cut at the first '-' or '=' (NP-SBJ-1 -> NP)."""
  for i, char in enumerate(label):
    if char in '-=':
      return label[:i]
  return label


def _same_label(first: str, second: str, params: Params) -> bool:
  """EVALB's label_comp: equal, or an EQ_LABEL pair."""
  return first == second or (first, second) in params.equivalent_labels or (
      second, first) in params.equivalent_labels


def _class_of(label: str, params: Params) -> str:
  """One name per EQ_LABEL class (PRT -> ADVP), so that equal labels count as one in a multiset."""
  for first, second in params.equivalent_labels:
    if label == second:
      return first
  return label


def _is_preterminal(node) -> bool:
  return isinstance(node, nltk.Tree) and len(node) == 1 and isinstance(node[0], str)


def _terminals_and_brackets(tree: nltk.Tree, params: Params):
  """(kept (word, tag) pairs, brackets [(label, start, end)] over kept words, length for the cut-off)."""
  terminals, brackets, length = [], [], 0
  deleted = set(params.delete_labels)

  def walk(node):
    nonlocal length
    if _is_preterminal(node):
      length += node.label() not in params.delete_labels_for_length
      if node.label() not in deleted:
        terminals.append((node[0], node.label()))
      return
    if isinstance(node, str):  # A word outside a POS node: counts as a word without a tag.
      terminals.append((node, ''))
      length += 1
      return
    start = len(terminals)
    for child in node:
      walk(child)
    label = _cut(node.label())
    if len(terminals) > start and not any(_same_label(label, d, params) for d in params.delete_labels):
      brackets.append((_class_of(label, params) if params.labeled else '', start, len(terminals)))
  walk(tree)
  return terminals, brackets, length


def score_sentence(gold: nltk.Tree, test: nltk.Tree, params: Params = COLLINS) -> SentenceCounts:
  """EVALB's counts for one sentence (see the module docstring).

  Args:
    gold: the gold tree (POS tags over words; any root).
    test: the parser's tree over the same words.
    params: the parameter file's settings (COLLINS.prm by default).
  """
  gold_terms, gold_brackets, length = _terminals_and_brackets(gold, params)
  test_terms, test_brackets, _ = _terminals_and_brackets(test, params)
  if not test_terms:
    return SentenceCounts(status=2, length=length)
  if [w for w, _ in gold_terms] != [w for w, _ in test_terms]:
    return SentenceCounts(status=1, length=length)
  matched = sum((Counter(gold_brackets) & Counter(test_brackets)).values())
  gold_spans = [(start, end) for _, start, end in gold_brackets]
  crossing = sum(any(gs < ts < ge < te or ts < gs < te < ge for gs, ge in gold_spans)
                 for _, ts, te in test_brackets)
  correct_tags = sum(_same_label(g, t, params) for (_, g), (_, t) in zip(gold_terms, test_terms))
  return SentenceCounts(status=0, length=length, gold_brackets=len(gold_brackets),
                        test_brackets=len(test_brackets), matched=matched, crossing=crossing,
                        words=len(gold_terms), correct_tags=correct_tags)


@dataclasses.dataclass(frozen=True)
class Scores:
  """EVALB's summary over a corpus; percentages in [0, 100]."""
  sentences: int
  error_sentences: int
  skipped_sentences: int
  valid_sentences: int
  recall: float
  precision: float
  f1: float
  complete_match: float
  average_crossing: float
  tagging_accuracy: float
  matched: int
  gold_brackets: int
  test_brackets: int


def summarize(counts: Sequence[SentenceCounts]) -> Scores:
  """EVALB's totals (its "-- All --" block) of per-sentence counts."""
  valid = [c for c in counts if c.status == 0]
  matched, gold, test = (sum(getattr(c, key) for c in valid) for key in ('matched', 'gold_brackets',
                                                                          'test_brackets'))
  recall = 100.0 * matched / gold if gold else 0.0
  precision = 100.0 * matched / test if test else 0.0
  f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
  words = sum(c.words for c in valid)
  n = len(valid)
  return Scores(
      sentences=len(counts), error_sentences=sum(c.status == 1 for c in counts),
      skipped_sentences=sum(c.status == 2 for c in counts), valid_sentences=n, recall=recall,
      precision=precision, f1=f1,
      complete_match=100.0 * sum(c.matched == c.gold_brackets == c.test_brackets for c in valid) / n if n else 0.0,
      average_crossing=sum(c.crossing for c in valid) / n if n else 0.0,
      tagging_accuracy=100.0 * sum(c.correct_tags for c in valid) / words if words else 0.0,
      matched=matched, gold_brackets=gold, test_brackets=test)


def score_corpus(golds: Sequence[nltk.Tree], tests: Sequence[nltk.Tree], params: Params = COLLINS
                 ) -> tuple[Scores, Scores]:
  """EVALB's summaries of a test corpus against its gold trees: (all sentences, sentences of at most
  params.cutoff_length words).

  Raises:
    ValueError: if the corpora have different numbers of trees.
  """
  if len(golds) != len(tests):
    raise ValueError(f'{len(golds)} gold trees but {len(tests)} test trees')
  counts = [score_sentence(gold, test, params) for gold, test in zip(golds, tests)]
  return summarize(counts), summarize([c for c in counts if c.length <= params.cutoff_length])
