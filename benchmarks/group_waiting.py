r"""Group waiting under asynchrony: SAO's single rollouts against GRPO groups.

  python benchmarks/group_waiting.py             # 6 variants x 3 sigmas x 5 seeds
  python benchmarks/group_waiting.py --quick     # CI: checks all, runs grpo_dis G=4
  python benchmarks/group_waiting.py --sigmas=1.0 --seeds=3

The paper's central argument against GRPO in asynchronous agentic RL (SAO.md
§2): a group trains only once all G of its members are back, so with
heavy-tailed environment latency the finished members wait for the slowest
one, the learner waits for whole groups, and what it trains on is older. SAO
trains each trajectory as it arrives.

Every run is `python -m sao_jax.train` on the tiny random model with two-turn
`word_target` episodes, each turn followed by a simulated tool call whose
latency is lognormal (median `--delay-median` s, log-space sigma 0.5 / 1.0 /
1.5, capped at `--delay-max` s). All variants share the staleness bound
(`--staleness`), the trajectory budget (B = 16 per policy step, the same
number of steps) and the episodes in flight ((bound + 1) x B: SAO's workers
play one episode each, a GRPO worker a group of G at once, so GRPO gets
(bound + 1) x B / G workers). Each member of a group is queued as soon as its
episode ends and waits there for its siblings (`rollout/workers.py`), which
is where the wait is measured.

Variants: `sao` (1 rollout per prompt, trained on arrival), `running_mean`
(1 rollout, no critic, DIS: the single-rollout pair of `grpo_dis`), `grpo G=4|8`
(verl's GRPO: group advantages, PPO clip, M = 4 mini-batch steps) and
`grpo_dis G=4|8` (group advantages with the DIS loss and one step: the
schedule of SAO, so the pair isolates the groups).

Reported per (variant, sigma), mean ± standard error over seeds:
  * seconds to the first held-out evaluation at or above `--target`
    (128 prompts, sampled replies, every 2 steps), from the program's start
    and from the first RL step's (SAO's value pretraining and start-up
    excluded), and the final accuracy;
  * realised staleness of the trained tokens (policy versions between the
    weights that sampled a token and those it trains: mean and p95, averaged
    over steps);
  * the share of the time finished episodes spent queued that they spent
    waiting for the rest of their group, and that wait per trajectory;
  * the learner's idle fraction (waiting for a batch).
Each variant is compared with SAO by Welch's t-test on the seconds to
target (runs that never reach it count as the run's full length). A second
table tests, per sigma, each variant against SAO and each GRPO+DIS against
the running mean (the same loss and schedule without groups) on the seconds
from the first RL step and on the area under the held-out accuracy curve.

The result file is rewritten after each run (`complete` false until the grid
ends), so a long grid can be committed as it goes; `--resume` reuses the runs
already in it, which continues the grid on a fresh checkout.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import training_runs  # pylint: disable=g-import-not-at-top,wrong-import-position

CONFIG = 'configs/tiny.py'
BATCH_SIZE = 16
SIGMAS = (0.5, 1.0, 1.5)
#: label -> (algorithm, group size G)
VARIANTS = {
    'sao': ('sao', 1),
    # Single rollouts without a critic: against grpo_dis (same DIS loss and
    # one step, groups), the pair differs in the groups alone; SAO also pays
    # for its critic (value pretraining, K = 2 critic steps per batch).
    'running_mean': ('running_mean', 1),
    'grpo G=4': ('grpo', 4),
    'grpo G=8': ('grpo', 8),
    'grpo_dis G=4': ('grpo_dis', 4),
    'grpo_dis G=8': ('grpo_dis', 8),
}
#: The variant the quick mode runs (the others' commands are only checked):
#: groups, whose members wait for each other in the queue.
QUICK_RUN = 'grpo_dis G=4'

#: (column, key in a run's `stability` (mean over steps) or `final` (at the
#: last step))
COLUMNS = (
    ('token staleness mean', 'stability', 'rollout/token_staleness_mean'),
    ('token staleness p95', 'stability', 'rollout/token_staleness_p95'),
    ('group-wait share', 'final', 'queue/group_wait_share'),
    ('group wait per trajectory (s)', 'final',
     'queue/group_wait_mean_seconds'),
    ('waiting for their group at a batch', 'stability',
     'queue/waiting_for_group'),
    ('learner idle', 'stability', 'time/learner_idle_fraction'),
)


def variant_name(label: str, sigma: float) -> str:
  return f'{label} sigma={sigma:g}'


def run_overrides(group_size: int, staleness: int) -> dict[str, object]:
  """The variant's group and worker count: (bound + 1) x B episodes."""
  episodes_in_flight = (staleness + 1) * BATCH_SIZE
  return {'group_size': group_size,
          'rollout.group_in_one_request': False,
          'rollout.max_staleness': staleness,
          'rollout.num_workers': episodes_in_flight // group_size,
          'rollout.queue_capacity': 0}


