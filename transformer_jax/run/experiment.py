"""What every mode builds from the config before it trains, evaluates or translates (§5).

`compute_setup` checks the config (`config_checks`) and builds the mesh, model and optimiser (a
`training.build.Build`: all that --mode=compile and --mode=benchmark need); `setup` also checks everything else
that can be checked before a byte is written (input files, that the workdir is writable and holds no
incompatible run), then loads or trains the vocabulary and opens the checkpoint managers (a
`training.build.Setup`). What a run folder must agree with (the checkpoint fingerprint, the vocabulary's hash)
is `storage/fingerprint.py`'s.
"""
import dataclasses
import os

from absl import logging
from etils import epath
import jax

from transformer_jax import errors
from transformer_jax.cpu import host_allocator
from transformer_jax.data import input_pipeline
from transformer_jax.model import sharding
from transformer_jax.model import transformer as model_lib
from transformer_jax.run import config_checks
from transformer_jax.storage import fingerprint
from transformer_jax.storage import workdir as workdir_lib
from transformer_jax.training import distributed
from transformer_jax.training import optim
from transformer_jax.training.build import Build
from transformer_jax.training.build import Setup


def compute_setup(config, devices=None) -> Build:
  """The I/O-free half of `setup`: config checks, mesh, model and optimiser; no tokenizer or checkpoints.

  Training (through `setup`), --mode=compile and --mode=benchmark all build the model, optimiser and mesh here,
  so that what compile and benchmark measure is what training runs.

  Args:
    config: the ConfigDict (configs/base.py).
    devices: the mesh's devices; all of `jax.devices()` by default (compile: a TPU slice's, `tpu_slices`).

  Raises:
    errors.ConfigError: for a bad config value (`validate_config`), a mesh that does not fit the devices or
      does not divide the model's dimensions (naming the model and mesh keys), or a mesh whose processes would
      not each hold their own rows of a batch.
  """
  model_cfg = config_checks.validate_config(config)
  dimensions = config_checks.mesh_dimensions(model_cfg)
  train_cfg = config.train
  schedule = optim.rsqrt_schedule(model_cfg.d_model, train_cfg.warmup_steps, train_cfg.learning_rate_scale)
  tx = optim.make_optimizer(schedule, b1=train_cfg.adam_b1, b2=train_cfg.adam_b2, eps=train_cfg.adam_eps,
                            grad_clip_norm=train_cfg.grad_clip_norm, weight_decay=train_cfg.weight_decay)
  try:  # sharding raises the built-in type, naming the mesh.* (and model.*) keys.
    mesh = sharding.make_mesh(config.mesh, devices, dimensions)
    rules = sharding.logical_axis_rules(config.mesh)
  except ValueError as e:
    raise errors.ConfigError(str(e)) from e
  return Build(mesh, rules, model=model_lib.Transformer(model_cfg), tx=tx, schedule=schedule,
               grad_accum_steps=train_cfg.grad_accum_steps)


