"""Log-prob parity metrics against numpy, and in the learner's step."""

import jax
import numpy as np

from sao_jax.rl import logprob_parity

import test_learner as helpers


def _numpy_parity(old, mu, mask, staleness, s):
  on = mask & np.isfinite(old) & (staleness == s)
  d = np.abs(old[on] - mu[on])
  out = {f'frac_gt_{e:g}': float(np.mean(d > e)) for e in (0.01, 0.1, 1.0)}
  out['mean_abs_diff'] = float(d.mean())
  out['pearson'] = float(np.corrcoef(old[on], mu[on])[0, 1])
  out['tokens'] = float(on.sum())
  return out


def test_parity_metrics_match_numpy_by_staleness():
  rng = np.random.default_rng(0)
  shape = (6, 40)
  mu = -rng.uniform(0.1, 6.0, shape)
  # Differences spread over the thresholds, a few outside the support.
  old = mu + rng.choice([0.0, 0.005, 0.05, 0.5, 3.0], shape) * rng.choice(
      [-1, 1], shape)
  old[0, 3] = -np.inf
  mask = rng.random(shape) < 0.7
  mask[0, 3] = True
  staleness = rng.integers(0, 3, shape)
  got = jax.tree.map(float, logprob_parity.parity_metrics(
      old.astype(np.float32), mu.astype(np.float32), mask, staleness, 2))
  for s in range(3):
    prefix = '' if s == 0 else f'staleness_{s}/'
    want = _numpy_parity(old, mu, mask, staleness, s)
    for name, value in want.items():
      np.testing.assert_allclose(got[prefix + name], value, rtol=2e-5,
                                 atol=2e-6, err_msg=prefix + name)
  assert 0 < got['frac_gt_1'] < got['frac_gt_0.1'] < got['frac_gt_0.01'] < 1


def test_no_token_of_a_staleness_gives_zero_fractions_and_nan_correlation():
  old = np.zeros((1, 4), np.float32)
  got = logprob_parity.parity_metrics(old, old, np.ones((1, 4), bool),
                                      np.zeros((1, 4), int), 1)
  assert float(got['staleness_1/tokens']) == 0
  assert float(got['staleness_1/frac_gt_0.1']) == 0
  assert np.isnan(float(got['staleness_1/pearson']))
  # Equal log-probs without spread: no correlation to speak of either.
  assert np.isnan(float(got['pearson']))


def test_learner_reports_parity_of_pi_old_against_mu():
  # The fake batch's mu are random, not the tiny model's: the learner's
  # log-probs at version 0 differ from them on nearly every token, and
  # (one step per batch: SAO) the first step's own forward pass is pi_old.
  for algorithm in ('sao', 'ppo'):
    config = helpers.make_config(algorithm, **{'mesh.data': 1})
    learner = helpers.make_learner(config, jax.devices()[:1])
    batch = helpers.fake_batch(0)
    (metrics,) = helpers.run(learner, [0])
    assert metrics['parity/tokens'] == batch.action_mask_BxT.sum()
    assert metrics['parity/frac_gt_0.01'] > 0.9
    assert metrics['parity/staleness_1/tokens'] == 0
    assert -1 <= metrics['parity/pearson'] <= 1
