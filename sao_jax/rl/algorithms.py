"""The algorithms: their parts registered by name, and what the learner calls.

An algorithm (`config.algorithm`, SAO.md §3) is an advantage estimator and a
policy loss, each chosen by name from a registry:

  ESTIMATORS     `advantage.estimator` -> `Estimator` (A_t, whether it needs
                 the critic's values, the state it carries between batches)
  POLICY_LOSSES  `policy_loss.name` -> `PolicyLoss` (DIS, PPO)
  OLD_POLICIES   `policy_loss.old_logprobs` -> `OldPolicy` (PPO's pi_old)
  ALGORITHMS     `algorithm` -> `Spec` (the estimator and loss it is made of)

`check_config` checks a config against these keys, and the learner asks
once, `algorithm = algorithms.resolve(config)`, for the parts and flags it
needs; it branches on no name. A new estimator is one `Estimator` in
`ESTIMATORS` (and an entry in `ALGORITHMS`, with its presets, to name it);
`tests/test_algorithms.py` adds one.

Alignment convention. Token t of a trajectory is predicted from the model's
output at position t-1, so per-token quantities are shifted by one:
`logp_BxT[:, t] = log pi(tokens[t] | tokens[<t])` and `values_BxT[:, t]` is the
critic's value of the state before token t (its output at t-1). Position 0 is
never an action (it is the prompt's first token) and gets 0.

All functions are pure and jit-able; `batch` is always a `types.TrainBatch`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sao_jax import masked_tokens
from sao_jax.kernels.dis_loss import api as dis_loss_api
from sao_jax.kernels.gae import api as gae_api
from sao_jax.models import moe
from sao_jax.models import sampling
from sao_jax.rl import advantages
from sao_jax.rl import losses

_F32 = jnp.float32


def _shift_right(x_BxT):
  """Moves position t-1's output to t; position 0 gets 0."""
  return jnp.pad(x_BxT[:, :-1], ((0, 0), (1, 0)))


def policy_logprobs(policy, batch, params: sampling.SamplingParams,
                    with_entropy: bool = False, chunk_size: int = 0,
                    replay: bool = False):
  """log pi_theta(a_t | s_t) `[B, T]` under the rollout's sampling distribution.

  The learner recomputes exactly what the engine recorded as mu_t (same
  temperature, top-k, top-p), so their ratio is the importance weight.
  `chunk_size` > 0 applies the LM head that many positions at a time
  (`sampling.chunked_token_logprobs`: the `[B, T, V]` logits are never whole).
  An MoE policy compares its routing with the engine's records
  (`batch.routed_experts_BxTxR`) and with `replay` uses them.

  Returns:
    `(logp_BxT, entropy_BxT or None, moe.Routing or None)`.
  """
  hidden_BxTxd, routing = policy.hidden_states(
      batch.tokens_BxT, batch.positions_BxT, batch.input_mask_BxT,
      batch.segment_ids_BxT, recorded_experts_BxTxR=batch.routed_experts_BxTxR,
      replay=replay, with_routing=True)
  targets_BxT = jnp.roll(batch.tokens_BxT, -1, axis=1)  # token t+1 at t
  logp_BxT, entropy_BxT = sampling.chunked_token_logprobs(
      policy.logits, hidden_BxTxd, targets_BxT, params, chunk_size,
      with_entropy)
  return _shift_right(logp_BxT), (None if entropy_BxT is None
                                  else _shift_right(entropy_BxT)), routing


def routing_terms(config, routing):
  """The router's share of the policy loss and its metrics (MoE only).

  `router_aux_loss_coef` x the load-balancing loss (`moe.load_balancing_loss`)
  and `routing_disagreement`: the share of the engine's recorded expert
  picks that the learner's routers would not make (0 with no records).
  """
  if routing is None:
    return 0.0, {}
  aux = moe.load_balancing_loss(routing)
  metrics = {'router_aux_loss': aux,
             'routing_disagreement': routing.mismatched
                                     / jnp.maximum(routing.recorded, 1.0)}
  return config.model.get('router_aux_loss_coef', 0.0) * aux, metrics


def critic_values(critic, batch):
  """V_phi of the state before each token, `[B, T]` float32."""
  # A segment's first token gets its predecessor's output: another
  # trajectory's, in a packed row. It is a prompt token (never an action), so
  # nothing reads it.
  return _shift_right(critic(batch.tokens_BxT, batch.positions_BxT,
                             batch.input_mask_BxT, batch.segment_ids_BxT))


