"""Transformer (big), Table 3 row "big", WMT 2014 English-German.

  python -m transformer_jax.main --config=configs/big.py --workdir=runs/big

Paper (Vaswani et al., 2017): base with d_model=1024, d_ff=4096, h=16 (d_k=d_v=64), P_drop=0.3, 300k steps;
213M parameters; newstest2013 PPL 4.33, BLEU 26.4 (Table 3); newstest2014 BLEU 28.4 EN-DE, 41.8 EN-FR
(Table 2; EN-FR used P_drop=0.1: add --config.model.dropout_rate=0.1). 3.5 days on 8 P100 GPUs (1.0 s/step).
§6.1: the big models average the last 20 checkpoints (written at 10-minute intervals).

The paper's batch (~25,000 source + 25,000 target tokens, §5.1) on the hardware at hand, with the per-device
memory `--mode=compile` reports for the step at the longest bucket ([97, 256] per side, padded with empty rows to
a multiple of data shards x grad_accum_steps; XLA:CPU's estimate on fake devices, GPU/TPU layouts differ):

  accelerators  mesh                     train.grad_accum_steps   per-device memory
  1             --config.mesh.data=1     1                        67.3 GiB
  1             --config.mesh.data=1     4                        19.4 GiB   (an 80 GB GPU: 4)
  1             --config.mesh.data=1     8                        12.2 GiB
  8             data=8 (the paper)       1                        10.8 GiB
  8             data=8                   4                         6.2 GiB   (97 rows padded to 128)
  8             data=8                   8                         5.6 GiB
  8             data=1 --config.mesh.fsdp=8  1                     8.5 GiB   (state 0.30 GiB per device)
  64            data=64                  1                         5.6 GiB   (2 rows per device)

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