def setup(config, workdir: str, data_splits=(), lock: str | None = None) -> Setup:
  """Checks config, input files and workdir, then loads (training: or trains) the vocabulary and builds the model.

  Training (`lock='train'`) writes nothing before every check has passed, and its only writes before training
  are the workdir itself, its `checkpoints/` folder (and `best_checkpoints/` with train.eval_bleu_every_steps)
  and the vocabulary `spm_<vocab_size>.model`. Every other mode reads the run: its checkpoint managers are
  read-only (they create, delete and rename nothing, and leave a trainer's save in progress alone), no
  vocabulary is trained, and without a lock nothing at all is written, so a run folder on a read-only share
  works and a trainer saving beside the reader is not disturbed.
  A training run's check that fails after its first writes (a vocabulary size the corpus cannot fill) removes
  the folders and the lock file this call created that are still empty.

  Args:
    config: the ConfigDict (configs/base.py).
    workdir: the run's folder.
    data_splits: splits whose input files must exist (`check_data_files`).
    lock: 'train', or 'evaluate' for an evaluation that writes its outputs into the run folder: check that the
      folder is writable and take its `workdir.RunLock` (process 0), released by `Setup.close`; None: read the
      run without locking or writing.

  Raises:
    errors.ConfigError: for a bad config value, or a workdir holding a run with an incompatible config.
    errors.MissingFileError: for a missing input file; when reading, for a run folder without its vocabulary.
    errors.PathError: if the workdir cannot be created or written (with a lock).
    tfds_downloads.DownloadError: when a TFDS dataset cannot be downloaded (before the workdir is created).
    workdir.WorkdirInUseError: when another process writes the run folder (nothing is written then).
  """
  built = compute_setup(config)
  model_cfg = built.model.cfg
  config_checks.check_data_files(config.data, data_splits)
  if lock == 'train':
    config_checks.check_resumable_optimizer(config, workdir)
  if data_splits:
    input_pipeline.prepare_dataset(config.data)  # A failed download leaves no workdir behind.
  new_paths = [path for path in (epath.Path(workdir) / workdir_lib.LOCK, epath.Path(workdir) / 'best_checkpoints',
                                 epath.Path(workdir) / 'checkpoints', epath.Path(workdir))
               if not path.exists()]  # Innermost first.
  read_only = lock != 'train'
  if lock is not None:
    _check_writable(workdir, ' (--output=DIR evaluates a run without writing into its folder)' if lock == 'evaluate'
                    else '')
    distributed.check_shared_workdir(workdir)  # Multi-host: one workdir for all processes.
  run_lock = _lock(workdir, lock)
  manager = None
  try:
    # The fingerprint check comes before the vocabulary is trained: a run with another vocabulary size would
    # otherwise leave a second spm_<vocab_size>.model behind before failing.
    manager = fingerprint.open_checkpoints(config, workdir, model_cfg, read_only=read_only)
    fingerprint.check_vocabulary(config, workdir, manager)
    if read_only:
      fingerprint.require_vocabulary(config, workdir)
    vocabulary = workdir_lib.path(workdir, workdir_lib.vocabulary_file(config.data.vocab_size))
    tokenizer = input_pipeline.get_tokenizer(config.data, vocabulary, jax.process_index())
    if tokenizer.vocab_size != model_cfg.vocab_size:
      raise errors.ConfigError(f'The vocabulary in {workdir} has {tokenizer.vocab_size} pieces, not '
                               f'data.vocab_size={model_cfg.vocab_size}')
    manager.vocabulary_sha256 = fingerprint.vocabulary_sha256(config, workdir)
    if lock == 'train':
      fingerprint.record_vocabulary_hash(config, workdir)
    best = (fingerprint.open_best_checkpoints(config, workdir, model_cfg, read_only=read_only)
            if config.train.eval_bleu_every_steps else None)
    if best is not None:
      best.vocabulary_sha256 = manager.vocabulary_sha256
  except BaseException:
    if manager is not None:
      manager.close()  # Its threads would outlive the error.
    if run_lock is not None:
      run_lock.release()
    _remove_if_empty(new_paths)
    raise
  return Setup(**{f.name: getattr(built, f.name) for f in dataclasses.fields(Build) if f.init}, workdir=workdir,
               tokenizer=tokenizer, checkpoints=manager, best_checkpoints=best, lock=run_lock)


def _remove_if_empty(paths: list[epath.Path]) -> None:
  """Removes each of `paths` (innermost first) that exists and is empty: a file of no bytes (the `run.lock` of a
  lock already released) or a folder with nothing in it; leaves any other as it is."""
  for path in paths:
    try:
      if path.is_file() and os.path.getsize(path) == 0:
        path.unlink()
      elif path.is_dir() and not any(path.iterdir()):
        path.rmdir()
    except OSError:
      pass  # Another process wrote into it, or it cannot be removed: it stays, as before this call.


def _lock(workdir: str, purpose: str | None) -> workdir_lib.RunLock | None:
  """The run folder's lock for `purpose` on process 0 (None when not asked for, or not a local folder)."""
  if purpose is None or jax.process_index() != 0:
    return None
  if not workdir_lib.RunLock.supported(workdir):
    logging.warning('%s is not a local folder: not locked; make sure no other process writes it.', workdir)
    return None
  return workdir_lib.RunLock(workdir, purpose).acquire()


def _check_writable(workdir: str, hint: str = '') -> None:
  """Fails before training when the workdir cannot be written (read-only, missing permissions, full); the error
  ends with `hint`."""
  try:
    path = epath.Path(workdir)
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f'.write_probe_{jax.process_index()}'
    probe.write_text('x' * 4096)
    probe.unlink()
  except OSError as e:
    raise errors.PathError(f'--workdir={workdir} is not writable: {e}{hint}') from e


def log_backend(config) -> None:
  """Logs the backend and devices in use, once; warns when a config sized for accelerators runs on a CPU."""
  devices = jax.devices()
  logging.info('JAX %s on %s: process %d of %d, %d devices (%d local: %s)', jax.__version__,
               jax.default_backend(), jax.process_index(), jax.process_count(), len(devices),
               jax.local_device_count(), ', '.join(str(d) for d in jax.local_devices()))
  if host_allocator.chosen is not None:
    logging.info('Host memory allocator: %s (%s; transformer_jax.cpu.host_allocator)', host_allocator.chosen,
                 host_allocator.ALLOCATOR_ENV)
  big = config.model.d_model >= 512 or config.data.tokens_per_batch >= 8192
  if jax.default_backend() == 'cpu' and big:
    logging.warning('This config is sized for accelerators (model.d_model=%d, data.tokens_per_batch=%d) and runs '
                    "on the CPU: steps will take seconds to minutes. For a GPU or TPU install jax's build with "
                    "pip install -e '.[cuda]' or -e '.[tpu]' (README, Set-up).", config.model.d_model,
                    config.data.tokens_per_batch)