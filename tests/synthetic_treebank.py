"""A synthetic constituency treebank from a small probabilistic grammar: data for the §6.3 parsing tests and
demonstration, since no real treebank may ship with the repository.

The grammar is English-like and written for these tests (nothing is copied from a treebank): sentences with
subjects, transitive, intransitive, phrasal (PRT) and clause-taking (SBAR) verbs, adjectives, adverbs (ADVP),
noun-attached 'of' phrases and verb-attached 'with'/'in'/'near'/'after' phrases, coordination with a comma, and a
final full stop. Each sentence has one tree: each preposition attaches one way ('of' to nouns, the others to
verbs) and 'of' phrases branch to the right only, so a parser can reach F1 100; recursion (NP -> NP PP,
VP -> V SBAR) is bounded by depth.

  python tests/synthetic_treebank.py OUT_DIR [--train 3000 --dev 200 --test 200 --seed 0]

writes OUT_DIR/train.txt, dev.txt and test.txt, one PTB-style tree per line ('( (S ...) )').
"""
import argparse
import pathlib
import random

LEXICON = {
    'DT': 'the a every some this'.split(),
    'NN': 'dog cat man woman telescope park idea book river city child teacher house garden letter song'.split(),
    'NNP': 'John Mary Paris London Alice Bob'.split(),
    'PRP': 'he she they we'.split(),
    'JJ': 'big small red old happy quiet green'.split(),
    'VBD_T': 'saw liked found took chased read wrote visited'.split(),
    'VBD_I': 'slept laughed arrived left smiled'.split(),
    'VBD_S': 'said thought knew believed'.split(),
    'VBD_P': 'looked picked gave turned'.split(),
    'RP': 'up out away'.split(),
    'IN_V': 'with in near after'.split(),
    'RB': 'quickly slowly yesterday often'.split(),
    'CC': 'and but'.split(),
}
MAX_DEPTH = 3


def _word(rng: random.Random, tag: str) -> str:
  return f'({tag.split("_")[0]} {rng.choice(LEXICON[tag])})'


def _choose(rng: random.Random, options):
  """One of [(probability, value)], by probability."""
  x, total = rng.random(), 0.0
  for probability, value in options:
    total += probability
    if x < total:
      return value
  return options[-1][1]


def noun_phrase(rng: random.Random, depth: int) -> str:
  kind = _choose(rng, [(0.35, 'dt_nn'), (0.15, 'dt_jj_nn'), (0.15, 'nnp'), (0.1, 'prp'),
                       (0.25 if depth < MAX_DEPTH else 0.0, 'np_pp')] + [(1.0, 'dt_nn')])
  if kind == 'dt_nn':
    return f'(NP {_word(rng, "DT")} {_word(rng, "NN")})'
  if kind == 'dt_jj_nn':
    return f'(NP {_word(rng, "DT")} {_word(rng, "JJ")} {_word(rng, "NN")})'
  if kind == 'nnp':
    return f'(NP {_word(rng, "NNP")})'
  if kind == 'prp':
    return f'(NP {_word(rng, "PRP")})'
  # Right-branching only ('the park of (the city of Paris)'), so that a sentence has one tree.
  return f'(NP {base_noun_phrase(rng)} (PP (IN of) {noun_phrase(rng, depth + 1)}))'


def base_noun_phrase(rng: random.Random) -> str:
  """A noun phrase without a PP."""
  return noun_phrase(rng, MAX_DEPTH)


def verb_phrase(rng: random.Random, depth: int) -> str:
  kind = _choose(rng, [(0.35, 'vt'), (0.15, 'vt_pp'), (0.15, 'vi'), (0.08, 'vi_advp'), (0.13, 'vp_prt'),
                       (0.14 if depth < MAX_DEPTH else 0.0, 'vs')] + [(1.0, 'vt')])
  if kind == 'vt':
    return f'(VP {_word(rng, "VBD_T")} {noun_phrase(rng, depth + 1)})'
  if kind == 'vt_pp':
    return (f'(VP {_word(rng, "VBD_T")} {noun_phrase(rng, depth + 1)} '
            f'(PP {_word(rng, "IN_V")} {noun_phrase(rng, depth + 1)}))')
  if kind == 'vi':
    return f'(VP {_word(rng, "VBD_I")})'
  if kind == 'vi_advp':
    return f'(VP {_word(rng, "VBD_I")} (ADVP {_word(rng, "RB")}))'
  if kind == 'vp_prt':
    return f'(VP {_word(rng, "VBD_P")} (PRT {_word(rng, "RP")}) {noun_phrase(rng, depth + 1)})'
  return f'(VP {_word(rng, "VBD_S")} (SBAR (IN that) {clause(rng, depth + 1)}))'


def clause(rng: random.Random, depth: int = 0) -> str:
  return f'(S {noun_phrase(rng, depth)} {verb_phrase(rng, depth)})'


def sentence(rng: random.Random) -> str:
  """One tree, PTB style: '( (S ...) )'."""
  if rng.random() < 0.15:
    body = f'(S {clause(rng, 1)} (, ,) {_word(rng, "CC")} {clause(rng, 1)} (. .))'
  else:
    inner = clause(rng)
    body = f'(S {inner[3:-1]} (. .))'  # The clause's NP and VP, then the full stop, under one S.
  return f'( {body} )'


def write_treebank(folder: str | pathlib.Path, sizes=(('train', 3000), ('dev', 200), ('test', 200)),
                   seed: int = 0) -> pathlib.Path:
  """Writes `<folder>/<split>.txt` for each (split, number of sentences), one tree per line.

  Sentences are drawn independently from one seeded generator, so the splits may share a sentence (short ones
  recur), as a real treebank's splits may share a short sentence.
  """
  folder = pathlib.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  rng = random.Random(seed)
  for split, count in sizes:
    (folder / f'{split}.txt').write_text(''.join(sentence(rng) + '\n' for _ in range(count)), encoding='utf-8')
  return folder


if __name__ == '__main__':
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('out_dir')
  parser.add_argument('--train', type=int, default=3000)
  parser.add_argument('--dev', type=int, default=200)
  parser.add_argument('--test', type=int, default=200)
  parser.add_argument('--seed', type=int, default=0)
  args = parser.parse_args()
  print(write_treebank(args.out_dir, (('train', args.train), ('dev', args.dev), ('test', args.test)), args.seed))
