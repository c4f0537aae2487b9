"""The record of one finished rollout, as workers hand it to the queue.

A trajectory is the token sequence `[prompt, action_0, obs_0, action_1, ...]`
with, per token, whether the policy generated it (action) and, for actions,
the behaviour log-prob mu_t the rollout engine sampled it with and the policy
version that did the sampling. Weights may change while a trajectory is being
generated (partial rollouts), so versions can differ within one trajectory;
staleness is measured from the *oldest* (SAO.md §2).
"""

from __future__ import annotations

import dataclasses
from typing import Any

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
