"""Table 3 of Vaswani et al. (2017): variations on the base model, one row per config argument.

  python -m transformer_jax.main --config=configs/table3.py:B1 --workdir=runs/table3_B1
  python -m transformer_jax.main --config=configs/table3.py:B1 --mode=summary   # parameter table only

Rows (labels ours, in table order); unlisted values are those of base. Every row trains 100k steps like
base, except big (300k). Paper figures on newstest2013 (EN-DE dev): PPL per word piece, BLEU without
checkpoint averaging, parameters in millions (the paper lists a count only for base, B, C and big):

  row   change                              PPL   BLEU  params
  base  N=6 d_model=512 d_ff=2048 h=8 d_k=d_v=64 P_drop=0.1 eps_ls=0.1
                                            4.92  25.8   65
  A1    h=1,  d_k=d_v=512                   5.29  24.9
  A2    h=4,  d_k=d_v=128                   5.00  25.5
  A3    h=16, d_k=d_v=32                    4.91  25.8
  A4    h=32, d_k=d_v=16                    5.01  25.4
  B1    d_k=16                              5.16  25.1   58
  B2    d_k=32                              5.01  25.4   60
  C1    N=2                                 6.11  23.7   36
  C2    N=4                                 5.19  25.3   50
  C3    N=8                                 4.88  25.5   80
  C4    d_model=256, d_k=d_v=32             5.75  24.5   28
  C5    d_model=1024, d_k=d_v=128           4.66  26.0  168
  C6    d_ff=1024                           5.12  25.4   53
  C7    d_ff=4096                           4.75  26.2   90
  D1    P_drop=0.0                          5.77  24.6
  D2    P_drop=0.2                          4.95  25.5
  D3    eps_ls=0.0                          4.67  25.3
  D4    eps_ls=0.2                          5.47  25.7
  E     learned positional embedding        4.92  25.7
  big   d_model=1024 d_ff=4096 h=16 P_drop=0.3, 300k steps
                                            4.33  26.4  213

Rows (F) are not in the paper: later variants, each a single change to base (F8 combines them as current
models do). Parameters at vocabulary 37,000 (base 63.05M), from --mode=summary:

  F1    pre-LN, a final norm per stack (Xiong et al., 2020)                        63.05M
  F2    RMSNorm instead of LayerNorm (Zhang & Sennrich, 2019)                      63.03M
  F3    rotary positions in self-attention (Su et al., 2021)                       63.05M
  F4    SwiGLU feed-forward, d_ff=1365 (Shazeer, 2020)                             63.01M
  F5    GeGLU feed-forward, d_ff=1365 (Shazeer, 2020)                              63.01M
  F6    multi-query attention, 1 K/V head (Shazeer, 2019)                          54.79M
  F7    grouped-query attention, 2 K/V heads (Ainslie et al., 2023)                55.97M
  F8    F1 + F2 + F3 + F4 + F7: pre-RMSNorm, RoPE, SwiGLU, GQA                     55.92M

Run from the repository root, so that `configs` is importable.
"""
import ml_collections

from configs import base
from configs import big

# The paper's rows: overrides of base, keyed by dotted config path. Table 3 rows (A) keep h * d_k = d_model (constant compute,
# §3.2.2); rows (B) change d_k only, so d_v stays 64.
PAPER_ROWS = {
    'base': {},
    'A1': {'model.num_heads': 1, 'model.d_k': 512, 'model.d_v': 512},
    'A2': {'model.num_heads': 4, 'model.d_k': 128, 'model.d_v': 128},
    'A3': {'model.num_heads': 16, 'model.d_k': 32, 'model.d_v': 32},
    'A4': {'model.num_heads': 32, 'model.d_k': 16, 'model.d_v': 16},
    'B1': {'model.d_k': 16},
    'B2': {'model.d_k': 32},
    'C1': {'model.num_layers': 2},
    'C2': {'model.num_layers': 4},
    'C3': {'model.num_layers': 8},
    'C4': {'model.d_model': 256, 'model.d_k': 32, 'model.d_v': 32},
    'C5': {'model.d_model': 1024, 'model.d_k': 128, 'model.d_v': 128},
    'C6': {'model.d_ff': 1024},
    'C7': {'model.d_ff': 4096},
    'D1': {'model.dropout_rate': 0.0},
    'D2': {'model.dropout_rate': 0.2},
    'D3': {'train.label_smoothing': 0.0},
    'D4': {'train.label_smoothing': 0.2},
    # Learned positions must cover decoding: data.max_length + decode.extra_length = 256 + 50.
    'E': {'model.position_embedding': 'learned', 'model.max_length': 306},
    'big': {},  # configs/big.py.
}

# Later variants (not in the paper), each one change to base except F8. Gated FFNs use d_ff = 2/3 * 2048 so that
# their three matrices hold the parameters of the paper's two.
_GATED_D_FF = 2048 * 2 // 3
VARIANT_ROWS = {
    'F1': {'model.layer_norm_position': 'pre'},
    'F2': {'model.norm': 'rms_norm'},
    'F3': {'model.position_embedding': 'rope'},
    'F4': {'model.feed_forward': 'swiglu', 'model.d_ff': _GATED_D_FF},
    'F5': {'model.feed_forward': 'geglu', 'model.d_ff': _GATED_D_FF},
    'F6': {'model.num_kv_heads': 1},
    'F7': {'model.num_kv_heads': 2},
    'F8': {'model.layer_norm_position': 'pre', 'model.norm': 'rms_norm', 'model.position_embedding': 'rope',
           'model.feed_forward': 'swiglu', 'model.d_ff': _GATED_D_FF, 'model.num_kv_heads': 2},
}
ROWS = PAPER_ROWS | VARIANT_ROWS

