r"""CPU learner against trajectory length: dense vs blockwise attention.

  python benchmarks/long_context.py                 # T = 1k .. 16k
  python benchmarks/long_context.py --quick         # T = 256, 512, for CI

For each T, two learners of `configs/default.py` (SAO: K = 2 critic updates,
the DIS policy update, remat, chunked LM head) on the tiny Qwen2 shape of
`benchmarks/learner.py` (2 layers, d = 256, 4 heads of 64, vocab 1000, f32)
take one row of T tokens (256 prompt, the rest actions), one with
`model.attention='dense'` (the definition: `[B, H, T, T]` scores) and one
with 'blockwise' (online softmax in tiles). They run side by side in
alternating rounds, each call a full `Learner.train_step`; reported: the
median step time of each and the median of the per-round ratios, and the
compiled step's memory (`memory_analysis`: temporaries, and arguments +
outputs + temporaries as the step's peak). Dense is skipped where its scores
alone would pass `--max-dense-gib` (16k tokens: 4 GiB per layer, several
times that with the backward's copies, on a 24 GiB VM).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import learner as learner_bench  # pylint: disable=g-import-not-at-top

import jax  # pylint: disable=g-bad-import-order,g-import-not-at-top

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = 256


def build(cfg, length: int, attention: str):
  batch = learner_bench.random_batch(cfg.vocab_size, 1, min(PROMPT,
                                                            length // 2),
                                     length - min(PROMPT, length // 2))
  overrides = (f'model.attention={attention}',
               f'rollout.max_sequence_length={length}',
               f'rollout.max_target_length={length}')
  return learner_bench.SaoStep(cfg, 1, 2, 'sao', batch, overrides)


def measure(cfg, length: int, rounds: int, max_dense_gib: float) -> dict:
  heads = cfg.num_heads
  dense_gib = heads * length * length * 4 / 2**30
  names = ['blockwise'] + (['dense'] if dense_gib <= max_dense_gib else [])
  steps = {name: build(cfg, length, name) for name in names}
  for step in steps.values():
    step()  # warm-up
  times = {name: [] for name in names}
  for _ in range(rounds):
    for name in names:
      start = time.perf_counter()
      steps[name]()
      times[name].append(time.perf_counter() - start)
  row = {'length': length, 'dense_scores_gib_per_layer': dense_gib}
  for name, step in steps.items():
    mem = step.memory
    row[name] = {
        'step_s': statistics.median(times[name]), 'times_s': times[name],
        'compile_s': step.compile_s, 'temp_bytes': mem['temp'],
        'peak_bytes': mem['argument'] + mem['output'] + mem['temp']}
  if 'dense' in steps:
    ratios = [b / d for b, d in zip(times['blockwise'], times['dense'])]
    row['time_ratio'] = statistics.median(ratios)
    row['peak_ratio'] = row['blockwise']['peak_bytes'] / row['dense'][
        'peak_bytes']
  return row


def table(rows) -> str:
  mib = lambda b: f'{b / 2**20:,.0f}'
  lines = ['| T | dense step (s) | blockwise step (s) | time ratio |'
           ' dense peak (MiB) | blockwise peak (MiB) | peak ratio |',
           '|---|---|---|---|---|---|---|']
  for r in rows:
    d, b = r.get('dense'), r['blockwise']
    dense = (f"{d['step_s']:.2f}", f"{r['time_ratio']:.2f}",
             mib(d['peak_bytes']), f"{r['peak_ratio']:.3f}") if d else (
                 'skipped', '', '', '')
    lines.append(f"| {r['length']:,} | {dense[0]} | {b['step_s']:.2f} |"
                 f" {dense[1]} | {dense[2]} | {mib(b['peak_bytes'])} |"
                 f" {dense[3]} |")
  return '\n'.join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--lengths', default='1024,2048,4096,8192,16384')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--max-dense-gib', type=float, default=2.0)
  parser.add_argument('--quick', action='store_true')
  parser.add_argument('--out', default=os.path.join(
      ROOT, 'benchmarks', 'results', 'long_context.json'))
  args = parser.parse_args()
  cfg = learner_bench.SHAPES['tiny_qwen2'][0]
  lengths = ([256, 512] if args.quick
             else [int(t) for t in args.lengths.split(',')])
  rows = []
  for length in lengths:
    print(f'T = {length} ...', flush=True)
    rows.append(measure(cfg, length, 2 if args.quick else args.rounds,
                        args.max_dense_gib))
    # After every length: a long sweep that stops keeps what it measured.
    result = {'shape': 'tiny_qwen2', 'rows_per_batch': 1, 'rows': rows,
              'date': time.strftime('%Y-%m-%d'), 'machine': platform.node(),
              'cpus': os.cpu_count(), 'jax': jax.__version__}
    learner_bench.write_result(args.out, result, table(rows))


if __name__ == '__main__':
  main()
