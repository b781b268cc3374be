"""Figures of a run: positional encodings (§3.5), attention heat-maps (§3.2), curves and the §5.3 schedule.

Every function returns a `matplotlib.figure.Figure` built without pyplot, so nothing depends on a display
or on pyplot's global state: `save_figure` writes a PNG, and a notebook shows the figure when it is the
value of a cell (with `%matplotlib inline`) or through `IPython.display.display`.
"""
import os
from collections.abc import Sequence

from matplotlib.figure import Figure
import ml_collections

from transformer_jax.tools import inspection

_CURVE_PANELS = (
    ('loss (label-smoothed, §5.4) and nll', ('train/loss', 'eval/loss', 'train/nll', 'eval/nll')),
    ('perplexity, exp(nll)', ('train/perplexity', 'eval/perplexity')),
    ('accuracy', ('train/accuracy', 'eval/accuracy')),
)
_TITLES = {'encoder_self': 'encoder self-attention', 'decoder_self': 'decoder self-attention (masked)',
           'encoder_decoder': 'encoder-decoder attention'}


def save_figure(figure: Figure, path: str | os.PathLike[str], dpi: int = 100) -> str:
  """Writes `figure` as a PNG (folders created); returns the path."""
  path = os.fspath(path)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  figure.savefig(path, dpi=dpi, bbox_inches='tight')
  return path


def positional_encoding_figure(length: int = 100, d_model: int = 512) -> Figure:
  """Heat-map of PE [position, dimension] (§3.5): sines on even, cosines on odd dimensions."""
  encoding = inspection.positional_encoding(length, d_model)  # [length, d_model]
  figure = Figure(figsize=(10, 5), layout='constrained')
  axes = figure.subplots()
  image = axes.imshow(encoding, aspect='auto', cmap='RdBu_r', vmin=-1.0, vmax=1.0, interpolation='nearest')
  axes.set(xlabel='dimension i', ylabel='position pos',
           title=f'Sinusoidal positional encoding (§3.5), {length} positions x d_model={d_model}')
  figure.colorbar(image, ax=axes, label='PE(pos, i)')
  return figure


def attention_figure(maps: inspection.AttentionMaps, kind: str, layers: Sequence[int] | None = None,
                     title: str = '') -> Figure:
  """Heat-maps of one kind of attention: a row of panels per layer, a column per head.

  Args:
    maps: from `inspection.attention_maps` or `sentence_attention`.
    kind: 'encoder_self', 'decoder_self' or 'encoder_decoder'.
    layers: which layers (0-based); None shows all.
    title: prefix of the figure title (e.g. the run and step).

  Returns:
    The figure: rows of each panel are queries, columns keys, colour the weight in [0, 1].

  Raises:
    ValueError: for an unknown kind or a layer out of range.
  """
  query_labels, key_labels = maps.labels(kind)  # Raises for an unknown kind.
  weights = getattr(maps, kind)  # [num_layers, num_heads, q_len, kv_len]
  num_layers, num_heads, q_len, kv_len = weights.shape
  layers = list(range(num_layers)) if layers is None else list(layers)
  if not layers or any(not 0 <= i < num_layers for i in layers):
    raise ValueError(f'layers must be a non-empty list in [0, {num_layers}), got {layers}')
  cell = 0.22  # Inches per token, so that labels stay legible.
  figure = Figure(figsize=(num_heads * max(cell * kv_len + 0.9, 2.5), len(layers) * max(cell * q_len + 0.9, 2.3)),
                  layout='constrained')
  grid = figure.subplots(len(layers), num_heads, squeeze=False)
  for row, layer in enumerate(layers):
    for head in range(num_heads):
      axes = grid[row, head]
      image = axes.imshow(weights[layer, head], cmap='viridis', vmin=0.0, vmax=1.0, interpolation='nearest')
      axes.set_title(f'layer {layer}, head {head}', fontsize=9)
      # Panels of a column share their keys, of a row their queries: label the outer ones.
      axes.set_xticks(range(kv_len), key_labels if row == len(layers) - 1 else [], rotation=90, fontsize=7)
      axes.set_yticks(range(q_len), query_labels if head == 0 else [], fontsize=7)
  for axes in grid[:, 0]:
    axes.set_ylabel('query')
  for axes in grid[-1]:
    axes.set_xlabel('key')
  figure.colorbar(image, ax=grid, shrink=0.6, label='attention weight')
  queries = 'source' if kind == 'encoder_self' else 'target'
  keys = 'target' if kind == 'decoder_self' else 'source'
  figure.suptitle(f'{title}{_TITLES[kind]}: rows = {queries} queries, columns = {keys} keys')
  return figure


def training_curves_figure(scalars: dict[str, inspection.Scalars], title: str = '') -> Figure:
  """Training and validation curves read back from TensorBoard (`inspection.read_scalars`).

  Panels whose tags were not logged (yet) are left out.

  Raises:
    ValueError: if none of the tags is present.
  """
  panels = [(name, [t for t in tags if t in scalars]) for name, tags in _CURVE_PANELS]
  panels = [(name, tags) for name, tags in panels if tags]
  if not panels:
    raise ValueError(f'no training or validation curves among the tags {sorted(scalars)}')
  figure = Figure(figsize=(5 * len(panels), 4), layout='constrained')
  for axes, (name, tags) in zip(figure.subplots(1, len(panels), squeeze=False)[0], panels):
    for tag in tags:
      steps, values = scalars[tag]
      style = 'o-' if tag.startswith('eval/') or len(steps) < 30 else '-'  # A line of one point is invisible.
      axes.plot(steps, values, style, markersize=4, label=tag)
    if name.startswith('perplexity'):
      axes.set_yscale('log')
    axes.set(xlabel='step', title=name)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
  figure.suptitle(f'{title}training and validation curves')
  return figure


def learning_rate_figure(config: ml_collections.ConfigDict,
                         logged: inspection.Scalars | None = None) -> Figure:
  """The §5.3 schedule of `config` over its train.num_train_steps, with the logged rates as dots."""
  steps, rates = inspection.learning_rates(config)
  warmup = config.train.warmup_steps
  figure = Figure(figsize=(7, 4), layout='constrained')
  axes = figure.subplots()
  axes.plot(steps, rates, label='scale · d_model^-0.5 · min(step^-0.5, step · warmup^-1.5)')
  if logged is not None:
    axes.plot(logged.steps, logged.values, '.', label="logged 'train/learning_rate'")
  axes.axvline(warmup, color='gray', linestyle='--', label=f'warmup_steps={warmup}')
  axes.set(xlabel='step', ylabel='learning rate',
           title=f'Learning-rate schedule (§5.3), d_model={config.model.d_model}, '
                 f'scale={config.train.learning_rate_scale}, peak {rates.max():.3g}')
  axes.grid(alpha=0.3)
  axes.legend(fontsize=8)
  return figure
