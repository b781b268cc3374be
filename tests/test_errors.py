"""The user-error types: each is the built-in exception it refines, and prints as the user has always seen it."""
import pytest

from transformer_jax import errors
from transformer_jax.storage import workdir as workdir_lib


@pytest.mark.parametrize('error_type, builtin', [
    (errors.ConfigError, ValueError), (errors.DamagedFileError, ValueError),
    (errors.MissingFileError, FileNotFoundError), (errors.PathError, OSError),
    (errors.RunFolderError, RuntimeError), (errors.MissingPackageError, ImportError),
    (errors.DivergedError, FloatingPointError)])
def test_each_kind_is_a_user_error_and_its_builtin(error_type, builtin):
  with pytest.raises(builtin, match='data.vocab_size'):  # Callers that catch the built-in still catch it.
    raise error_type('data.vocab_size=7 does not fit this corpus')
  assert issubclass(error_type, errors.UserError)
  assert errors.one_line(error_type('the message')) == f'{builtin.__name__}: the message'


def test_a_modules_own_user_error_prints_its_own_name():
  assert errors.one_line(workdir_lib.WorkdirInUseError('run.lock is held')) == 'WorkdirInUseError: run.lock is held'
  assert isinstance(workdir_lib.WorkdirInUseError('x'), RuntimeError)


def test_builtin_errors_are_not_user_errors():
  assert not issubclass(ValueError, errors.UserError) and not issubclass(RuntimeError, errors.UserError)
