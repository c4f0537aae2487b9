"""The Colab notebooks: each paired script runs, and its .ipynb has not drifted.

`notebooks/<name>.py` (jupytext percent format) is the source of truth;
`notebooks/<name>.ipynb` is generated from it (`jupytext --to ipynb
notebooks/*.py`) and committed without outputs. These tests need no jupytext:
they parse both files themselves, and execute the script under plain Python
with the tiny settings (`SAO_NOTEBOOK_TINY=1`).
"""

import json
import os
import subprocess
import sys
import time

import pytest

from sao_jax import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, 'notebooks')
NAMES = ('quickstart', 'sao_vs_grpo')
# The figure each notebook saves in its workdir.
PLOTS = {'quickstart': 'quickstart.png', 'sao_vs_grpo': 'sao_vs_grpo.png'}


def script_cells(path):
  """`[(cell_type, source)]` of a jupytext percent-format script.

  The YAML header (before the first `# %%`) is notebook metadata, not a cell.
  A markdown cell's lines lose their `# ` comment prefix. Blank lines around
  a cell are not part of it.
  """
  cells, kind, lines = [], None, []

  def flush():
    if kind is not None:
      cells.append((kind, '\n'.join(lines).strip('\n')))

  with open(path, encoding='utf-8') as f:
    for line in f.read().splitlines():
      if line.startswith('# %%'):
        flush()
        kind = 'markdown' if '[markdown]' in line else 'code'
        lines = []
      elif kind == 'markdown':
        assert line == '' or line.startswith('#'), (path, line)
        lines.append(line[2:] if line.startswith('# ') else line[1:])
      elif kind == 'code':
        lines.append(line)
  flush()
  return cells


def notebook_cells(path):
  with open(path, encoding='utf-8') as f:
    notebook = json.load(f)
  return notebook, [(c['cell_type'], ''.join(c['source']).strip('\n'))
                    for c in notebook['cells']]


def test_script_cell_parser():
  path = os.path.join(NOTEBOOKS, 'quickstart.py')
  cells = script_cells(path)
  assert cells[0][0] == 'markdown' and cells[0][1].startswith('# SAO')
  assert any(kind == 'code' and 'REPO_URL =' in source
             for kind, source in cells)


@pytest.mark.parametrize('name', NAMES)
def test_ipynb_matches_script(name):
  script = script_cells(os.path.join(NOTEBOOKS, f'{name}.py'))
  notebook, cells = notebook_cells(os.path.join(NOTEBOOKS, f'{name}.ipynb'))
  regenerate = f'regenerate it: jupytext --to ipynb notebooks/{name}.py'
  assert [k for k, _ in cells] == [k for k, _ in script], regenerate
  for i, (got, want) in enumerate(zip(cells, script)):
    assert got == want, (
        f'{name}.ipynb cell {i} differs from the .py; {regenerate}')
  assert notebook['metadata']['kernelspec']['name'] == 'python3'


@pytest.mark.parametrize('name', NAMES)
def test_ipynb_has_no_outputs(name):
  notebook, _ = notebook_cells(os.path.join(NOTEBOOKS, f'{name}.ipynb'))
  for i, cell in enumerate(notebook['cells']):
    if cell['cell_type'] == 'code':
      assert cell.get('outputs') == [], f'{name}.ipynb cell {i} has outputs'
      assert cell.get('execution_count') is None, (
          f'{name}.ipynb cell {i} has an execution count')


@pytest.mark.parametrize('name', NAMES)
def test_scripts_use_no_ipython_magics(name):
  # Plain `python notebooks/<name>.py` must run them (CI does).
  for kind, source in script_cells(os.path.join(NOTEBOOKS, f'{name}.py')):
    if kind == 'code':
      for line in source.splitlines():
        assert not line.lstrip().startswith(('!', '%')), (name, line)


def run_notebook_script(name, workdir, timeout=300):
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT,
             SAO_NOTEBOOK_TINY='1', SAO_NOTEBOOK_WORKDIR=str(workdir),
             MPLBACKEND='Agg')
  # The test session's eight fake CPU devices are not what a notebook sees.
  env = xla_flags.child_environment(env)
  start = time.monotonic()
  proc = subprocess.run(
      [sys.executable, os.path.join(NOTEBOOKS, f'{name}.py')], cwd=ROOT,
      env=env, capture_output=True, text=True, timeout=timeout)
  return proc, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize('name', NAMES)
def test_notebook_script_runs_with_tiny_settings(name, tmp_path):
  proc, seconds = run_notebook_script(name, tmp_path)
  assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
  plot = tmp_path / PLOTS[name]
  assert plot.is_file(), proc.stdout[-3000:]
  assert plot.stat().st_size > 20_000  # two panels of curves, not a blank
  from PIL import Image  # pylint: disable=g-import-not-at-top
  with Image.open(plot) as image:
    assert image.width >= 800 and image.height >= 300
    # More than a couple of colours: something was drawn.
    assert len(image.convert('RGB').getcolors(maxcolors=1 << 20)) > 50
  if name == 'quickstart':
    assert 'before' in proc.stdout and 'after' in proc.stdout
  else:
    for algorithm in ('sao', 'grpo'):
      assert (tmp_path / algorithm / 'metrics.jsonl').is_file()
  print(f'{name}: {seconds:.0f} s')
