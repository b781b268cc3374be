"""§6.3's parsing score for a decoded treebank split: the outputs turned back into trees and scored with EVALB's
rules (`evalb.py`, COLLINS.prm), the validation metric (eval.metric='f1') that selects checkpoints, and the
final figures a parsing run prints and writes.

The outputs are linearised trees (`data/treebank.py`); `delinearize` repairs the malformed ones and puts the
sentence's words back, with the gold POS tags (the output has none: see data/treebank.py), so EVALB's
punctuation deletion acts on the same words in both trees and its tagging accuracy is 100 by construction.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from absl import logging
from etils import epath
import jax
import nltk

from transformer_jax.data import treebank
from transformer_jax.evaluation import evalb
from transformer_jax.storage import workdir as workdir_lib

# What a decoded split is scored by (`score_split`), EVALB's "-- All --" figures in percent, plus the share of
# outputs that `treebank.delinearize` had to repair and F1 over sentences of at most 40 words.
SCORES = ('f1', 'precision', 'recall', 'complete_match', 'repaired_fraction', 'f1_len40')
TREE_SUFFIX = 'tree'  # Output files: <split>.hyp.tree (the parser's trees) and <split>.gold.tree, one per line.


def output_trees(hypotheses: Sequence[str], gold_trees: Sequence[Any]) -> tuple[list[Any], int]:
  """The trees of the outputs over the gold trees' words and tags (`treebank.delinearize`).

  Args:
    hypotheses: one decoded output per sentence (space-separated tokens).
    gold_trees: the split's cleaned gold trees (nltk.Tree), aligned with hypotheses.

  Returns:
    (trees under a TOP node, how many outputs needed a repair).

  Raises:
    ValueError: if the two lists differ in length.
  """
  if len(hypotheses) != len(gold_trees):
    raise ValueError(f'{len(hypotheses)} outputs for {len(gold_trees)} gold trees')
  trees, repaired = [], 0
  for hypothesis, gold in zip(hypotheses, gold_trees):
    words, tags = treebank.words_and_tags(gold)
    tree, fixed = treebank.delinearize(hypothesis, words, tags)
    trees.append(tree)
    repaired += fixed
  return trees, repaired


def score_split(hypotheses: Sequence[str], gold_trees: Sequence[Any]) -> dict[str, float]:
  """EVALB (COLLINS.prm) figures of decoded outputs against the gold trees.

  Returns:
    {SCORES: 'f1', 'precision', 'recall', 'complete_match' (percent, all sentences), 'repaired_fraction' (in
    [0, 1]), 'f1_len40' (percent, sentences of at most 40 words)}, plus 'error_sentences' (sentences EVALB
    would leave out; 0 unless the words differ, which `output_trees` prevents).
  """
  trees, repaired = output_trees(hypotheses, gold_trees)
  gold = [nltk.Tree(treebank.ROOT_LABEL, [tree]) for tree in gold_trees]
  everything, short = evalb.score_corpus(gold, trees)
  return {'f1': everything.f1, 'precision': everything.precision, 'recall': everything.recall,
          'complete_match': everything.complete_match, 'repaired_fraction': repaired / max(len(trees), 1),
          'f1_len40': short.f1, 'error_sentences': float(everything.error_sentences)}


def tree_line(hypothesis: str, sentence: str) -> str:
  """--mode=translate of a parser: the output over the sentence's words (split at spaces) as one bracketed line
  under TOP, every POS tag PLACEHOLDER ('XX'; the parser predicts none)."""
  return treebank.one_line(treebank.delinearize(hypothesis, sentence.split())[0])


def log_validation(scores: dict[str, float], step: int, beam_size: int, seconds: float) -> None:
  """The validation F1 log line of a training run."""
  logging.info('validation F1 at step %d | f1 %.2f | precision %.2f | recall %.2f | complete match %.2f | '
               'repaired %.1f%% | beam %d | %.1f s', step, scores['f1'], scores['precision'], scores['recall'],
               scores['complete_match'], 100 * scores['repaired_fraction'], beam_size, seconds)


def write_trees(output_dir: str, split: str, hypotheses: Sequence[str], gold_trees: Sequence[Any]) -> epath.Path:
  """Writes `<output_dir>/<split>.hyp.tree` (the parser's trees) and `<split>.gold.tree` (the cleaned gold
  trees), one bracketed tree per line under TOP, which the original EVALB reads:
  `evalb -p COLLINS.prm dev.gold.tree dev.hyp.tree`. Process 0 only.

  Returns:
    The path of the hypotheses file.
  """
  path = epath.Path(workdir_lib.path(output_dir, workdir_lib.hypotheses_file(split, TREE_SUFFIX)))
  if jax.process_index() == 0:
    trees, _ = output_trees(hypotheses, gold_trees)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(''.join(treebank.one_line(tree) + '\n' for tree in trees), encoding='utf-8')
    gold = epath.Path(workdir_lib.path(output_dir, f'{split}.gold.{TREE_SUFFIX}'))
    gold.write_text(''.join(treebank.one_line(nltk.Tree(treebank.ROOT_LABEL, [tree])) + '\n'
                            for tree in gold_trees), encoding='utf-8')
  return path


def final_scores(config, decode: Callable[[Any], tuple[list[str], dict[str, float], float]], eval_split,
                 test_split, output_dir: str, steps: list[int]) -> dict[str, float]:
  """Decodes and scores the validation and test splits with the final parameters, writes their trees, prints
  the figures.

  Args:
    config: the run's config (data.eval_split, data.test_split, decode.*).
    decode: split -> (hypotheses, `score_split` figures, seconds): evaluate.translate_split with the chosen
      parameters.
    eval_split, test_split: `input_pipeline.encode_split` of the two splits (with their gold trees).
    output_dir: where the trees go.
    steps: the checkpoint steps the parameters come from, for the printed line.

  Returns:
    {'validation_<score>'} for every SCORES of the validation split, the test split's SCORES under their own
    names, and 'decode_sentences_per_sec' (test).
  """
  data_cfg, results = config.data, {}
  hypotheses, scores, _ = decode(eval_split)
  write_trees(output_dir, data_cfg.eval_split, hypotheses, eval_split.trees)
  results |= {f'validation_{key}': scores[key] for key in SCORES}
  hypotheses, scores, seconds = decode(test_split)
  path = write_trees(output_dir, data_cfg.test_split, hypotheses, test_split.trees)
  results |= {key: scores[key] for key in SCORES}
  results['decode_sentences_per_sec'] = len(hypotheses) / max(seconds, 1e-9)
  logging.info('Parsed %d sentences in %.1f s; trees in %s', len(hypotheses), seconds, path)
  decode_cfg = config.decode
  print(f'validation_f1: {results["validation_f1"]:.2f}  (EVALB COLLINS.prm, {data_cfg.eval_split}; precision '
        f'{results["validation_precision"]:.2f}, recall {results["validation_recall"]:.2f})')
  print(f'f1: {results["f1"]:.2f}  (EVALB COLLINS.prm, {data_cfg.test_split}; precision {results["precision"]:.2f}, '
        f'recall {results["recall"]:.2f}, complete match {results["complete_match"]:.2f}, <=40 words '
        f'{results["f1_len40"]:.2f}, repaired outputs {100 * results["repaired_fraction"]:.1f}%; beam '
        f'{decode_cfg.beam_size}, alpha {decode_cfg.alpha:g}, max length input + {decode_cfg.extra_length}; '
        f'{config.eval.checkpoint_selection}: steps {steps})')
  return results
