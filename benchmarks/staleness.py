r"""Stability under staleness: faithful baselines pushed until they break.

  python benchmarks/staleness.py                 # 5 variants x 4 bounds x 5 seeds
  python benchmarks/staleness.py --quick         # CI: checks all, runs sao at 4
  python benchmarks/staleness.py --variants=sao,grpo --bounds=0,16 --seeds=3

`rollout.max_staleness` bounds how many policy versions the oldest token of a
trajectory may lag the learner (SAO.md §2); 0 is synchronous training. To
make the bound bite, each run has enough rollout workers to fill it
(`(max_staleness + 1) x B` episodes in flight), so the realised staleness
grows with the bound instead of being capped by the worker count.

Every variant takes the peers' update schedule, M = 4 mini-batch optimizer
steps per batch (verl's default; GRPO's and VAPO's presets already do, SAO and
GRPO+DIS are given it here), at an actor learning rate `--lr-scale` times the
recipe's stable one: the regime where a method that does not correct for
the lag should break. Variants: `sao`; `grpo` (PPO clip against the
recomputed old policy, verl's default); `grpo decoupled` (AReaL's decoupled
PPO: clip against the proximal policy, tokens weighted by min(pi_prox / mu,
2)); `grpo_dis` (group advantages, DIS loss); `vapo`.

Collapse is defined before looking at any run (`training_runs.
collapse_below_half_peak`): the training reward below half its peak (of the
3-step mean) for 5 consecutive steps, or any optimizer step skipped for a
non-finite gradient. Reported per (variant, bound), over seeds: collapses,
held-out accuracy (final and mean over the run), the importance ratio's range
(min / max over each batch's action tokens, averaged over steps: against mu
for DIS, against the recomputed old policy for the PPO clips), the DIS band
fractions or the PPO clip fraction, gradient norms, realised staleness of
the trained tokens (mean and p95).

Same recipe as benchmarks/algorithms.py (tiny random model on word_target),
run longer (`--total-steps`). The result file is rewritten after each run
(`complete` false until the grid ends); `--resume` reuses the runs already in
it, which continues the grid on a fresh checkout.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import algorithms  # pylint: disable=g-import-not-at-top,wrong-import-position
import training_runs  # pylint: disable=g-import-not-at-top,wrong-import-position

BOUNDS = (0, 4, 8, 16)
#: label -> (algorithm, overrides)
VARIANTS = {
    'sao': ('sao', {}),
    'grpo': ('grpo', {}),
    'grpo decoupled': ('grpo', {'policy_loss.old_logprobs': 'decoupled'}),
    'grpo_dis': ('grpo_dis', {}),
    'vapo': ('vapo', {}),
}
COLUMNS = (('token staleness mean', 'rollout/token_staleness_mean'),
           ('token staleness p95', 'rollout/token_staleness_p95'),
           ('DIS below', 'policy/frac_below'),
           ('DIS above', 'policy/frac_above'),
           ('PPO clip frac', 'policy/clip_frac'),
           ('ratio min', 'policy/ratio_min'),
           ('ratio max', 'policy/ratio_max'),
           ('actor grad norm', 'policy/grad_norm'),
           ('critic grad norm', 'critic/grad_norm'))


def variant_name(label: str, bound: int) -> str:
  return f'{label} staleness={bound}'


def collapse(run) -> int | None:
  """The run's collapse step by the rule above (0: a non-finite skip with
  no reward collapse), or None."""
  curve = run['reward_curve']
  step = training_runs.collapse_below_half_peak(
      [p['step'] for p in curve], [p['reward'] for p in curve])
  if step is not None:
    return step
  final = run.get('final', {})
  # `_total` since 2026-12-07; results written before carry the total
  # under the per-step name.
  if any(final.get(f'{role}/nonfinite_skips{suffix}')
         for role in ('policy', 'critic') for suffix in ('_total', '')):
    return 0
  return None


def _areas(summaries, variant):
  return [training_runs.area_under_accuracy(r['eval_curve'])
          for r in training_runs.ok_runs(summaries, variant)]


def comparisons(summaries, labels, bounds):
  """Welch's tests on the area under held-out accuracy: what each bound
  costs a variant (its area at the bound minus at the lowest bound), and
  SAO minus each other variant at every bound."""
  lag, versus = [], []
  for label in labels:
    base = _areas(summaries, variant_name(label, bounds[0]))
    for bound in bounds[1:]:
      areas = _areas(summaries, variant_name(label, bound))
      if areas and base:
        lag.append({'variant': label, 'bound': bound, 'against': bounds[0],
                    'area': training_runs.welch(areas, base)})
  if 'sao' in labels:
    for bound in bounds:
      sao = _areas(summaries, variant_name('sao', bound))
      for label in labels:
        other = _areas(summaries, variant_name(label, bound))
        if label != 'sao' and sao and other:
          versus.append({'variant': label, 'bound': bound,
                         'sao_minus_this': training_runs.welch(sao, other)})
  return {'bound_minus_lowest': lag, 'sao_minus_variant': versus}


def _by_bound_table(tests, corner, column, key) -> list[str]:
  """A markdown table of `tests[i][key]`: a row per variant, a column per
  bound, each cell the area difference and its Welch p."""
  bounds = sorted({t['bound'] for t in tests})
  lines = [f'| {corner} | ' + ' | '.join(column(b) for b in bounds) + ' |',
           '|---|' + '---|' * len(bounds)]
  for label in dict.fromkeys(t['variant'] for t in tests):
    cells = {t['bound']: t[key] for t in tests if t['variant'] == label}
    lines.append(f'| {label} | ' + ' | '.join(
        f'{cells[b]["difference"]:+.3f}'
        f' (p = {training_runs.p_text(cells[b]["p"])})' if b in cells else '-'
        for b in bounds) + ' |')
  return lines


def comparisons_markdown(tests) -> str:
  """Two tables: the cost of each bound per variant, and SAO against each
  variant per bound (area differences, Welch p in brackets)."""
  lag, versus = tests['bound_minus_lowest'], tests['sao_minus_variant']
  lines = []
  if lag:
    lines += _by_bound_table(
        lag, 'variant',
        lambda b: f'area at bound {b} minus at {lag[0]["against"]}', 'area')
  if versus:
    lines += [''] * bool(lines) + _by_bound_table(
        versus, 'SAO minus', lambda b: f'area at bound {b}', 'sao_minus_this')
  return '\n'.join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--recipe', choices=sorted(algorithms.RECIPES),
                      default='tiny')
  parser.add_argument('--variants', default=','.join(VARIANTS))
  parser.add_argument('--bounds', default=','.join(map(str, BOUNDS)))
  parser.add_argument('--seeds', type=int, default=5)
  parser.add_argument('--total-steps', type=int, default=60)
  parser.add_argument('--minibatches', type=int, default=4,
                      help='M, optimizer steps per batch, for every variant')
  parser.add_argument('--lr-scale', type=float, default=2.5,
                      help="the actor's learning rate over the recipe's")
  parser.add_argument('--quick', action='store_true',
                      help='CI: every variant checked at bounds 0 and 4, sao run'
                      ' at 4 (one seed, 3 steps)')
  parser.add_argument('--resume', action='store_true',
                      help='reuse the runs already in --out (same command)')
  parser.add_argument('--workdir', default='runs/benchmarks/staleness')
  parser.add_argument('--out', default='benchmarks/results/staleness.json')
  parser.add_argument('--plot', default='benchmarks/results/staleness.png')
  args = parser.parse_args()

  config, batch_size, overrides = algorithms.RECIPES[args.recipe]
  labels = training_runs.chosen_variants(parser, args.variants, VARIANTS)
  bounds = [int(b) for b in args.bounds.split(',')]
  seeds = args.seeds
  recipe_config = training_runs.load_recipe_config(config)
  learning_rate = (recipe_config.optim.actor.learning_rate * args.lr_scale)
  overrides = dict(overrides, **{
      'total_steps': args.total_steps,
      'optim.policy_minibatches': args.minibatches,
      'optim.actor.learning_rate': learning_rate})
  if args.quick:
    labels, bounds, seeds = list(VARIANTS), [0, 4], 1
    overrides = dict(overrides, **algorithms.QUICK)
  specs, variants = [], []
  for label in labels:
    algorithm, extra = VARIANTS[label]
    for bound in bounds:
      variant = variant_name(label, bound)
      variants.append(variant)
      for seed in range(seeds):
        specs.append(training_runs.RunSpec(
            variant, seed, f'{config}:algorithm={algorithm}',
            dict(overrides, **extra,
                 **{'rollout.max_staleness': bound,
                    'rollout.num_workers': (bound + 1) * batch_size,
                    'rollout.queue_capacity': 0})))
  specs.sort(key=lambda s: s.seed)  # a whole first seed before the second
  if args.quick:
    # Every variant's command at both bounds checked; SAO at bound 4 runs,
    # where the bound lets the data lag (bound 0 is async_speedup's sync).
    specs = training_runs.quick_grid(specs, variant_name('sao', 4))
    labels, bounds, variants = ['sao'], [4], [variant_name('sao', 4)]
  title = (f'max staleness ({args.recipe}, B={batch_size}, M='
           f'{args.minibatches}, actor lr {learning_rate:g}, {seeds} seeds)')

  def publish(summaries, complete=False):
    for run in summaries:
      if 'failed' not in run:
        run['collapse_rule_step'] = collapse(run)
    aggregated = training_runs.aggregate(summaries, variants)
    for variant, row in aggregated.items():
      runs = training_runs.ok_runs(summaries, variant)
      row['collapsed_by_rule'] = sum(r['collapse_rule_step'] is not None
                                     for r in runs)
      row['collapse_rule_steps'] = [r['collapse_rule_step'] for r in runs
                                    if r['collapse_rule_step'] is not None]
    tests = comparisons(summaries, labels, bounds)
    _plot(aggregated, labels, bounds, args.plot, title)
    training_runs.write_result(args.out, {
        'benchmark': 'staleness', 'recipe': args.recipe, 'quick': args.quick,
        'complete': complete,
        'command': ' '.join(['python', 'benchmarks/staleness.py']
                            + sys.argv[1:]),
        'machine': training_runs.machine(), 'config': config,
        'overrides': overrides,
        'variants': {label: VARIANTS[label] for label in labels},
        'collapse_rule': 'training reward below half its peak (3-step mean)'
                         ' for 5 consecutive steps, or a non-finite skip',
        'aggregate': aggregated, 'comparisons': tests, 'runs': summaries})
    return aggregated, tests

  summaries = training_runs.run_grid(
      specs, os.path.join(args.workdir, args.recipe + ('-quick' if args.quick
                                                       else '')),
      batch_size=batch_size,
      finished=training_runs.load_finished(args.out) if args.resume else None,
      on_run=publish)
  aggregated, tests = publish(summaries, complete=True)
  print(markdown(aggregated))
  print()
  print(comparisons_markdown(tests))
  print(f'plot: {args.plot}\nresult: {args.out}')


def markdown(aggregated) -> str:
  """The table: collapses by the rule first, then the usual columns."""
  table = training_runs.markdown_table(aggregated, COLUMNS).split('\n')
  head, rule, rows = table[0], table[1], table[2:]
  out = [head.replace('| collapsed |', '| collapsed (rule) |'), rule]
  for row, (_, a) in zip(rows, aggregated.items()):
    cells = row.split(' | ')
    # Column 7 (0-based after the variant) is `collapsed`.
    steps = a['collapse_rule_steps']
    cells[7] = f'{a["collapsed_by_rule"]}/{a["runs"] - a["failed"]}' + (
        f' (steps {", ".join(map(str, steps))})' if steps else '')
    out.append(' | '.join(cells))
  return '\n'.join(out)


def _plot(aggregated, labels, bounds, path, title):
  """Against the staleness bound, per variant: held-out accuracy (area),
  the collapse rate, the importance ratio's range, and the share of tokens
  DIS masks or the PPO clip clips."""
  fig = training_runs.new_figure(20)
  area_ax, collapse_ax, ratio_ax, mask_ax = fig.subplots(1, 4)
  for label in labels:
    rows = [aggregated[variant_name(label, b)] for b in bounds]
    line = area_ax.errorbar(
        bounds, [r['area_under_accuracy'] for r in rows],
        yerr=[r['area_under_accuracy_se'] for r in rows], marker='o',
        capsize=3, label=label)
    color = line[0].get_color()
    collapse_ax.plot(bounds, [r['collapsed_by_rule'] / max(
        r['runs'] - r['failed'], 1) for r in rows], marker='o', color=color,
                     label=label)
    for key, style in (('policy/ratio_min', '--'), ('policy/ratio_max', '-')):
      ratio_ax.plot(bounds, [r['stability'].get(key, float('nan'))
                             for r in rows], style, marker='o', color=color,
                    label=f'{label} {key.split("_")[-1]}')
    masked = [r['stability'].get('policy/frac_below',
                                 r['stability'].get('policy/clip_frac'))
              for r in rows]
    if all(m is not None for m in masked):
      mask_ax.plot(bounds, masked, marker='o', color=color, label=label)
  area_ax.set_ylabel('mean held-out accuracy over the run (area)')
  collapse_ax.set_ylabel('share of seeds collapsed (rule)')
  ratio_ax.set_ylabel('importance ratio: min (--), max (-)')
  mask_ax.set_ylabel('DIS: tokens below the band; PPO: clip fraction')
  for ax in (area_ax, collapse_ax, ratio_ax, mask_ax):
    ax.set_xlabel('rollout.max_staleness')
    ax.set_xticks(bounds)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  training_runs.save_figure(fig, title, path)


if __name__ == '__main__':
  main()
