"""The smallest Transformer the route runs: for tests and smoke runs; seconds per run, learns nothing.

  python -m transformer_jax.main --config=configs/smoke.py --workdir=/tmp/smoke \
      --config.data.manual_dir=../shared/data/multi30k --config.data.vocab_size=512

N=2, d_model=32, vocab 64, 4 steps: tests build this model and train it on their synthetic corpus
(tests/tiny_runs.py). configs/tiny.py is the small model that learns Multi30k in minutes.

data.manual_dir points nowhere by default, so that nothing downloads by accident: pass the folder holding
Multi30k's {split}.{lang}.gz. data.vocab_size=64 suits synthetic data and model tests; training a SentencePiece
vocabulary needs more, since byte fallback alone takes 256 pieces (Multi30k en+de needs at least 320).
"""
import ml_collections

from configs import base


def get_config() -> ml_collections.ConfigDict:
  config = base.get_config()
  config.model.update(num_layers=2, d_model=32, d_ff=64, num_heads=4, d_k=8, d_v=8, max_length=32,
                      dtype='float32')  # Exact numbers for the tests that compare them.

  config.data.update(
      dataset='multi30k',
      manual_dir='/nonexistent/multi30k',  # Deliberately missing; see the docstring.
      vocab_size=64,
      tokenizer_train_sentences=10_000,
      tokens_per_batch=256,
      max_length=32,
      bucket_lengths=(8, 16, 32),
  )
  config.train.update(
      num_train_steps=4,
      warmup_steps=2,
      log_every_steps=1,
      eval_every_steps=2,
      checkpoint_every_steps=2,
      max_checkpoints_to_keep=2,
  )
  config.decode.update(beam_size=2, extra_length=5)
  config.eval.average_last_n = 2
  config.benchmark.update(source_length=8, target_length=8, num_steps=2, decode_sentences=4)
  return config
