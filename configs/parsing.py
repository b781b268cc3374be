"""§6.3 English constituency parsing: the Transformer as a sequence-to-sequence parser on a treebank you hold.

  python -m transformer_jax.main --config=configs/parsing.py --workdir=runs/parsing \
      --config.data.treebank_dir=PTB/parsed/mrg/wsj          # The paper's WSJ-only setting.
  python -m transformer_jax.main --config=configs/parsing.py:cpu --workdir=runs/parsing_cpu \
      --config.data.treebank_dir=DIR                         # A small model for a 2-core CPU.

data.treebank_dir holds bracketed PTB-style trees: WSJ sections (wsj_SSNN.mrg, split 02-21 / 22 / 23) or files
train*, dev*, test* (one tree per line, or .mrg files); data/treebank.py reads them with nltk and linearises
them as Vinyals et al. (2015) do (words in; '(NP', 'XX', ')NP' out). Validation F1 on the dev split (EVALB's
rules with COLLINS.prm, evaluation/evalb.py) is computed every train.eval_bleu_every_steps steps and chooses
the checkpoint that is evaluated (eval.checkpoint_selection='best'); the run ends by parsing dev and test with
beam search and printing `f1: <test F1>`, and writes <split>.hyp.tree / <split>.gold.tree for the original
EVALB. The figures are comparable to the paper's 91.3 (WSJ only, Table 4) only when DIR is the WSJ portion of
the Penn Treebank with this split; no treebank ships with this repository (the Penn Treebank is licensed).

The paper (§6.3): "a 4-layer transformer with d_model = 1024 on the Wall Street Journal (WSJ) portion of the Penn
Treebank, about 40K training sentences ... a vocabulary of 16K tokens for the WSJ only setting ... We performed
only a small number of experiments to select the dropout, both attention and residual, learning rates and beam
size on the Section 22 development set, all other parameters remained unchanged from the English-to-German base
translation model. During inference, we increased the maximum output length to input length + 300. We used a
beam size of 21 and α = 0.3 for both WSJ only and the semi-supervised setting." So: N=4, d_model=1024, 16K
vocabulary, beam 21, α 0.3, input + 300; the rest is base's: d_ff=2048, h=8, with d_k = d_v = d_model / h = 128
(§3.2.2's relation; the paper does not say whether d_k or the relation stayed), P_drop 0.1 and base's schedule
and batch (the dropout and learning rate the paper chose on section 22 are not given). The number of training
steps is not given either; 100k is base's. Not measured here: no Penn Treebank on this machine.

`:cpu`, for a small treebank on a 2-core CPU (what tests/test_parsing_train.py trains on a synthetic treebank):
N=2, d_model=128, d_ff=512, h=4, a 512-piece vocabulary, the words themselves in the output where the paper
has XX (data.treebank_target='words': not the paper's), half the schedule's learning rate, greedy validation F1
every 400 of 2,000 steps, and the paper's beam 21, α 0.3, input + 300 at the end. Measured: docs/parsing.md.
"""
import ml_collections

from configs import base


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  """The paper's §6.3 WSJ-only settings, or the small CPU variant with `--config=configs/parsing.py:cpu`.

  Raises:
    ValueError: for a variant other than 'cpu'.
  """
  if variant not in (None, 'cpu'):
    raise ValueError(f"configs/parsing.py:{variant}: the variants are the paper's (no argument) and 'cpu'")
  config = base.get_config()
  config.model.update(num_layers=4, d_model=1024, d_ff=2048, num_heads=8, d_k=128, d_v=128, max_length=1024)
  config.data.update(
      dataset='treebank', treebank_dir='', source_lang='words', target_lang='tree',
      train_split='train', eval_split='dev', test_split='test',
      vocab_size=16000,  # §6.3: 16K tokens (WSJ only); the bracket tokens and XX are single pieces of it.
      max_length=512,    # Linearised WSJ trees run to ~3 tokens a word; longer training pairs are skipped.
      bucket_lengths=(16, 32, 48, 64, 96, 128, 160, 192, 256, 384, 512))
  config.train.update(eval_bleu_every_steps=5000)  # Validation F1 (eval.metric) on section 22.
  config.eval.update(metric='f1', checkpoint_selection='best', bleu_beam_size=1)
  config.decode.update(beam_size=21, alpha=0.3, extra_length=300)  # §6.3.
  if variant == 'cpu':
    config.model.update(num_layers=2, d_model=128, d_ff=512, num_heads=4, d_k=32, d_v=32, max_length=512,
                        attention_product_dtype='float32')
    # The words themselves in the output instead of XX (data/treebank.py), and half the schedule's learning rate
    # (a peak of 2.6e-3 instead of 5.1e-3 at d_model 128). Beam-21 dev / test F1 after 2,000 steps: 98.01 / 96.38;
    # with XX 94.34 / 94.07 (at the full rate 80.31 / 77.02 after 3,000 steps). docs/parsing.md has every run.
    config.data.update(vocab_size=512, tokens_per_batch=2048, max_length=256, bucket_lengths=(32, 64, 128, 256),
                       treebank_target='words')
    config.train.update(num_train_steps=2000, warmup_steps=300, learning_rate_scale=0.5, log_every_steps=100,
                        eval_every_steps=400, checkpoint_every_steps=400, max_checkpoints_to_keep=3,
                        eval_bleu_every_steps=400)
    config.eval.update(average_last_n=1, average_best_n=1)
    config.decode.update(tokens_per_batch=512)
  return config
