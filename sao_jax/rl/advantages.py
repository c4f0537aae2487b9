"""Advantage estimators: skip-observation GAE (SAO), GRPO groups, running means.

Notation follows `shared/docs/SAO.md`: a batch holds B trajectories of T tokens;
`action_mask_BxT` is 1 on tokens the policy generated (actions) and 0 on prompt,
environment-observation and padding tokens. Every function here is pure, jit-able
and checks shapes at trace time.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sao_jax import array_checks

_F32 = jnp.float32


def skip_observation_gae(rewards, values, action_mask, gamma, lam):
  """Token-level GAE whose recursion runs over action tokens only (SAO §1.4).

  For an action token t let n(t) be the next action token of the same row,
  skipping every non-action token in between (environment observations, padding).
  Then

    delta_t = r_t + gamma * V[n(t)] - V[t]
    A_t     = delta_t + gamma * lam * A[n(t)]

  with `V[n(t)] = A[n(t)] = 0` when t is the last action token of its row. The last
  token of action i thus bootstraps from the first token of action i+1, jumping the
  observation between them: observations condition the values that follow them but
  get no advantage, no value target and no loss.

  Args:
    rewards: float `[B, T]` per-token rewards r_t. Only action positions are read;
      the trajectory builder puts the outcome reward on the last action token.
    values: float `[B, T]` critic values V_t. Only action positions are read.
    action_mask: bool or 0/1 `[B, T]`, m_t.
    gamma: discount gamma (a Python float or a scalar array; SAO uses 1).
    lam: GAE lambda, a scalar or float `[B]` (one per trajectory, e.g. from
      `length_adaptive_lambda`).

  Returns:
    `(advantages, returns)`, both float32 `[B, T]`: A_t and the value target
    `R_t = A_t + V_t`, zero wherever `action_mask == 0`.

  References:
    Schulman et al., "High-Dimensional Continuous Control Using Generalized
    Advantage Estimation", 2015; SAO (arXiv 2607.07508) §3, skip-observation GAE.
  """
  mask_BxT, gamma, lam_B = check_gae_inputs(
      'skip_observation_gae', rewards, values, action_mask, gamma, lam)
  batch = mask_BxT.shape[0]
  # Sanitise non-action positions first: rewards there are ignored by
  # definition, and values at padding may be garbage (even NaN).
  rewards_BxT = jnp.where(mask_BxT, jnp.asarray(rewards, _F32), 0.0)
  values_BxT = jnp.where(mask_BxT, jnp.asarray(values, _F32), 0.0)

  def step(carry, xs):
    next_value_B, next_adv_B = carry  # V[n(t)], A[n(t)] for the rows.
    reward_B, value_B, is_action_B = xs
    delta_B = reward_B + gamma * next_value_B - value_B
    adv_B = delta_B + gamma * lam_B * next_adv_B
    adv_B = jnp.where(is_action_B, adv_B, 0.0)
    # A non-action token is transparent: the carry passes through untouched,
    # which is what links action i's last token to action i+1's first.
    carry = (jnp.where(is_action_B, value_B, next_value_B),
             jnp.where(is_action_B, adv_B, next_adv_B))
    return carry, adv_B

  init = (jnp.zeros((batch,), _F32), jnp.zeros((batch,), _F32))
  _, adv_TxB = jax.lax.scan(
      step, init, (rewards_BxT.T, values_BxT.T, mask_BxT.T), reverse=True)
  adv_BxT = adv_TxB.T
  returns_BxT = jnp.where(mask_BxT, adv_BxT + values_BxT, 0.0)
  return adv_BxT, returns_BxT


def response_mask(input_mask, action_mask):
  """Each row's real tokens from its first action token on, bool `[B, T]`.

  The response of a multi-turn trajectory: its actions and the observations
  between (and after) them, without the prompt before the first action and
  without padding. Naive GAE, the paper's ablation of skip-observation GAE,
  runs the same recursion over this mask instead of the action mask, so that
  observation tokens are ordinary steps: their values enter the deltas and
  every observation token costs a factor gamma * lambda.

  Args:
    input_mask: bool or 0/1 `[B, T]`, 1 on real (non-padding) tokens.
    action_mask: bool or 0/1 `[B, T]`, 1 on action tokens.
  """
  where = 'response_mask'
  array_checks.require_rank(where, 'input_mask', input_mask, '[B, T]')
  array_checks.require_shape(where, 'action_mask', action_mask,
                             jnp.shape(input_mask), '[B, T]')
  actions_BxT = jnp.asarray(action_mask).astype(jnp.int32)
  started_BxT = jnp.cumsum(actions_BxT, axis=1) > 0
  return jnp.asarray(input_mask).astype(bool) & started_BxT


def check_gae_inputs(where, rewards, values, action_mask, gamma, lam):
  """Validates GAE arguments (shared by the reference and the kernels).

  Returns:
    `(mask_BxT bool, gamma float32 scalar, lam_B float32 [B])`.
  """
  array_checks.require_rank(where, 'rewards', rewards, '[B, T]')
  batch, length = jnp.shape(rewards)
  array_checks.require_shape(where, 'values', values, (batch, length), '[B, T]')
  array_checks.require_shape(where, 'action_mask', action_mask, (batch, length),
                             '[B, T]')
  array_checks.require_float(where, 'rewards', rewards)
  array_checks.require_float(where, 'values', values)
  return (jnp.asarray(action_mask).astype(bool), _scalar(where, 'gamma', gamma),
          _per_row(where, 'lam', lam, batch))


def length_adaptive_lambda(num_action_tokens, alpha):
  """The policy's per-trajectory lambda, `clip(1 - 1 / (alpha * l), 0, 1)`.

  VAPO's length-adaptive GAE, used by SAO for the policy advantage (SAO §1.4):
  long trajectories get lambda close to 1 (low bias over many tokens), short ones a
  smaller lambda (lower variance).

  Args:
    num_action_tokens: int or float `[B]`, l = number of action tokens of each
      trajectory.
    alpha: the scale alpha (paper: 1.5); must be positive.

  Returns:
    float32 `[B]` lambda_policy; 0 where l = 0.

  References:
    Yue et al., "VAPO", arXiv 2504.05118, eq. 7; SAO §3.
  """
  where = 'length_adaptive_lambda'
  array_checks.require_rank(where, 'num_action_tokens', num_action_tokens, '[B]')
  if isinstance(alpha, (int, float)) and alpha <= 0:
    raise ValueError(f'{where}: alpha must be positive, got {alpha}')
  length_B = jnp.asarray(num_action_tokens, _F32)
  safe_B = jnp.where(length_B > 0, length_B, 1.0)
  lam_B = jnp.clip(1.0 - 1.0 / (alpha * safe_B), 0.0, 1.0)
  return jnp.where(length_B > 0, lam_B, 0.0)


def grpo_advantages(rewards, std_normalize=True, eps=1e-6):
  """Group-relative advantages of GRPO (or Dr.GRPO without the std).

  `A = (r - mean_g r) / (std_g r + eps)`, or `A = r - mean_g r` when
  `std_normalize` is False (Dr.GRPO). The std is the population std (ddof 0), so a
  group of one sample gets advantage 0 rather than NaN.

  Args:
    rewards: float `[P, G]`: P prompts with G samples each.
    std_normalize: divide by the group std (GRPO) or not (Dr.GRPO).
    eps: added to the std.

  Returns:
    float32 `[P, G]` advantages, one per trajectory.

  References:
    Shao et al., "DeepSeekMath", arXiv 2402.03300 (GRPO); Liu et al.,
    "Understanding R1-Zero-Like Training", arXiv 2503.20783 (Dr.GRPO).
  """
  array_checks.require_rank('grpo_advantages', 'rewards', rewards, '[P, G]')
  rewards_PxG = jnp.asarray(rewards, _F32)
  centred_PxG = rewards_PxG - jnp.mean(rewards_PxG, axis=1, keepdims=True)
  if not std_normalize:
    return centred_PxG
  std_Px1 = jnp.std(rewards_PxG, axis=1, keepdims=True)
  return centred_PxG / (std_Px1 + eps)


class RunningMeanState(NamedTuple):
  """Ring buffers of past rewards for the running-mean baseline.

  Attributes:
    history_SxW: float32 `[S, W]`: the last W rewards of each of S slots (a slot
      is one question for the per-question baseline). Entries not yet written
      are 0. The global baseline keeps one unused slot.
    count_S: int32 `[S]`: how many rewards each slot has ever received.
    global_history_G: float32 `[G]`: the last G rewards of any question (the
      global baseline, and the per-question baseline's fallback while a
      question's own window is empty).
    global_count: int32 scalar: rewards the global window has ever received.
  """
  history_SxW: jax.Array
  count_S: jax.Array
  global_history_G: jax.Array
  global_count: jax.Array


def running_mean_init(num_slots: int, window: int,
                      global_window: int) -> RunningMeanState:
  """Empty state: `num_slots` windows of W = `window`, one of `global_window`."""
  if min(num_slots, window, global_window) < 1:
    raise ValueError('running_mean_init: num_slots, window and global_window'
                     f' must be >= 1, got num_slots={num_slots},'
                     f' window={window}, global_window={global_window}')
  return RunningMeanState(
      history_SxW=jnp.zeros((num_slots, window), _F32),
      count_S=jnp.zeros((num_slots,), jnp.int32),
      global_history_G=jnp.zeros((global_window,), _F32),
      global_count=jnp.zeros((), jnp.int32))


def running_mean_advantages(state: RunningMeanState, rewards, slot_ids=None):
  """Reward minus the mean of recent rewards (SAO §3 running-mean baseline).

  Per question (`slot_ids` given): the mean of the question's last W rewards,
  or, while the question has none yet, the mean of the last G rewards of any
  question (a question seen for the first time is judged against the global
  level, not against 0). Global (`slot_ids` None): the mean of the last G
  rewards. Either baseline is 0 before any reward was recorded.

  Baselines are read from the state *before* this batch, so a reward never
  enters its own baseline (which keeps the estimator unbiased); the batch's
  rewards are then appended in order, so with duplicates in one batch the
  later ones win the ring buffer positions.

  Args:
    state: a `RunningMeanState`.
    rewards: float `[B]` outcome rewards.
    slot_ids: int `[B]` slot of each trajectory's question, in `[0, S)`; None
      for the global baseline.

  Returns:
    `(advantages, new_state)`: float32 `[B]` and the updated state.
  """
  where = 'running_mean_advantages'
  array_checks.require_rank(where, 'rewards', rewards, '[B]')
  (batch,) = jnp.shape(rewards)
  num_slots, window = state.history_SxW.shape
  (global_window,) = state.global_history_G.shape
  rewards_B = jnp.asarray(rewards, _F32)

  global_filled = jnp.minimum(state.global_count, global_window)
  global_mean = (jnp.sum(state.global_history_G)
                 / jnp.maximum(global_filled, 1))
  if slot_ids is None:
    baseline_B = jnp.full((batch,), global_mean, _F32)
    history_SxW, count_S = state.history_SxW, state.count_S
  else:
    array_checks.require_shape(where, 'slot_ids', slot_ids, (batch,), '[B]')
    slots_B = jnp.asarray(slot_ids, jnp.int32)
    filled_S = jnp.minimum(state.count_S, window)
    mean_S = jnp.sum(state.history_SxW, axis=1) / jnp.maximum(filled_S, 1)
    baseline_B = jnp.where(filled_S[slots_B] > 0, mean_S[slots_B],
                           global_mean)

    def append(carry, xs):
      history_SxW, count_S = carry
      reward, slot = xs
      history_SxW = history_SxW.at[slot, count_S[slot] % window].set(reward)
      return (history_SxW, count_S.at[slot].add(1)), None

    (history_SxW, count_S), _ = jax.lax.scan(
        append, (state.history_SxW, state.count_S), (rewards_B, slots_B))
  # The global window is a ring too: positions count, count + 1, ... mod G;
  # with more rewards than G in one batch the last G win.
  positions_B = (state.global_count + jnp.arange(batch)) % global_window
  keep_B = jnp.arange(batch) >= batch - global_window
  global_history_G = state.global_history_G.at[
      jnp.where(keep_B, positions_B, global_window)].set(rewards_B,
                                                         mode='drop')
  new_state = RunningMeanState(history_SxW, count_S, global_history_G,
                               state.global_count + batch)
  return rewards_B - baseline_B, new_state


def broadcast_to_actions(advantages, action_mask):
  """Spreads one advantage per trajectory `[B]` over its action tokens `[B, T]`.

  GRPO and the running-mean baseline give one scalar per trajectory; the token
  losses want it on every action token and 0 elsewhere.
  """
  where = 'broadcast_to_actions'
  array_checks.require_rank(where, 'advantages', advantages, '[B]')
  array_checks.require_rank(where, 'action_mask', action_mask, '[B, T]')
  (batch,) = jnp.shape(advantages)
  array_checks.require_shape(where, 'action_mask', action_mask,
                             (batch, jnp.shape(action_mask)[1]), '[B, T]')
  mask_BxT = jnp.asarray(action_mask).astype(bool)
  return jnp.where(mask_BxT, jnp.asarray(advantages, _F32)[:, None], 0.0)


def normalize_advantages(advantages, action_mask, eps=1e-6):
  """Whitens advantages over the batch's action tokens (off by default in SAO).

  Returns `(A - mean) / (std + eps)` on action tokens and 0 elsewhere, mean and
  std taken over all action tokens of the batch.
  """
  where = 'normalize_advantages'
  array_checks.require_rank(where, 'advantages', advantages, '[B, T]')
  array_checks.require_shape(where, 'action_mask', action_mask,
                             jnp.shape(advantages), '[B, T]')
  mask_BxT = jnp.asarray(action_mask).astype(bool)
  adv_BxT = jnp.where(mask_BxT, jnp.asarray(advantages, _F32), 0.0)
  count = jnp.maximum(jnp.sum(mask_BxT), 1)
  mean = jnp.sum(adv_BxT) / count
  var = jnp.sum(jnp.where(mask_BxT, (adv_BxT - mean) ** 2, 0.0)) / count
  return jnp.where(mask_BxT, (adv_BxT - mean) / (jnp.sqrt(var) + eps), 0.0)


def _scalar(where, name, x):
  if jnp.ndim(x) != 0:
    raise ValueError(f'{where}: {name} must be a scalar, got shape'
                     f' {tuple(jnp.shape(x))}')
  return jnp.asarray(x, _F32)


def _per_row(where, name, x, batch):
  """A scalar or `[B]` argument as float32 `[B]`."""
  if jnp.ndim(x) == 0:
    return jnp.full((batch,), x, _F32)
  array_checks.require_shape(where, name, x, (batch,), 'a scalar or [B]')
  return jnp.asarray(x, _F32)
