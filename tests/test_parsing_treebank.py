"""Reading a treebank folder, the linearisation of Vinyals et al. (2015) and its repairing inverse (§6.3)."""
import nltk
import pytest

from transformer_jax import errors
from transformer_jax.data import treebank

T = nltk.Tree.fromstring

PTB_TREE = """( (S
    (NP-SBJ-1 (DT The) (NN dog) )
    (VP (VBD was)
      (VP (VBN seen)
        (NP (-NONE- *-1) )
        (PP-LOC (IN in)
          (NP (DT the) (NN park) ))))
    (. .) ))
"""


def test_clean_removes_empty_elements_function_tags_and_the_root():
  tree = treebank.clean(T(PTB_TREE, remove_empty_top_bracketing=True))
  assert treebank.one_line(tree) == ('(S (NP (DT The) (NN dog)) (VP (VBD was) (VP (VBN seen) (PP (IN in) '
                                     '(NP (DT the) (NN park))))) (. .))')
  assert treebank.one_line(treebank.clean(T('(TOP (S (NP (PRP it)) (VP (VBZ is))))'))) == \
      '(S (NP (PRP it)) (VP (VBZ is)))'
  assert treebank.phrase_label('NP-SBJ-1') == 'NP' and treebank.phrase_label('S=2') == 'S'
  assert treebank.phrase_label('-NONE-') == '-NONE-'


def test_linearize_is_vinyals_with_closing_labels_and_xx():
  tree = treebank.clean(T(PTB_TREE, remove_empty_top_bracketing=True))
  assert ' '.join(treebank.linearize(tree)) == (
      '(S (NP XX XX )NP (VP XX (VP XX (PP XX (NP XX XX )NP )PP )VP )VP XX )S')


def test_the_words_target_writes_each_word_and_a_bracket_like_word_as_xx():
  tree = treebank.clean(T(PTB_TREE, remove_empty_top_bracketing=True))
  assert ' '.join(treebank.linearize(tree, 'words')) == (
      '(S (NP The dog )NP (VP was (VP seen (PP in (NP the park )NP )PP )VP )VP . )S')
  leaf = lambda tag, word: nltk.Tree(tag, [word])
  odd = nltk.Tree('S', [nltk.Tree('NP', [leaf('-LRB-', '('), leaf('NN', 'a'), leaf('-RRB-', ')')]),
                        nltk.Tree('VP', [leaf('VB', '(x)')]), leaf('.', '.')])
  assert treebank.linearize(odd, 'words') == ['(S', '(NP', '(', 'a', 'XX', ')NP', '(VP', 'XX', ')VP', '.', ')S']
  words, tags = treebank.words_and_tags(odd)
  back, repaired = treebank.delinearize(treebank.linearize(odd, 'words'), words, tags)
  assert back == nltk.Tree('TOP', [odd]) and not repaired
  # Whatever a word token says, it is the next word's slot: the tree's words are the input's.
  back, repaired = treebank.delinearize('(S (NP dog dog )NP (VP bark )VP )S', ['a', 'b', 'c'])
  assert treebank.one_line(back) == '(TOP (S (NP (XX a) (XX b)) (VP (XX c))))' and not repaired
  with pytest.raises(ValueError, match="target 'tags' is none of"):
    treebank.linearize(tree, 'tags')


def test_delinearize_inverts_and_keeps_the_words_and_tags():
  tree = treebank.clean(T(PTB_TREE, remove_empty_top_bracketing=True))
  words, tags = treebank.words_and_tags(tree)
  back, repaired = treebank.delinearize(treebank.linearize(tree), words, tags)
  assert back == nltk.Tree('TOP', [tree]) and not repaired
  untagged, _ = treebank.delinearize(treebank.linearize(tree), words)
  assert untagged.pos()[:2] == [('The', 'XX'), ('dog', 'XX')]


@pytest.mark.parametrize('output, expected', [
    # Brackets left open are closed.
    ('(S (NP XX XX )NP (VP XX', '(TOP (S (NP (DT a) (NN b)) (VP (VB c))))'),
    # A closing token with nothing open is dropped; its label is not checked.
    ('(S (NP XX XX )VP )S )S XX', '(TOP (S (NP (DT a) (NN b))) (VB c))'),
    # Too many word slots: the extra ones are dropped.
    ('(S XX XX XX XX XX )S', '(TOP (S (DT a) (NN b) (VB c)))'),
    # Too few: the missing words go at the end of the top phrase.
    ('(S (NP XX )NP )S', '(TOP (S (NP (DT a)) (NN b) (VB c)))'),
    # Phrases without a word are dropped; an empty output is a flat sentence.
    ('(S (NP )NP (ADJP (X )X )ADJP XX XX XX )S', '(TOP (S (DT a) (NN b) (VB c)))'),
    ('', '(TOP (DT a) (NN b) (VB c))'),
])
def test_delinearize_repairs_malformed_outputs(output, expected):
  tree, repaired = treebank.delinearize(output, ['a', 'b', 'c'], ['DT', 'NN', 'VB'])
  assert treebank.one_line(tree) == expected
  assert repaired
  assert tree.leaves() == ['a', 'b', 'c']


