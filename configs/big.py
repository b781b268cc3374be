"""Transformer (big), Table 3 row "big", WMT 2014 English-German.

  python -m transformer_jax.main --config=configs/big.py --workdir=runs/big

Paper (Vaswani et al., 2017): base with d_model=1024, d_ff=4096, h=16 (d_k=d_v=64), P_drop=0.3, 300k steps;
213M parameters; newstest2013 PPL 4.33, BLEU 26.4 (Table 3); newstest2014 BLEU 28.4 EN-DE, 41.8 EN-FR
(Table 2; EN-FR used P_drop=0.1: add --config.model.dropout_rate=0.1). 3.5 days on 8 P100 GPUs (1.0 s/step).
§6.1: the big models average the last 20 checkpoints (written at 10-minute intervals).

The paper's batch (~25,000 source + 25,000 target tokens, §5.1) on Cloud TPU slices, compiled by the TPU
compiler on a 2-core CPU without a TPU, shared with a training run (`--mode=compile
--config.compile.topology=<slice>`, bfloat16 compute, the default; benchmarks/tpu_fit_table.py); the step at the
longest bucket, [97, 256] per side padded to a multiple of the data shards. Step times are the roofline ESTIMATE
of aot.roofline (model FLOPs at the bf16 peak, XLA's bytes accessed at the HBM bandwidth; no collectives), not
measurements:

  slice   chips  mesh     grad_accum_steps  GiB per chip / HBM  est. step, MFU  est. 300k steps  compile
  v4-8    4      data=4   1                 6.95 / 32           89 ms, 35%      7.4 h            7.7 min
  v5e-8   8      data=8   1                 5.53 / 16           89 ms, 25%      7.4 h            5.3 min
  v5p-8   4      data=4   1                 6.90 / 95           31 ms, 61%      2.5 h            6.7 min
  v6e-8   8      data=8   1                 5.28 / 32           47 ms, 10%      4.0 h            14.0 min
  v5e-64  64     data=64  1                 3.93 / 16           51 ms, 7%       4.2 h            5.8 min

The paper: 3.5 days on 8 P100s (1.0 s/step). Every slice fits the paper's batch without accumulation; on one
GPU, `--mode=compile` on that machine gives the figures for its memory (train.grad_accum_steps lowers them).

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