def policy_lambda(config, batch):
  """lambda_policy per token `[B, T]`: length-adaptive per trajectory (SAO
  §1.4, l = its action tokens) or fixed; each trajectory's own in a packed
  row."""
  adv = config.advantage
  if adv.adaptive_lambda:
    lam_N = advantages.length_adaptive_lambda(batch.num_action_tokens_N,
                                              alpha=adv.alpha)
  else:
    lam_N = jnp.full(batch.num_action_tokens_N.shape, adv.lam, _F32)
  # On every token of the trajectory: GAE reads it on the tokens it runs over.
  return advantages.broadcast_to_actions(lam_N, batch.input_mask_BxT,
                                         batch.segment_ids_BxT)


def gae_mask(config, batch):
  """The tokens GAE runs over, which are also the critic's value targets.

  SAO's skip-observation GAE: the action tokens. Naive GAE
  (`advantage.skip_observations=False`, the paper's ablation): every response
  token, observations included (`advantages.response_mask`); the critic then
  learns values on observation tokens too, since the recursion reads them.
  The policy loss stays on action tokens either way.
  """
  if config.advantage.skip_observations:
    return batch.action_mask_BxT
  return advantages.response_mask(batch.input_mask_BxT, batch.action_mask_BxT,
                                  batch.segment_ids_BxT)


def gae(config, batch, values_BxT, lam, mesh=None):
  """GAE over `gae_mask`'s tokens through the kernel the config selects.

  The kernels skip every token outside the mask they are given: with the
  action mask that is skip-observation GAE, with the response mask naive GAE.
  `mesh`: the learner's mesh, over whose batch shards a Pallas kernel runs.
  """
  return gae_api.skip_observation_gae(
      batch.rewards_BxT, values_BxT, gae_mask(config, batch),
      gamma=config.advantage.gamma, lam=lam, segment_ids=batch.segment_ids_BxT,
      implementation=config.kernels.implementation, mesh=mesh)


# -- advantage estimators ------------------------------------------------------


def _no_state(config):
  del config
  return None


class Estimator(NamedTuple):
  """An advantage estimator A_t, registered by name in `ESTIMATORS`.

  Attributes:
    advantages: `fn(config, batch, values_BxT, state, mesh) -> (adv_BxT,
      state)`: A_t on the action tokens (0 elsewhere). `values_BxT` is the
      critic's V (None when `uses_critic` is False); `state` is what the
      estimator carries from batch to batch (from `init_state`), returned
      updated; `mesh` is the learner's mesh (for the kernels).
    uses_critic: whether the learner trains a critic and passes its values.
    init_state: `fn(config) -> pytree or None`, the carried state before the
      first batch (kept in `LearnerState.running_mean`).
    min_group_size: the smallest `config.group_size` it works with.
    variant_of: the estimator whose algorithms accept this one in its place
      (Dr.GRPO for GRPO), or None.
  """
  advantages: Callable[..., tuple[jax.Array, Any]]
  uses_critic: bool = False
  init_state: Callable[[Any], Any] = _no_state
  min_group_size: int = 1
  variant_of: str | None = None


def _gae_advantages(config, batch, values_BxT, state, mesh):
  """SAO's skip-observation GAE with the policy's lambda (SAO §1.4)."""
  adv_BxT, _ = gae(config, batch, values_BxT, policy_lambda(config, batch),
                   mesh)
  return adv_BxT, state


def _group_advantages(config, batch, values_BxT, state, mesh, *,
                      std_normalize):
  """GRPO's (Dr.GRPO's) group-relative advantage on every action token."""
  del values_BxT, mesh
  # Groups are contiguous on the `_N` axis, wherever packing put their rows.
  adv_N = advantages.grpo_advantages(
      batch.reward_N.reshape(-1, config.group_size),
      std_normalize=std_normalize).reshape(-1)
  return advantages.broadcast_to_actions(adv_N, batch.action_mask_BxT,
                                         batch.segment_ids_BxT), state


def _running_mean_init(config):
  adv = config.advantage
  per_question = adv.running_mean_scope == 'prompt'
  return advantages.running_mean_init(
      adv.running_mean_slots if per_question else 1,
      adv.running_mean_window if per_question else 1,
      adv.running_mean_global_window)


