"""Adding an advantage estimator: one registered function and one preset.

The estimator, its algorithm and its preset are defined here, registered for
the duration of a test (monkeypatch restores the registries), and run through
the unchanged learner.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax import config_lib
from sao_jax import recipe_checks
from sao_jax.rl import advantages
from sao_jax.rl import algorithms
import test_learner as helpers  # tests/test_learner.py: tiny learner, batches


def batch_mean_advantages(config, batch, values_BxT, state, mesh):
  """A toy estimator: each reward minus the batch's mean reward, A_t on every
  action token of its trajectory."""
  del config, values_BxT, mesh
  reward_N = batch.reward_N
  adv_N = reward_N - jnp.mean(reward_N)
  return advantages.broadcast_to_actions(adv_N, batch.action_mask_BxT,
                                         batch.segment_ids_BxT), state


def batch_mean_preset(config):
  """The toy algorithm's preset: SAO's settings with the toy estimator."""
  config.algorithm = 'batch_mean'
  config.advantage.estimator = 'batch_mean'
  return config


@pytest.fixture
def batch_mean(monkeypatch):
  monkeypatch.setitem(algorithms.ESTIMATORS, 'batch_mean',
                      algorithms.Estimator(batch_mean_advantages))
  monkeypatch.setitem(algorithms.ALGORITHMS, 'batch_mean',
                      algorithms.Spec(estimator='batch_mean', loss='dis'))


def test_unregistered_estimator_is_a_config_error():
  config = batch_mean_preset(helpers.make_config())
  with pytest.raises(config_lib.ConfigError,
                     match=r"config.advantage.estimator='batch_mean' is not"):
    recipe_checks.validate(config, num_devices=1)


def test_registered_estimator_trains_through_the_learner(batch_mean):
  config = batch_mean_preset(helpers.make_config(**{'mesh.data': 1}))
  recipe_checks.validate(config, num_devices=1)
  learner = helpers.make_learner(config, jax.devices()[:1])
  assert not learner.uses_critic and learner.state.critic is None

  (metrics,) = helpers.run(learner, [0])

  batch = helpers.fake_batch(0)
  reward_B = batch.reward_N  # one trajectory per row
  mask_BxT = batch.action_mask_BxT.astype(bool)
  adv_BxT = np.where(mask_BxT, (reward_B - reward_B.mean())[:, None], 0.0)
  count = mask_BxT.sum()
  assert np.abs(adv_BxT).sum() > 0  # the batch's rewards differ
  np.testing.assert_allclose(metrics['advantage/mean'],
                             adv_BxT.sum() / count, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(metrics['advantage/abs_mean'],
                             np.abs(adv_BxT).sum() / count, rtol=1e-5)
  assert np.isfinite(metrics['policy/loss'])
  assert 'critic/loss' not in metrics
  assert int(learner.state.step) == 1
