"""Every public function and class of the package is documented, and documents what it raises (a `Raises:`
section, or a summary that says "Raises ValueError if ...")."""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / 'transformer_jax'
MODULES = sorted(PACKAGE.rglob('*.py'))  # Sub-packages included (data/, training/, ...).
# Methods whose contract is the framework's (flax calls them), documented by their class.
FRAMEWORK_METHODS = {'setup', '__call__', '__init__', '__enter__', '__exit__', 'filter'}


def public_definitions(path: pathlib.Path):
  """(qualified name, node) of every public function, method and class, nested ones included."""
  def visit(node, prefix):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.ClassDef)) and not child.name.startswith('_') | (
          child.name in FRAMEWORK_METHODS):
        yield prefix + child.name, child
        if isinstance(child, ast.ClassDef):
          yield from visit(child, f'{prefix}{child.name}.')
  yield from visit(ast.parse(path.read_text()), '')


def raises_directly(function: ast.FunctionDef) -> bool:
  """Whether the function's own body (not a nested function's) raises an exception it constructs."""
  nodes, found = list(ast.iter_child_nodes(function)), False
  while nodes:
    node = nodes.pop()
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
      continue
    found |= isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
    nodes.extend(ast.iter_child_nodes(node))
  return found


def module_name(path: pathlib.Path) -> str:
  """The path below the package, e.g. 'training/step.py'."""
  return path.relative_to(PACKAGE).as_posix()


@pytest.mark.parametrize('path', MODULES, ids=module_name)
def test_public_definitions_have_docstrings_that_name_what_they_raise(path):
  assert ast.get_docstring(ast.parse(path.read_text())), f'{module_name(path)} has no module docstring'
  undocumented, no_raises = [], []
  for name, node in public_definitions(path):
    doc = ast.get_docstring(node)
    if not doc:
      undocumented.append(name)
    elif isinstance(node, ast.FunctionDef) and raises_directly(node) and 'Raises' not in doc:
      no_raises.append(name)
  assert not undocumented, f'{module_name(path)}: no docstring: {undocumented}'
  assert not no_raises, f'{module_name(path)}: raises without a Raises: section: {no_raises}'


@pytest.mark.parametrize('path', MODULES, ids=module_name)
def test_docstrings_do_not_point_outside_the_repository(path):
  for name, node in [('module', ast.parse(path.read_text()))] + list(public_definitions(path)):
    assert '../shared/' not in (ast.get_docstring(node) or '').replace('../shared/data/', ''), (module_name(path), name)


def test_readme_layout_lists_every_module():
  readme = (PACKAGE.parent / 'README.md').read_text()
  layout = readme[readme.index('## Layout'):]
  missing = [module_name(path) for path in MODULES
             if path.name != '__init__.py' and f'| `{module_name(path)}` |' not in layout]
  assert not missing, f"README's layout table lacks {missing}"
  folders = sorted({path.parent.name for path in MODULES if path.parent != PACKAGE})
  assert [f for f in folders if f'- `{f}/`:' not in layout] == [], "README's 'package in layers' lacks a folder"
