"""A constituency treebank as sequence pairs (§6.3): reading PTB-style trees and the linearisation of Vinyals
et al. (2015), "Grammar as a Foreign Language", which §6.3 follows.

§6.3 trains the Transformer on "the Wall Street Journal (WSJ) portion of the Penn Treebank (Marcus et al., 1993),
about 40K training sentences" and reports section 23 F1. No treebank ships with this repository (the Penn
Treebank is licensed): `data.treebank_dir` names the user's folder (`split_files` says which layouts it reads).

Reading: trees are parsed by `nltk.Tree` (no bracket parser of our own). `.mrg` files hold trees over several
lines each (the Penn Treebank's own files, split into trees by nltk's s-expression reader); any other file holds
one tree per line. A tree that does not parse, or that has a word not under exactly one POS tag, stops the run
with `TreebankError` naming the file and line.

Cleaning (`clean`), the usual preprocessing before EVALB: empty elements (-NONE-) and the constituents left
empty without them are removed; function tags and indices are cut from phrase labels (NP-SBJ-1 -> NP, as EVALB
cuts them; POS tags such as -LRB- are kept); the unlabelled, TOP or ROOT bracket around the sentence is removed.

Linearisation (`linearize`), Vinyals et al. (2015) §2: a depth-first walk that writes an opening token '(LABEL'
for each phrase, PLACEHOLDER ('XX') for each word, and a closing token ')LABEL' that repeats the label:

  (S (NP (DT The) (NN dog)) (VP (VBD barked)) (. .))  ->  (S (NP XX XX )NP (VP XX )VP XX )S

POS tags are replaced by the placeholder, as Vinyals et al. do ("we normalized all POS tags to XX"; they report
that this did not hurt, indeed helped, F1): EVALB's bracket F1 does not score POS tags, the output is one token
per word instead of a tag per word, and the placeholder lets `delinearize` put the input words back in order.
The tags of a parsed sentence are then unknown: scoring gives the predicted tree the gold tags
(`evaluation/parsing.py`), so EVALB's tagging accuracy is not a result here. Words never appear in the
output, so the output vocabulary is the bracket tokens and the placeholder (`output_symbols`), which the
tokenizer keeps as single pieces.

Not the paper's: `linearize(tree, target='words')` (data.treebank_target='words') writes each word itself where
Vinyals et al. write XX, '(S (NP The dog )NP (VP barked )VP . )S': the decoder can then find its place in the
sentence by the word it last wrote (a copy that attention can follow) instead of counting placeholders. A word
that starts with '(' or ')' would read as a bracket token and is written as XX. `delinearize` reads both
targets alike: every token that is not a bracket is the next word's slot, whatever it says; the words of the
tree are always the input's.

`delinearize` is the inverse, and repairs an output that is not a well-formed tree: a closing token with no open
bracket is dropped, brackets left open are closed, placeholders beyond the number of words are dropped and words
without a placeholder are attached at the end of the sentence's top constituent; brackets that hold no word are
dropped; the result is always under a TOP node (which EVALB ignores).
"""
from __future__ import annotations

from collections.abc import Sequence
import functools
import io
import os
import pathlib
import re
from typing import Any

import nltk
from nltk.corpus.reader.util import read_sexpr_block

from transformer_jax import errors

PLACEHOLDER = 'XX'  # Every POS tag of the output (Vinyals et al., 2015).
# data.treebank_target: what stands for a word in the output: 'xx' (PLACEHOLDER, Vinyals et al. and §6.3) or
# 'words' (the word itself; not the paper's).
TARGETS = ('xx', 'words')
ROOT_LABEL = 'TOP'  # The node `delinearize` puts every output under; EVALB's COLLINS.prm deletes it.
WSJ_SPLITS = {'train': range(2, 22), 'dev': (22,), 'test': (23,)}  # The standard sections: 02-21, 22, 23.
SPLIT_NAMES = tuple(WSJ_SPLITS)
_WSJ_FILE = re.compile(r'^wsj_(\d\d)\d\d\.mrg$', re.IGNORECASE)
_EMPTY_ELEMENT = '-NONE-'
_ROOT_LABELS = ('', 'TOP', 'ROOT')


class TreebankError(errors.DamagedFileError):
  """A tree file that cannot be read as PTB-style bracketed trees; the message names the file and line."""


class TreebankLayoutError(errors.ConfigError):
  """data.treebank_dir holds neither WSJ sections nor train/dev/test files (the message lists what it needs)."""


# --------------------------------------------------------------------------------------------------- reading


