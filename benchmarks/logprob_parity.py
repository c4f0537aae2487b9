r"""Train/inference log-prob parity: server and learner dtypes side by side.

  python benchmarks/logprob_parity.py            # SmolLM2 demo, 6 rows, ~20 min
  python benchmarks/logprob_parity.py --quick    # CI: tiny model, 2 rows

Each row is a short `python -m sao_jax.train` run of the recipe with one
setting of the server's weights and compute dtype (`rollout.param_dtype`,
`rollout.dtype`) and the learner's (`model.dtype`, `model.logits_dtype`).
Per step the learner logs, for the tokens sampled by the weights it holds
(staleness 0), how far its log pi_old is from the engine's log mu
(`parity/*`, rl/logprob_parity.py): the fraction of tokens with
|log pi_old - log mu| above 0.01, 0.1 and 1, the mean difference and the
Pearson correlation. A row pools its steps weighted by tokens; the DIS mask's
fractions (tokens outside [1 - eps_low, 1 + eps_high], which get no
gradient) show what the mismatch costs SAO.

`model.logits_dtype` is a model option, so the f32-head row sets it for the
server and the learner alike. The learner's parameters stay f32 in every row
(its optimizer needs them); only its compute dtype changes.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import training_runs  # pylint: disable=g-import-not-at-top,wrong-import-position

from sao_jax.logs import metrics_log  # pylint: disable=g-import-not-at-top,g-bad-import-order,wrong-import-position

_BF16 = 'bfloat16'
#: label -> overrides. The server follows the learner's dtypes where a key is
#: not set (rollout/engine.py's serving_dtype, serving_param_dtype).
VARIANTS = {
    'server f32 / learner f32': {},
    'server bf16 weights + f32 compute / learner f32': {
        'rollout.param_dtype': _BF16},
    'server bf16 / learner f32': {
        'rollout.param_dtype': _BF16, 'rollout.dtype': _BF16},
    'server f32 / learner bf16 compute': {
        'model.dtype': _BF16, 'rollout.dtype': 'float32'},
    'server bf16 / learner bf16 compute': {
        'model.dtype': _BF16, 'rollout.param_dtype': _BF16},
    'server bf16 / learner bf16 + f32 LM head (both)': {
        'model.dtype': _BF16, 'rollout.param_dtype': _BF16,
        'model.logits_dtype': 'float32'},
}
QUICK_VARIANTS = ('server f32 / learner f32', 'server bf16 / learner f32')

#: `(config file, batch size, overrides)`: a few SAO steps, no value
#: pretraining (it does not change pi or mu), a small held-out set.
RECIPES = {
    'demo': ('configs/default.py', 16, {
        'total_steps': 4, 'eval.every': 0, 'task.held_out': 16,
        'critic.pretrain_steps': 0}),
    'tiny': ('configs/tiny.py', 16, {
        'total_steps': 2, 'eval.every': 0, 'task.held_out': 16,
        'critic.pretrain_steps': 0}),
}

FRACTIONS = ('frac_gt_0.01', 'frac_gt_0.1', 'frac_gt_1')


def parity_of_run(workdir: str) -> dict:
  """A run's parity metrics pooled over its steps.

  Fractions and the mean difference are token-weighted means over steps
  (each step's are over its staleness-0 tokens); Pearson is the median of
  the steps'; DIS fractions are means over steps.
  """
  records = metrics_log.read_jsonl(os.path.join(workdir, 'metrics.jsonl'),
                                   dedupe=True)
  steps = [r for r in records if training_runs.finite_number(r.get('parity/tokens'))
           and r['parity/tokens'] > 0]
  if not steps:
    raise ValueError(f'{workdir}: no step logged parity/tokens > 0')
  tokens = np.array([r['parity/tokens'] for r in steps], float)
  out = {'steps': len(steps), 'tokens': float(tokens.sum())}
  for key in FRACTIONS + ('mean_abs_diff',):
    values = np.array([r[f'parity/{key}'] for r in steps], float)
    out[key] = float(np.sum(values * tokens) / tokens.sum())
  pearson = [r['parity/pearson'] for r in steps
             if training_runs.finite_number(r.get('parity/pearson'))]
  out['pearson'] = float(np.median(pearson)) if pearson else None
  for key in ('policy/frac_below', 'policy/frac_above'):
    values = [r[key] for r in steps if training_runs.finite_number(r.get(key))]
    out[key] = float(np.mean(values)) if values else None
  return out


def markdown_table(rows: dict) -> str:
  lines = ['| server / learner | runs | tokens | > 0.01 | > 0.1 | > 1 |'
           ' mean abs diff | Pearson | DIS below | DIS above |',
           '|---|---|---|---|---|---|---|---|---|---|']
  for label, row in rows.items():
    if row is None:
      lines.append(f'| {label} | 0 | - | - | - | - | - | - | - | - |')
      continue

    def fmt(value, spec):
      return '-' if value is None else format(value, spec)
    lines.append(
        f'| {label} | {row["runs"]} | {row["tokens"]:.0f} |'
        + ''.join(f' {fmt(row[k], ".2%")} |' for k in FRACTIONS)
        + f' {fmt(row["mean_abs_diff"], ".2e")} |'
        f' {fmt(row["pearson"], ".5f")} |'
        f' {fmt(row["policy/frac_below"], ".2%")} |'
        f' {fmt(row["policy/frac_above"], ".2%")} |')
  return '\n'.join(lines)


def plot_fractions(rows: dict, path: str, title: str) -> str:
  """Bars: per row, the share of tokens past each threshold (log scale)."""
  fig = training_runs.new_figure(10, 4.5)
  ax = fig.add_subplot(1, 1, 1)
  labels = [label for label, row in rows.items() if row is not None]
  width = 0.8 / len(FRACTIONS)
  for i, key in enumerate(FRACTIONS):
    # A share of 0 is drawn at the floor of the log axis, not left out.
    values = [max(rows[label][key], 1e-6) for label in labels]
    ax.bar(np.arange(len(labels)) + (i - 1) * width, values, width,
           label='|log pi_old - log mu| > ' + key.split('_')[-1])
  ax.set_yscale('log')
  ax.set_ylim(1e-6, 1)
  ax.set_ylabel('share of tokens')
  ax.set_xticks(np.arange(len(labels)))
  ax.set_xticklabels([label.replace(' / ', '\n') for label in labels],
                     fontsize=7)
  ax.legend(fontsize=8)
  return training_runs.save_figure(fig, title, path)


def pool_runs(runs: list[dict]) -> dict | None:
  """One row from a variant's runs (seeds): token-weighted again."""
  if not runs:
    return None
  tokens = np.array([r['tokens'] for r in runs])
  row = {'runs': len(runs), 'tokens': float(tokens.sum())}
  for key in FRACTIONS + ('mean_abs_diff',):
    row[key] = float(np.sum([r[key] * r['tokens'] for r in runs])
                     / tokens.sum())
  for key in ('pearson', 'policy/frac_below', 'policy/frac_above'):
    values = [r[key] for r in runs if r[key] is not None]
    row[key] = float(np.median(values)) if values else None
  return row


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--recipe', choices=sorted(RECIPES), default='demo')
  parser.add_argument('--variants', default=','.join(VARIANTS))
  parser.add_argument('--seeds', type=int, default=1)
  parser.add_argument('--quick', action='store_true',
                      help='CI: the tiny model, two rows, 2 steps; the'
                      " recipe's rows checked")
  parser.add_argument('--workdir', default='runs/benchmarks/logprob_parity')
  parser.add_argument('--out', default='benchmarks/results/logprob_parity.json')
  parser.add_argument('--plot', default='benchmarks/results/logprob_parity.png')
  args = parser.parse_args()

  recipe = 'tiny' if args.quick else args.recipe
  config, batch_size, overrides = RECIPES[recipe]
  names = (list(QUICK_VARIANTS) if args.quick else
           training_runs.chosen_variants(parser, args.variants, VARIANTS))
  # The model's random sampling stream is the same in every row (seed), so
  # rows differ by their dtypes and by what those do to the sampled tokens.
  specs = [training_runs.RunSpec(name, seed, config,
                                 dict(overrides, **VARIANTS[name]))
           for seed in range(args.seeds) for name in names]
  if args.quick:  # the rows of the full grid, checked without running
    full_config, _, full_overrides = RECIPES[args.recipe]
    training_runs.check_commands([
        training_runs.RunSpec(name, 0, full_config,
                              dict(full_overrides, **VARIANTS[name]))
        for name in VARIANTS])
  root = os.path.join(args.workdir, recipe + ('-quick' if args.quick else ''))
  summaries = training_runs.run_grid(specs, root, batch_size=batch_size)
  for spec, summary in zip(specs, summaries):
    if 'failed' not in summary:
      summary['parity'] = parity_of_run(os.path.join(root, spec.name))
  rows = {name: pool_runs([s['parity'] for s in summaries
                           if s['variant'] == name and 'parity' in s])
          for name in names}
  training_runs.write_result(args.out, {
      'benchmark': 'logprob_parity', 'recipe': recipe, 'quick': args.quick,
      'command': ' '.join(['python', 'benchmarks/logprob_parity.py']
                          + sys.argv[1:]),
      'machine': training_runs.machine(), 'config': config,
      'overrides': overrides, 'variants': {n: VARIANTS[n] for n in names},
      'rows': rows, 'runs': summaries})
  plot_fractions(rows, args.plot, f'log-prob parity ({recipe}, staleness-0'
                 ' tokens)')
  print(markdown_table(rows))
  print(f'plot: {args.plot}\nresult: {args.out}')


if __name__ == '__main__':
  main()
