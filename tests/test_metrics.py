"""metrics: sums divided once into means; TensorBoard scalars."""
import numpy as np
import pytest

from transformer_jax.training import metrics


def test_summarize_divides_sums_once():
  sums = {'loss_sum': 6.0, 'nll_sum': 4.0, 'correct_sum': 3.0, 'token_count': 4.0}
  assert metrics.summarize(sums) == pytest.approx({'loss': 1.5, 'nll': 1.0, 'perplexity': np.e, 'accuracy': 0.75})


def test_summarize_gives_r_drops_divergence_per_token_of_one_pass():
  """Under R-Drop token_count counts both passes and kl_sum each pair's tokens once: 8 tokens are 4 pairs."""
  sums = {'loss_sum': 12.0, 'nll_sum': 8.0, 'correct_sum': 6.0, 'token_count': 8.0, 'kl_sum': 2.0}
  assert metrics.summarize(sums) == pytest.approx(
      {'loss': 1.5, 'nll': 1.0, 'perplexity': np.e, 'accuracy': 0.75, 'kl': 0.5})


def test_write_scalars_tags_each_value_with_the_prefix():
  written = []

  class Writer:
    def add_scalar(self, tag, value, step):
      written.append((tag, value, step))

    def flush(self):
      written.append('flush')

  metrics.write_scalars(Writer(), 7, {'loss': 1.5, 'bleu': 30.0}, 'eval')
  assert written == [('eval/loss', 1.5, 7), ('eval/bleu', 30.0, 7), 'flush']
  metrics.write_scalars(None, 7, {'loss': 1.5}, 'eval')  # Processes other than 0 have no writer.
