"""Executes notebooks/inspect.ipynb headless on a tiny run trained from the Multi30k corpus.

Needs the test extra (nbclient comes with nbmake; ipykernel). Equivalent by hand:
  INSPECT_WORKDIR=/nonexistent pytest --nbmake notebooks/inspect.ipynb
"""
import os
import pathlib

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = REPO_ROOT / 'notebooks' / 'inspect.ipynb'


# ~30 s on 2 idle cores (TensorFlow import, a 40-step tiny run, three validations).
@pytest.mark.slow
def test_inspect_notebook_runs_on_a_tiny_run(multi30k_dir, tmp_path):
  nbformat = pytest.importorskip('nbformat', reason='needs the test extra (nbmake)')
  nbclient = pytest.importorskip('nbclient', reason='needs the test extra (nbmake)')
  pytest.importorskip('ipykernel', reason='needs the test extra (ipykernel)')
  env = dict(os.environ, INSPECT_WORKDIR=str(tmp_path / 'no_run'), INSPECT_TINY_WORKDIR=str(tmp_path / 'tiny'),
             INSPECT_PNG_DIR=str(tmp_path / 'png'), MULTI30K_DIR=str(multi30k_dir),
             XLA_FLAGS='--xla_force_host_platform_device_count=1')  # One device, as a notebook user has.
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  client = nbclient.NotebookClient(notebook, timeout=300, kernel_name='python3',
                                   resources={'metadata': {'path': str(NOTEBOOK.parent)}})
  client.execute(env=env)

  outputs = [output for cell in notebook.cells if cell.cell_type == 'code' for output in cell.outputs]
  assert not [o for o in outputs if o.output_type == 'error']
  text = ''.join(o.get('text', '') for o in outputs if o.output_type == 'stream')
  assert 'No checkpoint in' in text and 'checkpoint step 40 of [20, 40]' in text
  assert 'total_params:' in text and 'source: ▁A ▁man' in text and 'target: <s>' in text
  images = [o for o in outputs if 'image/png' in o.get('data', {})]
  pngs = sorted(p.name for p in (tmp_path / 'png').iterdir())
  assert pngs == ['attention_decoder_self.png', 'attention_encoder_decoder.png', 'attention_encoder_self.png',
                  'attention_own_translation.png', 'curves.png', 'learning_rate.png', 'positional_encoding.png']
  assert 'translation: ' in text  # The model's own translation, whose attention is drawn.
  assert len(images) == len(pngs)
