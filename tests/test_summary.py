"""Tests for transformer_jax.tools.summary: the parameter table (`--mode=summary`) and its total."""
import pathlib
import re

import flax.linen as nn
import jax
import numpy as np
import pytest

from transformer_jax.model import transformer as model_lib
from transformer_jax.tools import summary
import tiny_runs  # pylint: disable=g-bad-import-order

TINY = tiny_runs.tiny_model_fields(vocab_size=64)  # configs/smoke.py's model.
ROW = re.compile(r'^(?P<indent> *)(?P<name>\S.*?)\s+(?P<count>[\d,]+)\s+[\d.]+%$')


def parse_table(table: str) -> dict[str, tuple[int, dict[str, int]]]:
  """{top-level row name: (count, {sub-layer row name: count})}, from the rows between header and total."""
  modules = {}
  for line in table.splitlines()[1:-1]:
    match = ROW.match(line)
    assert match, line
    name, count = match['name'].split(' (')[0], int(match['count'].replace(',', ''))
    if match['indent']:
      modules[top][1][name] = count
    else:
      top = name
      modules[top] = (count, {})
  return modules


@pytest.mark.parametrize('overrides', [{}, {'position_embedding': 'learned', 'layer_norm_position': 'pre'}])
def test_total_is_the_sum_of_leaves(overrides):
  cfg = model_lib.ModelConfig(**{**TINY, **overrides})
  abstract = summary.abstract_params(cfg)  # Boxed ShapeDtypeStructs.
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(x.dtype), abstract)  # Boxed arrays.
  leaves_total = sum(int(np.size(leaf)) for leaf in jax.tree.leaves(nn.unbox(params)))
  table, total = summary.parameter_table(params)
  assert total == leaves_total == summary.count_params(params) == summary.count_params(nn.unbox(params))
  assert table.splitlines()[-1] == f'total_params: {leaves_total}'
  assert summary.parameter_table(abstract) == (table, total)
  modules = parse_table(table)
  assert sum(count for count, _ in modules.values()) == total
  for name in ('encoder', 'decoder'):  # Each stack's sub-layers add up to the stack.
    count, sub_layers = modules[name]
    assert sum(sub_layers.values()) == count, name


def test_summarize_base_by_sub_layer():
  text = summary.summarize(model_lib.ModelConfig(vocab_size=37000))
  assert re.fullmatch(r'total_params: \d+', text.splitlines()[-1])
  assert text.splitlines()[-1] == 'total_params: 63045632'
  modules = parse_table(text.split('\n', 1)[1])  # Below the configuration line.
  attention = 6 * 4 * 512 * 512  # W^Q, W^K, W^V, W^O in 6 layers; no biases.
  feed_forward = 6 * (2 * 512 * 2048 + 2048 + 512)
  assert modules['embedding'] == (37000 * 512, {})
  assert modules['encoder'] == (attention + feed_forward + 6 * 2 * 2 * 512, {
      'self-attention': attention, 'feed-forward': feed_forward, 'layer norms': 6 * 2 * 2 * 512,
      'positions': 0})  # Sinusoids (§3.5) have no parameters.
  assert modules['decoder'] == (2 * attention + feed_forward + 6 * 3 * 2 * 512, {
      'self-attention': attention, 'encoder-decoder attention': attention, 'feed-forward': feed_forward,
      'layer norms': 6 * 3 * 2 * 512, 'positions': 0})


def test_summarize_big_needs_no_memory():
  text = summary.summarize(model_lib.ModelConfig(vocab_size=37000, d_model=1024, d_ff=4096, num_heads=16))
  assert text.splitlines()[-1] == 'total_params: 214171648'


def test_summary_mode_of_main_prints_the_table_and_total():
  """`--mode=summary` reads no data and no checkpoint; its last line is the Table 3 row's count."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  root = pathlib.Path(__file__).resolve().parents[1]
  out = subprocess.run([sys.executable, '-m', 'transformer_jax.main', '--config=configs/table3.py:B1',
                        '--mode=summary'], cwd=root, capture_output=True, text=True, timeout=120, check=True)
  lines = out.stdout.strip().splitlines()
  assert lines[-1] == 'total_params: 55967744'  # B1 (d_k=16) at vocabulary 37000; the paper: 58M.
  assert any('feed-forward' in line for line in lines)