def _running_mean_advantages(config, batch, values_BxT, state, mesh):
  """Reward minus the question's (or global) running mean (SAO §3)."""
  del values_BxT, mesh
  slots = (None if config.advantage.running_mean_scope == 'global'
           else batch.slot_ids_N)
  adv_N, state = advantages.running_mean_advantages(state, batch.reward_N,
                                                    slots)
  return advantages.broadcast_to_actions(adv_N, batch.action_mask_BxT,
                                         batch.segment_ids_BxT), state


ESTIMATORS: dict[str, Estimator] = {
    'skip_observation_gae': Estimator(_gae_advantages, uses_critic=True),
    'grpo': Estimator(functools.partial(_group_advantages, std_normalize=True),
                      min_group_size=2),
    'dr_grpo': Estimator(
        functools.partial(_group_advantages, std_normalize=False),
        min_group_size=2, variant_of='grpo'),
    'running_mean': Estimator(_running_mean_advantages,
                              init_state=_running_mean_init),
}


# -- policy losses -------------------------------------------------------------


class OldPolicy(NamedTuple):
  """Where a clipped loss gets its old policy pi_old (`OLD_POLICIES`).

  Attributes:
    needs_proximal_logprobs: whether it reads the log-probs the learner
      recomputes under the weights at the start of the batch.
    select: `fn(prox_logp_BxT, batch, policy_loss_config) -> (old_logp_BxT,
      token_weights_BxT or None)`.
  """
  needs_proximal_logprobs: bool
  select: Callable[..., tuple[jax.Array, jax.Array | None]]


# By `policy_loss.old_logprobs`. DIS ignores it: its ratio is always against mu.
#   recompute: the weights at the start of the batch (PPO, verl and OpenRLHF's
#     default); off-policy lag between the engine and the learner is ignored.
#   behavior: the engine's own log-probs mu (verl's rollout-correction
#     "bypass" mode): the clip bounds the whole drift from the sampler.
#   decoupled: AReaL's decoupled PPO: clip against the proximal policy, each
#     token weighted by min(pi_prox / mu, C) (`behavior_weight_cap`).
OLD_POLICIES: dict[str, OldPolicy] = {
    'recompute': OldPolicy(True, lambda prox, batch, cfg: (prox, None)),
    'behavior': OldPolicy(False, lambda prox, batch, cfg: (
        batch.behavior_logprobs_BxT, None)),
    'decoupled': OldPolicy(True, lambda prox, batch, cfg: (
        prox, losses.truncated_behavior_weights(
            prox, batch.behavior_logprobs_BxT, batch.action_mask_BxT,
            cap=cfg.behavior_weight_cap))),
}


class PolicyLoss(NamedTuple):
  """A policy loss, registered by name in `POLICY_LOSSES`.

  Attributes:
    loss: `fn(config, logp_BxT, batch, adv_BxT, prox_logp_BxT, mesh) ->
      (loss, metrics)`, before the optional KL / entropy terms.
    uses_old_policy: whether it clips against `OLD_POLICIES[
      policy_loss.old_logprobs]` (and so may need proximal log-probs).
  """
  loss: Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
  uses_old_policy: bool = False


def _dis_loss(config, logp_BxT, batch, adv_BxT, prox_logp_BxT, mesh):
  """SAO's DIS loss (SAO §1.2) through the configured kernel."""
  del prox_logp_BxT  # the ratio is against the engine's own mu
  cfg = config.policy_loss
  return dis_loss_api.dis_policy_loss(
      logp_BxT, batch.behavior_logprobs_BxT, adv_BxT, batch.action_mask_BxT,
      eps_low=cfg.eps_low, eps_high=cfg.eps_high, aggregation=cfg.aggregation,
      segment_ids=batch.segment_ids_BxT,
      implementation=config.kernels.implementation, mesh=mesh)