def seconds_to_target(run, target: float) -> float:
  """Seconds to `target`; a run that never reaches it counts its length."""
  seconds = training_runs.first_time_at(run['eval_curve'], target)
  return run['seconds'] if seconds is None else seconds


def rl_seconds_to_target(run, target: float) -> float:
  """`seconds_to_target` counted from the first RL step's start: without
  start-up and value pretraining, which only the critic's variants pay."""
  loop_start = run['seconds'] - run['loop_seconds']
  return seconds_to_target(run, target) - loop_start


def report(summaries, labels, sigmas, target):
  """Per (variant, sigma): the table's columns, means and SEs over seeds,
  and Welch's test of each variant against SAO on seconds to target."""
  out = {}
  for sigma in sigmas:
    sao = training_runs.ok_runs(summaries, variant_name('sao', sigma))
    for label in labels:
      name = variant_name(label, sigma)
      runs = training_runs.ok_runs(summaries, name)
      row = {'runs': len(runs),
             'reached_target': sum(
                 training_runs.first_time_at(r['eval_curve'], target)
                 is not None for r in runs),
             'seconds_to_target': training_runs.mean_se(
                 [seconds_to_target(r, target) for r in runs]),
             'rl_seconds_to_target': training_runs.mean_se(
                 [rl_seconds_to_target(r, target) for r in runs]),
             'final_accuracy': training_runs.mean_se(
                 [r['final_accuracy'] for r in runs]),
             'area_under_accuracy': training_runs.mean_se(
                 [training_runs.area_under_accuracy(r['eval_curve'])
                  for r in runs])}
      for column, where, key in COLUMNS:
        row[column] = training_runs.mean_se(
            [r[where][key] for r in runs if key in r.get(where, {})])
      if label != 'sao':
        row['vs_sao_seconds_to_target'] = training_runs.welch(
            [seconds_to_target(r, target) for r in runs],
            [seconds_to_target(r, target) for r in sao])
        row['vs_sao_rl_seconds_to_target'] = training_runs.welch(
            [rl_seconds_to_target(r, target) for r in runs],
            [rl_seconds_to_target(r, target) for r in sao])
      out[name] = row
  return out


def pairs(labels) -> list[tuple[str, str]]:
  """The comparisons of the second table: each variant against SAO, and
  each GRPO+DIS against the running mean, its pair without groups (same
  loss, one step, no critic)."""
  out = [(label, 'sao') for label in labels if label != 'sao']
  if 'running_mean' in labels:
    out += [(label, 'running_mean') for label in labels
            if VARIANTS[label][0] == 'grpo_dis']
  return out


def comparisons(summaries, labels, sigmas, target):
  """Per sigma and pair (a, b): Welch's test of a - b on RL seconds to
  target and on the area under the held-out accuracy curve."""
  out = []
  for sigma in sigmas:
    for a, b in pairs(labels):
      runs_a, runs_b = (training_runs.ok_runs(summaries, variant_name(x, sigma))
                        for x in (a, b))
      if not runs_a or not runs_b:
        continue
      out.append({
          'sigma': sigma, 'a': a, 'b': b,
          'rl_seconds_to_target': training_runs.welch(
              [rl_seconds_to_target(r, target) for r in runs_a],
              [rl_seconds_to_target(r, target) for r in runs_b]),
          'area_under_accuracy': training_runs.welch(
              [training_runs.area_under_accuracy(r['eval_curve'])
               for r in runs_a],
              [training_runs.area_under_accuracy(r['eval_curve'])
               for r in runs_b])})
  return out


