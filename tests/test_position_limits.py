"""Indices that could run off a table (issue #16 class 1): JAX fills an out-of-range gather with NaN and clamps
an out-of-range slice instead of raising, so every such limit is checked before it is reached."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base
from configs import table3
from configs import table3_multi30k
from transformer_jax.decoding import translate
from transformer_jax.model import transformer as model_lib
from transformer_jax.run import config_checks


def learned_model(max_length):
  return model_lib.Transformer(model_lib.ModelConfig(
      vocab_size=24, num_layers=1, d_model=16, d_ff=32, num_heads=2, d_k=8, d_v=8, dropout_rate=0.0,
      position_embedding='learned', max_length=max_length))


def test_learned_positions_must_cover_the_longest_decode_in_config_validation():
  config = base.get_config()
  config.model.position_embedding = 'learned'  # Table of 256 rows; decoding reaches 256 + 50.
  with pytest.raises(ValueError, match=r'data\.max_length \+ decode\.extra_length must be <= '
                                       r'model\.max_length=256 with learned positions .*got 306'):
    config_checks.validate_config(config)
  config.model.max_length = 306
  config_checks.validate_config(config)
  config.model.position_embedding = 'sinusoidal'  # No table: any length.
  config.model.max_length = 8
  config_checks.validate_config(config)


@pytest.mark.parametrize('module', [table3, table3_multi30k])
def test_table3_row_e_passes_the_check(module):
  config_checks.validate_config(module.get_config('E'))


@pytest.mark.integration
@pytest.mark.parametrize('cache_stages', [(4,), ()])
def test_decoding_past_the_learned_table_raises_instead_of_nan(cache_stages):
  model = learned_model(max_length=8)
  params = nn.unbox(model.init(jax.random.key(0), jnp.ones((1, 3), jnp.int32), jnp.ones((1, 3), jnp.int32)))['params']
  source = jnp.asarray([[5, 6, 7, 8, 9, 2]], jnp.int32)  # 6 + extra_length 4 = 10 positions > 8 rows.
  with pytest.raises(ValueError, match=r'6 source positions \+ decode\.extra_length=4 needs 10 rows of the '
                                       r'learned position table; model\.max_length=8'):
    translate.decode_batch(params, source, model=model, beam_size=2, alpha=0.6, extra_length=4,
                          cache_stages=cache_stages)
  # At the limit (4 + 4 = 8 rows) the staged search decodes, with finite scores.
  tokens, scores = translate.decode_batch(params, source[:, 2:], model=model, beam_size=2, alpha=0.6,
                                         extra_length=4, cache_stages=cache_stages, with_scores=True)
  assert tokens.shape == (1, 2, 8) and np.all(np.isfinite(np.asarray(scores)))
