"""The EVALB scorer (§6.3's F1) on hand-worked cases, and where PYEVALB agrees and differs."""
import random

import nltk
import pytest

from transformer_jax.evaluation import evalb

T = nltk.Tree.fromstring

# The dog saw a cat with a telescope .  Gold attaches the PP to the verb, the test tree to the noun.
GOLD_PP = ('(TOP (S (NP (DT The) (NN dog)) (VP (VBD saw) (NP (DT a) (NN cat)) (PP (IN with) (NP (DT a) '
           '(NN telescope)))) (. .)))')
TEST_PP = ('(TOP (S (NP (DT The) (NN dog)) (VP (VBD saw) (NP (NP (DT a) (NN cat)) (PP (IN with) (NP (DT a) '
           '(NN telescope))))) (. .)))')
# He looked up the word .  Function tag, PRT against ADVP, and a wrong POS tag.
GOLD_PRT = '(TOP (S (NP-SBJ (PRP He)) (VP (VBD looked) (PRT (RP up)) (NP (DT the) (NN word))) (. .)))'
TEST_PRT = '(TOP (S (NP (PRP He)) (VP (VBD looked) (ADVP (RB up)) (NP (DT the) (NN word))) (. .)))'
# John left .  The full stop attached inside the VP: deleted, so it changes no span.
GOLD_PUNCT = '(TOP (S (NP (NNP John)) (VP (VBD left)) (. .)))'
TEST_PUNCT = '(TOP (S (NP (NNP John)) (VP (VBD left) (. .))))'
# a b c d: the test bracket X(1,3) crosses gold NP(0,2) (and VP(2,4)): one crossing bracket.
GOLD_CROSS = '(S (NP (DT a) (NN b)) (VP (VB c) (NP (NN d))))'
TEST_CROSS = '(S (DT a) (X (NN b) (VB c)) (NP (NN d)))'
# A unary chain NP -> NP, the same on both sides.
UNARY = '(S (NP (NP (NNS dogs))) (VP (VBP bark)))'


def test_pp_attachment_worked_by_hand():
  # Gold, the full stop deleted (8 words): S(0,8) NP(0,2) VP(2,8) NP(3,5) PP(5,8) NP(6,8) = 6 brackets; test adds
  # NP(3,8) = 7; all 6 gold brackets matched. R = 6/6, P = 6/7, F1 = 2 * 6 / (6 + 7) = 12/13.
  counts = evalb.score_sentence(T(GOLD_PP), T(TEST_PP))
  assert (counts.gold_brackets, counts.test_brackets, counts.matched, counts.crossing) == (6, 7, 6, 0)
  assert (counts.words, counts.length) == (8, 9)  # The full stop counts for the cut-off length, not for words.
  scores = evalb.summarize([counts])
  assert scores.recall == 100.0
  assert scores.precision == pytest.approx(600 / 7, abs=1e-12)
  assert scores.f1 == pytest.approx(1200 / 13, abs=1e-12)  # 92.307692...
  assert scores.complete_match == 0.0


def test_function_tags_prt_advp_and_tags_worked_by_hand():
  # NP-SBJ is cut to NP; PRT and ADVP are one label: all 5 brackets match. The RP/RB tag is 1 wrong of 5 words.
  counts = evalb.score_sentence(T(GOLD_PRT), T(TEST_PRT))
  assert (counts.gold_brackets, counts.test_brackets, counts.matched) == (5, 5, 5)
  scores = evalb.summarize([counts])
  assert (scores.recall, scores.precision, scores.f1, scores.complete_match) == (100.0, 100.0, 100.0, 100.0)
  assert scores.tagging_accuracy == 80.0


def test_without_the_equivalence_prt_and_advp_differ():
  params = evalb.Params(equivalent_labels=())
  counts = evalb.score_sentence(T(GOLD_PRT), T(TEST_PRT), params)
  assert (counts.gold_brackets, counts.test_brackets, counts.matched) == (5, 5, 4)


