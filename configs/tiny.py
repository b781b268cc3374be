"""A small Transformer that learns Multi30k English->German in minutes on a 2-core CPU: a first run.

  python -m transformer_jax.main --config=configs/tiny.py --workdir=runs/tiny \
      --config.data.manual_dir=../shared/data/multi30k

The paper's architecture (§3) at N=2, d_model=128, d_ff=512, h=4 (d_k=d_v=32) with a shared BPE vocabulary of
4,000; packed batches of 1,024 source + 1,024 target slots; 2,000 steps (~5 epochs) with the §5.3 schedule,
warm-up 300 steps. Validation BLEU (greedy) at steps 1,000 and 2,000, then beam search on the test split.

Measured: see README ("A first run"). For tests, configs/smoke.py is the same route at a size that learns nothing.
"""
import ml_collections

from configs import base


def get_config() -> ml_collections.ConfigDict:
  config = base.get_config()
  config.model.update(num_layers=2, d_model=128, d_ff=512, num_heads=4, d_k=32, d_v=32, max_length=128,
                      dtype='bfloat16', attention_product_dtype='compute')
  config.data.update(dataset='multi30k', source_lang='en', target_lang='de', vocab_size=4000,
                     tokenizer_train_sentences=60_000, tokens_per_batch=1024, max_length=128,
                     bucket_lengths=(16, 32, 64, 128), packing=True)
  config.train.update(num_train_steps=2000, warmup_steps=300, log_every_steps=100, eval_every_steps=1000,
                      checkpoint_every_steps=500, max_checkpoints_to_keep=4, eval_bleu_every_steps=1000)
  config.eval.update(average_last_n=2, bleu_beam_size=1)
  config.decode.update(alpha=1.0, tokens_per_batch=512)
  return config