def _ppo_loss(config, logp_BxT, batch, adv_BxT, prox_logp_BxT, mesh):
  """PPO's clipped loss against the configured old policy."""
  del mesh  # plain jnp: XLA partitions it
  cfg = config.policy_loss
  mask = batch.action_mask_BxT
  old_BxT, weights_BxT = OLD_POLICIES[cfg.old_logprobs].select(
      prox_logp_BxT, batch, cfg)
  loss, metrics = losses.ppo_policy_loss(
      logp_BxT, old_BxT, adv_BxT, mask, eps_low=cfg.eps_low,
      eps_high=cfg.eps_high, dual_clip=cfg.dual_clip or None,
      aggregation=cfg.aggregation, token_weights=weights_BxT,
      segment_ids=batch.segment_ids_BxT)
  if weights_BxT is not None:
    count = jnp.maximum(jnp.sum(mask), 1)
    metrics['behavior_weight_mean'] = jnp.sum(weights_BxT) / count
    metrics['behavior_weight_capped_frac'] = jnp.sum(
        (weights_BxT >= cfg.behavior_weight_cap) & (mask > 0)) / count
  return loss, metrics


POLICY_LOSSES: dict[str, PolicyLoss] = {
    'dis': PolicyLoss(_dis_loss),
    'ppo': PolicyLoss(_ppo_loss, uses_old_policy=True),
}


# -- algorithms ----------------------------------------------------------------


class Spec(NamedTuple):
  """What an algorithm is made of, and the settings it is run with.

  Attributes:
    estimator: its name in `ESTIMATORS`.
    loss: its name in `POLICY_LOSSES`.
    presets: dotted config key -> value, what the recipe's `algorithm=<name>`
      sets (`config_lib.apply_presets`): sampling, clip widths, the update
      schedule, as the algorithm's paper and its peers run it. The estimator
      and loss are set from the fields above.
  """
  estimator: str
  loss: str
  presets: Mapping[str, Any] = {}

  @property
  def critic(self) -> bool:
    """Whether the algorithm trains a critic (its estimator reads values)."""
    return ESTIMATORS[self.estimator].uses_critic

  def config_presets(self) -> dict[str, Any]:
    """Every key the algorithm sets, its estimator and loss included."""
    return {'advantage.estimator': self.estimator,
            'policy_loss.name': self.loss, **self.presets}


# The LLM baselines' PPO clip: clip-higher (DAPO, VAPO) against the
# recomputed old policy. With one step per batch such a clip never acts (the
# ratio is exactly 1), so they take M = 4 mini-batches per batch (verl's).
_PPO_CLIP_HIGHER = {
    'policy_loss.old_logprobs': 'recompute', 'policy_loss.eps_low': 0.2,
    'policy_loss.eps_high': 0.28, 'optim.policy_minibatches': 4}
# Critics as verl runs them: one optimizer step per actor step (the actor's
# E = 1 pass of M mini-batches), attention trained, value clip 0.5,
# whitened GAE advantages.
_VERL_CRITIC = {
    'critic.steps_per_policy_step': 1, 'critic.minibatches': 0,
    'critic.frozen_attention': False, 'critic.value_clip': 0.5,
    'advantage.normalize': True}

# SAO.md §3: SAO and the paper's baselines, each run the way its paper and
# its peers run it (docs/configuration.md lists what each preset changes).
ALGORITHMS: dict[str, Spec] = {
    # 1 rollout, skip-observation GAE with a critic, DIS: the defaults.
    'sao': Spec('skip_observation_gae', 'dis'),
    # Vanilla GRPO with clip-higher: G = 8 samples per prompt (the GRPO
    # paper: 16 x 8), group-normalised reward, no KL (policy_loss.ref_kl_coef
    # adds GRPO's reference KL).
    'grpo': Spec('grpo', 'ppo', {'group_size': 8, **_PPO_CLIP_HIGHER}),
    # GRPO's groups and advantages with SAO's DIS loss, E = M = 1.
    'grpo_dis': Spec('grpo', 'dis', {'group_size': 8}),
    # VAPO (arXiv 2504.05118) as far as sao_jax has it: G = 8 (VAPO's group
    # sampling; SAO.md's table runs it with group_size=1), decoupled GAE
    # (lambda_critic = 1, length-adaptive lambda_policy with alpha = 0.05),
    # token-level loss, value pretraining. Not included: VAPO's
    # positive-example LM loss and its 50-step critic warm-up.
    'vapo': Spec('skip_observation_gae', 'ppo', {
        'group_size': 8, **_PPO_CLIP_HIGHER, **_VERL_CRITIC,
        'advantage.alpha': 0.05}),
    # 1 rollout, the reward minus the question's running mean, DIS.
    'running_mean': Spec('running_mean', 'dis'),
    # Classic PPO (verl's): fixed lambda for actor and critic, symmetric
    # clip 0.2, no value pretraining.
    'ppo': Spec('skip_observation_gae', 'ppo', {
        **_PPO_CLIP_HIGHER, 'policy_loss.eps_high': 0.2, **_VERL_CRITIC,
        'advantage.adaptive_lambda': False, 'critic.lam': 0.95,
        'critic.pretrain_steps': 0}),
}


