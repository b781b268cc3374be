"""The shared source-target subword vocabulary (Sec. 5.1), trained with SentencePiece.

Sec. 5.1: "Sentences were encoded using byte-pair encoding, which has a shared source-target vocabulary of about
37000 tokens" (English-German). One SentencePiece model encodes both languages; BPE is the default, unigram an
option. This module imports no jax, so it can run anywhere (data preparation, evaluation scripts).

Special ids, fixed for every vocabulary trained here:
  PAD_ID = 0: padding; the loss and the attention masks ignore it. Never produced by `encode`.
  BOS_ID = 1: begin of sentence; the first decoder input (target tokens shifted right).
  EOS_ID = 2: end of sentence; appended to every source and target; decoding stops there.
  UNK_ID = 3: unknown piece; not produced in practice, since byte fallback spells any character unseen in training
    as its UTF-8 bytes (pieces <0x00>..<0xFF>).

Text normalisation policy (`data.tokenizer_normalization`, one of NORMALIZATIONS, stored in the model file): by
default SentencePiece's rule `nmt_nfkc`, as in tensor2tensor and flax's wmt example. `decode(encode(x)) == x` holds
for any text in Unicode NFKC form without leading, trailing or repeated whitespace (accents, CJK, emoji and other
characters unseen in training included). Otherwise the result is the normalised text: compatibility characters are
folded ('ﬁ' -> 'fi', full-width 'Ａ' -> 'A', '…' -> '...') and whitespace is trimmed and collapsed to single
spaces.
Training sentences are normalised the same way, so this only changes text, never loses it. BLEU is computed against
the raw references, not normalised ones, so a normalised character in a hypothesis can cost BLEU: `round_trip`
counts the lines that change, and `input_pipeline.get_tokenizer` logs that count for the validation targets when it
trains a vocabulary. 'identity' keeps every character (whitespace is still trimmed and collapsed); '*_cf' rules
also fold case.
"""
from collections.abc import Callable, Iterable, Sequence
import io
import os
import time

from absl import logging
from etils import epath
import google.protobuf.message
import numpy as np
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from transformer_jax import errors

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3

# SentencePiece's built-in normalisation rules (normalization_rule_name).
NORMALIZATIONS = ('nmt_nfkc', 'nfkc', 'nmt_nfkc_cf', 'nfkc_cf', 'identity')