def _check_tree(tree: nltk.Tree, where: str) -> None:
  """Raises TreebankError (at `where`, 'file:line') unless every word is the only child of a POS tag."""
  for subtree in tree.subtrees():
    words = [child for child in subtree if isinstance(child, str)]
    if words and len(subtree) != 1:
      raise TreebankError(f'{where}: ({subtree.label()} ...) mixes words and brackets or holds several words '
                          f'({" ".join(words)!r}): each word must be the only child of its POS tag, '
                          f'as in (NN dog)')
  if not tree.leaves():
    raise TreebankError(f'{where}: the tree has no word')


def _parse(text: str, where: str) -> nltk.Tree:
  """One tree from its bracketed text, with nltk; TreebankError naming `where` ('file:line') if it fails."""
  try:
    tree = nltk.Tree.fromstring(text, remove_empty_top_bracketing=True)
  except ValueError as e:
    reason = ' '.join(str(e).split('\n')[0].split())
    raise TreebankError(f'{where}: not a bracketed tree ({reason}): {text.strip()[:80]!r}') from None
  if isinstance(tree, str):
    raise TreebankError(f'{where}: not a bracketed tree: {text.strip()[:80]!r}')
  _check_tree(tree, where)
  return tree


def _read_text(path: pathlib.Path) -> str:
  """A file's text as UTF-8; TreebankError naming the file and line for invalid bytes."""
  data = path.read_bytes()
  try:
    return data.decode('utf-8').removeprefix('\ufeff')
  except UnicodeDecodeError as e:
    line = data.count(b'\n', 0, e.start) + 1
    raise TreebankError(f'{path}:{line}: not valid UTF-8 ({e.reason})') from None


