"""Learning-curve figure of a run, from its `metrics.jsonl`.

One PNG with a panel per family of metrics that the log holds, to look at a run
(or attach to a report) without starting TensorBoard. Panels whose metrics the
log lacks are left out: a toy run logs no critic, an early log has no eval yet.

Drawn with matplotlib's Agg canvas on a `Figure` object rather than `pyplot`,
so that plotting from a training process neither needs a display nor switches
the global backend under whoever else in the process uses matplotlib.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Sequence

import numpy as np
from matplotlib import figure as mpl_figure
from matplotlib.backends import backend_agg

from sao_jax.logs import metrics_log

REWARD = 'train/reward'
EVAL_ACCURACY = 'eval/accuracy'
EVAL_ACCURACY_SE = 'eval/accuracy_se'

# Trailing moving average of the reward: about a tenth of the run, so that the
# trend shows at any run length, capped so that it still follows changes.
_MAX_SMOOTHING = 50


@dataclasses.dataclass(frozen=True)
class _Panel:
  title: str
  keys: tuple[str, ...]
  log_scale: bool = False


_PANELS = (
    _Panel('Train reward', (REWARD,)),
    _Panel('Eval accuracy (± s.e.)', (EVAL_ACCURACY,)),
    _Panel('DIS band: fraction of tokens outside',
           ('policy/frac_below', 'policy/frac_above')),
    _Panel('Critic explained variance', ('critic/explained_variance',)),
    # Train/inference mismatch on the tokens of the learner's own version.
    _Panel('Log-prob parity: share of tokens off by > e',
           ('parity/frac_gt_0.01', 'parity/frac_gt_0.1', 'parity/frac_gt_1')),
    _Panel('KL to behaviour policy (k3)', ('policy/kl_k3',)),
    # Grad norms span decades, and a spike must not flatten the rest.
    _Panel('Gradient norm', ('policy/grad_norm', 'critic/grad_norm'),
           log_scale=True),
    _Panel('Mean staleness (policy versions)', ('rollout/staleness_mean',)),
    _Panel('Learner idle fraction', ('time/learner_idle_fraction',)),
)

_NCOLS = 3
# Updates skipped for a non-finite gradient: a red line at each such step.
_SKIP_ROLES = ('policy', 'critic')


def plot_learning_curves(jsonl_path: str | os.PathLike[str],
                         png_path: str | os.PathLike[str],
                         title: str | None = None) -> str:
  """Draws the learning curves of `jsonl_path` into the PNG `png_path`.

  The log is read deduplicated (`metrics_log.read_jsonl(..., dedupe=True)`),
  so a resumed run plots as one curve. A log without any of the known series
  (or an empty one) still gives a PNG, saying "no data", so a report step that
  plots every run never fails on a run that died early.

  Args:
    jsonl_path: a `metrics.jsonl` written by `metrics_log.MetricsLogger`.
    png_path: where to write the PNG; its directory is created if needed.
    title: figure title; by default the run directory's name and last step.

  Returns:
    `png_path`, as a str.

  Raises:
    FileNotFoundError: `jsonl_path` does not exist (a wrong path is a bug, not
      an empty run).
  """
  records = metrics_log.read_jsonl(jsonl_path, dedupe=True)
  png_path = os.fspath(png_path)
  if title is None:
    run = os.path.basename(os.path.dirname(os.path.abspath(jsonl_path)))
    title = f'{run} (step {records[-1]["step"]})' if records else run

  panels = [p for p in _PANELS
            if any(metrics_log.series(records, k)[0].size for k in p.keys)]
  if panels:
    ncols = min(_NCOLS, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = mpl_figure.Figure(figsize=(5.0 * ncols, 3.4 * nrows + 0.6),
                            layout='constrained')
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    skipped = skipped_steps(records)
    for ax, panel in zip(axes, panels):
      _draw(ax, panel, records)
      for i, step in enumerate(skipped):
        ax.axvline(step, color='tab:red', alpha=0.5, linewidth=0.8,
                   linestyle='--',
                   label='update skipped' if i == 0 and panel.keys == (
                       REWARD,) else None)
      if skipped and panel.keys == (REWARD,):
        ax.legend(fontsize=8)
    for ax in axes[len(panels):]:
      ax.set_visible(False)
  else:
    fig = mpl_figure.Figure(figsize=(5.0, 3.4), layout='constrained')
    ax = fig.subplots()
    ax.text(0.5, 0.5, 'no data', ha='center', va='center', fontsize=20,
            transform=ax.transAxes)
    ax.set_axis_off()
  fig.suptitle(title)

  directory = os.path.dirname(png_path)
  if directory:
    os.makedirs(directory, exist_ok=True)
  backend_agg.FigureCanvasAgg(fig).print_png(png_path)
  return png_path


def skipped_steps(records) -> list[int]:
  """Steps at which the policy or critic skipped an update (a non-finite
  gradient or gradient norm).

  From `<role>/nonfinite_skips` (per step) where the log has
  `<role>/nonfinite_skips_total`; a log written before that held only the
  running total, under the per-step name, and its increases are read.
  """
  steps = set()
  for role in _SKIP_ROLES:
    total_steps, _ = metrics_log.series(records, f'{role}/nonfinite_skips_total')
    at, values = metrics_log.series(records, f'{role}/nonfinite_skips')
    if not total_steps.size:  # the old running total
      values = np.diff(values, prepend=0.0)
    steps.update(int(t) for t, v in zip(at, values) if v > 0)
  return sorted(steps)


def moving_average(values: Sequence[float] | np.ndarray,
                   window: int) -> np.ndarray:
  """Trailing mean over the last `window` values (fewer at the start).

  Trailing rather than centred, so the curve at step t says what the reward
  was by step t, as a live run would have seen it.
  """
  values = np.asarray(values, np.float64)
  if window < 1:
    raise ValueError(f'window must be >= 1, got {window}')
  cumsum = np.concatenate([[0.0], np.cumsum(values)])
  ends = np.arange(1, values.size + 1)
  starts = np.maximum(ends - window, 0)
  return (cumsum[ends] - cumsum[starts]) / (ends - starts)


def _draw(ax, panel: _Panel, records) -> None:
  ax.set_title(panel.title, fontsize=10)
  ax.set_xlabel('step')
  ax.grid(alpha=0.3)
  drawn = 0
  positive = True
  for key in panel.keys:
    steps, values = metrics_log.series(records, key)
    if not steps.size:
      continue
    drawn += 1
    positive &= bool(np.all(values > 0))
    if key == REWARD:
      _draw_reward(ax, steps, values)
    elif key == EVAL_ACCURACY:
      _draw_eval(ax, steps, values, records)
    else:
      ax.plot(steps, values, marker='.' if steps.size < 30 else None,
              label=key)
  if panel.log_scale and positive:
    ax.set_yscale('log')
  if drawn > 1 or panel.keys == (REWARD,):
    ax.legend(fontsize=8)


def _draw_reward(ax, steps: np.ndarray, values: np.ndarray) -> None:
  ax.plot(steps, values, color='tab:blue', alpha=0.35, linewidth=0.8,
          marker='.' if steps.size < 30 else None, label=REWARD)
  window = max(1, min(_MAX_SMOOTHING, steps.size // 10))
  if window > 1:
    ax.plot(steps, moving_average(values, window), color='tab:blue',
            linewidth=2.0, label=f'moving average ({window} steps)')


def _draw_eval(ax, steps: np.ndarray, values: np.ndarray, records) -> None:
  se_steps, se_values = metrics_log.series(records, EVAL_ACCURACY_SE)
  se_by_step = dict(zip(se_steps.tolist(), se_values.tolist()))
  # A step with no s.e. logged gets no bar rather than a made-up one.
  yerr = np.array([se_by_step.get(s, 0.0) for s in steps.tolist()])
  ax.errorbar(steps, values, yerr=yerr, marker='o', markersize=3, capsize=3,
              color='tab:green', label=EVAL_ACCURACY)
