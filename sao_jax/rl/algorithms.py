"""What the learner differentiates: log-probs, values, advantages, losses.

Alignment convention. Token t of a trajectory is predicted from the model's
output at position t-1, so per-token quantities are shifted by one:
`logp_BxT[:, t] = log pi(tokens[t] | tokens[<t])` and `values_BxT[:, t]` is the
critic's value of the state before token t (its output at t-1). Position 0 is
never an action (it is the prompt's first token) and gets 0.

All functions are pure and jit-able; the algorithm's parts are chosen by name
from the config (SAO.md §3), not by branches spread through the learner.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sao_jax.kernels import partitioned
from sao_jax.models import sampling
from sao_jax.rl import advantages
from sao_jax.rl import losses

_F32 = jnp.float32


def _shift_right(x_BxT):
  """Moves position t-1's output to t; position 0 gets 0."""
  return jnp.pad(x_BxT[:, :-1], ((0, 0), (1, 0)))


def policy_logprobs(policy, batch, params: sampling.SamplingParams,
                    with_entropy: bool = False):
  """log pi_theta(a_t | s_t) `[B, T]` under the rollout's sampling distribution.

  The learner recomputes exactly what the engine recorded as mu_t (same
  temperature, top-k, top-p), so their ratio is the importance weight.

  Returns:
    `(logp_BxT, entropy_BxT or None)`.
  """
  logits_BxTxV = policy(batch['tokens'], input_mask=batch['input_mask'])
  targets_BxT = jnp.roll(batch['tokens'], -1, axis=1)  # token t+1 at t
  logp_BxTxV = sampling.sampling_logprobs(logits_BxTxV, params)
  logp_BxT = jnp.take_along_axis(logp_BxTxV, targets_BxT[..., None],
                                 axis=-1)[..., 0]
  entropy = None
  if with_entropy:
    probs = jnp.exp(logp_BxTxV)
    entropy = _shift_right(-jnp.sum(
        jnp.where(probs > 0, probs * logp_BxTxV, 0.0), axis=-1))
  return _shift_right(logp_BxT), entropy


def critic_values(critic, batch):
  """V_phi of the state before each token, `[B, T]` float32."""
  return _shift_right(critic(batch['tokens'], input_mask=batch['input_mask']))


def policy_lambda(config, batch):
  """lambda_policy: length-adaptive per trajectory (SAO §1.4) or fixed."""
  adv = config.advantage
  if adv.adaptive_lambda:
    return advantages.length_adaptive_lambda(batch['num_action_tokens'],
                                             adv.alpha)
  return jnp.full(batch['num_action_tokens'].shape, adv.lam, _F32)


def gae_mask(config, batch):
  """The tokens GAE runs over, which are also the critic's value targets.

  SAO's skip-observation GAE: the action tokens. Naive GAE
  (`advantage.skip_observations=False`, the paper's ablation): every response
  token, observations included (`advantages.response_mask`); the critic then
  learns values on observation tokens too, since the recursion reads them.
  The policy loss stays on action tokens either way.
  """
  if config.advantage.skip_observations:
    return batch['action_mask']
  return advantages.response_mask(batch['input_mask'], batch['action_mask'])


def gae(config, batch, values_BxT, lam, mesh=None):
  """GAE over `gae_mask`'s tokens through the kernel the config selects.

  The kernels skip every token outside the mask they are given: with the
  action mask that is skip-observation GAE, with the response mask naive GAE.
  `mesh`: the learner's mesh, over whose batch shards a Pallas kernel runs.
  """
  return partitioned.skip_observation_gae(
      batch['rewards'], values_BxT, gae_mask(config, batch),
      config.advantage.gamma, lam, mesh=mesh,
      implementation=config.kernels.implementation)


def trajectory_advantages(config, batch, running_mean_state=None):
  """Critic-free advantages broadcast to action tokens (GRPO, running mean).

  Returns:
    `(advantages_BxT, new_running_mean_state)`.
  """
  estimator = config.advantage.estimator
  reward_B = batch['reward']
  if estimator in ('grpo', 'dr_grpo'):
    group = config.group_size
    adv_B = advantages.grpo_advantages(
        reward_B.reshape(-1, group),
        std_normalize=estimator == 'grpo').reshape(-1)
  elif estimator == 'running_mean':
    slots = (None if config.advantage.running_mean_scope == 'global'
             else batch['slot_ids'])
    adv_B, running_mean_state = advantages.running_mean_advantages(
        running_mean_state, reward_B, slots)
  else:
    raise ValueError(f'{estimator!r} is not a critic-free estimator')
  return (advantages.broadcast_to_actions(adv_B, batch['action_mask']),
          running_mean_state)


# How the clipped (PPO) losses get their old policy, by
# `policy_loss.old_logprobs`: name -> (needs the recomputed proximal
# log-probs, function(prox_logp_BxT, batch, config) -> (old_logp_BxT,
# token_weights_BxT or None)). DIS ignores it: its ratio is always against mu.
#   recompute: the weights at the start of the batch (PPO, verl and OpenRLHF's
#     default); off-policy lag between the engine and the learner is ignored.
#   behavior: the engine's own log-probs mu (verl's rollout-correction
#     "bypass" mode): the clip bounds the whole drift from the sampler.
#   decoupled: AReaL's decoupled PPO: clip against the proximal policy, each
#     token weighted by min(pi_prox / mu, C) (`behavior_weight_cap`).
OLD_POLICIES = {
    'recompute': (True, lambda prox, batch, cfg: (prox, None)),
    'behavior': (False, lambda prox, batch, cfg: (batch['behavior_logprobs'],
                                                  None)),
    'decoupled': (True, lambda prox, batch, cfg: (
        prox, losses.truncated_behavior_weights(
            prox, batch['behavior_logprobs'], batch['action_mask'],
            cfg.behavior_weight_cap))),
}


