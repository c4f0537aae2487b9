"""Whether a finished trajectory can be trained on, and if not, why.

Workers hand the queue whatever their episodes produced, and a worker bug (or
a server returning garbage) must cost that trajectory, not the learner: a
NaN log-prob or an out-of-range token would poison a whole batch, a version
from the future would defeat the staleness bound. The rollout queue checks
every trajectory it is given with `rejection_reason`, then against its GRPO
groups, and counts rejections by reason: its `stats()` has one
`rejected/<reason>` per entry of `REJECT_REASONS`.
"""

from __future__ import annotations

import math

import numpy as np

from sao_jax.rollout import trajectory

# Why a trajectory was rejected; the queue's `stats()` has one
# `rejected/<reason>` each. The last three (and 'malformed' for a group id
# that is no dict key) are the queue's own group checks.
REJECT_REASONS = (
    'malformed',  # not a Trajectory, arrays of wrong rank or dtype
    'inconsistent_lengths',  # the per-token arrays differ in length
    'too_long',  # longer than max_length
    'token_out_of_range',  # a token id outside [0, vocab_size)
    'no_action_tokens',  # nothing to train on (and no token for the reward)
    'missing_version',  # an action token with version NO_VERSION (or < 0)
    'future_version',  # an action version newer than any that exists yet
    'bad_logprobs',  # an action log-prob non-finite or > tolerance
    'non_finite_reward',  # NaN, inf or not a number
    'missing_group_id',  # group_size > 1 and group_id is None
    'group_mismatch',  # not the group the lease was admitted for
    'group_overflow',  # a member of a group already released to the learner
)


def rejection_reason(traj, *, vocab_size: int, max_length: int,
                     newest_version: int,
                     logprob_tolerance: float = 1e-3) -> str | None:
  """Why `traj` cannot be trained on (one of `REJECT_REASONS`), or None.

  Never raises: a worker bug must cost its trajectory, not the queue.

  Args:
    traj: the candidate `Trajectory`.
    vocab_size: token ids must lie in [0, vocab_size).
    max_length: the most tokens a batch row holds.
    newest_version: the newest policy version that exists; an action token
      claiming a newer one is corrupt.
    logprob_tolerance: behaviour log-probs above this are corrupt.
  """
  if not isinstance(traj, trajectory.Trajectory):
    return 'malformed'
  try:
    tokens = np.asarray(traj.tokens)
    mask = np.asarray(traj.action_mask)
    logprobs = np.asarray(traj.behavior_logprobs)
    versions = np.asarray(traj.versions)
  except Exception:  # pylint: disable=broad-exception-caught
    return 'malformed'
  arrays = (tokens, mask, logprobs, versions)
  if any(a.ndim != 1 for a in arrays):
    return 'malformed'
  # A 0/1 integer mask is refused too: `versions[mask]` would then gather
  # positions 0 and 1 instead of selecting, in every consumer downstream.
  if (tokens.dtype.kind not in 'iu' or versions.dtype.kind not in 'iu' or
      mask.dtype.kind != 'b' or logprobs.dtype.kind != 'f'):
    return 'malformed'
  if len({a.shape[0] for a in arrays}) != 1:
    return 'inconsistent_lengths'
  if tokens.shape[0] > max_length:
    return 'too_long'
  if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
    return 'token_out_of_range'
  if not mask.any():
    return 'no_action_tokens'
  action_versions = versions[mask]
  if np.any(action_versions < 0):
    return 'missing_version'
  if action_versions.max() > newest_version:
    return 'future_version'
  action_logprobs = logprobs[mask]
  if (not np.all(np.isfinite(action_logprobs)) or
      np.any(action_logprobs > logprob_tolerance)):
    return 'bad_logprobs'
  try:
    if isinstance(traj.reward, (str, bytes)):
      raise TypeError('a reward is a number')
    reward = float(traj.reward)
  except (TypeError, ValueError):
    return 'non_finite_reward'
  if not math.isfinite(reward):
    return 'non_finite_reward'
  return None

