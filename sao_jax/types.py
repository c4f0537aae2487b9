"""The records that travel from a rollout server to the loss, one per concept.

  Trajectory   one finished rollout, as workers hand it to the queue (host,
               numpy, variable length L)
  TrainBatch   a batch of trajectories in fixed-shape rows [B, T] (one per
               row, or packed several to a row): the learner's input,
               numpy on the host and jax arrays inside `jit` (a pytree)
  LearnerState everything a learner step reads and writes (a pytree)

A trajectory is the token sequence `[prompt, action_0, obs_0, action_1, ...]`
with, per token, whether the policy generated it (action) and, for actions,
the behaviour log-prob mu_t the rollout engine sampled it with and the policy
version that sampled it. Versions can differ within one trajectory (weights
change during partial rollouts); staleness counts from the oldest (SAO.md §2).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import chex
import numpy as np

NO_VERSION = -1  # version entry of prompt and observation tokens


@dataclasses.dataclass
class Trajectory:
  """One finished rollout.

  Attributes:
    prompt_id: identifies the prompt (task) it answers: running-mean slots and
      GRPO groups key on it.
    group_id: the GRPO group (one prompt instance sampled G times), or None.
    tokens: int32 `[L]` the whole sequence.
    action_mask: bool `[L]`, True on tokens the policy generated.
    behavior_logprobs: float32 `[L]` mu_t on action tokens, 0 elsewhere.
    versions: int32 `[L]` policy version of each action token, `NO_VERSION`
      elsewhere.
    reward: the outcome reward (placed on the last action token in batches).
    info: task and episode details (correctness, answer, turns, finish reason).
    routed_experts: int16 `[L, layers * k]` or None: for an MoE policy, the
      experts the engine routed each generated token to (each layer's k,
      layer by layer), -1 on tokens it did not record (prompt,
      observations); what routing replay feeds the learner.
  """
  prompt_id: str
  tokens: np.ndarray
  action_mask: np.ndarray
  behavior_logprobs: np.ndarray
  versions: np.ndarray
  reward: float
  group_id: str | None = None
  info: dict[str, Any] = dataclasses.field(default_factory=dict)
  routed_experts: np.ndarray | None = None

  @property
  def length(self) -> int:
    return int(len(self.tokens))

  @property
  def num_action_tokens(self) -> int:
    return int(np.sum(self.action_mask))

  @property
  def oldest_version(self) -> int:
    """The oldest policy version among the action tokens (staleness is
    counted from it), or `NO_VERSION` when there are none."""
    actions = self.versions[self.action_mask]
    return int(actions.min()) if actions.size else NO_VERSION

  @property
  def newest_version(self) -> int:
    actions = self.versions[self.action_mask]
    return int(actions.max()) if actions.size else NO_VERSION


@chex.dataclass(frozen=True)
class TrainBatch:
  """Trajectories as fixed-shape arrays: R rows of T tokens (a pytree).

  Built on the host by `rollout.batching.assemble_batch` (numpy), placed on
  the mesh by `Learner.device_batch`, and read as is inside the jitted step.
  Field names end in their layout: `_BxT` per token of a row, `_N` per
  trajectory (N = the batch's trajectories, `config.batch_size`, in the
  queue's order: GRPO groups are contiguous on it).

  A row holds one trajectory (unpacked: R = N) or several back to back
  (packed, `config.batching`): a segment of a row is one trajectory, with its
  own positions from 0, attending only to itself. The unpacked batch is the
  special case of one segment per row, so the math has one path.

  Attributes:
    tokens_BxT: int32, pad id past each segment's end.
    input_mask_BxT: bool, True on real tokens.
    action_mask_BxT: bool, True on tokens the policy generated.
    behavior_logprobs_BxT: float32 mu_t on actions, 0 elsewhere.
    versions_BxT: int32 policy version that sampled each action token, -1
      elsewhere (token staleness = learner version - it).
    rewards_BxT: float32, the outcome reward on each segment's last action
      token and 0 elsewhere (what skip-observation GAE reads).
    positions_BxT: int32 RoPE positions, counted from 0 in each segment (0 on
      padding).
    segment_ids_BxT: int32, 0 on padding, `1 + n` on the tokens of
      trajectory n (its index on the `_N` axis): attention, GAE and the
      per-trajectory aggregation never cross a change of id, and a token's
      `_N` entries are `x_N[segment_ids_BxT - 1]`.
    reward_N: float32 outcome rewards R (GRPO and running-mean baselines).
    num_action_tokens_N: int32 (the length-adaptive lambda's l).
    slot_ids_N: int32 running-mean slot of each trajectory's prompt (0 when
      unused).
    routed_experts_BxTxR: int16 `[B, T, R]` (R = layers x k) the experts the
      engine routed each token to, -1 where it recorded none; None for a
      dense policy (`Trajectory.routed_experts`).
  """
  tokens_BxT: Any
  input_mask_BxT: Any
  action_mask_BxT: Any
  behavior_logprobs_BxT: Any
  versions_BxT: Any
  rewards_BxT: Any
  positions_BxT: Any
  segment_ids_BxT: Any
  reward_N: Any
  num_action_tokens_N: Any
  slot_ids_N: Any
  routed_experts_BxTxR: Any = None


# The dtype of each `TrainBatch` field (`rollout.batching` builds them so).
TRAIN_BATCH_DTYPES = {
    'tokens_BxT': np.int32, 'input_mask_BxT': np.bool_,
    'action_mask_BxT': np.bool_, 'behavior_logprobs_BxT': np.float32,
    'versions_BxT': np.int32,
    'rewards_BxT': np.float32, 'positions_BxT': np.int32,
    'segment_ids_BxT': np.int32, 'reward_N': np.float32,
    'num_action_tokens_N': np.int32, 'slot_ids_N': np.int32,
    'routed_experts_BxTxR': np.int16,
}
# The sentinel of a token whose routing was not recorded.
NOT_RECORDED = -1


def field_rank(name: str) -> int:
  """3 for a `_BxTxR` field, 2 for a `_BxT` field, 1 for a `_N` field of
  `TrainBatch`."""
  if name.endswith('_BxTxR'):
    return 3
  return 2 if name.endswith('_BxT') else 1


def row_fields(batch: TrainBatch) -> TrainBatch:
  """The batch without its per-trajectory (`_N`) fields (None there).

  What mini- and micro-batches split: they take rows, and a row of a packed
  batch holds a varying number of trajectories, so the `_N` arrays have no
  row-wise split. They are read once per batch (advantages), never per
  mini-batch.
  """
  return batch.replace(**{name: None for name in TRAIN_BATCH_DTYPES
                          if field_rank(name) == 1})


class LearnerState(NamedTuple):
  """Everything a learner step reads and writes (a pytree, donated per step).

  Attributes:
    policy: the policy's parameters theta (nnx State).
    critic: the critic's trainable parameters phi (MLP and head when attention
      is frozen; all of them otherwise), or None without a critic.
    critic_frozen: the critic's frozen parameters (possibly empty), or None.
    actor_opt, critic_opt: optimiser states (critic_opt None without critic).
    running_mean: what the advantage estimator carries between batches
      (`algorithms.Estimator.init_state`: the running-mean baseline's reward
      history), or None.
    ref_policy: the frozen initial policy of the reference-model KL
      (`policy_loss.ref_kl_coef` > 0), or None: one more copy of the policy's
      parameters, no optimizer state.
    step: batches trained so far: the policy version.
    critic_step: critic updates so far (pretraining included).
  """
  policy: Any
  critic: Any
  critic_frozen: Any
  actor_opt: Any
  critic_opt: Any
  running_mean: Any
  ref_policy: Any
  step: Any
  critic_step: Any
