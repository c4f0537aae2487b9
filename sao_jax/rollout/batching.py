"""Trajectories of a batch padded into the fixed-shape arrays the learner takes.

The rollout queue hands the learner lists of `Trajectory` records of
different lengths; the jitted train step wants numpy arrays of one shape,
[B, T], so that it compiles once. `assemble_batch` pads them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sao_jax import types


def assemble_batch(trajectories: Sequence[types.Trajectory],
                   max_length: int, pad_id: int) -> types.TrainBatch:
  """Pads trajectories into a `types.TrainBatch` of shape [B, T = max_length].

  Its `slot_ids_B` are 0: the trainer sets the running-mean slots.

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
    rewards_BxT[row, np.flatnonzero(mask_L)[-1]] = traj.reward
  return types.TrainBatch(
      tokens_BxT=tokens_BxT,
      input_mask_BxT=input_mask_BxT,
      action_mask_BxT=action_mask_BxT,
      behavior_logprobs_BxT=logprobs_BxT,
      rewards_BxT=rewards_BxT,
      reward_B=np.array([t.reward for t in trajectories], np.float32),
      num_action_tokens_B=np.array(
          [t.num_action_tokens for t in trajectories], np.int32),
      slot_ids_B=np.zeros(batch, np.int32))