def read_trees(path: str | os.PathLike[str]) -> list[nltk.Tree]:
  """Reads the trees of one file, cleaned (`clean`), in file order.

  A `.mrg` file (the Penn Treebank's own) holds trees over several lines each, split by nltk's s-expression
  reader; any other file holds one tree per non-blank line.

  Args:
    path: the file.

  Returns:
    nltk.Tree per tree: phrase nodes over POS nodes over one word (str) each.

  Raises:
    errors.MissingFileError: if the file does not exist.
    TreebankError: naming the file and the (first) line of a tree that nltk cannot parse, that has a word not
      alone under a POS tag, no word, or only empty elements; or for invalid UTF-8.
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise errors.MissingFileError(f'data.treebank_dir: {path} does not exist')
  text = _read_text(path)
  trees = []
  if path.suffix.lower() == '.mrg':
    stream, start = io.StringIO(text), 0
    while block := read_sexpr_block(stream, block_size=1 << 20):
      for chunk in block:
        offset = text.find(chunk, start)
        start = offset + len(chunk)
        where = f'{path}:{text.count(chr(10), 0, offset) + 1}'
        if chunk.count('(') != chunk.count(')'):
          raise TreebankError(f'{where}: unbalanced brackets ({chunk.count("(")} open, {chunk.count(")")} '
                              f'closed) in {" ".join(chunk.split())[:80]!r}')
        trees.append(clean(_parse(chunk, where), where))
  else:
    for number, line in enumerate(text.split('\n'), start=1):
      if line.strip():
        where = f'{path}:{number}'
        trees.append(clean(_parse(line, where), where))
  return trees


# -------------------------------------------------------------------------------------------------- cleaning


def _is_preterminal(tree: Any) -> bool:
  return isinstance(tree, nltk.Tree) and len(tree) == 1 and isinstance(tree[0], str)


def phrase_label(label: str) -> str:
  """A phrase label without function tags or indices, cut where EVALB cuts (NP-SBJ-1 -> NP, S=2 -> S)."""
  if label.startswith('-'):  # -NONE-, -LRB-: a label, not a function tag.
    return label
  return re.split(r'[-=]', label, maxsplit=1)[0] or label


def clean(tree: nltk.Tree, where: str = '<tree>') -> nltk.Tree:
  """The tree without empty elements, function tags or root bracket (see the module docstring); a new tree.

  Raises:
    TreebankError: naming `where` if nothing but empty elements is left.
  """
  def strip(node):
    if _is_preterminal(node):
      return None if node.label() == _EMPTY_ELEMENT else nltk.Tree(node.label(), [node[0]])
    children = [kept for kept in map(strip, node) if kept is not None]
    return nltk.Tree(phrase_label(node.label()), children) if children else None
  cleaned = strip(tree)
  if cleaned is None:
    raise TreebankError(f'{where}: the tree holds only empty elements (-NONE-)')
  while cleaned.label() in _ROOT_LABELS and len(cleaned) == 1 and not _is_preterminal(cleaned[0]):
    cleaned = cleaned[0]
  if cleaned.label() == '':
    cleaned.set_label(ROOT_LABEL)
  return cleaned


# ------------------------------------------------------------------------------------------ (de)linearisation


def words_and_tags(tree: nltk.Tree) -> tuple[list[str], list[str]]:
  """(words, POS tags) of a tree, in order."""
  pairs = tree.pos()
  return [word for word, _ in pairs], [tag for _, tag in pairs]


def _is_bracket_token(token: str) -> bool:
  """Whether `delinearize` reads `token` as a bracket: '(LABEL' (more than the '(') or anything from ')'."""
  return (token.startswith('(') and len(token) > 1) or token.startswith(')')


def linearize(tree: nltk.Tree, target: str = 'xx') -> list[str]:
  """Vinyals et al. (2015)'s linearisation: '(LABEL' ... ')LABEL' per phrase, PLACEHOLDER (or the word) per word.

  Args:
    tree: a cleaned tree (`clean`).
    target: one of TARGETS: 'xx', PLACEHOLDER for every word (Vinyals et al.; §6.3); 'words', the word itself,
      except a word that `delinearize` would read as a bracket token (starting with '(' and longer than it, or
      with ')'), which is PLACEHOLDER.

  Returns:
    The output tokens, e.g. ['(S', '(NP', 'XX', 'XX', ')NP', '(VP', 'XX', ')VP', 'XX', ')S'], or with 'words'
    ['(S', '(NP', 'The', 'dog', ')NP', '(VP', 'barked', ')VP', '.', ')S']; one word token per word of the tree.

  Raises:
    ValueError: for a target not in TARGETS.
  """
  if target not in TARGETS:
    raise ValueError(f'target {target!r} is none of {TARGETS}')
  if _is_preterminal(tree):
    word = tree[0]
    return [word if target == 'words' and not _is_bracket_token(word) else PLACEHOLDER]
  tokens = [f'({tree.label()}']
  for child in tree:
    tokens += linearize(child, target)
  return tokens + [f'){tree.label()}']


def delinearize(tokens: str | Sequence[str], words: Sequence[str], tags: Sequence[str] | None = None
                ) -> tuple[nltk.Tree, bool]:
  """The tree of an output sequence over `words`, repaired where the output is not well formed.

  Tokens starting with '(' (and longer than it) open a phrase of that label; tokens starting with ')' close the
  innermost open phrase (whatever label they repeat); any other token (PLACEHOLDER, or a word of the 'words'
  target, whatever it says) stands for the next word. Repairs (see the module docstring):
  unmatched closing tokens are dropped, open phrases closed, extra word slots dropped, missing words attached
  at the end of the top phrase, phrases without words dropped.

  Args:
    tokens: the output (of either target of `linearize`), a str of space-separated tokens or a sequence of
      tokens.
    words: the sentence's words.
    tags: the POS tag of each word (the gold tags when scoring); None: PLACEHOLDER for every word.

  Returns:
    (tree, repaired): the tree under a ROOT_LABEL ('TOP') node, its leaves exactly `words`; repaired is True
    when the output needed a repair.

  Raises:
    ValueError: if tags is given with a length other than len(words).
  """
  if tags is not None and len(tags) != len(words):
    raise ValueError(f'{len(tags)} tags for {len(words)} words')
  tags = list(tags) if tags is not None else [PLACEHOLDER] * len(words)
  tokens = tokens.split() if isinstance(tokens, str) else list(tokens)
  root = nltk.Tree(ROOT_LABEL, [])
  stack, next_word, repaired = [root], 0, False
  for token in tokens:
    if token.startswith('(') and len(token) > 1:
      node = nltk.Tree(token[1:], [])
      stack[-1].append(node)
      stack.append(node)
    elif token.startswith(')'):
      if len(stack) == 1:
        repaired = True
        continue
      stack.pop()
    elif next_word < len(words):
      stack[-1].append(nltk.Tree(tags[next_word], [words[next_word]]))
      next_word += 1
    else:
      repaired = True  # A word slot beyond the sentence.
  repaired |= len(stack) > 1 or next_word < len(words)
  if next_word < len(words):  # Missing words: at the end of the top phrase (or the root without one).
    top = root[-1] if len(root) == 1 and not _is_preterminal(root[-1]) else root
    top.extend(nltk.Tree(tag, [word]) for word, tag in zip(words[next_word:], tags[next_word:]))

  repaired |= any(not node.leaves() for node in root.subtrees() if node is not root)

  def prune(node):  # Phrases that hold no word.
    if _is_preterminal(node):
      return node
    children = [kept for kept in map(prune, node) if kept is not None]
    return nltk.Tree(node.label(), children) if children else None
  pruned = prune(root) or nltk.Tree(ROOT_LABEL, [])
  return pruned, repaired


def one_line(tree: nltk.Tree) -> str:
  """The tree as one bracketed line, e.g. '(TOP (S (NP (DT The) (NN dog)) (VP (VBD barked))))': what EVALB reads."""
  return tree.pformat(margin=1 << 30)


def output_symbols(trees: Sequence[nltk.Tree]) -> list[str]:
  """The output vocabulary's tokens: '(L' and ')L' for every phrase label L of `trees`, and PLACEHOLDER, sorted."""
  labels = {node.label() for tree in trees for node in tree.subtrees() if not _is_preterminal(node)}
  return sorted({PLACEHOLDER} | {f'({label}' for label in labels} | {f'){label}' for label in labels})