def test_punctuation_is_deleted_by_each_trees_own_tag():
  counts = evalb.score_sentence(T(GOLD_PUNCT), T(TEST_PUNCT))
  assert (counts.gold_brackets, counts.test_brackets, counts.matched) == (3, 3, 3)
  # A test tree whose full stop is not tagged '.' keeps it: the words differ in number, an error sentence.
  untagged = evalb.score_sentence(T(GOLD_PUNCT), T('(TOP (S (NP (XX John)) (VP (XX left)) (XX .)))'))
  assert untagged.status == 1


def test_crossing_and_partial_match_worked_by_hand():
  # Gold S(0,4) NP(0,2) VP(2,4) NP(3,4); test S(0,4) X(1,3) NP(3,4): 2 matched. R = 2/4, P = 2/3.
  counts = evalb.score_sentence(T(GOLD_CROSS), T(TEST_CROSS))
  assert (counts.gold_brackets, counts.test_brackets, counts.matched, counts.crossing) == (4, 3, 2, 1)
  scores = evalb.summarize([counts])
  assert (scores.recall, scores.precision) == (50.0, pytest.approx(200 / 3, abs=1e-12))
  assert scores.f1 == pytest.approx(400 / 7, abs=1e-12)  # 2 * 50 * 66.67 / 116.67 = 57.142857...
  assert scores.average_crossing == 1.0
  # Y(0,3) starts before gold VP(2,4) and ends inside it: crossing from the other side.
  other_side = evalb.score_sentence(T(GOLD_CROSS), T('(S (Y (DT a) (NN b) (VB c)) (NP (NN d)))'))
  assert (other_side.matched, other_side.crossing) == (2, 1)


def test_repeated_brackets_are_matched_as_a_multiset():
  counts = evalb.score_sentence(T(UNARY), T(UNARY))
  assert (counts.gold_brackets, counts.test_brackets, counts.matched) == (4, 4, 4)
  flat = evalb.score_sentence(T(UNARY), T('(S (NP (NNS dogs)) (VP (VBP bark)))'))
  assert (flat.gold_brackets, flat.test_brackets, flat.matched) == (4, 3, 3)


def test_corpus_totals_sum_before_dividing_and_skip_error_sentences():
  counts = [evalb.score_sentence(T(GOLD_PP), T(TEST_PP)), evalb.score_sentence(T(GOLD_PUNCT), T(TEST_PUNCT)),
            evalb.score_sentence(T(GOLD_PUNCT), T('(TOP (S (NP (NNP Jim)) (VP (VBD left)) (. .)))'))]
  assert [c.status for c in counts] == [0, 0, 1]  # 'Jim' is not 'John': left out of every total.
  scores = evalb.summarize(counts)
  # Matched 6 + 3, gold 6 + 3, test 7 + 3: R = 100, P = 90, F1 = 1800 / 19 = 94.74 (the mean of the two
  # sentences' F1, 96.15, would be another figure).
  assert (scores.sentences, scores.error_sentences, scores.valid_sentences) == (3, 1, 2)
  assert (scores.matched, scores.gold_brackets, scores.test_brackets) == (9, 9, 10)
  assert (scores.recall, scores.precision) == (100.0, 90.0)
  assert scores.f1 == pytest.approx(1800 / 19, abs=1e-12)
  assert scores.complete_match == 50.0


def test_top_unlabelled_root_and_empty_elements():
  # TOP is deleted; an unlabelled root bracket is not (as in EVALB); a bracket over -NONE- only spans nothing.
  gold = T('(TOP (S (NP (-NONE- *)) (VP (VB go))))')
  counts = evalb.score_sentence(gold, gold)
  assert (counts.gold_brackets, counts.words, counts.length) == (2, 1, 1)  # S(0,1), VP(0,1).
  unlabelled = T('( (S (NP (NN it)) (VP (VB goes))))')
  assert evalb.score_sentence(unlabelled, unlabelled).gold_brackets == 4  # '', S, NP, VP.


