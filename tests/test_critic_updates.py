"""The critic's updates: mini-batches as verl's critic takes them, its
metrics from the values before the updates, and schedules counted in batches.

References are independent of the learner's update loop: separate one-batch
critic steps on hand-assembled mini-batches, and numpy formulas for returns
and explained variance.
"""

import chex
import jax
import numpy as np
import pytest

from sao_jax.learner import learner as learner_lib
from sao_jax.rl import algorithms
from sao_jax.rollout import batching

import test_learner as helpers


def test_critic_minibatches_are_separate_steps_on_their_rows():
  # K = 1 pass in M_c = 2 mini-batches, Monte-Carlo returns (no value clip):
  # the same as two one-update critic steps on batches of exactly those
  # rows, in that order.
  changes = {'mesh.data': 1, 'critic.steps_per_policy_step': 1,
             'critic.minibatches': 2}
  config = helpers.make_config(lr=1e-2, **changes)
  trajectories = helpers.fake_trajectories(0)
  in_step = helpers.make_learner(config, jax.devices()[:1])
  in_step.state, metrics = in_step.train_step(
      in_step.state, in_step.device_batch(helpers.fake_batch(0)))
  assert metrics['critic/optimizer_steps'] == 2
  perm = np.asarray(learner_lib.minibatch_permutation(
      config.seed, 0, 0, len(trajectories), stream=1))
  stepwise = helpers.make_learner(config, jax.devices()[:1])
  for m in range(2):
    rows = perm.reshape(-1, 2)[:, m]
    part = batching.assemble_batch([trajectories[i] for i in rows], 32, 0)
    stepwise.state, _ = stepwise.critic_step(stepwise.state,
                                             stepwise.device_batch(part))
  chex.assert_trees_all_close(helpers.flat(in_step.state.critic),
                              helpers.flat(stepwise.state.critic),
                              rtol=1e-5, atol=1e-6)
  # The actor's shuffle is another one (stream 0).
  assert not np.array_equal(perm, learner_lib.minibatch_permutation(
      config.seed, 0, 0, len(trajectories)))


@pytest.mark.parametrize('algorithm', ['ppo', 'vapo'])
def test_ppo_family_critics_take_the_actors_optimizer_steps(algorithm):
  config = helpers.make_config(algorithm, **{'mesh.data': 1})
  assert config.critic.value_clip == 0.5 and config.advantage.normalize
  learner = helpers.make_learner(config, jax.devices()[:1])
  (metrics,) = helpers.run(learner, [0])
  assert metrics['policy/optimizer_steps'] == 4  # verl's M = 4
  assert metrics['critic/optimizer_steps'] == metrics['policy/optimizer_steps']
  assert int(learner.state.critic_step) == 4
  # Whitened advantages: mean 0 over the batch's action tokens.
  np.testing.assert_allclose(metrics['advantage/mean'], 0.0, atol=1e-6)


def test_sao_keeps_k_full_batch_critic_steps():
  config = helpers.make_config(**{'mesh.data': 1})
  assert (config.critic.steps_per_policy_step, config.critic.minibatches,
          config.critic.value_clip, config.advantage.normalize) == (
              2, 1, 0.0, False)
  (metrics,) = helpers.run(helpers.make_learner(config, jax.devices()[:1]),
                           [0])
  assert metrics['critic/optimizer_steps'] == 2


def test_critic_metrics_are_of_the_values_before_the_updates():
  config = helpers.make_config(lr=1e-2, **{'mesh.data': 1})
  learner = helpers.make_learner(config, jax.devices()[:1])
  batch = helpers.fake_batch(0)
  values = np.asarray(algorithms.critic_values(
      learner.critic_model(learner.state), batch), np.float64)
  learner.state, metrics = learner.train_step(learner.state,
                                              learner.device_batch(batch))
  # Monte-Carlo returns (gamma = lambda = 1): suffix sums of each row's
  # rewards; explained variance 1 - Var(R - V) / Var(R) on action tokens.
  rewards = batch.rewards_BxT.astype(np.float64)
  returns = np.cumsum(rewards[:, ::-1], axis=1)[:, ::-1]
  mask = batch.action_mask_BxT.astype(bool)
  r, v = returns[mask], values[mask]
  want_ev = 1 - np.var(r - v) / np.var(r)
  want_loss = np.mean(0.5 * (v - r) ** 2)
  np.testing.assert_allclose(metrics['critic/explained_variance'], want_ev,
                             rtol=1e-4)
  np.testing.assert_allclose(metrics['critic/loss'], want_loss, rtol=1e-5)
  # The last of the K = 2 updates started from a critic one update closer.
  assert metrics['critic/last_update/loss'] < metrics['critic/loss']


def test_schedules_count_batches_and_start_above_zero():
  lr = 1e-3
  config = helpers.make_config('ppo', lr=lr, **{'mesh.data': 1})
  for role in ('actor', 'critic'):
    config.optim[role].warmup_steps = 3
  learner = helpers.make_learner(config, jax.devices()[:1])
  metrics = helpers.run(learner, [0, 1])
  # Batches 0 and 1 of a 3-batch warm-up: 1/4 and 2/4 of the rate, for all
  # four optimizer steps of each (M = 4 does not warm up 4x sooner).
  for b, m in enumerate(metrics):
    np.testing.assert_allclose(m['policy/learning_rate'], lr * (b + 1) / 4,
                               rtol=1e-6)
    np.testing.assert_allclose(m['critic/learning_rate'], lr * (b + 1) / 4,
                               rtol=1e-6)
