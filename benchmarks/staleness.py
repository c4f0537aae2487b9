r"""Stability under staleness: the algorithms at max staleness 0, 2, 4, 8.

  python benchmarks/staleness.py                 # sao, grpo, grpo_dis x 3 seeds
  python benchmarks/staleness.py --quick         # CI: sao at 0 and 4, 3 steps
  python benchmarks/staleness.py --algorithms=sao,grpo,grpo_dis,vapo,running_mean --seeds=5

`rollout.max_staleness` bounds how many policy versions the oldest token of a
trajectory may lag the learner (SAO.md §2); 0 is synchronous training. To
make the bound bite, each run has enough rollout workers to fill it
(`(max_staleness + 1) x B` episodes in flight), so the realised staleness
grows with the bound instead of being capped by the worker count. Reported
per (algorithm, bound): held-out accuracy, collapses, the DIS band fractions
(tokens masked below 1 - eps_low and above 1 + eps_high) or the PPO clip
fraction, the importance ratio's range (min, mean, max over each batch's
action tokens, averaged over steps), gradient norms, realised staleness.

Same recipe as benchmarks/algorithms.py (tiny random model on word_target).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import algorithms  # pylint: disable=g-import-not-at-top,wrong-import-position
import training_runs  # pylint: disable=g-import-not-at-top,wrong-import-position

BOUNDS = (0, 2, 4, 8)
COLUMNS = (('realised staleness', 'rollout/staleness_mean'),
           ('DIS below', 'policy/frac_below'),
           ('DIS above', 'policy/frac_above'),
           ('PPO clip frac', 'policy/clip_frac'),
           ('ratio min', 'policy/ratio_min'),
           ('ratio mean', 'policy/ratio_mean'),
           ('ratio max', 'policy/ratio_max'),
           ('actor grad norm', 'policy/grad_norm'),
           ('critic grad norm', 'critic/grad_norm'))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--recipe', choices=sorted(algorithms.RECIPES),
                      default='tiny')
  parser.add_argument('--algorithms', default='sao,grpo,grpo_dis')
  parser.add_argument('--bounds', default=','.join(map(str, BOUNDS)))
  parser.add_argument('--seeds', type=int, default=3)
  parser.add_argument('--quick', action='store_true',
                      help='sao at bounds 0 and 4, one seed, 3 steps (CI)')
  parser.add_argument('--workdir', default='runs/benchmarks/staleness')
  parser.add_argument('--out', default='benchmarks/results/staleness.json')
  parser.add_argument('--plot', default='benchmarks/results/staleness.png')
  args = parser.parse_args()

  config, batch_size, overrides = algorithms.RECIPES[args.recipe]
  names = args.algorithms.split(',')
  bounds = [int(b) for b in args.bounds.split(',')]
  seeds = args.seeds
  if args.quick:
    names, bounds, seeds = ['sao'], [0, 4], 1
    overrides = dict(overrides, **algorithms.QUICK)
  specs, variants = [], []
  for name in names:
    for bound in bounds:
      variant = f'{name} staleness={bound}'
      variants.append(variant)
      for seed in range(seeds):
        specs.append(training_runs.RunSpec(
            variant, seed, f'{config}:algorithm={name}',
            dict(overrides, **{'rollout.max_staleness': bound,
                               'rollout.num_workers': (bound + 1) * batch_size,
                               'rollout.queue_capacity': 0})))
  specs.sort(key=lambda s: s.seed)  # a whole first seed before the second
  summaries = training_runs.run_grid(
      specs, os.path.join(args.workdir, args.recipe + ('-quick' if args.quick
                                                       else '')),
      batch_size=batch_size)
  aggregated = training_runs.aggregate(summaries, variants)
  training_runs.plot_accuracy(
      summaries, variants, args.plot,
      f'max staleness 0/2/4/8 ({args.recipe}, B={batch_size})',
      axes=('trajectories',))
  training_runs.write_result(args.out, {
      'benchmark': 'staleness', 'recipe': args.recipe, 'quick': args.quick,
      'command': ' '.join(['python', 'benchmarks/staleness.py']
                          + sys.argv[1:]),
      'machine': training_runs.machine(), 'config': config,
      'overrides': overrides, 'aggregate': aggregated, 'runs': summaries})
  print(training_runs.markdown_table(aggregated, COLUMNS))
  print(f'plot: {args.plot}\nresult: {args.out}')


if __name__ == '__main__':
  main()
