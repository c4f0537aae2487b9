"""Quick modes of the benchmark scripts run in CI, so the scripts cannot rot."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_kernels_benchmark_quick(tmp_path):
  out = tmp_path / 'kernels.json'
  proc = subprocess.run(
      [sys.executable, 'benchmarks/kernels.py', '--quick', f'--out={out}'],
      cwd=ROOT, capture_output=True, text=True, timeout=600,
      env=dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT))
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads(out.read_text())['results']
  assert {r['kernel'] for r in results} == {'gae', 'dis_fwd_bwd'}
  for r in results:
    assert r['min_hbm_bytes'] == r['batch'] * r['length'] * 17 + (
        r['batch'] * 4 if r['kernel'] == 'gae' else 0)
    assert r['xla_reference_ms']['cpu'] > 0
    assert r['tpu_compile_only']['v5e']['pallas']['bytes_accessed'] > 0
  assert '| gae |' in proc.stdout


def test_rollout_benchmark_quick(tmp_path):
  out = tmp_path / 'rollout.json'
  proc = subprocess.run(
      [sys.executable, 'benchmarks/rollout.py', '--quick', f'--out={out}'],
      cwd=ROOT, capture_output=True, text=True, timeout=900,
      env=dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT))
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(out.read_text())
  assert result['median_batched_tokens_per_s'] > 0
  assert result['median_sequential_tokens_per_s'] > 0
  assert result['server_load_and_swap_s'][0] > 0
  assert '| tiny-random |' in proc.stdout