# What each row changes, for reports (transformer_jax.tools.report) and --mode=summary readers.
NOTES = {
    'base': 'the base model', 'A1': 'h=1, d_k=d_v=512', 'A2': 'h=4, d_k=d_v=128', 'A3': 'h=16, d_k=d_v=32',
    'A4': 'h=32, d_k=d_v=16', 'B1': 'd_k=16', 'B2': 'd_k=32', 'C1': 'N=2', 'C2': 'N=4', 'C3': 'N=8',
    'C4': 'd_model=256, d_k=d_v=32', 'C5': 'd_model=1024, d_k=d_v=128', 'C6': 'd_ff=1024', 'C7': 'd_ff=4096',
    'D1': 'P_drop=0.0', 'D2': 'P_drop=0.2', 'D3': 'eps_ls=0.0', 'D4': 'eps_ls=0.2',
    'E': 'learned positional embedding', 'big': 'd_model=1024, d_ff=4096, h=16, P_drop=0.3',
    'F1': 'pre-LN (Xiong et al., 2020)', 'F2': 'RMSNorm (Zhang & Sennrich, 2019)',
    'F3': 'rotary positions (Su et al., 2021)', 'F4': 'SwiGLU, d_ff=2/3 (Shazeer, 2020)',
    'F5': 'GeGLU, d_ff=2/3 (Shazeer, 2020)', 'F6': 'multi-query, 1 K/V head (Shazeer, 2019)',
    'F7': 'grouped-query, 2 K/V heads (Ainslie et al., 2023)', 'F8': 'pre-RMSNorm + RoPE + SwiGLU + GQA-2',
}

# Table 3 figures: PPL and BLEU on newstest2013; params in millions, None where the paper gives none.
PAPER = {
    'base': dict(ppl_dev=4.92, bleu_dev=25.8, params_millions=65),
    'A1': dict(ppl_dev=5.29, bleu_dev=24.9, params_millions=None),
    'A2': dict(ppl_dev=5.00, bleu_dev=25.5, params_millions=None),
    'A3': dict(ppl_dev=4.91, bleu_dev=25.8, params_millions=None),
    'A4': dict(ppl_dev=5.01, bleu_dev=25.4, params_millions=None),
    'B1': dict(ppl_dev=5.16, bleu_dev=25.1, params_millions=58),
    'B2': dict(ppl_dev=5.01, bleu_dev=25.4, params_millions=60),
    'C1': dict(ppl_dev=6.11, bleu_dev=23.7, params_millions=36),
    'C2': dict(ppl_dev=5.19, bleu_dev=25.3, params_millions=50),
    'C3': dict(ppl_dev=4.88, bleu_dev=25.5, params_millions=80),
    'C4': dict(ppl_dev=5.75, bleu_dev=24.5, params_millions=28),
    'C5': dict(ppl_dev=4.66, bleu_dev=26.0, params_millions=168),
    'C6': dict(ppl_dev=5.12, bleu_dev=25.4, params_millions=53),
    'C7': dict(ppl_dev=4.75, bleu_dev=26.2, params_millions=90),
    'D1': dict(ppl_dev=5.77, bleu_dev=24.6, params_millions=None),
    'D2': dict(ppl_dev=4.95, bleu_dev=25.5, params_millions=None),
    'D3': dict(ppl_dev=4.67, bleu_dev=25.3, params_millions=None),
    'D4': dict(ppl_dev=5.47, bleu_dev=25.7, params_millions=None),
    'E': dict(ppl_dev=4.92, bleu_dev=25.7, params_millions=None),
    'big': dict(ppl_dev=4.33, bleu_dev=26.4, params_millions=213),
}


def get_config(row: str | None = None) -> ml_collections.ConfigDict:
  """The config of one Table 3 row.

  Args:
    row: a key of ROWS, given after the colon of `--config=configs/table3.py:<row>`.

  Returns:
    base's (or big's) config with the row's overrides applied.

  Raises:
    ValueError: for a missing or unknown row, listing the valid ones, or an override of a field base lacks.
  """
  if row not in ROWS:
    raise ValueError(f'unknown Table 3 row {row!r}; valid rows: {", ".join(ROWS)} '
                     '(use --config=configs/table3.py:<row>)')
  return apply_row(big.get_config() if row == 'big' else base.get_config(), row, ROWS[row])


def apply_row(config: ml_collections.ConfigDict, row: str, overrides: dict) -> ml_collections.ConfigDict:
  """Sets each dotted `overrides` path of `config` (in place) and returns it.

  Raises:
    ValueError: for a path that is not a field of configs/base.py.
  """
  for path, value in overrides.items():
    section, field = path.split('.')
    if field not in config[section]:  # ConfigDict would add a misspelt field silently.
      raise ValueError(f'Table 3 row {row}: {path} is not a field of configs/base.py')
    config[section][field] = value
  return config