def comparisons_markdown(tests, target) -> str:
  lines = [f'| sigma | a minus b | RL seconds to {target} (Welch p) |'
           ' area under held-out accuracy (Welch p) |', '|---|---|---|---|']
  for test in tests:
    seconds, area = test['rl_seconds_to_target'], test['area_under_accuracy']
    lines.append(
        f'| {test["sigma"]:g} | {test["a"]} minus {test["b"]} |'
        f' {seconds["difference"]:+.1f} s'
        f' (p = {training_runs.p_text(seconds["p"])}) |'
        f' {area["difference"]:+.3f} (p = {training_runs.p_text(area["p"])}) |')
  return '\n'.join(lines)


def markdown(rows, target) -> str:
  def fmt(pair, digits):
    mean, se = pair
    return '-' if mean != mean else f'{mean:.{digits}f} ± {se:.{digits}f}'
  head = (f'| variant | runs | reached {target} | seconds to {target} |'
          f' RL seconds to {target} | final accuracy |'
          + ''.join(f' {c} |' for c, _, _ in COLUMNS)
          + ' vs SAO, seconds to target (Welch p) |')
  lines = [head, '|' + '---|' * (7 + len(COLUMNS))]
  for name, row in rows.items():
    test = row.get('vs_sao_seconds_to_target')
    versus = '-' if test is None else f'{test["difference"]:+.1f} s' + (
        '' if math.isnan(test['p'])
        else f' (p = {training_runs.p_text(test["p"])})')
    lines.append(
        f'| {name} | {row["runs"]} | {row["reached_target"]}/{row["runs"]} |'
        f' {fmt(row["seconds_to_target"], 1)} |'
        f' {fmt(row["rl_seconds_to_target"], 1)} |'
        f' {fmt(row["final_accuracy"], 3)} |'
        + ''.join(f' {fmt(row[c], 3 if "share" in c or "idle" in c else 2)} |'
                  for c, _, _ in COLUMNS) + f' {versus} |')
  return '\n'.join(lines)