def needs_proximal_logprobs(config) -> bool:
  """Whether the policy loss reads log-probs recomputed before the updates."""
  cfg = config.policy_loss
  return cfg.name == 'ppo' and OLD_POLICIES[cfg.old_logprobs][0]


def policy_loss(config, logp_BxT, batch, adv_BxT, prox_logp_BxT=None,
                entropy_BxT=None, ref_logp_BxT=None, mesh=None):
  """The configured policy loss (DIS or PPO) plus optional KL / entropy terms.

  Args:
    config: the sao_jax config.
    logp_BxT: log pi_theta of the tokens under the parameters being updated.
    batch: the (mini-)batch's arrays.
    adv_BxT: A_t.
    prox_logp_BxT: log-probs under the weights at the start of the batch
      (PPO's old policy in the `recompute` and `decoupled` modes).
    entropy_BxT: per-token entropy (with `entropy_coef`).
    ref_logp_BxT: log-probs of the frozen initial policy (with `ref_kl_coef`).
    mesh: the learner's mesh (Pallas kernels run per batch shard).

  Returns:
    `(loss, metrics)`.
  """
  cfg = config.policy_loss
  mask = batch['action_mask']
  if cfg.name == 'dis':
    loss, metrics = partitioned.dis_policy_loss(
        logp_BxT, batch['behavior_logprobs'], adv_BxT, mask, cfg.eps_low,
        cfg.eps_high, cfg.aggregation, mesh=mesh,
        implementation=config.kernels.implementation)
  else:
    old_BxT, weights_BxT = OLD_POLICIES[cfg.old_logprobs][1](
        prox_logp_BxT, batch, cfg)
    loss, metrics = losses.ppo_policy_loss(
        logp_BxT, old_BxT, adv_BxT, mask, cfg.eps_low, cfg.eps_high,
        dual_clip=cfg.dual_clip or None, aggregation=cfg.aggregation,
        token_weights=weights_BxT)
    if weights_BxT is not None:
      count = jnp.maximum(jnp.sum(mask), 1)
      metrics['behavior_weight_mean'] = jnp.sum(weights_BxT) / count
      metrics['behavior_weight_capped_frac'] = jnp.sum(
          (weights_BxT >= cfg.behavior_weight_cap) & (mask > 0)) / count
  if cfg.behavior_kl_coef:
    # k3 estimate of KL(mu || pi) on the sampled tokens, differentiable in pi:
    # a pull towards the rollout engine's policy, not the reference model.
    log_ratio = jnp.where(mask, logp_BxT - batch['behavior_logprobs'], 0.0)
    k3 = jnp.exp(log_ratio) - 1.0 - log_ratio
    kl = losses.aggregate(k3, mask, cfg.aggregation)
    loss = loss + cfg.behavior_kl_coef * kl
    metrics['behavior_kl_penalty'] = kl
  if cfg.ref_kl_coef:
    kl = losses.reference_kl(logp_BxT, ref_logp_BxT, mask,
                             cfg.ref_kl_estimator, cfg.aggregation)
    loss = loss + cfg.ref_kl_coef * kl
    metrics['ref_kl'] = kl
  if cfg.entropy_coef:
    entropy = losses.aggregate(entropy_BxT, mask, cfg.aggregation)
    loss = loss - cfg.entropy_coef * entropy
    metrics['entropy'] = entropy
  return loss, metrics


def value_loss(config, values_BxT, returns_BxT, batch, old_values_BxT=None):
  """The critic's regression loss on the GAE tokens (`gae_mask`)."""
  clip = config.critic.value_clip or None
  return losses.value_loss(values_BxT, returns_BxT, gae_mask(config, batch),
                           old_values=old_values_BxT if clip else None,
                           clip_eps=clip,
                           aggregation=config.policy_loss.aggregation)


def microbatch_weight(mask_BxT, totals, aggregation):
  """The share of the full-batch loss one micro-batch's mean stands for.

  Losses are means over a micro-batch's tokens (or rows); weighting each by
  its share of the batch's tokens (rows) makes the accumulated gradient equal
  the full batch's, whatever the split.
  """
  if aggregation == 'token_mean':
    return jnp.sum(mask_BxT) / jnp.maximum(totals['tokens'], 1)
  rows = jnp.sum(jnp.any(mask_BxT, axis=1))
  return rows / jnp.maximum(totals['rows'], 1)


def batch_totals(mask_BxT):
  """Tokens and non-empty rows of a full batch's loss mask (for weights)."""
  return {'tokens': jnp.sum(mask_BxT).astype(_F32),
          'rows': jnp.sum(jnp.any(mask_BxT, axis=1)).astype(_F32)}


def stop_gradient_tree(tree):
  return jax.tree.map(jax.lax.stop_gradient, tree)
