"""Runs of the real training program for the evidence benchmarks.

Every evidence benchmark (algorithms, staleness, ablations, online learning,
async vs sync) is a grid of `python -m sao_jax.train` runs, one per (variant,
seed), each in its own workdir, with the config overrides that make the
variant. Nothing here trains: the numbers come from the program users run,
through its `metrics.jsonl`.

  * `quick_grid` is CI's quick mode of a grid: every variant's command is
    parsed and validated in this process (`check_commands`), as the training
    program would before it starts, and one variant runs.
  * `run_grid` launches the runs one after another (they share the machine's
    cores; running them side by side would make their wall-clocks meaningless)
    and skips a run whose workdir already holds a finished `summary.json`, so
    an interrupted benchmark resumes where it stopped.
  * `summarize_run` reduces a run's log to what the reports need: the held-out
    accuracy curve (against steps, trajectories consumed and seconds), the
    reward curve, the collapse step, and the means of the stability metrics.
  * `aggregate` puts the seeds of a variant together (means, standard errors,
    collapse counts), `plot_accuracy` draws the curves, `markdown_table` the
    table for BENCHMARKS.md.

The runs share a persistent XLA compilation cache (`compile_cache_dir`):
every run of a grid compiles the same shapes, and without the cache each
would spend most of a short run compiling.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib import figure as mpl_figure
from matplotlib.backends import backend_agg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from sao_jax import xla_flags  # pylint: disable=g-import-not-at-top,wrong-import-position
from sao_jax.logs import metrics_log  # pylint: disable=g-import-not-at-top,wrong-import-position
from sao_jax.logs import plots  # pylint: disable=g-import-not-at-top,wrong-import-position

#: Metrics whose per-run means the reports carry (stability under staleness).
STABILITY_KEYS = (
    'policy/frac_below', 'policy/frac_above', 'policy/ratio_min',
    'policy/ratio_max', 'policy/ratio_mean', 'policy/clip_frac',
    'policy/kl_k3', 'policy/optimizer_steps', 'policy/behavior_weight_mean',
    'policy/grad_norm', 'critic/grad_norm', 'critic/explained_variance',
    'critic/optimizer_steps',
    'rollout/staleness_mean', 'rollout/staleness_max',
    'rollout/token_staleness_mean', 'rollout/token_staleness_p95',
    'queue/waiting_for_group',
    'time/learner_idle_fraction', 'time/wait_seconds', 'time/train_seconds',
    'queue/dropped_stale')

#: Cumulative metrics (since the queue opened): the reports carry their value
#: at a run's last step, not a mean over steps.
FINAL_KEYS = ('queue/group_wait_share', 'queue/group_wait_mean_seconds',
              'queue/dropped_groups', 'queue/dropped_incomplete_group',
              'policy/nonfinite_skips_total', 'critic/nonfinite_skips_total')

#: A run has collapsed when its smoothed reward falls this far below the best
#: it reached and does not climb back to within half of that by the end.
COLLAPSE_DROP = 0.25
COLLAPSE_WINDOW = 5


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """One run of a grid.

  Attributes:
    variant: the label the reports group by, e.g. 'sao' or 'staleness=4'.
    seed: sets both `config.seed` (sampling) and `config.task.seed` (the
      order of the training prompts).
    config: the `--config` argument, e.g. 'configs/tiny.py:algorithm=grpo'.
    overrides: `--config.<key>=<value>` flags; values are written with
      `repr` for tuples and `str` otherwise.
  """
  variant: str
  seed: int
  config: str
  overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def name(self) -> str:
    safe = ''.join(c if c.isalnum() or c in '-_.' else '_'
                   for c in self.variant)
    return f'{safe}/seed{self.seed}'

  def command(self, workdir: str) -> list[str]:
    """The `python -m sao_jax.train` command line of this run."""
    return [sys.executable, '-m', 'sao_jax.train', f'--config={self.config}',
            f'--workdir={workdir}'] + self.override_flags()

  def override_flags(self) -> list[str]:
    """The `--config.<key>=<value>` flags of this run, seeds included."""
    flags = {'seed': self.seed, 'task.seed': self.seed,
             'log.progress': False, **self.overrides}
    return [f'--config.{k}={_flag_value(v)}' for k, v in flags.items()]


def _flag_value(value: Any) -> str:
  if isinstance(value, (tuple, list)):
    return '(' + ','.join(str(v) for v in value) + (
        ',)' if len(value) == 1 else ')')
  return str(value)


def load_recipe_config(config: str):
  """The config a `RunSpec.config` argument names, relative to the repo
  (for values a script derives from the recipe, e.g. a scaled rate)."""
  from sao_jax import config_lib  # pylint: disable=g-import-not-at-top
  return config_lib.load_config(os.path.join(ROOT, config))


def check_commands(specs: Sequence[RunSpec]) -> None:
  """Parses every spec's command line and validates its config, in this
  process, as `python -m sao_jax.train` does before its slow start.

  A variant with a renamed key, a value of the wrong type or settings that
  contradict each other fails here in seconds, not when its turn comes in a
  grid of hours. The mesh is checked against one device (what the runs see on
  a CPU); a run checks its own devices when it starts.

  Raises:
    SystemExit: naming the first variant whose command is wrong, and why.
  """
  # pylint: disable=g-import-not-at-top
  from absl import flags
  from ml_collections import config_flags
  from sao_jax import config_lib
  from sao_jax import recipe_checks
  # pylint: enable=g-import-not-at-top
  for spec in specs:
    argv = ['sao_jax.train', f'--config={os.path.join(ROOT, spec.config)}',
            *spec.override_flags()]
    # The trainer's config flag, on flag values of this command's own.
    values = flags.FlagValues()
    config_flags.DEFINE_config_file('config', flag_values=values,
                                    lock_config=True, sys_argv=argv)
    where = f'error: variant {spec.variant!r}:'
    try:
      values(argv)
    except config_lib.PARSE_ERRORS as e:
      raise SystemExit(f'{where} {config_lib.parse_message(e, argv)}') from e
    try:
      recipe_checks.validate(values.config, num_devices=1)
      recipe_checks.check_inputs(values.config)
    except config_lib.ConfigError as e:
      raise SystemExit(f'{where} {e}') from e


def quick_grid(specs: Sequence[RunSpec], variant: str) -> list[RunSpec]:
  """CI's quick mode of a grid: checks every spec's command
  (`check_commands`) and returns the specs of `variant` only.

  One real run keeps a benchmark script from rotting (its runs, summaries,
  report, table and plot) at the cost of one training run instead of one per
  variant, while the other variants' overrides are still checked.
  """
  check_commands(specs)
  chosen = [s for s in specs if s.variant == variant]
  if not chosen:
    raise ValueError(f'no spec of variant {variant!r} in the grid')
  return chosen


def compile_cache_dir(root: str) -> str:
  return os.path.join(root, 'jax_compile_cache')


def run_environment(root: str) -> dict[str, str]:
  """The environment of a run: the repo importable, the shared compile cache.
  """
  # A run measures this machine as a user runs it: not on the fake CPU
  # devices of a parent test session, under which a batch may not split over
  # the devices the way the recipe was sized for.
  env = xla_flags.child_environment(os.environ)
  env['PYTHONPATH'] = os.pathsep.join(
      p for p in (ROOT, env.get('PYTHONPATH', '')) if p)
  env.setdefault('JAX_COMPILATION_CACHE_DIR', compile_cache_dir(root))
  env.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
  env.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '-1')
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  return env


def run_key(command: str) -> str:
  """A run's command without its workdir: what identifies the run across
  machines and checkouts."""
  return ' '.join(t for t in command.split() if not t.startswith('--workdir='))


def load_finished(path: str) -> dict[str, dict[str, Any]]:
  """The finished runs of an earlier result file (none if it does not
  exist), by `run_key`: a grid whose result is committed resumes on a fresh
  checkout."""
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    runs = json.load(f).get('runs', [])
  return {run_key(r['command']): r for r in runs if 'failed' not in r}


def run_grid(specs: Sequence[RunSpec], root: str, *, batch_size: int,
             timeout_s: float = 1800,
             finished: Mapping[str, Mapping[str, Any]] | None = None,
             on_run=None) -> list[dict[str, Any]]:
  """Runs every spec (unless already done) and returns their summaries.

  A run that fails (non-zero exit, timeout) is reported with `failed` set and
  the tail of its output; the grid goes on, so one bad variant costs its own
  runs, not the benchmark.

  Args:
    specs: the runs, in the order to run them.
    root: the benchmark's directory; run `s` works in `root/s.name`.
    timeout_s: wall-clock limit per run.
    batch_size: trajectories per policy step (the config's `batch_size`),
      for the trajectory axis.
    finished: summaries of runs done earlier (`load_finished` of a committed
      result), by `run_key`; a spec whose command matches one is not rerun.
    on_run: called with the summaries so far after each new run (a long
      grid writes its partial result, to be committed as it goes).

  Returns:
    One summary per spec (`summarize_run` plus the spec's fields).
  """
  os.makedirs(root, exist_ok=True)
  finished = finished or {}
  summaries = []
  for i, spec in enumerate(specs):
    workdir = os.path.join(root, spec.name)
    summary_path = os.path.join(workdir, 'summary.json')
    key = run_key(' '.join(spec.command(workdir)[1:]))
    if key in finished:
      summaries.append(dict(finished[key]))
      print(f'[{i + 1}/{len(specs)}] {spec.name}: in the earlier result',
            flush=True)
      continue
    if os.path.exists(summary_path):
      with open(summary_path) as f:
        summaries.append(json.load(f))
      print(f'[{i + 1}/{len(specs)}] {spec.name}: done earlier', flush=True)
      continue
    if os.path.exists(workdir):  # an interrupted run: start it afresh
      subprocess.run(['rm', '-rf', workdir], check=True)
    os.makedirs(workdir)
    command = spec.command(workdir)
    start = time.perf_counter()
    try:
      proc = subprocess.run(command, cwd=ROOT, env=run_environment(root),
                            capture_output=True, text=True, timeout=timeout_s)
      returncode, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
      returncode = f'timeout after {timeout_s:.0f} s'
      output = ''.join(x.decode(errors='replace') if isinstance(x, bytes)
                       else (x or '') for x in (e.stdout, e.stderr))
    wall_s = time.perf_counter() - start
    with open(os.path.join(workdir, 'output.log'), 'w') as f:
      f.write(' '.join(command) + '\n' + output)
    base = {'variant': spec.variant, 'seed': spec.seed,
            'command': ' '.join(command[1:]), 'wall_s': wall_s}
    if returncode != 0:
      summary = dict(base, failed=(returncode if isinstance(returncode, str)
                                   else f'exit {returncode}'),
                     output_tail=output[-2000:])
      print(f'[{i + 1}/{len(specs)}] {spec.name}: FAILED ({returncode}),'
            f' see {workdir}/output.log', flush=True)
    else:
      summary = dict(base, **summarize_run(workdir, batch_size))
      print(f'[{i + 1}/{len(specs)}] {spec.name}: {wall_s:.0f} s, final'
            f' accuracy {summary["final_accuracy"]:.3f}', flush=True)
      with open(summary_path, 'w') as f:
        json.dump(summary, f, indent=1)
    summaries.append(summary)
    if on_run is not None:
      on_run(list(summaries))
  return summaries


def summarize_run(workdir: str, batch_size: int) -> dict[str, Any]:
  """What the reports need from one finished run's `metrics.jsonl`.

  Times are seconds since the training program started logging, so they
  include start-up, the first evaluation and value pretraining: the wall-clock
  a user waits.
  """
  records = metrics_log.read_jsonl(os.path.join(workdir, 'metrics.jsonl'),
                                   dedupe=True)
  evals = [(int(r['step']), float(r['time']), float(r['eval/accuracy']),
            float(r.get('eval/accuracy_se') or 0.0))
           for r in records if finite_number(r.get('eval/accuracy'))]
  rewards = [(int(r['step']), float(r['time']), float(r['train/reward']))
             for r in records if finite_number(r.get('train/reward'))]
  if not evals or not rewards:
    raise ValueError(f'{workdir}: the log holds no evaluation or no reward')
  reward_values = np.array([v for _, _, v in rewards])
  logged = {key: [float(r[key]) for r in records if finite_number(r.get(key))]
            for key in STABILITY_KEYS + FINAL_KEYS}
  stability = {key: float(np.mean(logged[key])) for key in STABILITY_KEYS
               if logged[key]}
  final = {key: logged[key][-1] for key in FINAL_KEYS if logged[key]}
  collapse = collapse_step([s for s, _, _ in rewards], reward_values)
  train_rows = [r for r in records if finite_number(r.get('time/step_seconds'))]
  step_seconds = sum(r['time/step_seconds'] for r in train_rows)
  wait_seconds = sum(r.get('time/wait_seconds') or 0.0 for r in train_rows)
  first = train_rows[0] if train_rows else None
  loop_seconds = (rewards[-1][1] - (first['time'] - first['time/step_seconds'])
                  if first else None)
  generator_idle = [r['rollout/client/generator_idle_fraction']
                    for r in records
                    if finite_number(r.get('rollout/client/generator_idle_fraction'))]
  return {
      'batch_size': batch_size,
      'steps': rewards[-1][0],
      'trajectories': rewards[-1][0] * batch_size,
      'seconds': rewards[-1][1],
      'initial_accuracy': evals[0][2],
      'final_accuracy': evals[-1][2],
      'final_accuracy_se': evals[-1][3],
      'eval_curve': [dict(step=s, trajectories=s * batch_size, seconds=t,
                          accuracy=a, se=se) for s, t, a, se in evals],
      'reward_curve': [dict(step=s, seconds=t, reward=v)
                       for s, t, v in rewards],
      'final_reward': float(np.mean(reward_values[-COLLAPSE_WINDOW:])),
      'collapsed': collapse is not None,
      'collapse_step': collapse,
      'stability': stability,
      'final': final,
      # The training loop only (first step's start to last step's end):
      'loop_seconds': loop_seconds,
      'trajectories_per_second': (rewards[-1][0] * batch_size / loop_seconds
                                  if loop_seconds else None),
      'learner_idle_fraction': (wait_seconds / step_seconds if step_seconds
                                else None),
      # Cumulative since the rollout client opened, at the last step.
      'generator_idle_fraction': (generator_idle[-1] if generator_idle
                                  else None),
  }


def finite_number(value) -> bool:
  """A logged number that is neither null, a bool, NaN nor inf."""
  return isinstance(value, (int, float)) and not isinstance(
      value, bool) and math.isfinite(value)


def collapse_step(steps: Sequence[int], rewards: Sequence[float],
                  drop: float = COLLAPSE_DROP,
                  window: int = COLLAPSE_WINDOW) -> int | None:
  """The step at which a run collapsed, or None.

  The reward's trailing `window`-step mean must fall more than `drop` below
  its best value so far and stay more than `drop / 2` below that best through
  the end of the run (a dip it recovers from is noise, not a collapse). The
  step reported is the first one of that final fall.
  """
  smooth = plots.moving_average(rewards, window)
  best = np.maximum.accumulate(smooth)
  if not smooth.size or smooth[-1] >= best[-1] - drop / 2:
    return None
  fallen = smooth < best - drop
  if not fallen.any():
    return None
  # The last stretch the run spent near its best; the collapse follows it.
  near_best = np.flatnonzero(smooth >= best - drop / 2)
  after = np.flatnonzero(fallen & (np.arange(smooth.size) > near_best[-1]))
  return int(steps[after[0]]) if after.size else None


def collapse_below_half_peak(steps: Sequence[int], rewards: Sequence[float],
                             patience: int = 5, smooth: int = 3,
                             min_peak: float = 0.2) -> int | None:
  """The step a run collapsed at by issue 16's rule, or None.

  Collapse: the training reward stays below half its peak so far for
  `patience` consecutive steps. The peak is that of the `smooth`-step
  trailing mean (one lucky batch is not a peak); a run whose peak never
  reaches `min_peak` never learned, which is not a collapse. The step
  reported is the first of the `patience` steps.
  """
  rewards = np.asarray(rewards, float)
  peak = np.maximum.accumulate(plots.moving_average(rewards, smooth))
  below = (rewards < peak / 2) & (peak >= min_peak)
  run = 0
  for i, is_below in enumerate(below):
    run = run + 1 if is_below else 0
    if run == patience:
      return int(steps[i - patience + 1])
  return None


def first_time_at(curve: Sequence[Mapping[str, float]], target: float,
                  key: str = 'seconds') -> float | None:
  """`curve[key]` of the first eval point whose accuracy reaches `target`."""
  for point in curve:
    if point['accuracy'] >= target:
      return float(point[key])
  return None


def area_under_accuracy(curve: Sequence[Mapping[str, float]]) -> float:
  """Mean held-out accuracy over a run's evaluations after step 0.

  The area under the accuracy curve divided by its length (evaluations are
  evenly spaced): one number that rewards learning sooner, not only ending
  higher.
  """
  values = [p['accuracy'] for p in curve if p['step'] > 0]
  return float(np.mean(values)) if values else math.nan


def mean_se(values: Sequence[float]) -> tuple[float, float]:
  """Mean and its standard error (0 for a single value)."""
  values = [float(v) for v in values]
  if not values:
    return math.nan, math.nan
  se = (statistics.stdev(values) / math.sqrt(len(values))
        if len(values) > 1 else 0.0)
  return float(np.mean(values)), se


def welch(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
  """Welch's two-sample t-test of mean(a) - mean(b) (unequal variances).

  `p` is two-sided; NaN when either side has fewer than two values or both
  have no spread.
  """
  from scipy import stats  # pylint: disable=g-import-not-at-top
  a, b = [float(x) for x in a], [float(x) for x in b]
  diff = (float(np.mean(a)) - float(np.mean(b))) if a and b else math.nan
  if len(a) < 2 or len(b) < 2 or (np.std(a) == 0 and np.std(b) == 0):
    return {'difference': diff, 't': math.nan, 'p': math.nan}
  t, p = stats.ttest_ind(a, b, equal_var=False)
  return {'difference': diff, 't': float(t), 'p': float(p)}


def paired(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
  """Paired t-test of a - b (runs paired by seed): the mean difference, its
  standard error and the two-sided p."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  d = np.asarray(a, float) - np.asarray(b, float)
  mean, se = mean_se(d)
  if d.size < 2 or np.std(d) == 0:
    return {'difference': mean, 'se': se, 'p': math.nan}
  return {'difference': mean, 'se': se,
          'p': float(stats.ttest_rel(a, b).pvalue)}


def p_text(p: float) -> str:
  """A test's p for a table: two significant digits; '-' when there was no
  test (NaN: too few runs or no spread)."""
  return '-' if math.isnan(p) else f'{p:.2g}'


def chosen_variants(parser, text: str, known) -> list[str]:
  """The comma-separated variant names of a `--variants` flag; an unknown
  one is a usage error (`parser.error`) that names the known ones."""
  names = text.split(',')
  unknown = sorted(set(names) - set(known))
  if unknown:
    parser.error(f'unknown variants {unknown}; known: {list(known)}')
  return names


def ok_runs(summaries: Sequence[Mapping[str, Any]],
            variant: str) -> list[Mapping[str, Any]]:
  """The finished (not failed) runs of `variant`."""
  return [s for s in summaries
          if s['variant'] == variant and 'failed' not in s]


def reward_rows(runs: Sequence[Mapping[str, Any]]
                ) -> tuple[list[int], np.ndarray]:
  """`(steps, reward_RxS)`: each run's training reward per step, cut to the
  shortest run, for curves averaged over seeds."""
  length = min(len(r['reward_curve']) for r in runs)
  reward_RxS = np.array([[p['reward'] for p in r['reward_curve'][:length]]
                         for r in runs])
  return [p['step'] for p in runs[0]['reward_curve'][:length]], reward_RxS


def aggregate(summaries: Sequence[Mapping[str, Any]],
              variants: Sequence[str]) -> dict[str, dict[str, Any]]:
  """Per variant, in `variants` order: seeds put together."""
  out = {}
  for variant in variants:
    runs = [s for s in summaries if s['variant'] == variant]
    ok = ok_runs(runs, variant)
    final, final_se = mean_se([s['final_accuracy'] for s in ok])
    initial, initial_se = mean_se([s['initial_accuracy'] for s in ok])
    reward, reward_se = mean_se([s['final_reward'] for s in ok])
    seconds, seconds_se = mean_se([s['seconds'] for s in ok])
    area, area_se = mean_se([area_under_accuracy(s['eval_curve'])
                             for s in ok])
    stability = {}
    for key in STABILITY_KEYS:
      values = [s['stability'][key] for s in ok if key in s['stability']]
      if values:
        stability[key] = mean_se(values)[0]
    out[variant] = {
        'runs': len(runs), 'failed': len(runs) - len(ok),
        'seeds': [s['seed'] for s in ok],
        'initial_accuracy': initial, 'initial_accuracy_se': initial_se,
        'final_accuracy': final, 'final_accuracy_se': final_se,
        'final_reward': reward, 'final_reward_se': reward_se,
        'area_under_accuracy': area, 'area_under_accuracy_se': area_se,
        'seconds': seconds, 'seconds_se': seconds_se,
        'collapsed': sum(s['collapsed'] for s in ok),
        'collapse_steps': [s['collapse_step'] for s in ok if s['collapsed']],
        'stability': stability,
    }
  return out


def time_to_target(summaries: Sequence[Mapping[str, Any]],
                   variants: Sequence[str], target: float
                   ) -> dict[str, dict[str, Any]]:
  """Per variant: trajectories and seconds until held-out accuracy first
  reaches `target` (runs that never do are counted, not averaged in)."""
  out = {}
  for variant in variants:
    runs = ok_runs(summaries, variant)
    trajectories = [first_time_at(r['eval_curve'], target, 'trajectories')
                    for r in runs]
    seconds = [first_time_at(r['eval_curve'], target, 'seconds')
               for r in runs]
    reached_t = [t for t in trajectories if t is not None]
    reached_s = [t for t in seconds if t is not None]
    out[variant] = {
        'runs': len(runs), 'reached': len(reached_t),
        'trajectories': trajectories, 'seconds': seconds,
        'median_trajectories': (float(np.median(reached_t)) if reached_t
                                else None),
        'median_seconds': float(np.median(reached_s)) if reached_s else None,
    }
  return out


def target_table(to_target: Mapping[str, Mapping[str, Any]],
                 target: float) -> str:
  """The markdown table of `time_to_target`."""
  rows = [f'| variant | reached {target} | median trajectories to {target} |'
          f' median seconds to {target} |', '|---|---|---|---|']
  for variant, t in to_target.items():
    traj, sec = t['median_trajectories'], t['median_seconds']
    rows.append(f'| {variant} | {t["reached"]}/{t["runs"]} |'
                f' {"-" if traj is None else f"{traj:.0f}"} |'
                f' {"-" if sec is None else f"{sec:.0f}"} |')
  return '\n'.join(rows)


def mean_curve(runs: Sequence[Mapping[str, Any]], x: str
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Mean eval accuracy (and SE) across seeds at each eval step.

  Runs of one variant evaluate at the same steps; `x` ('step',
  'trajectories' or 'seconds') is averaged across seeds too.
  """
  by_step: dict[int, list[Mapping[str, float]]] = {}
  for run in runs:
    for point in run['eval_curve']:
      by_step.setdefault(point['step'], []).append(point)
  steps = sorted(by_step)
  xs = np.array([np.mean([p[x] for p in by_step[s]]) for s in steps])
  stats = [mean_se([p['accuracy'] for p in by_step[s]]) for s in steps]
  return xs, np.array([m for m, _ in stats]), np.array([e for _, e in stats])


def new_figure(width: float, height: float = 4) -> mpl_figure.Figure:
  """A figure drawn off-screen (no pyplot state, no display)."""
  fig = mpl_figure.Figure(figsize=(width, height), dpi=100)
  backend_agg.FigureCanvasAgg(fig)
  return fig


def save_figure(fig: mpl_figure.Figure, title: str, path: str) -> str:
  """Titles, lays out and writes `fig` to `path` (its folder made)."""
  fig.suptitle(title)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path)
  return path


def plot_accuracy(summaries: Sequence[Mapping[str, Any]],
                  variants: Sequence[str], path: str, title: str,
                  axes: Sequence[str] = ('trajectories', 'seconds')) -> str:
  """Held-out accuracy (mean over seeds, SE band) per variant, one panel
  per x axis; plus the smoothed training reward against steps."""
  fig = new_figure(5 * (len(axes) + 1))
  panels = fig.subplots(1, len(axes) + 1)
  for variant in variants:
    runs = ok_runs(summaries, variant)
    if not runs:
      continue
    for ax, x in zip(panels, axes):
      xs, mean, se = mean_curve(runs, x)
      line, = ax.plot(xs, mean, marker='o', markersize=3,
                      label=f'{variant} (n={len(runs)})')
      ax.fill_between(xs, mean - se, mean + se, alpha=0.2,
                      color=line.get_color())
    steps, reward_RxS = reward_rows(runs)
    panels[-1].plot(steps, plots.moving_average(reward_RxS.mean(0), 3),
                    label=variant)
  for ax, x in zip(panels, axes):
    ax.set_xlabel({'seconds': 'wall-clock seconds',
                   'trajectories': 'trajectories consumed'}.get(x, x))
    ax.set_ylabel('held-out accuracy')
    ax.grid(alpha=0.3)
  panels[0].legend(fontsize=8)
  panels[-1].set_xlabel('policy step')
  panels[-1].set_ylabel('training reward (mean over seeds, 3-step avg)')
  panels[-1].grid(alpha=0.3)
  return save_figure(fig, title, path)


def markdown_table(aggregated: Mapping[str, Mapping[str, Any]],
                   extra: Sequence[tuple[str, str]] = ()) -> str:
  """A BENCHMARKS.md table: one row per variant.

  `extra`: (column title, stability key) pairs appended as columns.
  """
  head = ('| variant | runs | held-out before | held-out after |'
          ' mean held-out (area) | final reward | seconds | collapsed |'
          + ''.join(f' {t} |' for t, _ in extra))
  rule = '|' + '---|' * (8 + len(extra))
  rows = [head, rule]
  for variant, a in aggregated.items():
    collapsed = str(a['collapsed'])
    if a['collapse_steps']:
      collapsed += ' (steps ' + ', '.join(map(str, a['collapse_steps'])) + ')'
    row = (f'| {variant} | {a["runs"] - a["failed"]}/{a["runs"]} |'
           f' {a["initial_accuracy"]:.3f} ± {a["initial_accuracy_se"]:.3f} |'
           f' {a["final_accuracy"]:.3f} ± {a["final_accuracy_se"]:.3f} |'
           f' {a["area_under_accuracy"]:.3f} ±'
           f' {a["area_under_accuracy_se"]:.3f} |'
           f' {a["final_reward"]:.3f} ± {a["final_reward_se"]:.3f} |'
           f' {a["seconds"]:.0f} | {collapsed} |')
    for _, key in extra:
      value = a['stability'].get(key)
      row += f' {value:.3g} |' if value is not None else ' - |'
    rows.append(row)
  return '\n'.join(rows)


def machine() -> dict[str, Any]:
  """Where the numbers were measured."""
  return {'platform': platform.platform(), 'python': platform.python_version(),
          'cpus': os.cpu_count(), 'processor': platform.processor()}


def write_result(path: str, payload: Mapping[str, Any]) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, 'w') as f:
    json.dump(payload, f, indent=1)
