r"""Per-chip memory of the sharded SAO step against trajectory length (AOT).

  python benchmarks/long_context_plans.py                    # both presets
  python benchmarks/long_context_plans.py --presets=1b --lengths=2048,4096

For each preset and T, `sao_jax.tools.aot_compile` compiles the full SAO
step (critic and policy updates, splash attention, Pallas kernels under
shard_map) for the preset's TPU topology on libtpu's compile-only devices,
with T tokens per trajectory, and records its per-chip memory. Results are
written after every compile and reused on a rerun (a compile takes 1-5 min
on a 2-core VM), so an interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=g-import-not-at-top,wrong-import-position
from sao_jax import config_lib
from sao_jax.tools import aot_compile
# pylint: enable=g-import-not-at-top,wrong-import-position

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name: (config file, topology); the 8B series uses the 32k recipe's four
# micro-batches at every length, so that only T changes along a row.
PRESETS = {
    '1b': ('configs/llama3_1b_v6e.py', 'v6e:2x4'),
    '8b': ('configs/llama3_8b_agent_32k.py', 'v5p:4x4x4'),
}
LENGTHS = (2048, 4096, 8192, 16384, 32768)


def plan(preset: str, length: int) -> dict:
  path, topology = PRESETS[preset]
  config = config_lib.load_config(os.path.join(ROOT, path))
  config.rollout.max_sequence_length = length
  config.rollout.max_target_length = length
  config.rollout.max_prefill_length = min(config.rollout.max_prefill_length,
                                          length // 2)
  try:
    report = dataclasses.asdict(aot_compile.compile_train_step(config,
                                                               topology))
  except aot_compile.DoesNotFit as e:
    report = {'topology': topology, 'fits': False, 'error': str(e)}
  report.update(preset=preset, length=length, config=path,
                microbatches=config.optim.microbatches,
                date=time.strftime('%Y-%m-%d'))
  return report


def table(results: list[dict]) -> str:
  gib = lambda r, k: f"{r[k] / 2**30:.2f}" if k in r else 'n/a'
  lines = ['| preset | topology | T | micro-batches | temporaries (GiB) |'
           ' peak / HBM (GiB) | fits | compile (s) |',
           '|---|---|---|---|---|---|---|---|']
  for r in sorted(results, key=lambda r: (r['preset'], r['length'])):
    lines.append(
        f"| {r['preset']} | {r['topology']} | {r['length']:,} |"
        f" {r['microbatches']} | {gib(r, 'temp_bytes_per_device')} |"
        f" {gib(r, 'peak_bytes_per_device')} /"
        f" {gib(r, 'hbm_bytes_per_device')} | {'yes' if r['fits'] else 'NO'}"
        f" | {r.get('compile_seconds', 0):.0f} |")
  return '\n'.join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--presets', default=','.join(PRESETS))
  parser.add_argument('--lengths', default=','.join(map(str, LENGTHS)))
  parser.add_argument('--out', default=os.path.join(
      ROOT, 'benchmarks', 'results', 'long_context_plans.json'))
  parser.add_argument('--redo', action='store_true',
                      help='compile again what the JSON already holds')
  args = parser.parse_args()
  results = []
  if os.path.exists(args.out) and not args.redo:
    with open(args.out) as f:
      results = json.load(f)['results']
  done = {(r['preset'], r['length']) for r in results}
  for preset in args.presets.split(','):
    for length in map(int, args.lengths.split(',')):
      if (preset, length) in done:
        continue
      print(f'compiling {preset} at T={length} ...', flush=True)
      results.append(plan(preset, length))
      with open(args.out, 'w') as f:
        json.dump({'results': results}, f, indent=1)
  print(table(results))


if __name__ == '__main__':
  main()
