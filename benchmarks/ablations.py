r"""SAO ablations (SAO.md §3): K, frozen critic, value pretraining, skip-obs GAE.

  python benchmarks/ablations.py            # 6 variants x 5 seeds
  python benchmarks/ablations.py --quick    # CI: checks all, runs naive GAE

Each variant changes one thing of SAO (configs/tiny.py, algorithm=sao):
  K=1                    one critic update per policy step instead of K=2;
  full critic            the critic also trains its attention parameters;
  no value pretraining   RL starts with the freshly initialised value head;
and, on three-turn `word_target` episodes (observations of six words between
the replies), skip-observation GAE (SAO) against naive GAE whose recursion
also runs through the observation tokens (`advantage.skip_observations`).

Each ablation is compared with its reference (SAO, or skip-observation GAE
for naive GAE) seed by seed: runs of one seed share the task, the held-out
prompts and the initial weights, so a paired t-test on the area under the
held-out accuracy curve and on the final accuracy tests the one change. The
result file is rewritten after each run (`complete` false until the grid
ends); `--resume` reuses the runs already in it.
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
#: ablation -> the variant it changes one thing of
REFERENCES = {'K=1': 'sao', 'full critic': 'sao',
              'no value pretraining': 'sao',
              '3 turns: naive GAE': '3 turns: skip-observation GAE'}
#: The variant the quick mode runs (the others' commands are only checked):
#: multi-turn, without skipping observations.
QUICK_RUN = '3 turns: naive GAE'
COLUMNS = (('critic expl. var.', 'critic/explained_variance'),
           ('critic grad norm', 'critic/grad_norm'),
           ('actor grad norm', 'policy/grad_norm'))


#: metric of a run the ablations are tested on -> how to read it
_METRICS = {
    'area_under_accuracy':
        lambda run: training_runs.area_under_accuracy(run['eval_curve']),
    'final_accuracy': lambda run: run['final_accuracy'],
}


def comparisons(summaries, variants):
  """Per ablation whose reference ran: paired t-tests (by seed) of ablation
  minus reference on the area under held-out accuracy and the final
  accuracy."""
  out = []
  for variant in variants:
    reference = REFERENCES.get(variant)
    if reference not in variants:
      continue
    by_seed = [{r['seed']: r for r in training_runs.ok_runs(summaries, v)}
               for v in (variant, reference)]
    seeds = sorted(set(by_seed[0]) & set(by_seed[1]))
    if not seeds:
      continue
    out.append(dict(
        {'ablation': variant, 'reference': reference, 'seeds': seeds},
        **{metric: training_runs.paired([value(by_seed[0][s]) for s in seeds],
                                        [value(by_seed[1][s]) for s in seeds])
           for metric, value in _METRICS.items()}))
  return out


def comparisons_markdown(tests) -> str:
  lines = ['| ablation minus reference | seeds | area under held-out accuracy'
           ' (paired p) | final held-out accuracy (paired p) |',
           '|---|---|---|---|']
  for test in tests:
    cells = [f'{t["difference"]:+.3f} ± {t["se"]:.3f}'
             f' (p = {training_runs.p_text(t["p"])})'
             for t in (test['area_under_accuracy'], test['final_accuracy'])]
    lines.append(f'| {test["ablation"]} minus {test["reference"]} |'
                 f' {len(test["seeds"])} | {cells[0]} | {cells[1]} |')
  return '\n'.join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--seeds', type=int, default=5)
  parser.add_argument('--variants', default=','.join(VARIANTS),
                      help='comma-separated names from VARIANTS (the names'
                      ' hold no comma)')
  parser.add_argument('--quick', action='store_true',
                      help='CI: every variant checked, naive GAE run (one seed,'
                      ' 3 steps)')
  parser.add_argument('--resume', action='store_true',
                      help='reuse the runs already in --out (same command)')
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
    variants, seeds = list(VARIANTS), 1
    overrides = dict(overrides, **algorithms.QUICK)
  specs = [training_runs.RunSpec(v, seed, f'{config}:algorithm=sao',
                                 dict(overrides, **VARIANTS[v]))
           for seed in range(seeds) for v in variants]
  if args.quick:
    specs = training_runs.quick_grid(specs, QUICK_RUN)
    variants = [QUICK_RUN]
  def publish(summaries, complete=False):
    aggregated = training_runs.aggregate(summaries, variants)
    tests = comparisons(summaries, variants)
    training_runs.plot_accuracy(summaries, variants, args.plot,
                                f'SAO ablations (tiny, B={batch_size})',
                                axes=('trajectories',))
    training_runs.write_result(args.out, {
        'benchmark': 'ablations', 'quick': args.quick, 'complete': complete,
        'command': ' '.join(['python', 'benchmarks/ablations.py']
                            + sys.argv[1:]),
        'machine': training_runs.machine(), 'config': config,
        'overrides': overrides, 'variants': {v: VARIANTS[v] for v in variants},
        'aggregate': aggregated, 'comparisons': tests, 'runs': summaries})
    return aggregated, tests

  summaries = training_runs.run_grid(
      specs, args.workdir + ('-quick' if args.quick else ''),
      batch_size=batch_size,
      finished=training_runs.load_finished(args.out) if args.resume else None,
      on_run=publish)
  aggregated, tests = publish(summaries, complete=True)
  print(training_runs.markdown_table(aggregated, COLUMNS))
  print()
  print(comparisons_markdown(tests))
  print(f'plot: {args.plot}\nresult: {args.out}')


if __name__ == '__main__':
  main()
