"""Learning-curve PNGs from full, partial, resumed and empty logs."""

import struct

import numpy as np
import pytest

from sao_jax.logs import metrics_log
from sao_jax.logs import plots

_PNG_SIGNATURE = b'\x89PNG\r\n\x1a\n'


def png_size(path):
  """(width, height) from the IHDR chunk, after checking the signature."""
  with open(path, 'rb') as f:
    header = f.read(24)
  assert header[:8] == _PNG_SIGNATURE
  assert header[12:16] == b'IHDR'
  return struct.unpack('>II', header[16:24])


def write_log(workdir, steps, keys):
  rng = np.random.default_rng(0)
  with metrics_log.MetricsLogger(workdir, tensorboard=False) as logger:
    for step in range(steps):
      logger.write(step, {k: rng.uniform(0.1, 1.0) for k in keys})
      if 'eval/accuracy' in keys and step % 10 == 0:
        logger.write(step, {'accuracy_se': 0.05}, prefix='eval')
  return workdir / metrics_log.JSONL_NAME


ALL_KEYS = ('train/reward', 'eval/accuracy', 'policy/frac_below',
            'policy/frac_above', 'critic/explained_variance', 'policy/kl_k3',
            'policy/grad_norm', 'critic/grad_norm', 'rollout/staleness_mean',
            'time/learner_idle_fraction', 'parity/frac_gt_0.1')


def test_full_log_gives_a_grid_png(tmp_path):
  jsonl = write_log(tmp_path / 'run', 50, ALL_KEYS)
  png = plots.plot_learning_curves(jsonl, tmp_path / 'out' / 'curves.png')
  assert png == str(tmp_path / 'out' / 'curves.png')
  width, height = png_size(png)
  # 9 panels in 3 columns x 3 rows of 5 x 3.4 inches (+ title) at 100 dpi.
  assert (width, height) == (1500, 1080)


def test_partial_log_draws_only_its_panels(tmp_path):
  jsonl = write_log(tmp_path / 'run', 5, ('train/reward', 'policy/kl_k3',
                                          'unknown/metric'))
  png = plots.plot_learning_curves(jsonl, tmp_path / 'partial.png',
                                   title='partial')
  # Two panels side by side.
  assert png_size(png) == (1000, 400)


def test_nonfinite_and_resumed_logs_plot(tmp_path):
  run = tmp_path / 'run'
  with metrics_log.MetricsLogger(run, tensorboard=False) as logger:
    for step in range(5):
      logger.write(step, {'train/reward': float(step),
                          'policy/grad_norm': np.inf if step == 3 else 1.0})
  with metrics_log.MetricsLogger(run, tensorboard=False) as logger:
    logger.write(2, {'train/reward': np.nan})
  png = plots.plot_learning_curves(run / 'metrics.jsonl', tmp_path / 'r.png')
  assert png_size(png) == (1000, 400)


@pytest.mark.parametrize('content', ['', '{"step": 1, "other/metric": 2.0}\n'])
def test_log_without_known_series_says_no_data(tmp_path, content):
  jsonl = tmp_path / 'metrics.jsonl'
  jsonl.write_text(content)
  png = plots.plot_learning_curves(jsonl, tmp_path / 'empty.png')
  assert png_size(png) == (500, 340)


def test_missing_log_is_an_error(tmp_path):
  with pytest.raises(FileNotFoundError):
    plots.plot_learning_curves(tmp_path / 'nope.jsonl', tmp_path / 'x.png')


def test_moving_average_is_trailing():
  np.testing.assert_allclose(plots.moving_average([2, 4, 6, 8, 10], 3),
                             [2, 3, 4, 6, 8])
  np.testing.assert_allclose(plots.moving_average([1, 3], 1), [1, 3])


def test_skipped_updates_are_marked(tmp_path):
  """Per-step skip counts (with the running total beside them) mark their
  steps; a log from before the split, whose `nonfinite_skips` was the
  running total, marks the steps where it rose."""
  run = tmp_path / 'run'
  with metrics_log.MetricsLogger(run, tensorboard=False) as logger:
    for step, (policy, critic) in enumerate([(0, 0), (1, 2), (0, 0), (0, 1)]):
      logger.write(step, {'train/reward': 0.5, 'policy/nonfinite_skips': policy,
                          'critic/nonfinite_skips': critic,
                          'policy/nonfinite_skips_total': 1 if step else 0})
  records = metrics_log.read_jsonl(run / 'metrics.jsonl')
  assert plots.skipped_steps(records) == [1, 3]
  png = plots.plot_learning_curves(run / 'metrics.jsonl', tmp_path / 's.png')
  assert png_size(png)[0] > 0
  old = [{'step': s, 'policy/nonfinite_skips': v}
         for s, v in enumerate([0, 0, 1, 1, 3])]
  assert plots.skipped_steps(old) == [2, 4]
