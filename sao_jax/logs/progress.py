"""A progress bar over policy steps, for people watching a run.

The numbers worth a glance: where the run is, whether reward is moving, the last
eval, and throughput. Everything else belongs in `metrics_log` (TensorBoard and
the JSONL), which this does not replace.

A bar redraws in place on a terminal, but in a CI log or a file every redraw is
a new line; there the bar redraws at most every 30 s, so a long run adds a few
lines a minute, not one per step.
"""

from __future__ import annotations

import collections
import math
import sys
import time
from typing import Any, Callable, Mapping, TextIO

import numpy as np
import tqdm

REWARD = 'train/reward'
EVAL_ACCURACY = 'eval/accuracy'

# Seconds between redraws: a terminal redraws in place, so often is cheap; a
# log gets a line per redraw.
_TTY_MININTERVAL = 0.5
_LOG_MININTERVAL = 30.0


class Progress:
  """A tqdm bar over policy steps with reward, eval accuracy and throughput.

  The postfix reads e.g. `step=120 reward=0.431 acc=0.512 steps/min=2.1
  traj/s=5.3`: `reward` is the mean of `train/reward` over the last
  `reward_window` updates (one step's reward is mostly noise), `acc` the last
  `eval/accuracy` seen (absent until the first eval), and the rates are over
  the last `rate_window` updates, so they follow the current speed rather than
  averaging in the compile time of the first steps.

  In a multi-host job, pass `enabled=jax.process_index() == 0`.
  """

  def __init__(self, total_steps: int, initial: int = 0, enabled: bool = True,
               *, file: TextIO | None = None, mininterval: float | None = None,
               reward_window: int = 20, rate_window: int = 20,
               clock: Callable[[], float] = time.monotonic):
    """Starts the bar.

    Args:
      total_steps: the step the run ends at.
      initial: the step the run starts from (a resumed run's checkpoint).
      enabled: draw the bar; when False, `update` and `close` do nothing and
        `print_line` still prints.
      file: the stream to draw on (default stderr).
      mininterval: seconds between redraws; by default 0.5 on a terminal, 30
        elsewhere (CI logs, files).
      reward_window: updates that the shown reward is averaged over.
      rate_window: updates that the rates are measured over.
      clock: seconds, for the rates (tests inject a fake one).
    """
    self._file = sys.stderr if file is None else file
    self._enabled = enabled
    self._clock = clock
    self._rewards = collections.deque(maxlen=reward_window)
    # (time, step, trajectories or None), oldest first.
    self._marks = collections.deque(maxlen=rate_window + 1)
    self._marks.append((clock(), initial, None))
    self._accuracy = None
    self._closed = False
    is_tty = _isatty(self._file)
    if mininterval is None:
      mininterval = _TTY_MININTERVAL if is_tty else _LOG_MININTERVAL
    self._bar = tqdm.tqdm(
        total=total_steps, initial=initial, disable=not enabled,
        file=self._file, unit='step', dynamic_ncols=is_tty,
        # miniters=1 with a fixed mininterval: redraw on time alone. tqdm's
        # default dynamic miniters would learn to skip steps and then, on a
        # slow step, wait for a count that comes minutes later.
        mininterval=mininterval, miniters=1,
        # Plain characters in logs, where unicode blocks may render as junk.
        ascii=not is_tty)

  def update(self, step: int, metrics: Mapping[str, Any] | None = None, *,
             trajectories: int | None = None) -> None:
    """Moves the bar to `step` and refreshes its postfix (drawn when due).

    Args:
      step: the policy step just finished.
      metrics: this step's metrics; `train/reward` and `eval/accuracy` are
        read if present (Python, numpy or jax scalars; non-finite rewards are
        left out of the mean).
      trajectories: total trajectories trained on so far, for `traj/s`.
    """
    if not self._enabled or self._closed:
      return
    metrics = metrics or {}
    reward = _as_float(metrics.get(REWARD))
    if reward is not None and math.isfinite(reward):
      self._rewards.append(reward)
    accuracy = _as_float(metrics.get(EVAL_ACCURACY))
    if accuracy is not None:
      self._accuracy = accuracy
    self._marks.append((self._clock(), step, trajectories))
    self._bar.set_postfix_str(self.postfix(step), refresh=False)
    # update() rather than assigning n: it is what applies mininterval.
    self._bar.update(step - self._bar.n)

  def postfix(self, step: int) -> str:
    """The postfix text for `step`, from what the updates so far reported."""
    parts = [f'step={step}']
    if self._rewards:
      parts.append(f'reward={np.mean(self._rewards):.3f}')
    if self._accuracy is not None:
      parts.append(f'acc={self._accuracy:.3f}')
    (t0, step0, _), (t1, step1, _) = self._marks[0], self._marks[-1]
    if t1 > t0:
      parts.append(f'steps/min={(step1 - step0) / (t1 - t0) * 60:.2f}')
    counted = [(t, n) for t, _, n in self._marks if n is not None]
    if len(counted) >= 2 and counted[-1][0] > counted[0][0]:
      (t0, n0), (t1, n1) = counted[0], counted[-1]
      parts.append(f'traj/s={(n1 - n0) / (t1 - t0):.2f}')
    return ' '.join(parts)

  def print_line(self, text: str) -> None:
    """Prints `text` on its own line without breaking the bar."""
    tqdm.tqdm.write(text, file=self._file)

  def close(self) -> None:
    """Draws the final state and releases the bar; later calls do nothing."""
    if self._closed:
      return
    self._closed = True
    self._bar.close()

  def __enter__(self) -> Progress:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def _isatty(stream: Any) -> bool:
  try:
    return bool(stream.isatty())
  except (AttributeError, ValueError):  # No isatty, or a closed stream.
    return False


def _as_float(value: Any) -> float | None:
  if value is None:
    return None
  # np.asarray fetches a jax scalar to host.
  return float(np.asarray(value).reshape(()))
