"""The layout index in docs/architecture.md matches the repository's tree.

The `## Layout` section of docs/architecture.md is the one place that names
every module of the package with its purpose. An index that silently drifts
from the tree (a module moved, one added, one deleted) misleads every reader,
so this test compares the two by reading files only: no sao_jax import, so it
runs in milliseconds and cannot fail for reasons other than the index.

The block's format: one entry per line, a name (`x.py` or `folder/`) and then
its purpose, two spaces of indent per folder level under the folder above it.
"""

import pathlib
import re

_REPO = pathlib.Path(__file__).resolve().parents[1]
_PACKAGE = _REPO / 'sao_jax'
_ARCHITECTURE = _REPO / 'docs' / 'architecture.md'
_DOC = 'docs/architecture.md'


def _layout_block():
  """The lines of the first fenced block under the `## Layout` heading."""
  text = _ARCHITECTURE.read_text()
  section = re.search(r'^## Layout\n(.*?)(?=^## |\Z)', text, re.S | re.M)
  assert section, f'{_DOC} has no "## Layout" section'
  block = re.search(r'^```[^\n]*\n(.*?)^```', section.group(1), re.S | re.M)
  assert block, f'the "## Layout" section of {_DOC} has no fenced block'
  return block.group(1).splitlines()


def _listed():
  """{path relative to the repository: line} of every entry in the block.

  Folders end with '/'. A line's indent says which folder above it holds it,
  so a file is known by its full path, not by a bare name that several
  folders may share (api.py, reference.py, ...).
  """
  entries = {}
  folders = []  # folders[i]: the open folder at indent level i
  for number, line in enumerate(_layout_block(), 1):
    if not line.strip():
      continue
    match = re.fullmatch(r'( *)(\S+)(\s{2,}\S.*)?', line)
    assert match, f'{_DOC}, layout line {number}: not "name  purpose": {line!r}'
    indent, name = len(match.group(1)), match.group(2)
    assert indent % 2 == 0, (
        f'{_DOC}, layout line {number}: indent by two spaces per level: {line!r}')
    level = indent // 2
    assert level <= len(folders), (
        f'{_DOC}, layout line {number}: indented below no folder: {line!r}')
    assert name.endswith(('/', '.py')), (
        f'{_DOC}, layout line {number}: a name ends with / or .py: {name!r}')
    assert match.group(3), f'{_DOC}, layout line {number}: {name} has no purpose'
    path = ''.join(folders[:level]) + name
    assert path not in entries, f'{_DOC}: {path} is listed twice'
    entries[path] = number
    del folders[level:]
    if name.endswith('/'):
      folders.append(name)
  return entries


def test_every_module_and_package_is_listed():
  listed = _listed()
  modules = sorted(
      path.relative_to(_REPO).as_posix()
      for path in _PACKAGE.rglob('*.py')
      if '__pycache__' not in path.parts and path.name != '__init__.py')
  packages = sorted(
      path.parent.relative_to(_REPO).as_posix() + '/'
      for path in _PACKAGE.rglob('__init__.py')
      if '__pycache__' not in path.parts)
  missing = [path for path in modules + packages if path not in listed]
  assert not missing, (
      f'add these to the "## Layout" block of {_DOC}, each with the first'
      ' line of its docstring:\n  ' + '\n  '.join(missing))


def test_every_listed_name_exists():
  gone = []
  for path, number in _listed().items():
    target = _REPO / path.rstrip('/')
    exists = target.is_dir() if path.endswith('/') else target.is_file()
    if not exists:
      gone.append(f'{path} (line {number} of the block)')
  assert not gone, (
      f'the "## Layout" block of {_DOC} names what does not exist; remove or'
      ' rename:\n  ' + '\n  '.join(gone))
