"""Several policy updates per batch, checked against an independent reference.

The reference re-does one batch of E = 2 passes x M = 2 mini-batches by hand:
GRPO advantages, the old policy of each mode, the clip / DIS masks, the token
mean, the loss gradient with respect to each log-prob, global-norm clipping and
AdamW, all in numpy. Only the network is shared: its log-probs and their
vector-Jacobian product come from the tiny model itself.
"""

import chex
import jax
import numpy as np
import pytest

from sao_jax.learner import learner as learner_lib
from sao_jax.models import sampling
from sao_jax.rl import algorithms

import test_learner as helpers

EPOCHS, MINIBATCHES, LR, CLIP = 2, 2, 1e-3, 1.0


def schedule_config(algorithm, old_logprobs='recompute'):
  config = helpers.make_config(algorithm, lr=LR, **{
      'mesh.data': 1, 'optim.policy_epochs': EPOCHS,
      'optim.policy_minibatches': MINIBATCHES})
  config.policy_loss.old_logprobs = old_logprobs
  config.optim.actor.grad_clip_norm = CLIP
  return config


def grpo_advantages(batch, group):
  rewards = batch.reward_N.astype(np.float64).reshape(-1, group)
  adv = (rewards - rewards.mean(1, keepdims=True)) / (
      rewards.std(1, ddof=1, keepdims=True) + 1e-6)  # verl's torch.std
  return np.where(batch.action_mask_BxT, adv.reshape(-1)[:, None], 0.0)


def token_grads(mode, logp, old, mu, adv, mask, eps_low, eps_high, cap):
  """Numpy loss and dL/dlogp of one mini-batch (token mean)."""
  n = max(mask.sum(), 1)
  if mode == 'dis':
    ratio = np.exp(logp - mu)
    keep = mask & (ratio > 1 - eps_low) & (ratio < 1 + eps_high)
    loss = np.sum(np.where(keep, -ratio * adv * logp, 0.0)) / n
    return loss, np.where(keep, -ratio * adv, 0.0) / n
  weight = np.ones_like(logp)
  if mode == 'decoupled':
    weight = np.minimum(np.exp(old - mu), cap)
  ratio = np.exp(logp - old)
  unclipped = -adv * ratio
  clipped = -adv * np.clip(ratio, 1 - eps_low, 1 + eps_high)
  loss_t = weight * np.maximum(unclipped, clipped)
  # The gradient flows through the unclipped term only where it is the max
  # (inside the band both terms are the same function of logp).
  grad_t = np.where(unclipped >= clipped, weight * unclipped, 0.0)
  return (np.sum(np.where(mask, loss_t, 0.0)) / n,
          np.where(mask, grad_t, 0.0) / n)


def reference_update(learner, batch, mode):
  """Parameters and per-step losses after one batch, by hand."""
  config = learner.config
  leaves, treedef = jax.tree.flatten(learner.state.policy)
  params = [np.asarray(x, np.float64) for x in leaves]
  params_sampling = sampling.SamplingParams(config.rollout.temperature,
                                            config.rollout.top_k,
                                            config.rollout.top_p)
  def logp_fn(flat_params, rows):
    policy = jax.tree.unflatten(treedef, flat_params)
    model = learner.policy_model(learner.state._replace(policy=policy))
    micro = jax.tree.map(lambda x: x[rows], batch)
    return algorithms.policy_logprobs(model, micro, params_sampling)[0]

  def as_tree(flat):
    return [np.asarray(p, np.float32) for p in flat]

  all_rows = np.arange(len(batch.reward_N))
  old_all = np.asarray(logp_fn(as_tree(params), all_rows), np.float64)
  adv_all = grpo_advantages(batch, config.group_size)
  m = [np.zeros_like(p) for p in params]
  v = [np.zeros_like(p) for p in params]
  pl = config.policy_loss
  losses, tokens = [], []
  for update in range(EPOCHS * MINIBATCHES):
    perm = np.asarray(learner_lib.minibatch_permutation(
        config.seed, 0, update // MINIBATCHES, len(all_rows)))
    rows = perm.reshape(-1, MINIBATCHES)[:, update % MINIBATCHES]
    logp, vjp = jax.vjp(lambda p: logp_fn(p, rows), as_tree(params))
    mask = batch.action_mask_BxT[rows]
    mu = batch.behavior_logprobs_BxT[rows].astype(np.float64)
    old = mu if mode == 'behavior' else old_all[rows]
    loss, dlogp = token_grads(mode, np.asarray(logp, np.float64), old, mu,
                              adv_all[rows], mask, pl.eps_low, pl.eps_high,
                              pl.behavior_weight_cap)
    losses.append(loss)
    tokens.append(mask.sum())
    (grads,) = vjp(np.asarray(dlogp, np.float32))
    grads = [np.asarray(g, np.float64) for g in grads]
    norm = np.sqrt(sum(np.sum(g ** 2) for g in grads))
    if norm >= CLIP:
      grads = [g * CLIP / norm for g in grads]
    t = update + 1
    o = config.optim.actor
    for i, g in enumerate(grads):
      m[i] = o.b1 * m[i] + (1 - o.b1) * g
      v[i] = o.b2 * v[i] + (1 - o.b2) * g ** 2
      step = (m[i] / (1 - o.b1 ** t)) / (np.sqrt(v[i] / (1 - o.b2 ** t))
                                         + 1e-8)
      params[i] = params[i] - LR * step
  return params, losses, tokens


@pytest.mark.parametrize('algorithm,mode', [
    ('grpo', 'recompute'), ('grpo', 'behavior'), ('grpo', 'decoupled'),
    ('grpo_dis', 'dis')])
def test_two_epochs_of_two_minibatches_match_numpy(algorithm, mode):
  config = schedule_config(algorithm,
                           'recompute' if mode == 'dis' else mode)
  learner = helpers.make_learner(config, jax.devices()[:1])
  batch = helpers.fake_batch(0)
  want_params, want_losses, tokens = reference_update(learner, batch, mode)
  learner.state, metrics = learner.train_step(learner.state,
                                              learner.device_batch(batch))
  metrics = jax.tree.map(np.asarray, metrics)
  assert metrics['policy/optimizer_steps'] == EPOCHS * MINIBATCHES
  np.testing.assert_allclose(metrics['policy/loss_first'], want_losses[0],
                             rtol=1e-5, atol=1e-7)
  # Step metrics are token-weighted means over the steps.
  assert len(set(tokens)) > 1  # the weighting is really tested
  np.testing.assert_allclose(metrics['policy/loss'],
                             np.average(want_losses, weights=tokens),
                             rtol=1e-5, atol=1e-7)
  # Token counts are per pass over the batch.
  assert metrics['policy/num_tokens'] == batch.action_mask_BxT.sum()
  chex.assert_trees_all_close(jax.tree.leaves(learner.state.policy),
                              want_params, rtol=1e-5, atol=1e-5)
  # The policy moved between updates: the clip has something to act on.
  if mode != 'dis':
    assert metrics['policy/ratio_max'] > metrics['policy/ratio_min']


def test_minibatches_take_every_row_once_per_pass():
  perm = np.asarray(learner_lib.minibatch_permutation(0, 3, 1, 16))
  assert sorted(perm) == list(range(16))
  other = np.asarray(learner_lib.minibatch_permutation(0, 4, 1, 16))
  assert not np.array_equal(perm, other)  # a new order every batch
