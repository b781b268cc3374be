"""The paper's architecture sized for a 2-core CPU: Multi30k English->German (29,000 training pairs).

  python -m transformer_jax.main --config=configs/multi30k.py --workdir=runs/multi30k \
      --config.data.manual_dir=../shared/data/multi30k

Trains from scratch, averages the last checkpoints (§6.1), translates test_2016_flickr with beam search
(beam 4, alpha 0.6, max length input + 50) and prints `bleu: <sacreBLEU>`. Measured on a 2-vCPU Xeon
(shared with test runs at times): 40.8 min of training, validation perplexity 6.00 (average of 5),
test_2016_flickr BLEU 37.66 (sacreBLEU 13a), 51 s to decode its 1,000 sentences; 42.0 min in all. An
earlier build trained the same recipe in 46.2 min to perplexity 5.97 and BLEU 37.99 (36.26 greedy, 36.42
without averaging). The yardstick, a PyTorch nn.Transformer of the same shape trained 30 minutes on the
same machine (a script outside this repository), reaches 35.2 BLEU. On a 2-vCPU AMD EPYC (2026-12-01, shared
with the test suite for part of the run): 29.4 min in all, validation sacreBLEU 38.72 (lowercased
tokenised 38.85, perplexity 5.95), test_2016_flickr sacreBLEU 37.47, lowercased tokenised 37.85, tokenised
37.53. Every recipe tried, with its validation BLEU: docs/multi30k_recipes.md.

What differs from the paper, and why (a 29k-pair corpus on 2 cores instead of 4.5M pairs on 8 GPUs):
- N=3, d_model=256, d_ff=1024, h=4 (d_k=d_v=64): Table 3 row C shows smaller models lose little, and
  this one trains ~10x faster per token than base on a CPU.
- A shared BPE vocabulary of 8,000 (the corpus has ~10k distinct word types per language).
- ~2,000 source + 2,000 target tokens per batch instead of 25,000: more updates in the time budget.
- warmup_steps=400 and learning_rate_scale=0.5 (peak 1.6e-3), the schedule of the yardstick.
- bfloat16 matrix products with float32 accumulation: 1.8x faster than float32 on this CPU's AMX units;
  the batched attention products in float32 (attention_product_dtype), which XLA:CPU runs faster.
- 3,600 steps (~12 epochs); checkpoints every 200 steps and the last 5 averaged (§6.1 averages 5 for base).
"""
from configs import base


def get_config(target_lang: str | None = None):
  """English->German, or English->French with `--config=configs/multi30k.py:fr`.

  Raises:
    ValueError: for a target language Multi30k does not have.
  """
  target_lang = target_lang or 'de'
  if target_lang not in ('de', 'fr'):
    raise ValueError(f"configs/multi30k.py:{target_lang}: Multi30k's targets are 'de' and 'fr'")
  config = base.get_config()
  config.model.update(num_layers=3, d_model=256, d_ff=1024, num_heads=4, d_k=64, d_v=64,
                      dropout_rate=0.1, max_length=128, dtype='bfloat16',
                      attention_product_dtype='float32')
  config.data.update(dataset='multi30k', source_lang='en', target_lang=target_lang, eval_split='validation',
                     test_split='test', vocab_size=8000, tokens_per_batch=2048, max_length=128,
                     bucket_lengths=(16, 24, 32, 48, 64, 128))
  config.train.update(num_train_steps=3600, warmup_steps=400, learning_rate_scale=0.5, log_every_steps=100,
                      eval_every_steps=600, checkpoint_every_steps=200, max_checkpoints_to_keep=5)
  config.eval.average_last_n = 5
  return config