class Algorithm(NamedTuple):
  """One config's algorithm, looked up once (`resolve`).

  Attributes:
    estimator: the `Estimator` of `advantage.estimator`.
    policy_loss: the `PolicyLoss` of `policy_loss.name`.
    uses_critic: whether the learner trains a critic.
    needs_proximal_logprobs: whether the policy loss reads log-probs
      recomputed under the weights at the start of the batch.
  """
  estimator: Estimator
  policy_loss: PolicyLoss
  uses_critic: bool
  needs_proximal_logprobs: bool


def resolve(config) -> Algorithm:
  """The parts of `config`'s algorithm, from the registries by name."""
  estimator = ESTIMATORS[config.advantage.estimator]
  loss = POLICY_LOSSES[config.policy_loss.name]
  return Algorithm(
      estimator=estimator, policy_loss=loss,
      uses_critic=estimator.uses_critic,
      needs_proximal_logprobs=loss.uses_old_policy and OLD_POLICIES[
          config.policy_loss.old_logprobs].needs_proximal_logprobs)


# -- the losses of one (micro-)batch -------------------------------------------


def policy_loss(config, logp_BxT, batch, adv_BxT, prox_logp_BxT=None,
                entropy_BxT=None, ref_logp_BxT=None, mesh=None):
  """The configured policy loss (`POLICY_LOSSES`) plus KL / entropy terms.

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
  mask = batch.action_mask_BxT
  segments = batch.segment_ids_BxT
  loss, metrics = POLICY_LOSSES[cfg.name].loss(config, logp_BxT, batch,
                                               adv_BxT, prox_logp_BxT, mesh)
  if cfg.behavior_kl_coef:
    # k3 estimate of KL(mu || pi) on the sampled tokens, differentiable in pi:
    # a pull towards the rollout engine's policy, not the reference model.
    # Tokens outside pi's truncated support (-inf) are left out.
    kl_mask, _ = losses.finite_mask(mask, logp_BxT)
    log_ratio = jnp.where(kl_mask, logp_BxT - batch.behavior_logprobs_BxT,
                          0.0)
    k3 = jnp.exp(log_ratio) - 1.0 - log_ratio
    kl = losses.aggregate(k3, kl_mask, cfg.aggregation, segments)
    loss = loss + cfg.behavior_kl_coef * kl
    metrics['behavior_kl_penalty'] = kl
  if cfg.ref_kl_coef:
    kl = losses.reference_kl(logp_BxT, ref_logp_BxT, mask,
                             estimator=cfg.ref_kl_estimator,
                             aggregation=cfg.aggregation, segment_ids=segments)
    loss = loss + cfg.ref_kl_coef * kl
    metrics['ref_kl'] = kl
  if cfg.entropy_coef:
    entropy = losses.aggregate(entropy_BxT, mask, cfg.aggregation, segments)
    loss = loss - cfg.entropy_coef * entropy
    metrics['entropy'] = entropy
  return loss, metrics


def value_loss(config, values_BxT, returns_BxT, batch, old_values_BxT=None):
  """The critic's regression loss on the GAE tokens (`gae_mask`)."""
  clip = config.critic.value_clip or None
  return losses.value_loss(values_BxT, returns_BxT, gae_mask(config, batch),
                           old_values=old_values_BxT if clip else None,
                           clip_eps=clip,
                           aggregation=config.policy_loss.aggregation,
                           segment_ids=batch.segment_ids_BxT)


