r"""Asynchronous vs synchronous SAO on a workload with heavy-tailed latency.

  python benchmarks/async_speedup.py             # 3 seeds per mode
  python benchmarks/async_speedup.py --quick     # CI: checks both, runs sync

The same `python -m sao_jax.train` run twice, differing only in asynchrony:
  sync   `rollout.max_staleness=0`: the workers generate exactly one batch
         for the current weights, the learner trains on it, the weights are
         pushed, and only then does the next batch start; a batch is as slow
         as its slowest episode, and the servers idle while the learner
         trains;
  async  `rollout.max_staleness=4` with 5 x B episodes in flight: rollouts of
         the next batches continue while the learner trains, slow episodes
         overlap fast ones, and DIS corrects for the lag (SAO.md §2).

The workload: the tiny random model on two-turn `word_target` episodes, each
turn followed by a simulated environment call whose latency is lognormal
(median `--delay-median` s, log-space sigma `--delay-sigma`, capped at
`--delay-max` s): with sigma 1, p90 is 3.6x and p99 10x the median, the
heavy tail of real tool calls and sandboxes. Reply lengths vary too (the
model stops when it emits its end token).

Reported per mode (mean over seeds): wall-clock from the program's start to
the first held-out evaluation (128 prompts, sampled replies at temperature 1,
every 2 steps) at or above `--target` accuracy, trajectories
per second of the training loop, learner idle fraction (waiting for data) and
generator idle fraction (servers with nothing in flight), and the speedup
sync/async of time to target, each seed's pair measured back to back.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import training_runs  # pylint: disable=g-import-not-at-top,wrong-import-position

CONFIG = 'configs/tiny.py'
BATCH_SIZE = 16
ASYNC_STALENESS = 4


def mode_overrides(mode: str) -> dict[str, object]:
  staleness = 0 if mode == 'sync' else ASYNC_STALENESS
  return {'rollout.max_staleness': staleness,
          'rollout.num_workers': (staleness + 1) * BATCH_SIZE}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--seeds', type=int, default=3)
  parser.add_argument('--total-steps', type=int, default=40)
  parser.add_argument('--target', type=float, default=0.7)
  parser.add_argument('--delay-median', type=float, default=0.5)
  parser.add_argument('--delay-sigma', type=float, default=1.0)
  parser.add_argument('--delay-max', type=float, default=20.0)
  parser.add_argument('--quick', action='store_true',
                      help='CI: both modes checked, sync run (one seed, 3 steps,'
                      ' 0.05 s median delay)')
  parser.add_argument('--workdir', default='runs/benchmarks/async_speedup')
  parser.add_argument('--out', default='benchmarks/results/async_speedup.json')
  parser.add_argument('--plot', default='benchmarks/results/async_speedup.png')
  args = parser.parse_args()

  seeds, total, median = args.seeds, args.total_steps, args.delay_median
  if args.quick:
    seeds, total, median = 1, 3, 0.05
  overrides = {
      'total_steps': total, 'eval.every': 0 if args.quick else 2,
      'task.held_out': 16 if args.quick else 128,
      'eval.temperature': 1.0, 'eval.batch_size': 64,
      'task.word_target.turns': 2,
      'task.word_target.delay_median_s': median,
      'task.word_target.delay_sigma': args.delay_sigma,
      'task.word_target.delay_max_s': args.delay_max,
      'rollout.max_sequence_length': 96, 'rollout.max_prefill_length': 64,
      'rollout.max_target_length': 96}
  if args.quick:
    overrides['critic.pretrain_steps'] = 2  # the machinery, not the result
  modes = ('sync', 'async')
  specs = [training_runs.RunSpec(mode, seed, CONFIG,
                                 dict(overrides, **mode_overrides(mode)))
           for seed in range(seeds) for mode in modes]
  if args.quick:
    # Both commands checked, the synchronous one run: its property (no
    # stale data) is exact; benchmarks/staleness.py's quick mode runs the
    # asynchronous bound.
    specs = training_runs.quick_grid(specs, 'sync')
    modes = ('sync',)
  summaries = training_runs.run_grid(
      specs, args.workdir + ('-quick' if args.quick else ''),
      batch_size=BATCH_SIZE)
  # {mode: {seed: run}} of the finished runs.
  by_seed = {m: {r['seed']: r for r in training_runs.ok_runs(summaries, m)}
             for m in ('sync', 'async')}
  report = {}
  for mode in modes:
    runs = list(by_seed[mode].values())
    for run in runs:
      run['seconds_to_target'] = training_runs.first_time_at(
          run['eval_curve'], args.target)
    reached = [r['seconds_to_target'] for r in runs
               if r['seconds_to_target'] is not None]
    report[mode] = {
        'runs': len(runs), 'reached_target': len(reached),
        'seconds_to_target': training_runs.mean_se(reached)}
    for key in ('final_accuracy', 'trajectories_per_second',
                'learner_idle_fraction', 'generator_idle_fraction',
                'loop_seconds'):
      report[mode][key] = training_runs.mean_se([r[key] for r in runs])
  # Ratios per seed: the pair of a seed ran back to back.
  pairs = [(by_seed['sync'][s], by_seed['async'][s]) for s in range(seeds)
           if s in by_seed['sync'] and s in by_seed['async']]
  speedups = [sync['seconds_to_target'] / fast['seconds_to_target']
              for sync, fast in pairs
              if sync['seconds_to_target'] and fast['seconds_to_target']]
  throughput = [fast['trajectories_per_second']
                / sync['trajectories_per_second'] for sync, fast in pairs]
  result = {
      'benchmark': 'async_speedup', 'quick': args.quick,
      'command': ' '.join(['python', 'benchmarks/async_speedup.py']
                          + sys.argv[1:]),
      'machine': training_runs.machine(), 'config': CONFIG,
      'overrides': overrides, 'target_accuracy': args.target,
      'modes': {m: mode_overrides(m) for m in modes}, 'report': report,
      'speedup_to_target_per_seed': speedups,
      'throughput_ratio_per_seed': throughput, 'runs': summaries}
  training_runs.plot_accuracy(
      summaries, modes, args.plot,
      f'sync vs async (max staleness {ASYNC_STALENESS}), lognormal env'
      f' latency median {median} s', axes=('seconds', 'trajectories'))
  training_runs.write_result(args.out, result)

  def fmt(pair, digits=2):
    mean, se = pair
    return '-' if mean != mean else f'{mean:.{digits}f} ± {se:.{digits}f}'
  print(f'| mode | reached {args.target} | seconds to {args.target} |'
        ' final accuracy | trajectories/s | learner idle | generator idle |')
  print('|---|---|---|---|---|---|---|')
  for mode, r in report.items():
    print(f'| {mode} | {r["reached_target"]}/{r["runs"]} |'
          f' {fmt(r["seconds_to_target"], 1)} | {fmt(r["final_accuracy"], 3)}'
          f' | {fmt(r["trajectories_per_second"], 1)} |'
          f' {fmt(r["learner_idle_fraction"])} |'
          f' {fmt(r["generator_idle_fraction"])} |')
  print('speedup to target (sync/async) per seed:',
        ', '.join(f'{x:.2f}x' for x in speedups) or '-')
  print('throughput ratio (async/sync) per seed:',
        ', '.join(f'{x:.2f}x' for x in throughput) or '-')
  print(f'plot: {args.plot}\nresult: {args.out}')


if __name__ == '__main__':
  main()
