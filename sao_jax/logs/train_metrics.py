"""Host-side bookkeeping of the training loop: metrics, timings, prompt slots."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from sao_jax import host_gather
from sao_jax import process_memory
from sao_jax import types


def host_metrics(device_metrics: Mapping[str, Any]) -> dict[str, float]:
  """Device scalars as Python floats (one transfer)."""
  host = jax.device_get(dict(device_metrics))
  return {k: float(np.asarray(v)) for k, v in host.items()}


def prefixed(prefix: str, metrics: Mapping[str, Any]) -> dict[str, float]:
  return {f'{prefix}/{k}': float(v) for k, v in metrics.items()
          if isinstance(v, (int, float, np.number))}


def batch_metrics(trajectories: Sequence[types.Trajectory],
                  version: int) -> dict[str, float]:
  """What the batch says about the rollouts: reward, accuracy, staleness."""
  rewards = np.array([t.reward for t in trajectories], np.float64)
  correct = np.array([bool(t.info.get('correct', t.reward >= 1.0))
                      for t in trajectories])
  # The batch trains version `version - 1`; staleness from the oldest token.
  staleness = np.array([version - 1 - t.oldest_version for t in trajectories])
  # Per action token (a trajectory may span weight updates): what the
  # importance ratio of each trained token actually corrects for.
  token_staleness = np.concatenate(
      [version - 1 - t.versions[t.action_mask] for t in trajectories])
  lengths = np.array([t.num_action_tokens for t in trajectories])
  finish = collections.Counter(t.info.get('finish_reason', 'unknown')
                               for t in trajectories)
  metrics = {
      'train/reward': float(rewards.mean()),
      'train/reward_std': float(rewards.std()),
      'train/accuracy': float(correct.mean()),
      'rollout/staleness_mean': float(staleness.mean()),
      'rollout/staleness_max': float(staleness.max()),
      'rollout/token_staleness_mean': float(token_staleness.mean()),
      'rollout/token_staleness_p95': float(np.percentile(token_staleness, 95)),
      'rollout/action_tokens_mean': float(lengths.mean()),
      'rollout/turns_mean': float(np.mean([t.info.get('turns', 1)
                                           for t in trajectories])),
  }
  for reason, count in finish.items():
    metrics[f'rollout/finish_{reason}'] = count / len(trajectories)
  # Replies cut by the token budget whose reward was withheld
  # (`rollout.reward_cut_replies = False`), and how much they lost.
  cut = [t.info['cut_reward'] for t in trajectories if 'cut_reward' in t.info]
  metrics['rollout/cut_rewards_withheld'] = len(cut) / len(trajectories)
  metrics['rollout/cut_reward_lost_mean'] = (
      float(np.sum(cut)) / len(trajectories))
  return metrics


class MemoryPhases:
  """The learner process's resident memory after each phase of the run.

  `mark(phase)` ends a phase: it returns the allocator's free pages to the
  system (`process_memory.return_free_pages`: what one phase freed must not
  stay resident under the next) and records the resident set now
  (`memory/<phase>_rss_gb`) and the peak so far (`memory/<phase>_peak_rss_gb`,
  VmHWM: it only grows, so the phase after which it first reaches its final
  value is the one that set it). `metrics()` returns what was marked since
  its last call, plus the peak now, for the step's record.
  """

  def __init__(self):
    self._marked: dict[str, float] = {}

  def mark(self, phase: str) -> None:
    process_memory.return_free_pages()
    rss, peak = process_memory.usage()
    self._marked[f'memory/{phase}_rss_gb'] = rss
    self._marked[f'memory/{phase}_peak_rss_gb'] = peak

  def metrics(self) -> dict[str, float]:
    out, self._marked = self._marked, {}
    out['memory/peak_rss_gb'] = process_memory.usage()[1]
    return out


class StepTimer:
  """Wall time per phase of a step (wait for data, train, weight sync)."""

  def __init__(self):
    self._seconds = collections.defaultdict(float)
    self._start = time.perf_counter()

  @contextlib.contextmanager
  def phase(self, name: str):
    start = time.perf_counter()
    try:
      yield
    finally:
      self._seconds[name] += time.perf_counter() - start

  def metrics(self) -> dict[str, float]:
    """Seconds of this step per phase, and the learner's idle fraction."""
    total = time.perf_counter() - self._start
    out = {f'time/{k}_seconds': v for k, v in self._seconds.items()}
    out['time/step_seconds'] = total
    # Idle: waiting for trajectories, not computing or syncing.
    out['time/learner_idle_fraction'] = self._seconds['wait'] / max(total,
                                                                     1e-9)
    self._seconds.clear()
    self._start = time.perf_counter()
    return out


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


class Plateau:
  """Stops when a score has not gained `min_delta` for `patience` updates.

  Value pretraining's rule. Non-finite scores (R^2 of a batch whose returns
  are all equal is undefined) are not counted either way.
  """

  def __init__(self, patience: int, min_delta: float):
    self.patience = patience
    self.min_delta = min_delta
    self.best = -np.inf
    self.since_best = 0

  def update(self, score: float) -> bool:
    """Records one score; True when the rule says stop."""
    if not np.isfinite(score):
      return False
    if score > self.best + self.min_delta:
      self.best, self.since_best = score, 0
    else:
      self.since_best += 1
    return self.since_best >= self.patience