def plot(summaries, rows, labels, sigmas, path, title):
  """Held-out accuracy against wall-clock per sigma, and the group-wait
  share and token staleness against sigma."""
  fig = training_runs.new_figure(5 * (len(sigmas) + 2))
  panels = fig.subplots(1, len(sigmas) + 2)
  colors = {}
  for ax, sigma in zip(panels, sigmas):
    for label in labels:
      runs = training_runs.ok_runs(summaries, variant_name(label, sigma))
      if not runs:
        continue
      xs, mean, se = training_runs.mean_curve(runs, 'seconds')
      line, = ax.plot(xs, mean, marker='o', markersize=3, label=label,
                      color=colors.get(label))
      colors[label] = line.get_color()
      ax.fill_between(xs, mean - se, mean + se, alpha=0.2,
                      color=line.get_color())
    ax.set(title=f'latency sigma {sigma:g}', xlabel='wall-clock seconds',
           ylabel='held-out accuracy')
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a partial result may have none
      ax.legend(fontsize=7)
  for ax, column in zip(panels[len(sigmas):],
                        ('group-wait share', 'token staleness p95')):
    for label in labels:
      means = [rows[variant_name(label, s)][column] for s in sigmas]
      ax.errorbar(sigmas, [m for m, _ in means], yerr=[e for _, e in means],
                  marker='o', capsize=3, label=label, color=colors.get(label))
    ax.set(xlabel='lognormal sigma of the tool latency', ylabel=column)
    ax.set_xticks(list(sigmas))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  training_runs.save_figure(fig, title, path)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--variants', default=','.join(VARIANTS))
  parser.add_argument('--sigmas', default=','.join(map(str, SIGMAS)))
  parser.add_argument('--seeds', type=int, default=5)
  parser.add_argument('--total-steps', type=int, default=30)
  parser.add_argument('--staleness', type=int, default=4)
  parser.add_argument('--target', type=float, default=0.7)
  parser.add_argument('--delay-median', type=float, default=0.25)
  parser.add_argument('--delay-max', type=float, default=20.0)
  parser.add_argument('--quick', action='store_true',
                      help='CI: every variant checked, grpo_dis G=4 run at'
                      ' sigma 1 (one seed, 3 steps, 0.05 s median delay)')
  parser.add_argument('--resume', action='store_true',
                      help='reuse the runs already in --out (same command)')
  parser.add_argument('--workdir', default='runs/benchmarks/group_waiting')
  parser.add_argument('--out', default='benchmarks/results/group_waiting.json')
  parser.add_argument('--plot', default='benchmarks/results/group_waiting.png')
  args = parser.parse_args()

  labels = training_runs.chosen_variants(parser, args.variants, VARIANTS)
  sigmas = [float(s) for s in args.sigmas.split(',')]
  seeds, total, median = args.seeds, args.total_steps, args.delay_median
  if args.quick:
    labels, sigmas, seeds, total, median = list(VARIANTS), [1.0], 1, 3, 0.05
  if 'sao' not in labels:
    labels.insert(0, 'sao')  # the reference of the comparisons
  overrides = {
      'total_steps': total, 'eval.every': 0 if args.quick else 2,
      'task.held_out': 16 if args.quick else 128,
      'eval.temperature': 1.0, 'eval.batch_size': 64,
      'task.word_target.turns': 2,
      'task.word_target.delay_median_s': median,
      'task.word_target.delay_max_s': args.delay_max,
      'rollout.max_sequence_length': 96, 'rollout.max_prefill_length': 64,
      'rollout.max_target_length': 96}
  if args.quick:
    overrides['critic.pretrain_steps'] = 2  # the machinery, not the result
  specs = []
  for seed in range(seeds):  # a whole seed before the next: drift is shared
    for sigma in sigmas:
      for label in labels:
        algorithm, group = VARIANTS[label]
        specs.append(training_runs.RunSpec(
            variant_name(label, sigma), seed,
            f'{CONFIG}:algorithm={algorithm}',
            dict(overrides, **run_overrides(group, args.staleness),
                 **{'task.word_target.delay_sigma': sigma})))
  if args.quick:
    specs = training_runs.quick_grid(specs, variant_name(QUICK_RUN, 1.0))
    labels = [QUICK_RUN]

  def publish(summaries, complete=False):
    rows = report(summaries, labels, sigmas, args.target)
    tests = comparisons(summaries, labels, sigmas, args.target)
    plot(summaries, rows, labels, sigmas, args.plot,
         f'group waiting: lognormal tool latency (median {median} s), max'
         f' staleness {args.staleness}, B={BATCH_SIZE}, {seeds} seeds')
    training_runs.write_result(args.out, {
        'benchmark': 'group_waiting', 'quick': args.quick,
        'complete': complete,
        'command': ' '.join(['python', 'benchmarks/group_waiting.py']
                            + sys.argv[1:]),
        'machine': training_runs.machine(), 'config': CONFIG,
        'overrides': overrides, 'staleness': args.staleness,
        'target_accuracy': args.target,
        'variants': {label: VARIANTS[label] for label in labels},
        'sigmas': sigmas, 'report': rows, 'comparisons': tests,
        'runs': summaries})
    return rows, tests

  summaries = training_runs.run_grid(
      specs, args.workdir + ('-quick' if args.quick else ''),
      batch_size=BATCH_SIZE,
      finished=training_runs.load_finished(args.out) if args.resume else None,
      on_run=publish)
  rows, tests = publish(summaries, complete=True)
  print(markdown(rows, args.target))
  print()
  print(comparisons_markdown(tests, args.target))
  print(f'plot: {args.plot}\nresult: {args.out}')


if __name__ == '__main__':
  main()
