"""Trajectories of a batch padded into the fixed-shape arrays the learner takes.

The rollout queue hands the learner lists of `Trajectory` records of
different lengths; the jitted train step wants numpy arrays of one shape,
[B, T], so that it compiles once. `assemble_batch` pads them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from sao_jax.rollout import trajectory


@dataclasses.dataclass
class Batch:
  """Trajectories as fixed-shape numpy arrays, right-padded to T.

  Attributes:
    tokens_BxT: int32, pad_id past each row's end.
    input_mask_BxT: bool, True on real tokens.
    action_mask_BxT: bool, True on tokens the policy generated.
    behavior_logprobs_BxT: float32 mu_t on actions, 0 elsewhere.
    rewards_BxT: float32, the outcome reward on each row's last action token
      and 0 elsewhere (what skip-observation GAE reads).
    versions_BxT: int32 policy version of action tokens, NO_VERSION elsewhere.
    reward_B: float32 outcome rewards (GRPO and running-mean baselines).
    oldest_version_B: int32, staleness is counted from it.
    num_action_tokens_B: int32 (length-adaptive lambda).
    prompt_ids: the rows' prompt ids.
    group_ids: the rows' group ids (None outside GRPO).
  """
  tokens_BxT: np.ndarray
  input_mask_BxT: np.ndarray
  action_mask_BxT: np.ndarray
  behavior_logprobs_BxT: np.ndarray
  rewards_BxT: np.ndarray
  versions_BxT: np.ndarray
  reward_B: np.ndarray
  oldest_version_B: np.ndarray
  num_action_tokens_B: np.ndarray
  prompt_ids: list[str]
  group_ids: list[str | None]


def assemble_batch(trajectories: Sequence[trajectory.Trajectory],
                   max_length: int, pad_id: int) -> Batch:
  """Pads trajectories into a `Batch` of shape [B, T = max_length].

  T is fixed rather than the batch's longest row so that the jitted train
  step compiles once.

  Raises:
    ValueError: no trajectories, one longer than max_length, or one without
      an action token (its reward would have nowhere to go).
  """
  batch = len(trajectories)
  if not batch:
    raise ValueError('assemble_batch: no trajectories')
  tokens_BxT = np.full((batch, max_length), pad_id, np.int32)
  input_mask_BxT = np.zeros((batch, max_length), bool)
  action_mask_BxT = np.zeros((batch, max_length), bool)
  logprobs_BxT = np.zeros((batch, max_length), np.float32)
  rewards_BxT = np.zeros((batch, max_length), np.float32)
  versions_BxT = np.full((batch, max_length), trajectory.NO_VERSION, np.int32)
  for row, traj in enumerate(trajectories):
    length = traj.length
    mask_L = np.asarray(traj.action_mask, bool)
    if length > max_length:
      raise ValueError(f'assemble_batch: row {row} (prompt {traj.prompt_id!r})'
                       f' has {length} tokens, more than max_length'
                       f' {max_length}')
    if not mask_L.any():
      raise ValueError(f'assemble_batch: row {row} (prompt {traj.prompt_id!r})'
                       ' has no action token')
    tokens_BxT[row, :length] = traj.tokens
    input_mask_BxT[row, :length] = True
    action_mask_BxT[row, :length] = mask_L
    logprobs_BxT[row, :length] = np.where(mask_L, traj.behavior_logprobs, 0.0)
    versions_BxT[row, :length] = np.where(mask_L, traj.versions,
                                          trajectory.NO_VERSION)
    rewards_BxT[row, np.flatnonzero(mask_L)[-1]] = traj.reward
  return Batch(
      tokens_BxT=tokens_BxT,
      input_mask_BxT=input_mask_BxT,
      action_mask_BxT=action_mask_BxT,
      behavior_logprobs_BxT=logprobs_BxT,
      rewards_BxT=rewards_BxT,
      versions_BxT=versions_BxT,
      reward_B=np.array([t.reward for t in trajectories], np.float32),
      oldest_version_B=np.array([t.oldest_version for t in trajectories],
                                np.int32),
      num_action_tokens_B=np.array(
          [t.num_action_tokens for t in trajectories], np.int32),
      prompt_ids=[t.prompt_id for t in trajectories],
      group_ids=[t.group_id for t in trajectories])
