"""The records that travel from a rollout server to the loss, one per concept.

  Trajectory   one finished rollout, as workers hand it to the queue (host,
               numpy, variable length L)
  TrainBatch   a batch of trajectories padded to [B, T]: the learner's input,
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
  """
  prompt_id: str
  tokens: np.ndarray
  action_mask: np.ndarray
  behavior_logprobs: np.ndarray
  versions: np.ndarray
  reward: float
  group_id: str | None = None
  info: dict[str, Any] = dataclasses.field(default_factory=dict)

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
  """Trajectories as fixed-shape arrays, right-padded to T (a pytree).

  Built on the host by `rollout.batching.assemble_batch` (numpy), placed on
  the mesh by `Learner.device_batch`, and read as is inside the jitted step.
  Field names end in their layout: `_BxT` per token, `_B` per row.

  Attributes:
    tokens_BxT: int32, pad id past each row's end.
    input_mask_BxT: bool, True on real tokens.
    action_mask_BxT: bool, True on tokens the policy generated.
    behavior_logprobs_BxT: float32 mu_t on actions, 0 elsewhere.
    rewards_BxT: float32, the outcome reward on each row's last action token
      and 0 elsewhere (what skip-observation GAE reads).
    reward_B: float32 outcome rewards R (GRPO and running-mean baselines).
    num_action_tokens_B: int32 (the length-adaptive lambda's l).
    slot_ids_B: int32 running-mean slot of each row's prompt (0 when unused).
  """
  tokens_BxT: Any
  input_mask_BxT: Any
  action_mask_BxT: Any
  behavior_logprobs_BxT: Any
  rewards_BxT: Any
  reward_B: Any
  num_action_tokens_B: Any
  slot_ids_B: Any


# The dtype of each `TrainBatch` field (`rollout.batching` builds them so).
TRAIN_BATCH_DTYPES = {
    'tokens_BxT': np.int32, 'input_mask_BxT': np.bool_,
    'action_mask_BxT': np.bool_, 'behavior_logprobs_BxT': np.float32,
    'rewards_BxT': np.float32, 'reward_B': np.float32,
    'num_action_tokens_B': np.int32, 'slot_ids_B': np.int32,
}


def field_rank(name: str) -> int:
  """2 for a `_BxT` field, 1 for a `_B` field of `TrainBatch`."""
  return 2 if name.endswith('_BxT') else 1


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
