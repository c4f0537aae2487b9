"""Simulated environment latency: heavy-tailed and reproducible per turn.

A real tool, judge or sandbox takes time, and the slow tail is what makes
asynchronous rollouts pay off: a synchronous batch waits for its slowest
episode. Environments that simulate latency draw it here, from a lognormal
with median `median_s` and log-space deviation `sigma` (p99 ~ median *
e^(2.33 sigma)), optionally capped at `max_s`. The draw is seeded by
(seed, task id, turn, the call: the reply that made it), so the same call
waits the same time in every run while the G episodes of a GRPO group, whose
replies differ, wait independently, as separate tool calls do. It is slept
with asyncio in `astep` so that one slow episode never blocks the others.
"""

from __future__ import annotations

import math

from sao_jax.envs import arithmetic
# The hash salt of every draw; the calculator's delays were first drawn under
# this name and keep their values.
_SALT = 'tool_latency'


def check(median_s: float, sigma: float, max_s: float | None,
          what: str = 'delay') -> None:
  """Raises ValueError unless median and sigma are >= 0 and a cap is > 0."""
  if median_s < 0 or sigma < 0:
    raise ValueError(f'{what} median and sigma must be >= 0, got median'
                     f' {median_s} and sigma {sigma}')
  if max_s is not None and max_s <= 0:
    raise ValueError(f'{what} cap must be > 0 (or None for none), got {max_s}')


def lognormal_seconds(median_s: float, sigma: float, max_s: float | None,
                      seed: int, task_id: str, turn: int,
                      call: str = '') -> float:
  """Seconds turn `turn` of task `task_id` takes; 0 when `median_s` is 0.

  Args:
    median_s: median latency; 0 disables it.
    sigma: lognormal sigma (log-space standard deviation).
    max_s: optional cap on one delay.
    seed: the environment's seed (varies latencies between runs).
    task_id: the episode's task.
    turn: the 0-based model turn.
    call: what the turn asked for (its reply text). Without it every episode
      of a task waits alike on a turn, so a group's members would all finish
      together and never wait for each other.
  """
  if median_s <= 0:
    return 0.0
  key = (seed, task_id, turn, call) if call else (seed, task_id, turn)
  rng = arithmetic.seeded_rng(_SALT, *key)
  delay = median_s * math.exp(sigma * rng.gauss(0.0, 1.0))
  if max_s is not None:
    delay = min(delay, max_s)
  return delay
