r"""Stability under staleness: the algorithms at max staleness 0, 2, 4, 8.

  python benchmarks/staleness.py                 # 5 algorithms x 4 bounds x 2 seeds
  python benchmarks/staleness.py --quick         # CI: sao at 0 and 4, 3 steps
  python benchmarks/staleness.py --algorithms=sao,grpo --seeds=5

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
           ('optimizer steps per batch', 'policy/optimizer_steps'),
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
  parser.add_argument('--algorithms', default=','.join(algorithms.ALGORITHMS))
  parser.add_argument('--bounds', default=','.join(map(str, BOUNDS)))
  parser.add_argument('--seeds', type=int, default=2)
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
  _plot(aggregated, names, bounds, args.plot,
        f'max staleness ({args.recipe}, B={batch_size}, {seeds} seeds)')
  training_runs.write_result(args.out, {
      'benchmark': 'staleness', 'recipe': args.recipe, 'quick': args.quick,
      'command': ' '.join(['python', 'benchmarks/staleness.py']
                          + sys.argv[1:]),
      'machine': training_runs.machine(), 'config': config,
      'overrides': overrides, 'aggregate': aggregated, 'runs': summaries})
  print(training_runs.markdown_table(aggregated, COLUMNS))
  print(f'plot: {args.plot}\nresult: {args.out}')


def _plot(aggregated, names, bounds, path, title):
  """Against the staleness bound, per algorithm: held-out accuracy (area),
  the importance ratio's range, and the share of tokens DIS masks."""
  # pylint: disable=g-import-not-at-top
  from matplotlib import figure as mpl_figure
  from matplotlib.backends import backend_agg
  fig = mpl_figure.Figure(figsize=(15, 4), dpi=100)
  backend_agg.FigureCanvasAgg(fig)
  area_ax, ratio_ax, mask_ax = fig.subplots(1, 3)
  for name in names:
    rows = [aggregated[f'{name} staleness={b}'] for b in bounds]
    line = area_ax.errorbar(
        bounds, [r['area_under_accuracy'] for r in rows],
        yerr=[r['area_under_accuracy_se'] for r in rows], marker='o',
        capsize=3, label=name)
    color = line[0].get_color()
    for key, style in (('policy/ratio_min', '--'), ('policy/ratio_max', '-')):
      ratio_ax.plot(bounds, [r['stability'].get(key, float('nan'))
                             for r in rows], style, marker='o', color=color,
                    label=f'{name} {key.split("_")[-1]}')
    below = [r['stability'].get('policy/frac_below') for r in rows]
    if all(b is not None for b in below):
      mask_ax.plot(bounds, below, marker='o', color=color, label=name)
  area_ax.set_ylabel('mean held-out accuracy over the run (area)')
  ratio_ax.set_ylabel('ratio to the behaviour policy: min (--), max (-)')
  mask_ax.set_ylabel('tokens below the DIS band (masked)')
  for ax in (area_ax, ratio_ax, mask_ax):
    ax.set_xlabel('rollout.max_staleness')
    ax.set_xticks(bounds)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.suptitle(title)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path)


if __name__ == '__main__':
  main()
