"""No module of sao_jax imports a module of a higher layer.

The layers are the fenced `layers` block of docs/architecture.md: lines
`N name: glob ...`, a lower N being a lower layer; groups that share N sit
beside each other and may import each other. Every module of the package must
match exactly one glob. Every `import` of a sao_jax module counts, at module
level, inside functions and under `if TYPE_CHECKING:` alike, since each one
ties the importer to the imported module's layer.
"""

import ast
import pathlib
import re

import pytest

_REPO = pathlib.Path(__file__).resolve().parents[1]
_PACKAGE = _REPO / 'sao_jax'
_ARCHITECTURE = _REPO / 'docs' / 'architecture.md'

# Known imports that go up a layer, as (importer, imported), each to be
# removed; empty now, kept so that a temporary exception is written down.
_PENDING = frozenset()


def _glob_regex(glob):
  """`**` spans directories, `*` and `?` stay inside one path component."""
  parts = re.split(r'(\*\*|\*|\?)', glob)
  table = {'**': '.*', '*': '[^/]*', '?': '[^/]'}
  return re.compile(''.join(table.get(p, re.escape(p)) for p in parts) + r'\Z')


def _layers():
  """[(level, name, [glob regex])] from the `layers` block of the doc."""
  text = _ARCHITECTURE.read_text()
  block = re.search(r'^```layers\n(.*?)^```', text, re.S | re.M)
  assert block, f'{_ARCHITECTURE} has no ```layers fenced block'
  layers = []
  for line in block.group(1).splitlines():
    line = line.split('#', 1)[0].strip()
    if not line:
      continue
    match = re.fullmatch(r'(\d+)\s+([\w-]+):\s*(.+)', line)
    assert match, f'bad line in the layers block: {line!r}'
    level, name, globs = match.groups()
    layers.append((int(level), name,
                   [(g, _glob_regex(g)) for g in globs.split()]))
  return layers


def _modules():
  """{dotted module name: path relative to the repository}."""
  modules = {}
  for path in sorted(_PACKAGE.rglob('*.py')):
    parts = list(path.relative_to(_REPO).with_suffix('').parts)
    if parts[-1] == '__init__':
      parts.pop()
    modules['.'.join(parts)] = path.relative_to(_REPO).as_posix()
  return modules


def _imports(name, path, modules):
  """[(line, imported sao_jax module)] of the module `name` at `path`."""
  tree = ast.parse((_REPO / path).read_text(), filename=path)
  is_package = path.endswith('/__init__.py')
  package = name if is_package else name.rpartition('.')[0]
  found = []

  def resolve(dotted, line):
    # `from sao_jax.x import y`: y is a module when there is one, else a name
    # defined in sao_jax.x. Walk up to the longest existing module.
    while dotted and dotted not in modules:
      dotted = dotted.rpartition('.')[0]
    if dotted:
      found.append((line, dotted))

  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.split('.')[0] == 'sao_jax':
          resolve(alias.name, node.lineno)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:
        anchor = package.split('.')[:len(package.split('.')) - node.level + 1]
        base = '.'.join(anchor + ([base] if base else []))
      if base.split('.')[0] != 'sao_jax':
        continue
      for alias in node.names:
        resolve(f'{base}.{alias.name}', node.lineno)
  return found


def _layer_of(path, layers):
  matches = [(level, name) for level, name, globs in layers
             for _, regex in globs if regex.match(path)]
  return matches


def test_every_module_has_exactly_one_layer():
  layers = _layers()
  problems = []
  for path in _modules().values():
    matches = _layer_of(path, layers)
    if len(matches) != 1:
      problems.append(f'{path}: matched by {matches or "no layer"}')
  assert not problems, (
      f'place each module in one layer of {_ARCHITECTURE.name}:\n'
      + '\n'.join(problems))


def test_every_glob_matches_a_module():
  # A stale glob (a module moved or deleted) would silently place nothing.
  paths = list(_modules().values())
  unused = [f'{level} {name}: {glob}' for level, name, globs in _layers()
            for glob, regex in globs
            if not any(regex.match(p) for p in paths)]
  assert not unused, 'globs that match no module:\n' + '\n'.join(unused)


def test_no_module_imports_a_higher_layer():
  layers = _layers()
  modules = _modules()
  layer = {}
  for name, path in modules.items():
    matches = _layer_of(path, layers)
    if len(matches) == 1:
      layer[name] = matches[0]
  violations, pending_seen = [], set()
  for name, path in modules.items():
    if name not in layer:
      continue  # reported by test_every_module_has_exactly_one_layer
    for line, imported in _imports(name, path, modules):
      if imported not in layer or layer[imported][0] <= layer[name][0]:
        continue
      if (name, imported) in _PENDING:
        pending_seen.add((name, imported))
        continue
      violations.append(
          f'{path}:{line}: {name} (layer {layer[name][0]} {layer[name][1]})'
          f' imports {imported} (layer {layer[imported][0]}'
          f' {layer[imported][1]})')
  assert not violations, (
      'imports that go up a layer (see docs/architecture.md):\n'
      + '\n'.join(violations))
  gone = sorted(_PENDING - pending_seen)
  assert not gone, f'no longer violations; remove them from _PENDING: {gone}'


def _folder(path):
  return path.rpartition('/')[0]


def _layered_imports():
  """[(path, line, importer layer, imported path, imported layer)]."""
  layers = _layers()
  modules = _modules()
  layer = {n: _layer_of(p, layers)[0][0] for n, p in modules.items()
           if len(_layer_of(p, layers)) == 1}
  return [(path, line, layer[name], modules[imported], layer[imported])
          for name, path in modules.items() if name in layer
          for line, imported in _imports(name, path, modules)
          if imported in layer]


def test_no_folder_imports_a_folder_with_a_higher_layer():
  """Folder A imports folder B only if A's lowest module is at or above
  B's highest: the folders stack as the modules do (the base folder
  `sao_jax/` itself excepted: it holds the base and the top layers)."""
  levels = {}
  for path, _, level, imported_path, imported_level in _layered_imports():
    for p, lv in ((path, level), (imported_path, imported_level)):
      low, high = levels.get(_folder(p), (lv, lv))
      levels[_folder(p)] = (min(low, lv), max(high, lv))
  arrows = set()
  for path, line, _, imported_path, _ in _layered_imports():
    a, b = _folder(path), _folder(imported_path)
    if a != b and 'sao_jax' not in (a, b):
      arrows.add((a, b, f'{path}:{line}'))
  upward = sorted(f'{where}: {a}/ (lowest layer {levels[a][0]}) imports {b}/'
                  f' (highest layer {levels[b][1]})'
                  for a, b, where in arrows if levels[b][1] > levels[a][0])
  assert not upward, 'folder-level arrows that go up:\n' + '\n'.join(upward)


@pytest.mark.parametrize('folder', ['sao_jax/rollout', 'sao_jax/models'])
def test_no_import_circle_inside(folder):
  graph = {}
  for path, _, _, imported_path, _ in _layered_imports():
    if _folder(path) == folder and _folder(imported_path) == folder:
      graph.setdefault(path, set()).add(imported_path)
  state = {}

  def visit(node, trail):
    state[node] = 'open'
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 'open':
        return trail[trail.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt, trail + [nxt])
        if found:
          return found
    state[node] = 'done'
    return None

  for start in sorted(graph):
    if start not in state:
      circle = visit(start, [start])
      assert circle is None, 'import circle: ' + ' -> '.join(circle)