class Tokenizer:
  """A SentencePiece model with the special ids above."""

  def __init__(self, model_proto: bytes):
    """Wraps a serialized SentencePiece model.

    Args:
      model_proto: the bytes of a `.model` file.

    Raises:
      errors.DamagedFileError: if the model's special ids differ from PAD_ID, BOS_ID, EOS_ID, UNK_ID.
    """
    self._processor = spm.SentencePieceProcessor(model_proto=model_proto)
    ids = (self._processor.pad_id(), self._processor.bos_id(), self._processor.eos_id(), self._processor.unk_id())
    if ids != (PAD_ID, BOS_ID, EOS_ID, UNK_ID):
      raise errors.DamagedFileError(f'SentencePiece model has (pad, bos, eos, unk) ids {ids}; '
                                    f'expected {(PAD_ID, BOS_ID, EOS_ID, UNK_ID)}.')
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_proto)
    self._normalization = proto.normalizer_spec.name
    self._is_bpe = proto.trainer_spec.model_type == sentencepiece_model_pb2.TrainerSpec.BPE

  @classmethod
  def load(cls, path: str | os.PathLike[str]) -> 'Tokenizer':
    """Loads a `.model` file (local or any path `etils.epath` reads, such as gs://).

    Raises:
      errors.DamagedFileError: naming the file, when it is not a SentencePiece model (truncated or damaged).
    """
    try:
      return cls(epath.Path(path).read_bytes())
    except (RuntimeError, google.protobuf.message.DecodeError) as e:
      raise errors.DamagedFileError(
          f'{path} is not a readable SentencePiece model ({e}): the file is damaged or truncated. '
          'Restore it; a run without checkpoints can delete it to train it again.') from None

  @property
  def normalization(self) -> str:
    """The model's normalisation rule, e.g. 'nmt_nfkc' (one of NORMALIZATIONS)."""
    return self._normalization

  @property
  def vocab_size(self) -> int:
    """The number of ids, special ids and byte pieces included."""
    return self._processor.get_piece_size()

  def pieces(self) -> list[str]:
    """Every piece, in id order (what an exported model's vocabulary lists)."""
    return [self._processor.id_to_piece(i) for i in range(self.vocab_size)]

  def encode(self, texts: list[str], bpe_dropout_rate: float = 0.0) -> list[list[int]]:
    """Encodes sentences into ids, without BOS or EOS.

    Args:
      texts: sentences, str.
      bpe_dropout_rate: BPE-dropout (Provilkov et al., 2020; not in the paper), SentencePiece's sampling: the
        probability with which each merge is skipped, so that a word may come out in smaller pieces than in the
        deterministic segmentation (on Multi30k, rate 0.1 gives ~40% more pieces). Every segmentation decodes to
        the same text. 0 (the default) is the deterministic segmentation. The samples are not reproducible:
        with sentencepiece 0.2.3, two processes that call `spm.set_random_generator_seed(7)` and then encode
        the same sentences, in one thread or several, get different segmentations (measured), so callers that
        need one sample on several hosts must share it.

    Returns:
      One list of int ids per sentence, in [UNK_ID, vocab_size); [] for an empty or blank sentence.

    Raises:
      ValueError: if bpe_dropout_rate is outside [0, 1), or positive for a model that is not BPE (for a unigram
        model SentencePiece's sampling parameter means something else).
    """
    if not 0 <= bpe_dropout_rate < 1:
      raise ValueError(f'BPE-dropout rate must be in [0, 1), got {bpe_dropout_rate}.')
    if not bpe_dropout_rate:
      return self._processor.encode(list(texts), out_type=int)
    if not self._is_bpe:
      raise ValueError('BPE-dropout needs a BPE vocabulary (data.tokenizer_model_type=bpe).')
    return self._processor.encode(list(texts), out_type=int, enable_sampling=True, alpha=bpe_dropout_rate)

  def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
    """Decodes ids into sentences.

    Args:
      ids: one sequence of ids per sentence (lists or int arrays, e.g. rows of a [batch, length] array). Each is
        cut at its first EOS_ID; PAD_ID and BOS_ID are dropped.

    Returns:
      One str per sentence.
    """
    kept = []
    for row in ids:
      row = [int(i) for i in row]
      if EOS_ID in row:
        row = row[:row.index(EOS_ID)]
      kept.append([i for i in row if i not in (PAD_ID, BOS_ID)])
    return self._processor.decode(kept)


def round_trip(tokenizer: Tokenizer, lines: Sequence[str]) -> list[int]:
  """Indices of the lines that `decode(encode(line))` changes (normalisation; see the module docstring).

  Args:
    tokenizer: the vocabulary.
    lines: raw sentences, e.g. the validation targets that BLEU scores against.

  Returns:
    The 0-based indices of the lines that do not come back unchanged, in order.
  """
  decoded = tokenizer.decode(tokenizer.encode(list(lines)))
  return [i for i, (line, back) in enumerate(zip(lines, decoded)) if line != back]


def sample_sentences(sentences: Iterable[str], max_sentences: int, seed: int) -> list[str]:
  """A uniform sample of at most `max_sentences` of the non-empty sentences, in corpus order, chosen by `seed`.

  The sample is drawn here with numpy rather than by SentencePiece (input_sentence_size with
  shuffle_input_sentence), whose sample differs from process to process whatever `spm.set_random_generator_seed`
  says (sentencepiece 0.2.3: three runs, three vocabularies), so the same corpus and seed give the same file.

  Args:
    sentences: the training sentences (str).
    max_sentences: the most to keep.
    seed: seeds numpy's default Generator (data.tokenizer_seed).

  Returns:
    The non-empty sentences if there are at most max_sentences of them, else max_sentences of them without
    replacement, in their original order.
  """
  kept = [sentence for sentence in sentences if sentence]  # SentencePiece skips empty lines too.
  if len(kept) <= max_sentences:
    return kept
  chosen = np.sort(np.random.default_rng(seed).choice(len(kept), max_sentences, replace=False))
  return [kept[i] for i in chosen]


def _train(sentences: Iterable[str], vocab_size: int, model_type: str, max_sentences: int, seed: int,
           normalization: str, user_defined_symbols: Sequence[str] = ()) -> bytes:
  """Trains a SentencePiece model on a seeded sample of at most `max_sentences` sentences; returns its bytes."""
  sample = sample_sentences(sentences, max_sentences, seed)
  model = io.BytesIO()
  spm.set_random_generator_seed(seed)  # For SentencePiece's other random choices (unigram).
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(sample),
      model_writer=model,
      vocab_size=vocab_size,
      model_type=model_type,
      pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=UNK_ID,
      byte_fallback=True,
      normalization_rule_name=normalization,
      # Each a single piece wherever it occurs; given with SentencePiece's word-start mark '▁', so that a
      # space-separated token is one piece, not '▁' and the symbol.
      user_defined_symbols=[f'\u2581{symbol}' for symbol in user_defined_symbols],
      input_sentence_size=0,  # All of the sample: SentencePiece's own sampling is not reproducible.
      num_threads=os.cpu_count() or 1,
      minloglevel=1)
  return model.getvalue()