def test_cutoff_length_counts_punctuation_but_not_empty_elements():
  words = ' '.join(f'(NN w{i})' for i in range(40))
  forty = T(f'(S (NP {words}) (. .))')  # 41 words with the full stop: over the cut-off.
  forty_traced = T(f'(S (NP {words}) (NP (-NONE- *)))')  # 40 words: within it.
  everything, short = evalb.score_corpus([forty, forty_traced], [forty, forty_traced])
  assert (everything.sentences, short.sentences) == (2, 1)


def test_skip_when_the_test_tree_has_no_word():
  assert evalb.score_sentence(T(GOLD_PUNCT), T('(TOP (. .))')).status == 2


def _pyevalb_scores(golds, tests):
  """PYEVALB's corpus recall, precision, F1 (percent), from one-line trees."""
  pyevalb_scorer = pytest.importorskip('PYEVALB.scorer')
  pyevalb_summary = pytest.importorskip('PYEVALB.summary')
  results = pyevalb_scorer.Scorer().score_corpus([g.pformat(margin=10**9) for g in golds],
                                                 [t.pformat(margin=10**9) for t in tests])
  summary = pyevalb_summary.summary(results)
  return summary.bracket_recall, summary.bracket_prec, summary.bracker_fmeasure


def test_pyevalb_differs_on_punctuation_root_function_tags_prt_and_repeats():
  # PYEVALB counts TOP and the full stop, compares NP-SBJ with NP and PRT with ADVP literally.
  assert _pyevalb_scores([T(GOLD_PRT)], [T(TEST_PRT)])[:2] == (pytest.approx(400 / 6), pytest.approx(400 / 6))
  assert _pyevalb_scores([T(GOLD_PUNCT)], [T(TEST_PUNCT)])[:2] == (75.0, 75.0)
  assert _pyevalb_scores([T(UNARY)], [T(UNARY)])[:2] == (75.0, 75.0)  # A set: NP(0,1) matched once of twice.
  assert evalb.summarize([evalb.score_sentence(T(UNARY), T(UNARY))]).f1 == 100.0


def _perturbed(tree: nltk.Tree, rng: random.Random) -> nltk.Tree:
  """The tree with some phrases flattened into their parent and some adjacent siblings grouped as X."""
  def walk(node):
    if isinstance(node[0], str):
      return [node]
    children = [grand for child in node for grand in walk(child)]
    if len(children) > 2 and rng.random() < 0.3:
      i = rng.randrange(len(children) - 1)
      children[i:i + 2] = [nltk.Tree('X', children[i:i + 2])]
    return children if rng.random() < 0.25 else [nltk.Tree(node.label(), children)]
  return nltk.Tree(tree.label(), [grand for child in tree for grand in walk(child)])


def test_pyevalb_agrees_without_punctuation_root_prt_or_repeats(synthetic_treebank):
  from transformer_jax.data import treebank  # pylint: disable=g-import-not-at-top
  rng = random.Random(0)
  golds = []
  for tree in treebank.split_trees(synthetic_treebank, 'train')[:600]:
    text = treebank.one_line(tree)
    if any(label in text for label in ('(. ', '(, ', '(PRT ')):  # Keep the trees PYEVALB scores the same way.
      text = text.replace('(. .)', '').replace('(, ,)', '')
      if '(PRT ' in text:
        continue
    gold = T(text)
    if any(len(sub) == 1 and not isinstance(sub[0], str) and sub[0].label() == sub.label()
           for sub in gold.subtrees()):
      continue  # A unary chain of one label.
    golds.append(gold)
  tests = [_perturbed(gold, rng) for gold in golds]
  ours = evalb.summarize([evalb.score_sentence(g, t) for g, t in zip(golds, tests)])
  assert len(golds) > 450 and 50 < ours.f1 < 95  # Enough trees, and perturbed enough to be a test.
  recall, precision, f1 = _pyevalb_scores(golds, tests)
  assert (ours.recall, ours.precision, ours.f1) == (pytest.approx(recall, abs=1e-9),
                                                    pytest.approx(precision, abs=1e-9), pytest.approx(f1, abs=1e-9))
