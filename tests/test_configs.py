"""Every file in configs/ and every Table 3 row loads, builds a ModelConfig, and has the paper's parameter count.

Configs are loaded as ml_collections' config_flags loads them: the file is imported from its path and
get_config() (or get_config(row) for `file.py:row`) is called. Parameters are built under jax.eval_shape.
"""
import functools
import importlib.util
import json
import pathlib
import sys

from absl import flags
import jax
from ml_collections import config_flags
import pytest

from transformer_jax.model import transformer as model_lib
from transformer_jax.tools import report
from transformer_jax.tools import summary
from transformer_jax.run import config_checks
from transformer_jax.training import flops
from transformer_jax.training import step as step_lib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / 'configs'
if str(REPO_ROOT) not in sys.path:
  sys.path.insert(0, str(REPO_ROOT))  # Configs do `from configs import base`, as when run from the root.


def load_config_module(path: pathlib.Path):
  spec = importlib.util.spec_from_file_location(f'_config_{path.stem}', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


TABLE3 = load_config_module(CONFIG_DIR / 'table3.py')
TABLE3_MULTI30K = load_config_module(CONFIG_DIR / 'table3_multi30k.py')
RECIPES = load_config_module(CONFIG_DIR / 'multi30k_recipes.py')
ROW_FILES = {'table3.py': TABLE3, 'table3_multi30k.py': TABLE3_MULTI30K,  # Configs named as file.py:<row>.
             'multi30k_recipes.py': RECIPES}
# (file name, argument after the colon or None): every way a config can be named on the command line.
CONFIG_FILES = sorted(p for p in CONFIG_DIR.glob('*.py') if not p.name.startswith('_'))  # _*.py: not configs.
CONFIG_ARGS = [(path.name, None) for path in CONFIG_FILES if path.name not in ROW_FILES]
CONFIG_ARGS += [(name, row) for name, module in ROW_FILES.items() for row in module.ROWS]
CONFIG_ARGS += [('multi30k.py', 'fr')]  # English->French.
CONFIG_ARGS += [('parsing.py', 'cpu')]  # §6.3 parsing, the small CPU variant.


@functools.cache
def load(file_name: str, arg: str | None):
  module = load_config_module(CONFIG_DIR / file_name)
  return module.get_config() if arg is None else module.get_config(arg)


def model_config(config) -> model_lib.ModelConfig:
  return model_lib.ModelConfig(vocab_size=config.data.vocab_size, **config.model)


@functools.cache
def table3_count(row: str) -> int:
  return summary.count_params(summary.abstract_params(model_config(load('table3.py', row))))


def test_every_config_file_is_covered():
  assert {name for name, _ in CONFIG_ARGS} == {path.name for path in CONFIG_FILES}
  assert {'base.py', 'big.py', 'smoke.py', 'tiny.py', 'table3.py'} <= {name for name, _ in CONFIG_ARGS}


@pytest.mark.parametrize('file_name, arg', CONFIG_ARGS)
def test_config_loads_and_builds(file_name, arg):
  config = load(file_name, arg)
  base = load('base.py', None)
  for section in base:  # Same fields as base: a misspelt override would add a field instead of changing one.
    assert set(config[section]) == set(base[section]), section
  cfg = model_config(config)  # Validates the model fields.
  variables = jax.eval_shape(model_lib.Transformer(cfg).init, jax.random.key(0),
                             jax.ShapeDtypeStruct((2, 3), 'int32'), jax.ShapeDtypeStruct((2, 3), 'int32'))
  embedding = variables['params']['shared_embedding']['embedding']
  assert embedding.value.shape == (config.data.vocab_size, config.model.d_model)
  assert summary.count_params(variables['params']) > 0


@pytest.mark.filterwarnings('ignore:the load_module:DeprecationWarning')  # Inside ml_collections.
def test_config_flags_load_table3_row_and_overrides():
  argv = ['main', f'--config={CONFIG_DIR / "table3.py"}:B1', '--config.model.dropout_rate=0.2']
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file('config', flag_values=flag_values, sys_argv=argv)  # Overrides read sys_argv.
  flag_values(argv)
  assert flag_values.config.model.d_k == 16 and flag_values.config.model.d_v == 64
  assert flag_values.config.model.dropout_rate == 0.2


def test_unknown_table3_row_lists_valid_rows():
  with pytest.raises(ValueError, match="unknown Table 3 row 'G1'; valid rows: base, A1, A2, A3, A4, B1, B2, C1"):
    TABLE3.get_config('G1')
  with pytest.raises(ValueError, match='valid rows'):
    TABLE3.get_config()


def test_table3_rows_follow_the_paper():
  assert list(TABLE3.PAPER_ROWS) == list(TABLE3.PAPER) and set(TABLE3.NOTES) == set(TABLE3.ROWS)
  assert [r for r in TABLE3.PAPER_ROWS if r not in ('base', 'big')] == [
      'A1', 'A2', 'A3', 'A4', 'B1', 'B2', 'C1', 'C2', 'C3', 'C4', 'C5', 'C6', 'C7', 'D1', 'D2', 'D3', 'D4', 'E']
  for row in TABLE3.PAPER_ROWS:
    config = load('table3.py', row)
    assert config.train.num_train_steps == (300_000 if row == 'big' else 100_000), row
  for row in ('A1', 'A2', 'A3', 'A4'):  # §3.2.2: constant computation, h * d_k = d_model.
    model = load('table3.py', row).model
    assert model.num_heads * model.d_k == model.num_heads * model.d_v == 512, row
  big = load('table3.py', 'big')
  assert (big.model.d_model, big.model.d_ff, big.model.num_heads, big.model.dropout_rate) == (1024, 4096, 16, 0.3)
  assert big.eval.average_last_n == 20 and load('big.py', None).to_dict() == big.to_dict()
  assert load('table3.py', 'D3').train.label_smoothing == 0.0
  assert load('table3.py', 'E').model.position_embedding == 'learned'


# Parameter counts at the paper's vocabulary (§5.1: about 37000 shared BPE tokens).
#
# Our counts are 2-7% below the paper's d_model=512 rows (base: 63.05M vs 65M). The architecture is
# exact: attention projections without biases, FFN with biases, LayerNorm scale and bias, one embedding
# shared by both stacks and the pre-softmax layer, parameter-free sinusoids. Only the vocabulary is
# unknown: the embedding (vocab x d_model) is the only vocabulary-dependent term, and the paper's rounded
# counts for base, B, C1-C3, C6 and C7 are all reproduced, to the paper's rounding, only with a vocabulary
# of 41,003-41,209 (base alone: 39,841-41,794), 4.1k more than 37000 (= 2.1M parameters at d_model 512).
# C4 (39,670-43,576) and C5 (40,598-41,575) agree. big alone does not: its 213M implies 35,368-36,344.
# So differences between rows of the same d_model cancel the vocabulary and must match within rounding
# (two counts rounded to 1M: +-1.0M), while absolute counts carry the vocabulary gap (7% covers C1, the
# smallest d_model=512 row: 33.6M vs 36M, -6.5%). Rows changing d_model carry the vocabulary gap in their
# difference too, so the difference test leaves them out: C5's difference holds (1024 - 512) x vocabulary,
# 2.1M less at 37000 than at 41.1k (+100.77M vs +103M), and big has its own implied vocabulary (+151.13M vs
# +148M). Both stay within 7% of the paper's absolute counts (C5 -2.5%, big +0.55%).
IMPLIED_VOCAB_SIZE = 41_100
COUNTED_ROWS = [row for row, paper in TABLE3.PAPER.items() if paper['params_millions'] is not None]
D_MODEL_CHANGES = ('C5', 'big')


@pytest.mark.parametrize('row', [r for r in COUNTED_ROWS if r not in ('base',) + D_MODEL_CHANGES])
def test_table3_parameter_difference_from_base(row):
  difference = (table3_count(row) - table3_count('base')) / 1e6
  expected = TABLE3.PAPER[row]['params_millions'] - TABLE3.PAPER['base']['params_millions']
  assert abs(difference - expected) <= 1.0, f'{row}: {difference:+.3f}M, paper {expected:+d}M'


@pytest.mark.parametrize('row', COUNTED_ROWS)
def test_table3_parameter_count_within_7_percent(row):
  count, paper = table3_count(row), TABLE3.PAPER[row]['params_millions'] * 1e6
  assert abs(count / paper - 1.0) <= 0.07, f'{row}: {count / 1e6:.2f}M, paper {paper / 1e6:.0f}M'


@pytest.mark.parametrize('row', [r for r in COUNTED_ROWS if r != 'big'])  # big implies 35.4k-36.3k.
def test_table3_parameter_count_at_implied_vocabulary(row):
  """At a 41,100-token vocabulary every counted row rounds to the paper's figure (see the comment above)."""
  d_model = load('table3.py', row).model.d_model
  count = table3_count(row) + (IMPLIED_VOCAB_SIZE - load('table3.py', row).data.vocab_size) * d_model
  assert abs(count / 1e6 - TABLE3.PAPER[row]['params_millions']) <= 0.5, f'{row}: {count / 1e6:.3f}M'


@pytest.mark.integration
def test_parameter_counts_do_not_depend_on_regularisation():
  base = table3_count('base')
  assert all(table3_count(row) == base for row in ('A1', 'A2', 'A3', 'A4', 'D1', 'D2', 'D3', 'D4'))
  # Learned positions: one max_length x d_model table per stack, max_length = 256 + 50 (§6.1 decoding).
  assert table3_count('E') == base + 2 * 306 * 512


# The variant rows (F) against base at vocabulary 37,000 (their docstring in configs/table3.py lists them).
VARIANT_COUNTS_MILLIONS = {'F1': 63.05, 'F2': 63.03, 'F3': 63.05, 'F4': 63.01, 'F5': 63.01, 'F6': 54.79,
                           'F7': 55.97, 'F8': 55.92}


@pytest.mark.parametrize('row', list(VARIANT_COUNTS_MILLIONS))
def test_variant_rows_change_only_their_fields_and_count_as_documented(row):
  base, config = load('base.py', None).to_dict(), load('table3.py', row).to_dict()
  changed = {f'{section}.{key}' for section in base for key in base[section]
             if base[section][key] != config[section][key]}
  assert changed == set(TABLE3.VARIANT_ROWS[row]), row
  assert round(table3_count(row) / 1e6, 2) == VARIANT_COUNTS_MILLIONS[row]


def test_multi30k_takes_the_target_language():
  assert load('multi30k.py', 'fr').data.target_lang == 'fr' and load('multi30k.py', None).data.target_lang == 'de'
  with pytest.raises(ValueError, match="Multi30k's targets are 'de' and 'fr'"):
    load('multi30k.py', 'cs')


def test_validation_names_a_bad_early_stopping():
  config = load_config_module(CONFIG_DIR / 'base.py').get_config()
  config_checks.validate_config(config)
  config.decode.early_stopping = 'eager'
  with pytest.raises(ValueError, match=r"decode\.early_stopping must be one of \('bound', 'finished'\), got 'eager'"):
    config_checks.validate_config(config)


def _assert_rejected(field: str, values, message: str, accepted) -> None:
  """Each of `values` in `field` ('section.name') of configs/base.py fails validation with `message`; `accepted`
  passes."""
  section, name = field.split('.')
  for value in values:
    config = load_config_module(CONFIG_DIR / 'base.py').get_config()
    config[section][name] = value
    with pytest.raises(ValueError, match=message):
      config_checks.validate_config(config)
  config[section][name] = accepted
  config_checks.validate_config(config)


def test_validation_names_a_bad_r_drop_alpha():
  _assert_rejected('train.rdrop_alpha', (-1.0, float('nan'), float('inf')),
                   r'train\.rdrop_alpha must be a finite number >= 0 \(0: no R-Drop\)', 5.0)


@pytest.mark.parametrize('rate', ['dropout_rate', 'attention_dropout_rate', 'activation_dropout_rate'])
def test_validation_rejects_r_drop_without_dropout(rate):
  """R-Drop's divergence compares two dropout masks: with every dropout rate 0 the passes agree and the doubled
  step buys nothing, so train.rdrop_alpha > 0 is refused there; any one nonzero rate of the three is enough."""
  config = load_config_module(CONFIG_DIR / 'base.py').get_config()
  config.train.rdrop_alpha = 5.0
  config.model.dropout_rate = config.model.attention_dropout_rate = config.model.activation_dropout_rate = 0.0
  with pytest.raises(ValueError, match=r'train\.rdrop_alpha must be 0 when model\.dropout_rate, '
                     r'model\.attention_dropout_rate, model\.activation_dropout_rate are all 0'):
    config_checks.validate_config(config)
  config.model[rate] = 0.1
  config_checks.validate_config(config)


def test_validation_names_a_bad_decoding_batch():
  # tokens_per_batch 1 is raised to one row of the longest bucket per data shard when decoding.
  _assert_rejected('decode.tokens_per_batch', (True, -1), r'decode\.tokens_per_batch must be an integer >= 0', 1)
  _assert_rejected('decode.compact_every_steps', (True, False, -1),
                   r'decode\.compact_every_steps must be an integer >= 0', 0)
  _assert_rejected('decode.concurrent_batches', (True, -1), r'decode\.concurrent_batches must be an integer >= 0',
                   0)


@pytest.mark.parametrize('recipe', list(RECIPES.ROWS))
def test_multi30k_recipes_train_within_the_main_jobs_compute(recipe):
  """Each candidate recipe's analytic training FLOPs are the main job's (8,000 steps of 96.4 GFLOP) within 1%
  or less: Multi30k's packed rows are 64 tokens long, so a batch is [tokens_per_batch / 64, 64], run
  `passes_per_step` times (twice under R-Drop)."""
  def train_flops(config):
    rows = config.data.tokens_per_batch // 64
    passes = step_lib.passes_per_step(config.train.rdrop_alpha)
    return flops.train_step_flops(model_config(config), rows, 64, 64, passes) * config.train.num_train_steps
  main_job = train_flops(load('multi30k.py', None))
  assert main_job == pytest.approx(RECIPES.BUDGET_FLOPS, rel=1e-4)
  assert 0.97 * main_job <= train_flops(load('multi30k_recipes.py', recipe)) <= 1.01 * main_job
  assert set(RECIPES.NOTES) == set(RECIPES.ROWS)


def test_multi30k_recipes_keep_the_adam_they_were_measured_with():
  """The recipes start from the main job as they were measured against it, with Adam (no weight decay) at half of
  §5.3's rate, decoded with beam 4: `paper` is configs/multi30k.py but for train.weight_decay 0,
  train.learning_rate_scale 0.5 and decode.beam_size 4, and `weight_decay3_lr2x_dose` (AdamW, λ 0.3, §5.3's rate)
  is configs/multi30k.py, the main job since 2026-12-07, but for its beam of 4 (6 since later that day).
  configs/multi30k_modern.py is `modern_lr2x_dose`, the main job with rotary positions (until 2026-12-07 it was
  `modern`, rotary positions with Adam at half the rate)."""
  main_job = load('multi30k.py', None).to_dict()
  paper = load('multi30k_recipes.py', 'paper').to_dict()
  assert (main_job['train']['weight_decay'], main_job['train']['learning_rate_scale']) == (0.3, 1.0)
  assert main_job['decode']['beam_size'] == 6
  assert (paper['train']['weight_decay'], paper['train']['learning_rate_scale']) == (0.0, 0.5)
  assert paper['decode']['beam_size'] == 4
  paper['train'].update(weight_decay=0.3, learning_rate_scale=1.0)
  paper['decode'].update(beam_size=6)
  assert paper == main_job
  lr2x_dose = load('multi30k_recipes.py', 'weight_decay3_lr2x_dose').to_dict()
  lr2x_dose['decode'].update(beam_size=6)
  assert lr2x_dose == main_job
  modern = load('multi30k_modern.py', None).to_dict()
  assert modern == load('multi30k_recipes.py', 'modern_lr2x_dose').to_dict()
  assert modern['model']['position_embedding'] == 'rope' != main_job['model']['position_embedding']
  modern['model']['position_embedding'] = main_job['model']['position_embedding']
  assert modern == main_job


# What an archived run may differ in from its recipe today: where the corpus was, the seeds, and the 40 checkpoints
# paper's seeds kept for the averaging study (docs/multi30k_recipes.md). A field added to the package after a run
# must read, in the recipe, the value the run trained with before the field existed.
_RUN_ONLY_FIELDS = {('data', 'manual_dir'), ('data', 'shuffle_seed'), ('train', 'seed'),
                    ('train', 'max_checkpoints_to_keep')}
_BEFORE_THE_FIELD = {('train', 'weight_decay'): 0.0, ('model', 'activation_dropout_rate'): 0.0,
                     ('train', 'rdrop_alpha'): 0.0}
_ARCHIVED_RECIPE_RUNS = sorted((REPO_ROOT / 'docs' / 'multi30k_recipes' / 'runs').glob('*/config.json'))


@pytest.mark.parametrize('run_config', _ARCHIVED_RECIPE_RUNS, ids=lambda path: path.parent.name)
def test_multi30k_recipes_still_describe_their_archived_runs(run_config):
  """Each recipe of configs/multi30k_recipes.py is the config its archived runs trained with, so that a change
  of configs/multi30k.py (AdamW's weight decay on 2026-12-06) cannot silently change a measured row."""
  archived = json.loads(run_config.read_text())
  recipe = load('multi30k_recipes.py', run_config.parent.name.split(report.SEED_SUFFIX)[0]).to_dict()
  for section in ('model', 'data', 'train', 'eval', 'decode'):
    for field, value in recipe[section].items():
      if (section, field) in _RUN_ONLY_FIELDS:
        continue
      if field not in archived[section]:
        if (section, field) in _BEFORE_THE_FIELD:
          assert value == _BEFORE_THE_FIELD[section, field], f'{section}.{field}'
        continue
      expected = archived[section][field]
      assert (list(value) if isinstance(value, tuple) else value) == expected, f'{section}.{field}'