def microbatch_weight(mask_BxT, segment_ids_BxT, totals, aggregation):
  """The share of the full-batch loss one micro-batch's mean stands for.

  Losses are means over a micro-batch's tokens (or trajectories: segments of
  rows); weighting each by its share of the batch's tokens (trajectories)
  makes the accumulated gradient equal the full batch's, whatever the split
  (a micro-batch takes whole rows, so whole trajectories).
  """
  if aggregation == 'token_mean':
    return jnp.sum(mask_BxT) / jnp.maximum(totals['tokens'], 1)
  segments = masked_tokens.num_segments(mask_BxT, segment_ids_BxT)
  return segments / jnp.maximum(totals['segments'], 1)


def batch_totals(mask_BxT, segment_ids_BxT):
  """Tokens and non-empty trajectories of a full batch's loss mask (for
  weights)."""
  return {'tokens': jnp.sum(mask_BxT).astype(_F32),
          'segments': masked_tokens.num_segments(mask_BxT,
                                          segment_ids_BxT).astype(_F32)}


# -- the config sections this module owns ---------------------------------------

RUNNING_MEAN_SCOPES = ('prompt', 'global')
ADVANTAGE_VALUES = ('pre_update', 'post_update')


def critic_minibatches(config) -> int:
  """M_c, the critic's mini-batches per pass: `critic.minibatches`, or (0)
  the actor's `optim.policy_minibatches`."""
  return (config.critic.get('minibatches', 1)
          or config.optim.policy_minibatches)


def row_minibatches(config) -> int:
  """The mini-batch count every batch's rows must split into: the actor's
  and (with a critic) the critic's."""
  actor = config.optim.policy_minibatches
  if not ESTIMATORS[config.advantage.estimator].uses_critic:
    return actor
  return math.lcm(actor, critic_minibatches(config))


def check_config(check) -> None:
  """`algorithm`, `advantage`, `policy_loss`, `critic` and `group_size`.

  Args:
    check: a `config_lib.Checker` of the whole config.
  """
  algorithm = check.choice('algorithm', ALGORITHMS)
  estimator = check.choice('advantage.estimator', ESTIMATORS)
  loss = check.choice('policy_loss.name', POLICY_LOSSES)
  if algorithm and estimator and loss:
    want = ALGORITHMS[algorithm]
    family = ESTIMATORS[estimator].variant_of or estimator
    if (family, loss) != (want.estimator, want.loss):
      check.problem(
          f'config.algorithm={algorithm!r} uses advantage.estimator'
          f' {want.estimator!r} and policy_loss.name {want.loss!r}, but'
          f' the config has {estimator!r} and {loss!r}; choose algorithms with'
          f' the recipe argument (--config=configs/<recipe>.py:algorithm='
          f'{algorithm}) so that their presets apply')

  policy = check.scope('policy_loss')
  policy.open_interval('eps_low', 0.0, 1.0)
  policy.positive('eps_high')
  dual_clip = policy.get('dual_clip')
  if dual_clip is not None and dual_clip != 0 and dual_clip <= 1:
    check.problem(f'config.policy_loss.dual_clip={dual_clip} must be > 1'
                  ' (or 0 to disable it)')
  policy.choice('aggregation', losses.AGGREGATIONS)
  policy.choice('old_logprobs', OLD_POLICIES)
  policy.positive('behavior_weight_cap')
  policy.non_negative('behavior_kl_coef')
  policy.non_negative('ref_kl_coef')
  policy.choice('ref_kl_estimator', losses.KL_ESTIMATORS)
  policy.non_negative('entropy_coef')

  adv = check.scope('advantage')
  adv.closed_interval('gamma', 0.0, 1.0)
  adv.closed_interval('lam', 0.0, 1.0)
  adv.positive('alpha')
  adv.choice('values_from', ADVANTAGE_VALUES)
  adv.positive_int('running_mean_window')
  adv.positive_int('running_mean_global_window')
  adv.positive_int('running_mean_slots')
  adv.choice('running_mean_scope', RUNNING_MEAN_SCOPES)

  critic = check.scope('critic')
  critic.positive_int('steps_per_policy_step')
  critic.non_negative_int('minibatches')
  critic.closed_interval('lam', 0.0, 1.0)
  critic.non_negative('value_clip')
  critic.non_negative_int('pretrain_steps')

  group = check.positive_int('group_size')
  min_group = ESTIMATORS[estimator].min_group_size if estimator else 1
  if group is not None and group < min_group:
    check.problem(f'config.group_size={group}: advantage estimator'
                  f' {estimator!r} needs groups of at least {min_group}'
                  ' samples')
