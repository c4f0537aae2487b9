"""The interim main job runs end to end, learns, and writes its plot."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_toy_demo_learns_and_plots(tmp_path):
  proc = subprocess.run(
      [sys.executable, '-m', 'sao_jax.toy_demo', '--config=configs/default.py',
       f'--workdir={tmp_path}', '--steps=40'],
      cwd=ROOT, capture_output=True, text=True, timeout=300,
      env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert proc.returncode == 0, proc.stderr
  first, last = map(float, re.search(
      r'reward ([\d.]+) \(first 10 steps\) -> ([\d.]+)', proc.stdout).groups())
  assert last > first + 0.2
  assert os.path.getsize(tmp_path / 'toy_demo.png') > 1000
