"""The synthetic corpus and tiny training runs that test_train.py and test_reliability.py share.

configs/smoke.py on a word-for-word "translation" corpus written to a temporary folder (dataset='text'): no
network, no real corpus. The fixtures that build them are in conftest.py.
"""
import dataclasses
import os
import pathlib
import re
import sys

import numpy as np

from transformer_jax.data import train_iterator

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
  sys.path.insert(0, str(REPO_ROOT))  # Configs do `from configs import base`, as when run from the root.
from configs import smoke  # pylint: disable=g-import-not-at-top,wrong-import-position

VOCAB_SIZE = 384  # Byte fallback, specials and the corpus's characters take 286; 384 keeps sentences < 20 pieces.
NUM_STEPS = 6     # Checkpoints (every 2 steps, 2 kept) end at steps 4 and 6.
EN = 'a man woman dog cat red big small runs sits on the street grass ball with plays child blue house'.split()
DE = 'ein mann frau hund katze rot gross klein rennt sitzt auf der strasse gras ball mit spielt kind blau haus'.split()
SPLITS = {'train': 200, 'val': 16, 'test': 12}  # Pairs per split.
COMPARED_TAGS = re.compile(r'^(train/(loss|nll|accuracy|perplexity|learning_rate|skipped_steps)|eval.*|test/.*)$')


def tiny_model_fields(**overrides) -> dict:
  """configs/smoke.py's model section (the tiny model the tests build: N=2, d_model=32, h=4, d_k=d_v=8), as
  `transformer.ModelConfig` keyword arguments, with `overrides` (e.g. vocab_size=64, num_layers=1)."""
  return dict(smoke.get_config().model) | overrides


def synthetic_pairs(num_pairs: int, seed: int) -> list[tuple[str, str]]:
  """Sentences of 3 to 9 words and their word-for-word German translation."""
  rng = np.random.default_rng(seed)
  pairs = []
  for _ in range(num_pairs):
    words = rng.integers(0, len(EN), size=rng.integers(3, 10))
    pairs.append((' '.join(EN[w] for w in words), ' '.join(DE[w] for w in words)))
  return pairs


def write_lines(path: pathlib.Path, lines) -> str:
  path.write_text(''.join(line + '\n' for line in lines), encoding='utf-8')
  return str(path)


def write_corpus(folder: pathlib.Path) -> dict[str, str]:
  """Writes {split}.en / {split}.de; returns the data.*_files values ('SOURCE,TARGET') by config key."""
  folder.mkdir(parents=True, exist_ok=True)
  files = {}
  for seed, (split, num_pairs) in enumerate(SPLITS.items()):
    pairs = synthetic_pairs(num_pairs, seed)
    files[split] = ','.join(write_lines(folder / f'{split}.{lang}', [p[i] for p in pairs])
                            for i, lang in enumerate(('en', 'de')))
  return {'train_files': files['train'], 'eval_files': files['val'], 'test_files': files['test']}


def text_config(corpus: dict[str, str], **train_overrides):
  """configs/smoke.py on the synthetic corpus: one batch shape [8, 32], NUM_STEPS steps, no decoding."""
  config = smoke.get_config()
  config.data.update(dataset='text', vocab_size=VOCAB_SIZE, max_length=32, bucket_lengths=(32,), **corpus)
  config.train.update(num_train_steps=NUM_STEPS, translate_at_end=False)
  config.train.update(**train_overrides)
  return config


def config_flags(corpus: dict[str, str], **train_overrides) -> list[str]:
  """The same as `text_config`, as command-line flags for main."""
  values = {'data.dataset': 'text', 'data.vocab_size': VOCAB_SIZE, 'data.max_length': 32,
            'data.bucket_lengths': '(32,)', 'train.num_train_steps': NUM_STEPS, 'train.translate_at_end': False,
            **{f'data.{key}': value for key, value in corpus.items()},
            **{f'train.{key}': value for key, value in train_overrides.items()}}
  return [f'--config={REPO_ROOT / "configs" / "smoke.py"}'] + [f'--config.{k}={v}' for k, v in values.items()]


def read_events(workdir) -> dict[str, dict[int, float]]:
  """Scalars of every TensorBoard event file in workdir, {tag: {step: value}}; later files win."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  scalars = {}
  for path in sorted(pathlib.Path(workdir).glob('events.out.tfevents.*'), key=os.path.getmtime):
    for event in tf.compat.v1.train.summary_iterator(str(path)):
      for value in event.summary.value:
        scalars.setdefault(value.tag, {})[event.step] = value.simple_value
  return scalars


def compared(events: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
  """The scalars that must repeat exactly across runs (not the timings)."""
  return {tag: values for tag, values in events.items() if COMPARED_TAGS.match(tag)}


def checkpoint_steps(workdir) -> list[int]:
  """The committed checkpoint steps in <workdir>/checkpoints, ascending."""
  folder = pathlib.Path(workdir) / 'checkpoints'
  return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.exists() else []


_TRAIN_ITERATOR_NEXT = train_iterator.TrainIterator.__next__  # Unpatched, whatever a test did before.


def record_batches(monkeypatch, on_batch=None) -> list[dict[str, np.ndarray]]:
  """Makes TrainIterator record the batches it yields; on_batch(index, batch) may raise or alter them."""
  batches = []

  def recording_next(iterator):
    batch = _TRAIN_ITERATOR_NEXT(iterator)
    if on_batch is not None:
      batch = on_batch(len(batches) + 1, batch)
    batches.append({k: v.copy() for k, v in batch.items()})
    return batch

  monkeypatch.setattr(train_iterator.TrainIterator, '__next__', recording_next)
  return batches


def assert_same_batches(actual, expected):
  assert len(actual) == len(expected)
  for a, e in zip(actual, expected):
    assert a.keys() == e.keys()
    for key in a:
      np.testing.assert_array_equal(a[key], e[key], err_msg=key)


def subprocess_env(cache_dir) -> dict[str, str]:
  """The test process's device setup, plus the shared compilation cache, for `python -m transformer_jax.main`."""
  return {**os.environ, 'JAX_COMPILATION_CACHE_DIR': str(cache_dir),
          'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0', 'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES': '0',
          'JAX_NUMPY_RANK_PROMOTION': 'raise'}


def main_command(workdir, flags) -> list[str]:
  """`python -m transformer_jax.main --workdir=... --logtostderr <flags>` as an argv list."""
  return [sys.executable, '-m', 'transformer_jax.main', f'--workdir={workdir}', '--logtostderr', *flags]


@dataclasses.dataclass
class Run:
  """A finished tiny run: its workdir, final metrics, the batches it read and its TensorBoard scalars."""
  workdir: pathlib.Path
  results: dict[str, float]
  batches: list[dict[str, np.ndarray]]
  events: dict[str, dict[int, float]]
