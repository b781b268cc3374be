"""Every config field with its value, its default and its meaning: what `--mode=config` prints.

The meanings are the comments of configs/base.py, where every default lives: a field's inline comment, or the
comment lines just above it. Reading them from that file keeps one source for the defaults and their
explanations.
"""
import json
import os
import pathlib
import re

import ml_collections

from transformer_jax.storage import workdir as workdir_lib

BASE_CONFIG = workdir_lib.BASE_CONFIG
_SECTION = re.compile(r'^\s*config\.(\w+) = ml_collections\.ConfigDict\(')
_FIELD = re.compile(r'^\s{6}(\w+)=[^#]*?(?:#\s*(.*))?$')
_COMMENT = re.compile(r'^\s*#\s?(.*)$')


def field_comments(path: str | os.PathLike[str] = BASE_CONFIG) -> dict[str, str]:
  """{'section.field': meaning} from the comments of a config file laid out as configs/base.py.

  Returns:
    The comment of every field that has one; {} if the file does not exist (an installed wheel ships no
    configs/).
  """
  path = pathlib.Path(path)
  if not path.is_file():
    return {}
  comments, section, pending = {}, None, []
  for line in path.read_text(encoding='utf-8').splitlines():
    if match := _SECTION.match(line):
      section, pending = match[1], []
    elif section and (match := _COMMENT.match(line)):
      pending.append(match[1].strip())
    elif section and (match := _FIELD.match(line)):
      text = ' '.join(pending + ([match[2].strip()] if match[2] else []))
      if text:
        comments[f'{section}.{match[1]}'] = text
      pending = []
    else:
      pending = []
  return comments


def _defaults() -> dict[str, object]:
  """{'section.field': default} of configs/base.py, or {} without it."""
  if not BASE_CONFIG.is_file():
    return {}
  return dict(_flatten(workdir_lib.load_config(BASE_CONFIG)))


def _flatten(config: ml_collections.ConfigDict, prefix: str = ''):
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      yield from _flatten(value, f'{prefix}{key}.')
    else:
      yield f'{prefix}{key}', value


def describe(config: ml_collections.ConfigDict) -> str:
  """One line per field, `section.field = value` (with `(default: X)` where it differs from configs/base.py),
  followed by the field's meaning; sections in the config's order."""
  comments, defaults = field_comments(), _defaults()
  lines, section = [], None
  for key, value in _flatten(config):
    if key.split('.')[0] != section:
      section = key.split('.')[0]
      lines.append(f'\n[{section}]')
    line = f'{key} = {value!r}'
    if key in defaults and json.dumps(defaults[key]) != json.dumps(value):  # Tuples and lists alike.
      line += f'  (default: {defaults[key]!r})'
    if key in comments:
      line += f'\n    {comments[key]}'
    lines.append(line)
  return '\n'.join(lines).lstrip('\n') + '\n'