def train_or_load(path: str | os.PathLike[str],
                  sentences: Callable[[], Iterable[str]],
                  vocab_size: int,
                  model_type: str = 'bpe',
                  max_sentences: int = 2_000_000,
                  seed: int = 0,
                  normalization: str = 'nmt_nfkc',
                  user_defined_symbols: Sequence[str] = (),
                  on_trained: Callable[[Tokenizer], None] | None = None,
                  process_index: int = 0,
                  timeout_secs: float = 3600.0,
                  poll_secs: float = 1.0) -> Tokenizer:
  """Loads the SentencePiece model file `path`, training it first if it does not exist.

  Process 0 trains and writes the file atomically (a temporary file, then a rename); the other processes wait for
  it to appear, so every host uses the same vocabulary.

  The arguments' ranges are checked once, at start-up, with the rest of the config
  (`config_checks.validate_config`: data.vocab_size, tokenizer_model_type, tokenizer_seed, tokenizer_normalization).

  Args:
    path: the model file (a run's is `<workdir>/spm_<vocab_size>.model`, `storage.workdir.vocabulary_file`); its
      folder is created if missing.
    sentences: returns the training sentences (source and target together, Sec. 5.1); called only when process 0
      trains.
    vocab_size: number of pieces, special ids and the 256 byte pieces included (Sec. 5.1: about 37000).
    model_type: 'bpe' (Sec. 5.1) or 'unigram'.
    max_sentences: at most this many non-empty sentences, sampled uniformly (`sample_sentences`), train the model.
    seed: chooses the sample (data.tokenizer_seed): the same sentences and seed give the same file, byte for byte.
    normalization: SentencePiece's normalisation rule (data.tokenizer_normalization), one of NORMALIZATIONS. An
      existing file must have been trained with it.
    user_defined_symbols: tokens that must each be one piece when they stand between spaces (a treebank's
      '(NP', ')NP', 'XX', §6.3); they count towards vocab_size.
    on_trained: called with the new Tokenizer on process 0 right after training (not when the file existed).
    process_index: this host's index (jax.process_index()).
    timeout_secs: how long a process other than 0 waits for the file, seconds.
    poll_secs: seconds between checks for the file.

  Returns:
    The loaded Tokenizer.

  Raises:
    errors.ConfigError: for an existing file trained with another normalization, or a vocab_size the corpus
      cannot fill or that is smaller than its characters plus the special and byte pieces (naming
      data.vocab_size).
    TimeoutError: if the file does not appear within timeout_secs on a process other than 0.
  """
  path = epath.Path(path)
  if path.exists():
    logging.info('Loading the vocabulary %s (%d pieces).', path, vocab_size)
  elif process_index == 0:
    texts = sentences()
    start = time.perf_counter()
    try:
      proto = _train(texts, vocab_size, model_type, max_sentences, seed, normalization, user_defined_symbols)
    except RuntimeError as e:  # SentencePiece reports a size that does not fit the corpus as a RuntimeError.
      if 'ocabulary size' not in str(e):
        raise
      raise errors.ConfigError(f'data.vocab_size={vocab_size} does not fit this corpus: {e}') from e
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f'{path.name}.tmp-{os.getpid()}'
    tmp.write_bytes(proto)
    tmp.replace(path)
    logging.info('Trained %s vocabulary of %d pieces (normalisation %s) in %.1f s: %s', model_type, vocab_size,
                 normalization, time.perf_counter() - start, path)
    if on_trained is not None:
      on_trained(Tokenizer(proto))
  deadline = time.monotonic() + timeout_secs
  while not path.exists():
    if time.monotonic() > deadline:
      raise TimeoutError(f'Process {process_index}: {path} did not appear within {timeout_secs} s '
                         '(process 0 trains it).')
    time.sleep(poll_secs)
  tokenizer = Tokenizer.load(path)
  if tokenizer.normalization != normalization:
    raise errors.ConfigError(f'{path} was trained with normalisation {tokenizer.normalization!r}, not '
                             f'data.tokenizer_normalization={normalization!r}: use a new workdir, or the same setting.')
  return tokenizer

