r"""SAO against the GRPO family at an equal trajectory budget (SAO.md §3).

  python benchmarks/algorithms.py                  # 5 algorithms x 5 seeds
  python benchmarks/algorithms.py --quick          # CI: 2 algorithms, 3 steps
  python benchmarks/algorithms.py --recipe=demo --seeds=2   # SmolLM2, slow

Every run is `python -m sao_jax.train` with the recipe's config and
`algorithm=<name>`: the same model, task, batch of B trajectories per policy
step (GRPO and GRPO+DIS as B/G prompts x G samples, the others as B prompts x
1), learning rates and step budget; the algorithms differ only in sampling,
advantage estimator and policy loss (configs/default.py's presets).

Recipes:
  tiny  the tiny random model on `word_target` (configs/tiny.py): about half a
        minute per run, so that five seeds of five algorithms fit in a
        quarter of an hour on two CPU cores.
  demo  SmolLM2-135M-Instruct on one-digit chain sums (configs/default.py,
        the README's main job): about 13 minutes per run; the slower
        confirmation on a real model and task.

Writes the per-run summaries and the per-algorithm aggregate to a JSON file,
held-out accuracy against trajectories consumed and against wall-clock to a
PNG, and prints the markdown table of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import training_runs  # pylint: disable=g-import-not-at-top,wrong-import-position

ALGORITHMS = ('sao', 'grpo', 'grpo_dis', 'vapo', 'running_mean')

#: `(config file, batch size, overrides)` per recipe. tiny: 40 steps, 128
#: held-out prompts evaluated every 5 steps with sampled replies
#: (temperature 1): this task's greedy reply is right within a few steps,
#: long before the policy is.
RECIPES = {
    'tiny': ('configs/tiny.py', 16, {
        'total_steps': 40, 'eval.every': 5, 'task.held_out': 128,
        'eval.temperature': 1.0, 'eval.batch_size': 64}),
    'demo': ('configs/default.py', 16, {}),
}
#: CI's quick mode checks the machinery: value pretraining is cut to 2 batches
#: (it runs ~13 by its plateau rule on this recipe).
QUICK = {'total_steps': 3, 'eval.every': 0, 'task.held_out': 16,
         'critic.pretrain_steps': 2}

STABILITY_COLUMNS = (('optimizer steps per batch', 'policy/optimizer_steps'),
                     ('DIS below', 'policy/frac_below'),
                     ('DIS above', 'policy/frac_above'),
                     ('PPO clip frac', 'policy/clip_frac'),
                     ('ratio min', 'policy/ratio_min'),
                     ('ratio max', 'policy/ratio_max'),
                     ('actor grad norm', 'policy/grad_norm'))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--recipe', choices=sorted(RECIPES), default='tiny')
  parser.add_argument('--algorithms', default=','.join(ALGORITHMS))
  parser.add_argument('--seeds', type=int, default=5)
  parser.add_argument('--target', type=float, default=0.8,
                      help='held-out accuracy for "trajectories / seconds to"')
  parser.add_argument('--quick', action='store_true',
                      help='sao and grpo, one seed, 3 steps (CI)')
  parser.add_argument('--workdir', default='runs/benchmarks/algorithms')
  parser.add_argument('--out', default='benchmarks/results/algorithms.json')
  parser.add_argument('--plot', default='benchmarks/results/algorithms.png')
  args = parser.parse_args()

  config, batch_size, overrides = RECIPES[args.recipe]
  algorithms = args.algorithms.split(',')
  seeds = args.seeds
  if args.quick:
    algorithms, seeds, overrides = ['sao', 'grpo'], 1, dict(overrides, **QUICK)
  specs = [training_runs.RunSpec(name, seed, f'{config}:algorithm={name}',
                                 overrides)
           for seed in range(seeds) for name in algorithms]
  summaries = training_runs.run_grid(
      specs, os.path.join(args.workdir, args.recipe + ('-quick' if args.quick
                                                       else '')),
      batch_size=batch_size)
  aggregated = training_runs.aggregate(summaries, algorithms)
  to_target = training_runs.time_to_target(summaries, algorithms, args.target)
  training_runs.plot_accuracy(
      summaries, algorithms, args.plot,
      f'algorithms at equal trajectory budget ({args.recipe}, B={batch_size})')
  training_runs.write_result(args.out, {
      'benchmark': 'algorithms', 'recipe': args.recipe, 'quick': args.quick,
      'command': ' '.join(['python', 'benchmarks/algorithms.py']
                          + sys.argv[1:]),
      'machine': training_runs.machine(), 'config': config,
      'overrides': overrides, 'aggregate': aggregated,
      'target_accuracy': args.target, 'to_target': to_target,
      'runs': summaries})
  print(training_runs.markdown_table(aggregated, STABILITY_COLUMNS))
  print()
  print(training_runs.target_table(to_target, args.target))
  print(f'plot: {args.plot}\nresult: {args.out}')


if __name__ == '__main__':
  main()
