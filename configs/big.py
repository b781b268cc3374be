"""Transformer (big), Table 3 row "big", WMT 2014 English-German.

  python -m transformer_jax.main --config=configs/big.py --workdir=runs/big

Paper (Vaswani et al., 2017): base with d_model=1024, d_ff=4096, h=16 (d_k=d_v=64), P_drop=0.3, 300k steps;
213M parameters; newstest2013 PPL 4.33, BLEU 26.4 (Table 3); newstest2014 BLEU 28.4 EN-DE, 41.8 EN-FR
(Table 2; EN-FR used P_drop=0.1: add --config.model.dropout_rate=0.1). 3.5 days on 8 P100 GPUs (1.0 s/step).
§6.1: the big models average the last 20 checkpoints (written at 10-minute intervals).

Run from the repository root, so that `configs` is importable.
"""
import ml_collections

from configs import base


def get_config() -> ml_collections.ConfigDict:
  config = base.get_config()
  config.model.d_model = 1024
  config.model.d_ff = 4096
  config.model.num_heads = 16
  config.model.d_k = 64              # d_model / h, as in base.
  config.model.d_v = 64
  config.model.dropout_rate = 0.3    # Table 3 (EN-DE); §6.1: 0.1 for EN-FR.
  config.train.num_train_steps = 300_000
  config.eval.average_last_n = 20    # §6.1.
  return config
