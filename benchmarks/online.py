r"""Online learning: the rewarded target switches twice (SAO.md §5).

  python benchmarks/online.py              # SAO vs two running means, 5 seeds
  python benchmarks/online.py --quick      # CI: checks all, runs the per-question mean

The tiny random model on `word_target` with `task.word_target.switch_steps`:
phase 0 rewards even-numbered words, phase 1 odd ones, phase 2 even ones
again. The prompt never changes; the learner notices the switch only through
the reward, while rollouts keep flowing (asynchronous, max staleness 2). SAO
(critic, skip-observation GAE, DIS) against the paper's online baselines:
a running-mean reward baseline over the last 128 rewards of any prompt
(`algorithm=running_mean`, global scope, window 128), and one over the last
8 rewards of the same question (per-question scope; the global window's
mean while a question has no history). Each baseline is compared with SAO
per switch by Welch's t-test on the mean reward after the switch.

Per switch, from the training reward (each trajectory judged by the phase
current when it finished):
  * pre-switch reward: the mean over the `--window` steps before the switch;
  * steps to recover: the first step after the switch whose trailing
    `--window`-step mean reaches 90% of the pre-switch reward (None: never
    within the phase);
  * area under the reward curve after the switch: the mean reward over the
    phase (steps from the switch to the next switch or the end), i.e. the
    area divided by the phase length, so phases of different lengths compare.

The result file is rewritten after each run (`complete` false until the grid
ends); `--resume` reuses the runs already in it.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import training_runs  # pylint: disable=g-import-not-at-top,wrong-import-position

from sao_jax.logs import plots  # pylint: disable=g-import-not-at-top,wrong-import-position

CONFIG = 'configs/tiny.py'
BATCH_SIZE = 16
VARIANTS = {
    'sao': ('sao', {}),
    'running_mean (W=128)': ('running_mean', {
        'advantage.running_mean_scope': 'global',
        'advantage.running_mean_global_window': 128}),
    # The paper's per-question baseline: the mean of the question's last 8
    # rewards, the global window's while a question has no history yet.
    'running_mean (per question, W=8)': ('running_mean', {
        'advantage.running_mean_scope': 'prompt',
        'advantage.running_mean_window': 8,
        'advantage.running_mean_global_window': 128}),
}
#: The variant the quick mode runs (the others' commands are only checked):
#: the paper's per-question baseline.
QUICK_RUN = 'running_mean (per question, W=8)'


def switch_report(curve, switches, total_steps, window):
  """Recovery steps and post-switch reward per switch of one run."""
  steps = np.array([p['step'] for p in curve])
  reward = np.array([p['reward'] for p in curve])
  smooth = plots.moving_average(reward, window)
  report = []
  bounds = list(switches) + [total_steps]
  for i, switch in enumerate(switches):
    before = reward[(steps > switch - window) & (steps <= switch)]
    phase = (steps > switch) & (steps <= bounds[i + 1])
    pre = float(before.mean()) if before.size else float('nan')
    recovered = np.flatnonzero(phase & (smooth >= 0.9 * pre)
                               & (steps >= switch + window))
    report.append({
        'switch_step': switch, 'pre_switch_reward': pre,
        'steps_to_recover_90': (int(steps[recovered[0]] - switch)
                                if recovered.size else None),
        'post_switch_mean_reward': float(reward[phase].mean()),
        'first_step_reward': float(reward[phase][0]) if phase.any() else None,
    })
  return report


def report(summaries, variants, switches, total, window):
  """Per variant and switch: recoveries, the post-switch mean reward, and
  each baseline against SAO by Welch's test on that mean. Adds each run's
  `switches` (its `switch_report`)."""
  per_variant = {}
  for variant in variants:
    runs = training_runs.ok_runs(summaries, variant)
    for run in runs:
      run['switches'] = switch_report(run['reward_curve'], switches, total,
                                      window)
    per_switch = []
    for i, switch in enumerate(switches):
      recover = [r['switches'][i]['steps_to_recover_90'] for r in runs]
      auc = training_runs.mean_se(
          [r['switches'][i]['post_switch_mean_reward'] for r in runs])
      recovered = [x for x in recover if x is not None]
      per_switch.append({
          'switch_step': switch, 'steps_to_recover_90': recover,
          'recovered': f'{len(recovered)}/{len(recover)}',
          'median_steps_to_recover_90': (float(np.median(recovered))
                                         if recovered else None),
          'post_switch_mean_reward': auc[0],
          'post_switch_mean_reward_se': auc[1]})
    per_variant[variant] = per_switch
  sao_runs = training_runs.ok_runs(summaries, 'sao')
  for variant in variants:
    runs = training_runs.ok_runs(summaries, variant)
    if variant == 'sao' or not runs or not sao_runs:
      continue
    for i, entry in enumerate(per_variant[variant]):
      entry['sao_minus_this'] = training_runs.welch(
          [r['switches'][i]['post_switch_mean_reward'] for r in sao_runs],
          [r['switches'][i]['post_switch_mean_reward'] for r in runs])
  return per_variant


def markdown(per_variant) -> str:
  lines = ['| variant | switch step | recovered to 90% | median steps to'
           ' recover | mean reward after switch | SAO minus this (Welch p) |',
           '|---|---|---|---|---|---|']
  for variant, per_switch in per_variant.items():
    for s in per_switch:
      median = s['median_steps_to_recover_90']
      test = s.get('sao_minus_this')
      versus = '-' if test is None else f'{test["difference"]:+.3f}' + (
          '' if math.isnan(test['p'])
          else f' (p = {training_runs.p_text(test["p"])})')
      lines.append(f'| {variant} | {s["switch_step"]} | {s["recovered"]} |'
                   f' {"-" if median is None else f"{median:.0f}"} |'
                   f' {s["post_switch_mean_reward"]:.3f} ±'
                   f' {s["post_switch_mean_reward_se"]:.3f} | {versus} |')
  return '\n'.join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--seeds', type=int, default=5)
  parser.add_argument('--switch-steps', default='40,80')
  parser.add_argument('--total-steps', type=int, default=120)
  parser.add_argument('--window', type=int, default=3)
  parser.add_argument('--quick', action='store_true',
                      help='CI: every variant checked, the per-question mean'
                      ' run (one seed, switches at steps 2 and 4 of 6)')
  parser.add_argument('--resume', action='store_true',
                      help='reuse the runs already in --out (same command)')
  parser.add_argument('--workdir', default='runs/benchmarks/online')
  parser.add_argument('--out', default='benchmarks/results/online.json')
  parser.add_argument('--plot', default='benchmarks/results/online.png')
  args = parser.parse_args()

  switches = [int(s) for s in args.switch_steps.split(',')]
  total, seeds, window = args.total_steps, args.seeds, args.window
  variants = dict(VARIANTS)
  if args.quick:
    switches, total, seeds, window = [2, 4], 6, 1, 1
  overrides = {'total_steps': total, 'eval.every': 0, 'task.held_out': 16,
               'task.word_target.switch_steps': tuple(switches),
               'rollout.max_staleness': 2}
  if args.quick:
    overrides['critic.pretrain_steps'] = 2  # the machinery, not the result
  specs = [training_runs.RunSpec(variant, seed, f'{CONFIG}:algorithm={name}',
                                 dict(overrides, **extra))
           for seed in range(seeds)
           for variant, (name, extra) in variants.items()]
  if args.quick:
    specs = training_runs.quick_grid(specs, QUICK_RUN)
    variants = {QUICK_RUN: VARIANTS[QUICK_RUN]}
  def publish(summaries, complete=False):
    per_variant = report(summaries, variants, switches, total, window)
    _plot(summaries, variants, switches, args.plot)
    training_runs.write_result(args.out, {
        'benchmark': 'online', 'quick': args.quick, 'complete': complete,
        'command': ' '.join(['python', 'benchmarks/online.py']
                            + sys.argv[1:]),
        'machine': training_runs.machine(), 'config': CONFIG,
        'overrides': {k: list(v) if isinstance(v, tuple) else v
                      for k, v in overrides.items()},
        'variants': {v: name for v, (name, _) in variants.items()},
        'per_switch': per_variant, 'runs': summaries})
    return per_variant

  summaries = training_runs.run_grid(
      specs, args.workdir + ('-quick' if args.quick else ''),
      batch_size=BATCH_SIZE,
      finished=training_runs.load_finished(args.out) if args.resume else None,
      on_run=publish)
  print(markdown(publish(summaries, complete=True)))
  print(f'plot: {args.plot}\nresult: {args.out}')


def _plot(summaries, variants, switches, path):
  fig = training_runs.new_figure(8)
  ax = fig.subplots()
  for variant in variants:
    runs = training_runs.ok_runs(summaries, variant)
    if not runs:
      continue
    steps, reward_RxS = training_runs.reward_rows(runs)
    mean = plots.moving_average(reward_RxS.mean(0), 3)
    line, = ax.plot(steps, mean, label=f'{variant} (n={len(runs)})')
    for row in reward_RxS:
      ax.plot(steps, plots.moving_average(row, 3), color=line.get_color(),
              alpha=0.2, linewidth=0.8)
  for switch in switches:
    ax.axvline(switch, color='grey', linestyle='--', linewidth=1)
  ax.set_xlabel('policy step (dashed: rewarded target switches)')
  ax.set_ylabel('training reward (3-step avg; thin: seeds)')
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  training_runs.save_figure(
      fig, 'online learning: the rewarded word parity flips twice', path)


if __name__ == '__main__':
  main()
