"""Host-side bookkeeping of the training loop: metrics and timings."""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

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
