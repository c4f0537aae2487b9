r"""SAO ablations (SAO.md §3): K, frozen critic, value pretraining, skip-obs GAE.

  python benchmarks/ablations.py            # 3 seeds per variant
  python benchmarks/ablations.py --quick    # CI: two variants, one seed

Each variant changes one thing of SAO (configs/tiny.py, algorithm=sao):
  K=1                    one critic update per policy step instead of K=2;
  full critic            the critic also trains its attention parameters;
  no value pretraining   RL starts with the freshly initialised value head;
and, on three-turn `word_target` episodes (observations of six words between
the replies), skip-observation GAE (SAO) against naive GAE whose recursion
also runs through the observation tokens (`advantage.skip_observations`).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import algorithms  # pylint: disable=g-import-not-at-top,wrong-import-position
import training_runs  # pylint: disable=g-import-not-at-top,wrong-import-position

_MULTI_TURN = {'task.word_target.turns': 3,
               'rollout.max_sequence_length': 128,
               'rollout.max_prefill_length': 64,
               'rollout.max_target_length': 128}
VARIANTS = {
    'sao': {},  # K=2, frozen attention, pretrained value, skip-obs GAE
    'K=1': {'critic.steps_per_policy_step': 1},
    'full critic': {'critic.frozen_attention': False},
    'no value pretraining': {'critic.pretrain_steps': 0},
    '3 turns: skip-observation GAE': dict(_MULTI_TURN),
    '3 turns: naive GAE': dict(_MULTI_TURN,
                               **{'advantage.skip_observations': False}),
}
COLUMNS = (('critic expl. var.', 'critic/explained_variance'),
           ('critic grad norm', 'critic/grad_norm'),
           ('actor grad norm', 'policy/grad_norm'))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--seeds', type=int, default=3)
  parser.add_argument('--variants', default=','.join(VARIANTS),
                      help='comma-separated names from VARIANTS (the names'
                      ' hold no comma)')
  parser.add_argument('--quick', action='store_true',
                      help='K=1 and naive GAE, one seed, 3 steps (CI)')
  parser.add_argument('--workdir', default='runs/benchmarks/ablations')
  parser.add_argument('--out', default='benchmarks/results/ablations.json')
  parser.add_argument('--plot', default='benchmarks/results/ablations.png')
  args = parser.parse_args()

  config, batch_size, overrides = algorithms.RECIPES['tiny']
  wanted = args.variants.split(',')
  unknown = set(wanted) - set(VARIANTS)
  if unknown:
    parser.error(f'unknown variants {sorted(unknown)}; known: {list(VARIANTS)}')
  variants = [v for v in VARIANTS if v in wanted]
  seeds = args.seeds
  if args.quick:
    variants, seeds = ['K=1', '3 turns: naive GAE'], 1
    overrides = dict(overrides, **algorithms.QUICK)
  specs = [training_runs.RunSpec(v, seed, f'{config}:algorithm=sao',
                                 dict(overrides, **VARIANTS[v]))
           for seed in range(seeds) for v in variants]
  summaries = training_runs.run_grid(
      specs, args.workdir + ('-quick' if args.quick else ''),
      batch_size=batch_size)
  aggregated = training_runs.aggregate(summaries, variants)
  training_runs.plot_accuracy(summaries, variants, args.plot,
                              f'SAO ablations (tiny, B={batch_size})',
                              axes=('trajectories',))
  training_runs.write_result(args.out, {
      'benchmark': 'ablations', 'quick': args.quick,
      'command': ' '.join(['python', 'benchmarks/ablations.py']
                          + sys.argv[1:]),
      'machine': training_runs.machine(), 'config': config,
      'overrides': overrides, 'variants': {v: VARIANTS[v] for v in variants},
      'aggregate': aggregated, 'runs': summaries})
  print(training_runs.markdown_table(aggregated, COLUMNS))
  print(f'plot: {args.plot}\nresult: {args.out}')


if __name__ == '__main__':
  main()
