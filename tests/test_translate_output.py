"""--mode=translate's output: checked before anything is decoded, and one line per input line whatever the
pieces decode to."""
import contextlib
import types

import ml_collections
import pytest

from transformer_jax import errors
from transformer_jax.evaluation import evaluate
from transformer_jax.run import evaluate as evaluate_mode
from transformer_jax.run import experiment


def _refuse_setup(*args, **kwargs):
  raise AssertionError('the run was opened (and the model would have been loaded and every line decoded)')


@pytest.mark.parametrize('output', ['a folder', 'missing/out.txt', 'a file/out.txt'])
def test_an_output_that_cannot_be_written_stops_translate_before_the_model_is_loaded(monkeypatch, tmp_path, output):
  (tmp_path / 'a folder').mkdir()
  (tmp_path / 'a file').write_text('x')
  (tmp_path / 'in.txt').write_text('a man\n')
  monkeypatch.setattr(experiment, 'setup', _refuse_setup)
  with pytest.raises(errors.PathError, match=rf'--output={tmp_path / output}'):
    evaluate_mode.translate_file(None, str(tmp_path / 'run'), str(tmp_path / 'in.txt'), str(tmp_path / output))


class _FakeSetup:
  """What translate_file uses of a Setup, without a model."""
  tokenizer = None
  checkpoints = types.SimpleNamespace(latest_step=lambda: 6)

  def close(self):
    pass

  def mesh_context(self):
    return contextlib.nullcontext()


@pytest.mark.parametrize('decoded', ['ein\nmann', 'ein\rmann', 'ein\r\nmann', 'ein\u2028mann', 'ein\u2029mann',
                                     'ein\x85mann', 'ein\x0bmann\x0c', 'ein\x1cmann\x1d\x1e'])
def test_a_line_break_decoded_from_byte_pieces_never_splits_an_output_line(monkeypatch, tmp_path, decoded):
  (tmp_path / 'in.txt').write_text('a man\n\nthe dog\n')
  monkeypatch.setattr(experiment, 'setup', lambda *args, **kwargs: _FakeSetup())
  monkeypatch.setattr(evaluate, 'load_params', lambda *args: ({}, [6]))
  monkeypatch.setattr(evaluate_mode.input_pipeline, 'encode', lambda tokenizer, lines: lines)
  monkeypatch.setattr(evaluate, 'translate_ids', lambda config, setup, params, lines: [decoded] * len(lines))
  config = ml_collections.ConfigDict({'data': {'dataset': 'multi30k'}, 'eval': {}, 'train': {'num_train_steps': 6}})
  evaluate_mode.translate_file(config, str(tmp_path), str(tmp_path / 'in.txt'), str(tmp_path / 'out.txt'))
  written = (tmp_path / 'out.txt').read_text(encoding='utf-8')
  lines = written.splitlines()  # Splits at every line break there is.
  assert len(lines) == 3 and lines[1] == '' and lines[0] == lines[2] and lines[0].split() == ['ein', 'mann']
  assert written.count('\n') == 3 and '\r' not in written
