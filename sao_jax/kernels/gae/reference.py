"""Skip-observation GAE (SAO §1.4) in plain JAX: its definition.

Every implementation is tested against `skip_observation_gae` here; it runs
under XLA anywhere. `sao_jax.rl.advantages.skip_observation_gae` is this
function, and `sao_jax.kernels.gae.api` picks between it and the Pallas
kernel (and runs the kernel per batch shard on a mesh).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from sao_jax import array_checks

_F32 = jnp.float32


def skip_observation_gae(rewards: chex.Array, values: chex.Array,
                         action_mask: chex.Array, *, gamma: float,
                         lam: float | chex.Array,
                         segment_ids=None):
  """Token-level GAE whose recursion runs over action tokens only (SAO §1.4).

  For an action token t let n(t) be the next action token of the same
  trajectory, skipping every non-action token in between (environment
  observations, padding).
  Then

    delta_t = r_t + gamma * V[n(t)] - V[t]
    A_t     = delta_t + gamma * lam * A[n(t)]

  with `V[n(t)] = A[n(t)] = 0` when t is the last action token of its
  trajectory: of its row, or of its segment in a packed row, so nothing
  carries from one trajectory into the one before it. The last
  token of action i thus bootstraps from the first token of action i+1, jumping the
  observation between them: observations condition the values that follow them but
  get no advantage, no value target and no loss.

  Args:
    rewards: float `[B, T]` per-token rewards r_t. Only action positions are read;
      the trajectory builder puts the outcome reward on the last action token.
    values: float `[B, T]` critic values V_t. Only action positions are read.
    action_mask: bool or 0/1 `[B, T]`, m_t.
    gamma: discount gamma (a Python float or a scalar array; SAO uses 1).
    lam: GAE lambda, a scalar, float `[B]` (one per row) or `[B, T]` (per
      token: packed rows hold trajectories of different lambdas, e.g. from
      `length_adaptive_lambda`). Only action positions are read.
    segment_ids: int `[B, T]` (`TrainBatch.segment_ids_BxT`): the
      recursion restarts where the id changes; None: one trajectory per row.

  Returns:
    `(advantages, returns)`, both float32 `[B, T]`: A_t and the value target
    `R_t = A_t + V_t`, zero wherever `action_mask == 0`.

  References:
    Schulman et al., "High-Dimensional Continuous Control Using Generalized
    Advantage Estimation", 2015; SAO (arXiv 2607.07508) §3, skip-observation GAE.
  """
  where = 'skip_observation_gae'
  mask_BxT, gamma, lam = check_gae_inputs(where, rewards, values, action_mask,
                                          gamma, lam)
  batch = mask_BxT.shape[0]
  lam_BxT = jnp.broadcast_to(lam[:, None] if lam.ndim == 1 else lam,
                             mask_BxT.shape)
  ends_BxT = segment_ends(where, segment_ids, mask_BxT.shape)
  # Sanitise non-action positions first: rewards there are ignored by
  # definition, and values at padding may be garbage (even NaN).
  rewards_BxT = jnp.where(mask_BxT, jnp.asarray(rewards, _F32), 0.0)
  values_BxT = jnp.where(mask_BxT, jnp.asarray(values, _F32), 0.0)

  def step(carry, xs):
    reward_B, value_B, is_action_B, lam_B, end_B = xs
    # V[n(t)], A[n(t)] for the rows; none past the trajectory's end.
    next_value_B, next_adv_B = jax.tree.map(
        lambda x: jnp.where(end_B, 0.0, x), carry)
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
      step, init, (rewards_BxT.T, values_BxT.T, mask_BxT.T, lam_BxT.T,
                   ends_BxT.T), reverse=True)
  adv_BxT = adv_TxB.T
  returns_BxT = jnp.where(mask_BxT, adv_BxT + values_BxT, 0.0)
  return adv_BxT, returns_BxT


def segment_ends(where, segment_ids, shape):
  """True on the last token of each segment (and of each row): bool `[B, T]`.

  Where the GAE recursion, walking backwards, starts afresh. None: one
  segment per row, whose end is the row's last token.
  """
  if segment_ids is None:
    return jnp.broadcast_to(jnp.arange(shape[1]) == shape[1] - 1, shape)
  array_checks.require_shape(where, 'segment_ids', segment_ids, shape,
                             '[B, T]')
  ids_BxT = jnp.asarray(segment_ids, jnp.int32)
  return ids_BxT != jnp.pad(ids_BxT[:, 1:], ((0, 0), (0, 1)),
                            constant_values=-1)


def check_gae_inputs(where, rewards, values, action_mask, gamma, lam):
  """Validates GAE arguments (shared with the Pallas kernel's dispatcher).

  Returns:
    `(mask_BxT bool, gamma float32 scalar, lam float32 [B] or [B, T])`.
  """
  array_checks.require_rank(where, 'rewards', rewards, '[B, T]')
  batch, length = jnp.shape(rewards)
  array_checks.require_shape(where, 'values', values, (batch, length), '[B, T]')
  array_checks.require_shape(where, 'action_mask', action_mask, (batch, length),
                             '[B, T]')
  array_checks.require_float(where, 'rewards', rewards)
  array_checks.require_float(where, 'values', values)
  if jnp.ndim(lam) == 2:
    array_checks.require_shape(where, 'lam', lam, (batch, length),
                               'a scalar, [B] or [B, T]')
    lam = jnp.asarray(lam, _F32)
  else:
    lam = _per_row(where, 'lam', lam, batch)
  return (jnp.asarray(action_mask).astype(bool), _scalar(where, 'gamma', gamma),
          lam)


def _scalar(where, name, x):
  if jnp.ndim(x) != 0:
    raise ValueError(f'{where}: {name} must be a scalar, got shape'
                     f' {tuple(jnp.shape(x))}')
  return jnp.asarray(x, _F32)


def _per_row(where, name, x, batch):
  """A scalar or `[B]` argument as float32 `[B]`."""
  if jnp.ndim(x) == 0:
    return jnp.full((batch,), x, _F32)
  array_checks.require_shape(where, name, x, (batch,), 'a scalar, [B] or'
                             ' [B, T]')
  return jnp.asarray(x, _F32)
