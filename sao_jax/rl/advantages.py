"""Advantage estimators: skip-observation GAE (SAO), GRPO groups, running means.

Notation follows `shared/docs/SAO.md`: a batch holds B trajectories of T tokens;
`action_mask_BxT` is 1 on tokens the policy generated (actions) and 0 on prompt,
environment-observation and padding tokens. Every function here is pure, jit-able
and checks shapes at trace time.

Skip-observation GAE is defined next to its Pallas kernel
(`sao_jax.kernels.gae.reference`) and re-exported here.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sao_jax import array_checks
from sao_jax.kernels.gae import reference as gae_reference
from sao_jax import masked_tokens

_F32 = jnp.float32

# Defined next to its Pallas kernel; re-exported as the definition. To run GAE
# through the configured kernel (Pallas on TPU), call
# `sao_jax.kernels.gae.api.skip_observation_gae`.
skip_observation_gae = gae_reference.skip_observation_gae
check_gae_inputs = gae_reference.check_gae_inputs


def response_mask(input_mask, action_mask, segment_ids=None):
  """Each trajectory's real tokens from its first action token on, bool
  `[B, T]`.

  The response of a multi-turn trajectory: its actions and the observations
  between (and after) them, without the prompt before the first action and
  without padding. Naive GAE, the paper's ablation of skip-observation GAE,
  runs the same recursion over this mask instead of the action mask, so that
  observation tokens are ordinary steps: their values enter the deltas and
  every observation token costs a factor gamma * lambda.

  Args:
    input_mask: bool or 0/1 `[B, T]`, 1 on real (non-padding) tokens.
    action_mask: bool or 0/1 `[B, T]`, 1 on action tokens.
    segment_ids: int `[B, T]`, the trajectories of packed rows (each has its
      own prompt); None: one per row.
  """
  where = 'response_mask'
  array_checks.require_rank(where, 'input_mask', input_mask, '[B, T]')
  array_checks.require_shape(where, 'action_mask', action_mask,
                             jnp.shape(input_mask), '[B, T]')
  actions_BxT = jnp.asarray(action_mask).astype(jnp.int32)
  seen_BxT = jnp.cumsum(actions_BxT, axis=1)  # actions at or before t
  if segment_ids is not None:
    local_BxT = masked_tokens.row_segments(where, segment_ids, actions_BxT)
    starts_BxT = local_BxT != jnp.pad(local_BxT[:, :-1], ((0, 0), (1, 0)))
    # The row's actions before t's segment began (the count is
    # non-decreasing, so the latest start's count is the running max).
    before_BxT = jax.lax.cummax(
        jnp.where(starts_BxT, seen_BxT - actions_BxT, 0), axis=1)
    seen_BxT = seen_BxT - before_BxT
  return jnp.asarray(input_mask).astype(bool) & (seen_BxT > 0)


def length_adaptive_lambda(num_action_tokens, *, alpha):
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


def grpo_advantages(rewards, std_normalize=True, eps=1e-6, ddof=1):
  """Group-relative advantages of GRPO (or Dr.GRPO without the std).

  `A = (r - mean_g r) / (std_g r + eps)`, or `A = r - mean_g r` when
  `std_normalize` is False (Dr.GRPO). The std has Bessel's correction
  (`ddof = 1`) as verl computes it (`torch.std`); a group of one sample has
  no spread and gets advantage 0 rather than NaN (verl: mean 0, std 1).

  Args:
    rewards: float `[P, G]`: P prompts with G samples each.
    std_normalize: divide by the group std (GRPO) or not (Dr.GRPO).
    eps: added to the std.
    ddof: delta degrees of freedom of the std (0: the population std).

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
  if rewards_PxG.shape[1] <= ddof:
    return jnp.zeros_like(centred_PxG)  # the centred rewards are all 0
  std_Px1 = jnp.std(rewards_PxG, axis=1, keepdims=True, ddof=ddof)
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


def broadcast_to_actions(advantages, action_mask, segment_ids=None):
  """Spreads one advantage per trajectory `[N]` over its action tokens `[B, T]`.

  GRPO and the running-mean baseline give one scalar per trajectory; the token
  losses want it on every action token and 0 elsewhere.

  Args:
    advantages: float `[N]`, one per trajectory.
    action_mask: bool or 0/1 `[B, T]`.
    segment_ids: int `[B, T]` (`TrainBatch.segment_ids_BxT`): token t
      belongs to trajectory `segment_ids[t] - 1`; None: trajectory n is row n
      (N = B).
  """
  where = 'broadcast_to_actions'
  array_checks.require_rank(where, 'advantages', advantages, '[N]')
  array_checks.require_rank(where, 'action_mask', action_mask, '[B, T]')
  mask_BxT = jnp.asarray(action_mask).astype(bool)
  adv_N = jnp.asarray(advantages, _F32)
  if segment_ids is None:
    (batch,) = jnp.shape(advantages)
    array_checks.require_shape(where, 'action_mask', action_mask,
                               (batch, jnp.shape(action_mask)[1]), '[B, T]')
    return jnp.where(mask_BxT, adv_N[:, None], 0.0)
  array_checks.require_shape(where, 'segment_ids', segment_ids,
                             jnp.shape(action_mask), '[B, T]')
  ids_BxT = jnp.asarray(segment_ids, jnp.int32)
  adv_BxT = jnp.take(adv_N, jnp.maximum(ids_BxT - 1, 0), axis=0)
  return jnp.where(mask_BxT & (ids_BxT > 0), adv_BxT, 0.0)


def normalize_advantages(advantages, action_mask, eps=1e-8):
  """Whitens advantages over the batch's action tokens (off by default in SAO).

  `(A - mean) / sqrt(var + eps)` on action tokens and 0 elsewhere, mean and
  variance over all action tokens of the batch, the variance with Bessel's
  correction: verl's `masked_whiten` (PPO's GAE advantages). A batch of one
  action token is only centred (verl raises).
  """
  where = 'normalize_advantages'
  array_checks.require_rank(where, 'advantages', advantages, '[B, T]')
  array_checks.require_shape(where, 'action_mask', action_mask,
                             jnp.shape(advantages), '[B, T]')
  mask_BxT = jnp.asarray(action_mask).astype(bool)
  adv_BxT = jnp.where(mask_BxT, jnp.asarray(advantages, _F32), 0.0)
  count = jnp.sum(mask_BxT).astype(_F32)
  mean = jnp.sum(adv_BxT) / jnp.maximum(count, 1.0)
  sq_dev = jnp.sum(jnp.where(mask_BxT, (adv_BxT - mean) ** 2, 0.0))
  var = jnp.where(count > 1, sq_dev / jnp.maximum(count - 1.0, 1.0), 0.0)
  scale = jnp.where(count > 1, jax.lax.rsqrt(var + eps), 1.0)
  return jnp.where(mask_BxT, (adv_BxT - mean) * scale, 0.0)
