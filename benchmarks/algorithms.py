r"""SAO against the GRPO family at an equal trajectory budget (SAO.md §3).

  python benchmarks/algorithms.py                  # 6 rows x 5 seeds
  python benchmarks/algorithms.py --quick          # CI: checks all, runs grpo
  python benchmarks/algorithms.py --recipe=demo --seeds=2   # SmolLM2, slow
  python benchmarks/algorithms.py --recipe=chain_sums --algorithms=sao,grpo,grpo_dis \
      --seeds=3 --resume --out=benchmarks/results/algorithms_chain_sums.json \
      --plot=benchmarks/results/algorithms_chain_sums.png    # ~90 min

Every run is `python -m sao_jax.train` with the recipe's config and
`algorithm=<name>`: the same model, task, batch of B trajectories per policy
step (GRPO and GRPO+DIS as B/G prompts x G samples, the others as B prompts x
1), learning rates and step budget; the algorithms differ only in sampling,
advantage estimator and policy loss (configs/default.py's presets).

Recipes:
  tiny  the tiny random model on `word_target` (configs/tiny.py): about half a
        minute per run, so that five seeds of the six rows fit in about
        twenty minutes on two CPU cores.
  demo  SmolLM2-135M-Instruct on one-digit chain sums (configs/default.py,
        the README's main job): about 13 minutes per run; the slower
        confirmation on a real model and task.
  chain_sums  the demo stopped at step 11 (held-out accuracy at steps 0 and
        11): about 10 minutes per run.

The result file (`--out`) is rewritten after each run, so a long grid can be
committed as it goes; with `--resume`, a run already in it with the same
command is not run again, which resumes the grid on a fresh checkout (the
run's workdir resumes it on the same machine either way). Where seeds pair up,
each algorithm's final held-out accuracy is compared with SAO's by a paired
t-test over seeds (the same seed: the same task order and held-out set).

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

ALGORITHMS = ('sao', 'grpo', 'grpo_dis', 'vapo', 'vapo_g1', 'running_mean')

#: Rows that are a preset with overrides: `name: (algorithm, overrides)`.
#: VAPO samples G = 8 per prompt, its own technique (configs/default.py);
#: the SAO paper's comparison runs it with one rollout per prompt.
VARIANTS = {'vapo_g1': ('vapo', {'group_size': 1})}

#: `(config file, batch size, overrides)` per recipe. tiny: 40 steps, 128
#: held-out prompts evaluated every 5 steps with sampled replies
#: (temperature 1): this task's greedy reply is right within a few steps,
#: long before the policy is.
RECIPES = {
    'tiny': ('configs/tiny.py', 16, {
        'total_steps': 40, 'eval.every': 5, 'task.held_out': 128,
        'eval.temperature': 1.0, 'eval.batch_size': 64}),
    'demo': ('configs/default.py', 16, {}),
    # Issue 16's SmolLM2 grid: the demo's recipe stopped at step 11, where
    # its held-out accuracy peaks (README, main job); ~10 min a run.
    'chain_sums': ('configs/default.py', 16, {'total_steps': 11}),
}
#: CI's quick mode checks the machinery: value pretraining is cut to 2 batches
#: (it runs ~13 by its plateau rule on this recipe).
QUICK = {'total_steps': 3, 'eval.every': 0, 'task.held_out': 16,
         'critic.pretrain_steps': 2}
#: The row the quick mode runs (the others' commands are only checked): GRPO,
#: whose mini-batch epochs move its ratio off 1.
QUICK_RUN = 'grpo'

STABILITY_COLUMNS = (('optimizer steps per batch', 'policy/optimizer_steps'),
                     ('critic steps per batch', 'critic/optimizer_steps'),
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
                      help='CI: every row checked, grpo run (one seed, 3 steps)')
  parser.add_argument('--resume', action='store_true',
                      help='reuse the runs already in --out (same command)')
  parser.add_argument('--workdir', default='runs/benchmarks/algorithms')
  parser.add_argument('--out', default='benchmarks/results/algorithms.json')
  parser.add_argument('--plot', default='benchmarks/results/algorithms.png')
  args = parser.parse_args()

  config, batch_size, overrides = RECIPES[args.recipe]
  algorithms = args.algorithms.split(',')
  seeds = args.seeds
  if args.quick:
    algorithms, seeds, overrides = list(ALGORITHMS), 1, dict(overrides, **QUICK)
  specs = [run_spec(name, seed, config, overrides)
           for seed in range(seeds) for name in algorithms]
  if args.quick:
    specs = training_runs.quick_grid(specs, QUICK_RUN)
    algorithms = [QUICK_RUN]

  def report(summaries, final=False):
    aggregated = training_runs.aggregate(summaries, algorithms)
    to_target = training_runs.time_to_target(summaries, algorithms,
                                             args.target)
    versus_sao = paired_against_sao(summaries, algorithms)
    training_runs.plot_accuracy(
        summaries, algorithms, args.plot,
        f'algorithms at equal trajectory budget ({args.recipe},'
        f' B={batch_size})')
    training_runs.write_result(args.out, {
        'benchmark': 'algorithms', 'recipe': args.recipe,
        'quick': args.quick, 'complete': final,
        'command': ' '.join(['python', 'benchmarks/algorithms.py']
                            + sys.argv[1:]),
        'machine': training_runs.machine(), 'config': config,
        'overrides': overrides, 'aggregate': aggregated,
        'target_accuracy': args.target, 'to_target': to_target,
        'final_accuracy_paired_with_sao': versus_sao, 'runs': summaries})
    return aggregated, to_target, versus_sao

  summaries = training_runs.run_grid(
      specs, os.path.join(args.workdir, args.recipe + ('-quick' if args.quick
                                                       else '')),
      batch_size=batch_size,
      finished=training_runs.load_finished(args.out) if args.resume else None,
      on_run=report)
  aggregated, to_target, versus_sao = report(summaries, final=True)
  print(training_runs.markdown_table(aggregated, STABILITY_COLUMNS))
  print()
  print(training_runs.target_table(to_target, args.target))
  if versus_sao:
    print()
    print('| final held-out, SAO minus | seeds | difference ± paired SE | p |')
    print('|---|---|---|---|')
    for name, test in versus_sao.items():
      print(f'| {name} | {test["seeds"]} | {test["difference"]:+.3f} ±'
            f' {test["se"]:.3f} | {training_runs.p_text(test["p"])} |')
  print(f'plot: {args.plot}\nresult: {args.out}')


def run_spec(name, seed, config, overrides):
  """The run of row `name`: a preset, or a VARIANTS preset with overrides."""
  algorithm, extra = VARIANTS.get(name, (name, {}))
  return training_runs.RunSpec(name, seed, f'{config}:algorithm={algorithm}',
                               dict(overrides, **extra))


def paired_against_sao(summaries, algorithms):
  """Per algorithm: SAO's final held-out accuracy minus its, paired by seed
  over the seeds both finished."""
  if 'sao' not in algorithms:
    return {}
  sao = {r['seed']: r for r in training_runs.ok_runs(summaries, 'sao')}
  out = {}
  for name in algorithms:
    if name == 'sao':
      continue
    runs = {r['seed']: r for r in training_runs.ok_runs(summaries, name)}
    seeds = sorted(set(sao) & set(runs))
    if seeds:
      out[name] = dict(training_runs.paired(
          [sao[s]['final_accuracy'] for s in seeds],
          [runs[s]['final_accuracy'] for s in seeds]), seeds=len(seeds))
  return out


if __name__ == '__main__':
  main()
