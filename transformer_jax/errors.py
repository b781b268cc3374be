"""Mistakes a user can fix: a config key or value, a missing or damaged file, a run folder in use, a package.

The package raises a `UserError` (one of the types below, or a module's own subclass such as
`workdir.WorkdirInUseError`) only where its message names what to change. `main` prints such an error as one
line, `<kind>: <message>`, with exit status 1; any other exception is a bug and keeps its traceback. Each type
is also the built-in exception it refines (a `ConfigError` is a ValueError, a `MissingFileError` a
FileNotFoundError), so code that catches the built-in catches it too.
"""


class UserError(Exception):
  """A mistake the user can fix; raise one of the subclasses, whose message names the key, value or path."""


class ConfigError(UserError, ValueError):
  """A config field's or a flag's value that cannot work, alone or with the run already in the workdir."""


class DamagedFileError(UserError, ValueError):
  """A file the run reads that is cut short, corrupt or not of the expected kind: restore or replace it."""


class MissingFileError(UserError, FileNotFoundError):
  """A file or folder that the config or the command line names and that does not exist."""


class PathError(UserError, OSError):
  """A path that exists but cannot be used as the command needs (a run folder that is not writable)."""


class RunFolderError(UserError, RuntimeError):
  """The run folder's state stops the command: another process writes it, or unusable steps are left in it."""


class MissingPackageError(UserError, ImportError):
  """A setting that needs a package (an extra of pyproject.toml) that is not installed."""


class DivergedError(UserError, FloatingPointError):
  """Training stopped on a non-finite loss or gradient; the message names the step and the settings to change."""


def one_line(error: UserError) -> str:
  """`<kind>: <message>`: the kind is the error's class, or for the types of this module the built-in one it
  refines (`ValueError` for a ConfigError), as the messages read before these types existed."""
  kind = next(cls for cls in type(error).__mro__ if cls.__module__ != __name__)
  return f'{kind.__name__}: {error}'
