r"""Bytes per step of sparse weight deltas (`rollout.weight_delta = sparse`)
on the demo: the main job's config, shortened, once per served dtype.

  python benchmarks/weight_delta.py                  # f32 and bf16 servers, 6 steps each
  python benchmarks/weight_delta.py --steps 3 --dtypes bfloat16

Each run is `python -m sao_jax.train --config=configs/default.py` with
`rollout.weight_delta=sparse`, `total_steps=--steps`, evaluation only at the end, and the
servers' `rollout.param_dtype` set (float32: the demo as it ships; bfloat16:
the engine keeps and computes in bf16, as on a TPU). From each run's
`metrics.jsonl`, per policy step: the payload bytes that went to the server
(`rollout/weight_push_megabytes`) against a whole version
(`rollout/weight_version_megabytes`), and the learner's wait for the host
copy, which now includes the comparison (`time/weight_prepare_seconds`).
The first push (at start) and every `weight_delta_anchor_every`-th go whole
by design; the table reports the rest. Writes JSON and prints markdown rows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import training_runs  # pylint: disable=g-import-not-at-top,wrong-import-position

ROOT = training_runs.ROOT


def command(workdir: str, steps: int, dtype: str) -> list[str]:
  return [sys.executable, '-m', 'sao_jax.train',
          '--config=configs/default.py', f'--workdir={workdir}',
          f'--config.total_steps={steps}', '--config.eval.at_start=False',
          '--config.eval.every=0',
          '--config.rollout.weight_delta=sparse',
          f'--config.rollout.param_dtype={dtype}']


def summarize(workdir: str) -> dict:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  pushes = [r for r in records if 'rollout/weight_push_megabytes' in r]
  steps = [{'step': r['step'],
            'push_mb': r['rollout/weight_push_megabytes'],
            'version_mb': r['rollout/weight_version_megabytes'],
            'prepare_s': r.get('time/weight_prepare_seconds'),
            'push_s': r.get('time/weight_push_seconds')} for r in pushes]
  deltas = [s for s in steps if s['push_mb'] < s['version_mb']]
  whole = [s for s in steps if s['push_mb'] >= s['version_mb']]
  fractions = [s['push_mb'] / s['version_mb'] for s in steps]
  return {'steps': steps, 'delta_pushes': len(deltas),
          'whole_pushes': len(whole),
          'median_fraction': statistics.median(fractions) if fractions
                             else None,
          'median_prepare_s': statistics.median(
              s['prepare_s'] for s in steps if s['prepare_s'] is not None)
                              if steps else None}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--steps', type=int, default=6)
  parser.add_argument('--dtypes', default='float32,bfloat16')
  parser.add_argument('--out', default='benchmarks/results/weight_delta.json')
  args = parser.parse_args()
  root = tempfile.mkdtemp(prefix='sao_weight_delta_')
  results = {'machine': {'platform': platform.platform(),
                         'cpus': os.cpu_count(),
                         'command': ' '.join(sys.argv),
                         'date': datetime.date.today().isoformat()},
             'runs': {}}
  for dtype in args.dtypes.split(','):
    workdir = os.path.join(root, dtype)
    run = command(workdir, args.steps, dtype)
    print(' '.join(run[1:]), flush=True)
    proc = subprocess.run(run, cwd=ROOT,
                          env=training_runs.run_environment(root),
                          capture_output=True, text=True)
    if proc.returncode != 0:
      raise SystemExit(f'{dtype} run failed:\n{proc.stderr[-3000:]}')
    results['runs'][dtype] = dict(summarize(workdir),
                                  command=' '.join(run[1:]))
  os.makedirs(os.path.dirname(os.path.join(ROOT, args.out)), exist_ok=True)
  with open(os.path.join(ROOT, args.out), 'w') as f:
    json.dump(results, f, indent=1)
  report(results)


def report(results: dict) -> None:
  """Markdown rows: the delta pushes' bytes against a whole version."""
  print('| served dtype | pushes: delta / whole | bytes per delta push, median'
        ' (range) | of a whole version | push s, median |')
  print('|---|---|---|---|---|')
  for dtype, r in results['runs'].items():
    version = r['steps'][0]['version_mb']
    sent = [s['push_mb'] for s in r['steps'] if s['push_mb'] < version]
    seconds = statistics.median(s['push_s'] for s in r['steps'])
    if sent:
      cell = (f'{statistics.median(sent):.1f} MB ({min(sent):.1f}-'
              f'{max(sent):.1f}) | {statistics.median(sent) / version:.1%}')
    else:
      cell = 'none: every piece went whole | 100%'
    print(f'| {dtype} | {r["delta_pushes"]} / {r["whole_pushes"]} |'
          f' {cell} of {version:.0f} MB | {seconds:.2f} |')


if __name__ == '__main__':
  main()