@pytest.mark.parametrize('target', treebank.TARGETS)
def test_linearisation_round_trips_every_synthetic_tree(synthetic_treebank, target):
  for split in treebank.SPLIT_NAMES:
    trees = treebank.split_trees(synthetic_treebank, split)
    sources, targets = treebank.split_pairs(synthetic_treebank, split, target)
    assert len(trees) == len(sources) == {'train': 3000, 'dev': 200, 'test': 200}[split]
    for tree, source, output in zip(trees, sources, targets):
      words, tags = treebank.words_and_tags(tree)
      assert source.split() == words
      back, repaired = treebank.delinearize(output, words, tags)
      assert (back, repaired) == (nltk.Tree('TOP', [tree]), False)


def test_output_symbols_are_the_bracket_tokens_and_the_placeholder(synthetic_treebank):
  symbols = treebank.output_symbols(treebank.split_trees(synthetic_treebank, 'train'))
  labels = ['ADVP', 'NP', 'PP', 'PRT', 'S', 'SBAR', 'VP']
  assert symbols == sorted([f'({label}' for label in labels] + [f'){label}' for label in labels] + ['XX'])


def test_the_tokenizer_keeps_every_output_symbol_one_piece(synthetic_treebank, tmp_path):
  from transformer_jax.data import tokenizer  # pylint: disable=g-import-not-at-top
  sources, targets = treebank.split_pairs(synthetic_treebank, 'train')
  symbols = treebank.output_symbols(treebank.split_trees(synthetic_treebank, 'train'))
  vocabulary = tokenizer.train_or_load(tmp_path / 'spm_512.model', lambda: sources + targets, 512,
                                       user_defined_symbols=symbols)
  ids = vocabulary.encode(targets[:50])
  assert [len(row) for row in ids] == [len(target.split()) for target in targets[:50]]
  assert vocabulary.decode(ids) == targets[:50]
  # The words target (a vocabulary trained on the XX target's lines also holds the words: they are the sources).
  word_targets = treebank.split_pairs(synthetic_treebank, 'train', 'words')[1][:50]
  assert vocabulary.decode(vocabulary.encode(word_targets)) == word_targets


def test_wsj_sections_give_the_standard_split(tmp_path):
  tree = '( (S (NP (NN x)) (VP (VB y))) )\n'
  for section in range(25):
    folder = tmp_path / 'mrg' / 'wsj' / f'{section:02d}'
    folder.mkdir(parents=True)
    for number in range(2):
      (folder / f'wsj_{section:02d}{number:02d}.mrg').write_text(tree)
  files = treebank.split_files(tmp_path)
  assert [path.parent.name for path in files['train']] == [f'{s:02d}' for s in range(2, 22) for _ in range(2)]
  assert [path.name for path in files['dev']] == ['wsj_2200.mrg', 'wsj_2201.mrg']
  assert [path.name for path in files['test']] == ['wsj_2300.mrg', 'wsj_2301.mrg']
  assert len(treebank.split_trees(tmp_path, 'train')) == 40


def test_mrg_files_hold_multiline_trees_and_errors_name_file_and_line(tmp_path):
  (tmp_path / 'train.mrg').write_text(PTB_TREE + '\n' + PTB_TREE)
  assert len(treebank.read_trees(tmp_path / 'train.mrg')) == 2
  broken = PTB_TREE + '\n' + PTB_TREE.replace('(NN park) ))))', '(NN park) )))')  # One ')' short.
  (tmp_path / 'bad.mrg').write_text(broken)
  with pytest.raises(treebank.TreebankError, match=r'bad\.mrg:10: unbalanced brackets'):
    treebank.read_trees(tmp_path / 'bad.mrg')


@pytest.mark.parametrize('line, message', [
    ('(S (NP (NN a)) (VP (VB b))', r"lines\.txt:2: not a bracketed tree \(Tree.read\(\): expected '\)'"),
    ('(S (NP a b))', r'lines\.txt:2: \(NP \.\.\.\) mixes words and brackets or holds several words'),
    ('(S (NP (-NONE- *)))', r'lines\.txt:2: the tree holds only empty elements'),
])
def test_one_tree_per_line_errors_name_the_line(tmp_path, line, message):
  (tmp_path / 'lines.txt').write_text(f'(S (NP (NN x)) (VP (VB y)))\n{line}\n(S (NP (NN z)))\n')
  with pytest.raises(treebank.TreebankError, match=message):
    treebank.read_trees(tmp_path / 'lines.txt')


def test_a_folder_without_a_layout_or_a_missing_folder_is_a_user_error(tmp_path):
  (tmp_path / 'train.txt').write_text('(S (NP (NN x)))\n')
  with pytest.raises(treebank.TreebankLayoutError, match='has no file for split dev, test'):
    treebank.split_files(tmp_path)
  with pytest.raises(errors.MissingFileError, match='does not exist'):
    treebank.split_files(tmp_path / 'nowhere')
  with pytest.raises(errors.ConfigError, match='data.treebank_dir is empty'):
    treebank.split_files('')