# ------------------------------------------------------------------------------------------------ the folder


def split_files(treebank_dir: str | os.PathLike[str]) -> dict[str, list[pathlib.Path]]:
  """The files of each split (SPLIT_NAMES: 'train', 'dev', 'test') in a treebank folder.

  Two layouts: WSJ sections, when the folder (searched recursively) holds files named wsj_SSNN.mrg, as the Penn
  Treebank's parsed/mrg/wsj/SS/ folders do: the standard split, sections 02-21 train, 22 dev, 23 test (§6.3's
  WSJ setting). Otherwise files directly in the folder whose names start with 'train', 'dev' and 'test'
  (train.txt, dev.mrg, test.trees, ...; several per split are read in name order).

  Raises:
    errors.MissingFileError: naming the folder, if it does not exist.
    TreebankLayoutError: naming the folder and what it lacks, if it has neither layout (or a WSJ folder
      lacks a section of the split).
  """
  folder = pathlib.Path(treebank_dir)
  if not str(treebank_dir):
    raise errors.ConfigError('data.treebank_dir is empty: pass the folder of your treebank, '
                             '--config.data.treebank_dir=DIR (README, "Constituency parsing")')
  if not folder.is_dir():
    shown = os.path.abspath(folder)
    raise errors.MissingFileError(f'data.treebank_dir: the folder {shown} does not exist')
  sections: dict[int, list[pathlib.Path]] = {}
  for path in sorted(folder.rglob('*')):
    if match := _WSJ_FILE.match(path.name):
      sections.setdefault(int(match[1]), []).append(path)
  if sections:
    files = {}
    for split, numbers in WSJ_SPLITS.items():
      missing = [f'{n:02d}' for n in numbers if n not in sections]
      if missing:
        raise TreebankLayoutError(f'data.treebank_dir={folder} holds WSJ files (wsj_SSNN.mrg) but no section '
                                  f'{", ".join(missing)} of the {split} split (train 02-21, dev 22, test 23)')
      files[split] = [path for n in numbers for path in sections[n]]
    return files
  files = {split: sorted(path for path in folder.iterdir() if path.is_file() and path.name.startswith(split))
           for split in SPLIT_NAMES}
  missing = [split for split, paths in files.items() if not paths]
  if missing:
    raise TreebankLayoutError(
        f'data.treebank_dir={folder} has no file for split {", ".join(missing)}: it needs WSJ sections '
        '(wsj_SSNN.mrg files: train 02-21, dev 22, test 23) or files named train*, dev* and test* (bracketed '
        'trees, one per line, or .mrg files)')
  return files


@functools.lru_cache(maxsize=8)
def _split_trees(files: tuple[tuple[str, float, int], ...]) -> tuple[nltk.Tree, ...]:
  """The trees of files given as (path, mtime, size): cached while the files are unchanged."""
  return tuple(tree for path, _, _ in files for tree in read_trees(path))


def split_trees(treebank_dir: str | os.PathLike[str], split: str) -> tuple[nltk.Tree, ...]:
  """The cleaned trees of one split ('train', 'dev' or 'test'), in file order (cached: a split is read once).

  Raises:
    errors.ConfigError: for a split name not in SPLIT_NAMES.
    errors.MissingFileError, TreebankLayoutError: as `split_files`.
    TreebankError: as `read_trees`, or if the split holds no tree.
  """
  if split not in SPLIT_NAMES:
    raise errors.ConfigError(f"Split {split!r} is none of a treebank's splits {SPLIT_NAMES} (data.train_split, "
                             'eval_split and test_split)')
  paths = split_files(treebank_dir)[split]
  trees = _split_trees(tuple((str(p), p.stat().st_mtime, p.stat().st_size) for p in paths))
  if not trees:
    raise TreebankError(f'The {split} split of data.treebank_dir={treebank_dir} holds no tree '
                        f'({", ".join(map(str, paths))})')
  return trees


def split_pairs(treebank_dir: str | os.PathLike[str], split: str, target: str = 'xx'
                ) -> tuple[list[str], list[str]]:
  """(sources, targets) of a split: each sentence's words joined by spaces, and its linearisation (`linearize`
  with `target`, 'xx' or 'words') joined by spaces.

  Raises:
    ValueError: for a target not in TARGETS.
    As `split_trees`.
  """
  trees = split_trees(treebank_dir, split)
  return [' '.join(tree.leaves()) for tree in trees], [' '.join(linearize(tree, target)) for tree in trees]
