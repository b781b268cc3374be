"""Parameter counts per module (Table 3, column "params ×10^6"), from shapes alone.

`summarize(cfg)` builds the parameters under `jax.eval_shape`, so even the big model costs no memory; it backs
`python -m transformer_jax.main --config=... --mode=summary`.
"""
import math
from typing import Any

import flax.linen as nn
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model import transformer as model_lib

# Sub-layer categories in display order; a leaf belongs to the first whose path component it contains.
_CATEGORIES = (
    ('layer norms', ('layer_norm', 'final_layer_norm')),
    ('encoder-decoder attention', ('encoder_decoder_attention',)),
    ('self-attention', ('self_attention',)),
    ('feed-forward', ('feed_forward',)),
    ('positions', ('embedder',)),
)
_ORDER = ('self-attention', 'encoder-decoder attention', 'feed-forward', 'layer norms', 'positions', 'other')
_TOP_NAMES = {'shared_embedding': 'embedding (shared: source, target, pre-softmax; §3.4)'}


def _size(leaf: Any) -> int:
  """Number of elements of an array or a jax.ShapeDtypeStruct."""
  return math.prod(np.shape(leaf))


def count_params(params: Any) -> int:
  """Total number of parameters in a (possibly boxed, possibly abstract) parameter tree."""
  return sum(_size(leaf) for leaf in jax.tree.leaves(nn.unbox(params)))


def _category(path: tuple[str, ...]) -> str:
  for name, components in _CATEGORIES:
    if any(part in components for part in path):
      return name
  return 'other'


def parameter_table(params: Any) -> tuple[str, int]:
  """A table of parameter counts: the shared embedding, then encoder and decoder by sub-layer.

  Args:
    params: the 'params' collection of `Transformer` (boxed or not; arrays or ShapeDtypeStructs).

  Returns:
    (the table as text, ending with the line `total_params: <integer>`; the total number of parameters).
  """
  flat = traverse_util.flatten_dict(nn.unbox(params))
  total = sum(_size(leaf) for leaf in flat.values())
  tops: dict[str, dict[str, int]] = {}  # top-level module -> category -> count
  layers: dict[str, set[str]] = {}      # top-level module -> names of its layer_<i> submodules
  for path, leaf in flat.items():
    top, rest = path[0], path[1:]
    tops.setdefault(top, {})
    layers.setdefault(top, set()).update(p for p in rest[:1] if p.startswith('layer_'))
    if top in ('encoder', 'decoder'):
      category = _category(rest)
      tops[top][category] = tops[top].get(category, 0) + _size(leaf)
    else:
      tops[top][''] = tops[top].get('', 0) + _size(leaf)

  width = 56
  row = lambda name, count: f'{name:<{width}}{count:>14,}{100.0 * count / max(total, 1):>8.1f}%'
  lines = [f'{"module":<{width}}{"params":>14}{"share":>9}']
  for top in sorted(tops, key=lambda t: (t not in _TOP_NAMES, t != 'encoder', t)):
    counts = tops[top]
    if top in ('encoder', 'decoder'):
      lines.append(row(f'{top} ({len(layers[top])} layers)', sum(counts.values())))
      shown = [c for c in _ORDER if c in counts or c == 'positions'
               or (c == 'encoder-decoder attention' and top == 'decoder')]
      lines.extend(row(f'  {category}', counts.get(category, 0)) for category in shown)
    else:
      lines.append(row(_TOP_NAMES.get(top, top), sum(counts.values())))
  lines.append(f'total_params: {total}')
  return '\n'.join(lines), total


def abstract_params(cfg: model_lib.ModelConfig) -> Any:
  """The Transformer's parameters as boxed jax.ShapeDtypeStructs, built without allocating them."""
  tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  variables = jax.eval_shape(model_lib.Transformer(cfg).init, jax.random.key(0), tokens, tokens)
  return variables['params']


def summarize(cfg: model_lib.ModelConfig) -> str:
  """The configuration line and the parameter table of `cfg`, ending with `total_params: <integer>`."""
  table, _ = parameter_table(abstract_params(cfg))
  header = (f'Transformer: N={cfg.num_layers} d_model={cfg.d_model} d_ff={cfg.d_ff} h={cfg.num_heads} '
            f'd_k={cfg.d_k} d_v={cfg.d_v} vocab={cfg.vocab_size} positions={cfg.position_embedding} '
            f'layer_norm={cfg.layer_norm_position}')
  return f'{header}\n{table}'
