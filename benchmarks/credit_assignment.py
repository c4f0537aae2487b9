r"""Credit assignment across turns: the reward is earned by the first reply.

  python benchmarks/credit_assignment.py           # 5 variants x 5 seeds
  python benchmarks/credit_assignment.py --quick   # CI: checks all, runs sao

Three-turn `word_target` episodes with `scored_reply='first'`: the reward
(the share of even-numbered words) counts the first reply only, but is given
at the end of the episode, after two observations and two more replies that
cannot change it. What a learner must do is credit the first reply and not
the later ones. A critic can see it: after the first reply the return is
already decided, so the values of the later tokens can explain the return
(skip-observation GAE then gives those tokens advantages near zero, and the
first reply's tokens the signal). The critic-free baselines give every token
of a trajectory the same advantage, so the later replies' tokens, which do
not matter, get the same push as the first reply's.

Variants, each with its preset: `sao` (critic, skip-observation GAE, DIS),
`sao full critic` (its attention trained too: the tiny model's frozen
attention is random, not pretrained), `running_mean` (per-question running mean, DIS), `grpo` (groups of G = 4,
PPO clip, M = 4: verl's) and `grpo_dis` (groups, DIS, one step: SAO's
schedule). Reported over seeds: held-out accuracy (a first reply at least 75%
even words; 128 prompts, sampled replies, every 5 steps), the mean over the
run (area), final training reward, and for SAO the critic's explained
variance of the returns. SAO is compared with each baseline by Welch's test
on the area.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import algorithms  # pylint: disable=g-import-not-at-top,wrong-import-position
import training_runs  # pylint: disable=g-import-not-at-top,wrong-import-position

#: label -> (algorithm, overrides)
VARIANTS = {
    'sao': ('sao', {}),
    # The critic with its attention trained too: on the tiny random model a
    # frozen attention is random, and the critic may not read the first
    # reply through it.
    'sao full critic': ('sao', {'critic.frozen_attention': False}),
    'running_mean': ('running_mean', {}),
    'grpo': ('grpo', {}),
    'grpo_dis': ('grpo_dis', {}),
}
#: The variant the quick mode runs (the others' commands are only checked).
QUICK_RUN = 'sao'
TURNS = 3
COLUMNS = (('critic expl. var.', 'critic/explained_variance'),
           ('critic grad norm', 'critic/grad_norm'),
           ('actor grad norm', 'policy/grad_norm'),
           ('optimizer steps per batch', 'policy/optimizer_steps'))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--variants', default=','.join(VARIANTS))
  parser.add_argument('--seeds', type=int, default=5)
  parser.add_argument('--total-steps', type=int, default=40)
  parser.add_argument('--quick', action='store_true',
                      help='CI: every variant checked, sao run (one seed, 3 steps)')
  parser.add_argument('--workdir', default='runs/benchmarks/credit_assignment')
  parser.add_argument('--out',
                      default='benchmarks/results/credit_assignment.json')
  parser.add_argument('--plot',
                      default='benchmarks/results/credit_assignment.png')
  args = parser.parse_args()

  config, batch_size, overrides = algorithms.RECIPES['tiny']
  names = training_runs.chosen_variants(parser, args.variants, VARIANTS)
  seeds = args.seeds
  overrides = dict(overrides, **{
      'total_steps': args.total_steps,
      'task.word_target.turns': TURNS,
      'task.word_target.scored_reply': 'first',
      'rollout.group_in_one_request': False,
      'rollout.max_sequence_length': 96, 'rollout.max_prefill_length': 64,
      'rollout.max_target_length': 96})
  if args.quick:
    names, seeds = list(VARIANTS), 1
    overrides = dict(overrides, **algorithms.QUICK)
  specs = [training_runs.RunSpec(
      name, seed, f'{config}:algorithm={VARIANTS[name][0]}',
      dict(overrides, **VARIANTS[name][1]))
           for seed in range(seeds) for name in names]
  if args.quick:
    specs, names = training_runs.quick_grid(specs, QUICK_RUN), [QUICK_RUN]
  summaries = training_runs.run_grid(
      specs, args.workdir + ('-quick' if args.quick else ''),
      batch_size=batch_size)
  aggregated = training_runs.aggregate(summaries, names)
  areas = {name: [training_runs.area_under_accuracy(r['eval_curve'])
                  for r in training_runs.ok_runs(summaries, name)]
           for name in names}
  versus_sao = {name: training_runs.welch(areas['sao'], areas[name])
                for name in names if name != 'sao' and 'sao' in areas}
  training_runs.plot_accuracy(
      summaries, names, args.plot,
      f'credit across {TURNS} turns: only the first reply is scored'
      f' (B={batch_size}, {seeds} seeds)')
  training_runs.write_result(args.out, {
      'benchmark': 'credit_assignment', 'quick': args.quick,
      'command': ' '.join(['python', 'benchmarks/credit_assignment.py']
                          + sys.argv[1:]),
      'machine': training_runs.machine(), 'config': config,
      'overrides': overrides, 'aggregate': aggregated,
      'sao_minus_this_area': versus_sao, 'runs': summaries})
  print(training_runs.markdown_table(aggregated, COLUMNS))
  print()
  print('| SAO minus | area difference | Welch p |')
  print('|---|---|---|')
  for name, test in versus_sao.items():
    print(f'| {name} | {test["difference"]:+.3f} |'
          f' {training_runs.p_text(test["p"])} |')
  print(f'plot: {args.plot}\nresult: {args.out}')


if __name__ == '__main__':
  main()
