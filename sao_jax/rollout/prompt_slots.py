"""Which running-mean slot each trajectory's question takes (`slot_ids_N`).

The per-question running-mean baseline (SAO.md §3) keeps one mean per
question; a batch names each trajectory's slot. The rollout system fills them
in (`RolloutSystem.next_batch`), and the trainer checkpoints the table.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np

from sao_jax import host_gather


def question_digest(tokens_T, action_mask_T) -> str:
  """A stable name of a trajectory's question: its prompt tokens, hashed.

  The prompt is every token before the first action. The digest is the same in
  every process and after a resume (unlike Python's salted `hash`), and the
  same question under two task indices gets the same name.
  """
  mask_T = np.asarray(action_mask_T, bool)
  first = int(np.argmax(mask_T)) if mask_T.any() else len(mask_T)
  prompt = np.asarray(tokens_T[:first], '<i4').tobytes()
  return hashlib.blake2b(prompt, digest_size=8).hexdigest()


class PromptSlots:
  """Dense slot ids of questions for the per-question running-mean baseline.

  Questions (`question_digest`) get slots in order of first appearance; past
  `capacity` distinct questions, new ones share slots chosen by their digest
  (counted): a bounded memory that degrades gracefully for huge question sets,
  and the same choice in every process. On several processes
  `trajectory_ids` numbers the digests of every host's batch, gathered in
  process order, so every host holds the same table and a slot names one
  question across the global batch.
  """

  def __init__(self, capacity: int):
    self.capacity = capacity
    self._slots: dict[str, int] = {}
    self.shared = 0

  def ids(self, digests: Iterable[str]) -> np.ndarray:
    out = []
    for digest in digests:
      slot = self._slots.get(digest)
      if slot is None:
        if len(self._slots) < self.capacity:
          slot = self._slots[digest] = len(self._slots)
        else:
          slot = int(digest, 16) % self.capacity
          self.shared += 1
      out.append(slot)
    return np.asarray(out, np.int32)

  def batch_ids(self, tokens_BxT, action_mask_BxT) -> np.ndarray:
    """The slot of each row's question."""
    return self.ids(question_digest(t, m)
                    for t, m in zip(tokens_BxT, action_mask_BxT))

  def trajectory_ids(self, trajectories) -> np.ndarray:
    """The slot of each trajectory's question (`TrainBatch.slot_ids_N`):
    per trajectory, not per row, since a packed row holds several.

    A collective on several processes: every process calls it with its own
    batch, at the same step.
    """
    mine = [question_digest(t.tokens, t.action_mask) for t in trajectories]
    every = host_gather.allgather_json(mine)
    ids = self.ids(itertools.chain.from_iterable(every))
    offset = sum(len(d) for d in every[:jax.process_index()])
    return ids[offset:offset + len(mine)]

  def state_dict(self) -> dict[str, Any]:
    return {'slots': dict(self._slots), 'shared': self.shared}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    self._slots = {str(k): int(v) for k, v in state['slots'].items()}
    self.shared = int(state.get('shared', 0))
