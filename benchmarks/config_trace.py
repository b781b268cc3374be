"""How far a run's configuration travels: the modules a tiny training run passes `config` through, in order.

  python benchmarks/config_trace.py [--show]

Runs `train.train_and_evaluate` on configs/smoke.py (the tests' synthetic corpus, tests/tiny_runs.py, with the
final translation; in a temporary folder) under `sys.setprofile` and follows every call into the package that receives the configuration: the
ConfigDict itself, one of its sections (config.data, config.train, ...), or an object holding it in a
`config` attribute (`Setup` once did). Each call site is followed once (the first time a function calls a given
function), so the training loop's repeated steps count once, like reading the code. The route is the module of
each such call, in the order the calls are made (consecutive calls in one module count once); a **move** is a
step of the route from one module to another, a **climb** a move into a module that imports (directly or not)
the one before it: the reader goes back up the import graph, as when a stage returns from a deep call and the
next call is made from higher up, or a low module calls into a high one.
Prints the counts, the modules entered and how often, and with --show the route itself (module.function of
each call followed, indented by depth).
"""
import argparse
import ast
import collections
import pathlib
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / 'transformer_jax'


def _module(path: pathlib.Path) -> str:
  """A package file's module below the package: 'run.train', 'errors'."""
  return '.'.join(path.relative_to(PACKAGE).with_suffix('').parts)


def _imports() -> dict[str, set[str]]:
  """{module: the package modules it imports, transitively}."""
  direct = {}
  modules = {_module(path) for path in PACKAGE.rglob('*.py')}
  for path in PACKAGE.rglob('*.py'):
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and (node.module or '').split('.')[0] == 'transformer_jax':
        below = node.module.removeprefix('transformer_jax').lstrip('.')
        if below in modules:  # from transformer_jax.storage.checkpoints import CheckpointManager
          names.add(below)
        else:  # from transformer_jax import errors; from transformer_jax.run import train
          names.update(f'{below}.{alias.name}'.lstrip('.') for alias in node.names)
    direct[_module(path)] = names
  closure = {}
  for module in direct:
    seen, todo = set(), list(direct[module])
    while todo:
      name = todo.pop()
      if name not in seen and name in direct:
        seen.add(name)
        todo.extend(direct[name])
    closure[module] = seen
  return closure


class _Tracer:
  """sys.setprofile hook: the route of the configuration through the package's modules."""

  def __init__(self, config):
    self.targets = {id(config)} | {id(config[key]) for key in config.keys() if hasattr(config[key], 'keys')}
    self.config = config
    self.stack = []          # (frame, module) of the config-carrying calls being followed.
    self.followed = set()    # (caller code, callee code) pairs already followed once.
    self.skipping = None     # The frame of a repeated call whose subtree is skipped.
    self.route = []          # Modules, consecutive repeats collapsed.
    self.steps = []          # What --show prints.

  def _carries(self, frame) -> bool:
    for name in frame.f_code.co_varnames[:frame.f_code.co_argcount + frame.f_code.co_kwonlyargcount]:
      value = frame.f_locals.get(name)
      if id(value) in self.targets or getattr(value, 'config', None) is self.config:
        return True
    return False

  def _enter(self, module: str) -> None:
    if not self.route or self.route[-1] != module:
      self.route.append(module)

  def __call__(self, frame, event, arg):
    del arg
    if self.skipping is not None:
      if event == 'return' and frame is self.skipping:
        self.skipping = None
      return
    filename = pathlib.Path(frame.f_code.co_filename)
    if PACKAGE not in filename.parents:
      return
    if event == 'call' and self._carries(frame):
      caller = self.stack[-1][0].f_code if self.stack else None
      if (caller, frame.f_code) in self.followed:
        self.skipping = frame
        return
      self.followed.add((caller, frame.f_code))
      self.stack.append((frame, _module(filename)))
      self._enter(_module(filename))
      self.steps.append('  ' * (len(self.stack) - 1) + f'{_module(filename)}.{frame.f_code.co_qualname}')
    elif event == 'return' and self.stack and self.stack[-1][0] is frame:
      self.stack.pop()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--show', action='store_true', help='print the route, one step per line')
  args = parser.parse_args()
  sys.path[:0] = [str(REPO), str(REPO / 'tests')]
  import tiny_runs  # pylint: disable=import-outside-toplevel
  from transformer_jax.run import train  # pylint: disable=import-outside-toplevel
  with tempfile.TemporaryDirectory() as folder:
    config = tiny_runs.text_config(tiny_runs.write_corpus(pathlib.Path(folder) / 'corpus'), translate_at_end=True)
    workdir = str(pathlib.Path(folder) / 'run')
    tracer = _Tracer(config)
    sys.setprofile(tracer)
    try:
      train.train_and_evaluate(config, workdir)
    finally:
      sys.setprofile(None)
  imports = _imports()
  route = tracer.route
  moves = list(zip(route, route[1:]))
  climbs = [(a, b) for a, b in moves if a in imports.get(b, set())]
  if args.show:
    print('\n'.join(tracer.steps))
  entered = collections.Counter(route)
  print(f'moves {len(moves)}, climbs back {len(climbs)}, modules {len(entered)}')
  print('entered: ' + ', '.join(f'{module} {count}' for module, count in entered.most_common()))


if __name__ == '__main__':
  main()
