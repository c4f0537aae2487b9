"""Which training tasks were handed out, and which the learner consumed.

The rollout workers take tasks in index order from a `TaskStream`, but
episodes finish (and are consumed) out of order, and at a checkpoint some are
still in flight or waiting in the queue, which is not saved. Resuming from the
stream's cursor would skip those; resuming from zero would repeat everything.
The ledger saves the *frontier* (the lowest index handed out but not yet
done) and the done indices above it: a resumed run replays from the frontier
and skips what was already consumed, so no task is lost or trained on twice.
With synchronous training the consumed tasks are exactly the next indices,
and a resumed run trains on the same batches it would have.

A task is done when its trajectories are consumed by the learner or its
request failed for good (counted by the workers); trajectories the queue
rejected or dropped as stale are not reported back, so their tasks are
replayed after a resume (a slight over-sampling, never a loss).
"""

from __future__ import annotations

import threading
from typing import Any

from sao_jax.envs import base
from sao_jax.envs import task_stream

class TaskLedger:
  """Thread-safe: workers take tasks in their loop, the learner marks them."""

  def __init__(self, stream: task_stream.TaskStream):
    self._stream = stream
    self._lock = threading.Lock()
    self._outstanding: set[int] = set()  # handed out, not done
    self._done_above: set[int] = set()  # done, above the frontier
    self.handed_out = 0

  def next_task(self) -> tuple[int, base.Task]:
    """The next training task and its index (skipping done replays)."""
    with self._lock:
      while True:
        task = next(self._stream)
        index = self._stream.last_index
        if index in self._done_above:
          continue
        self._outstanding.add(index)
        self.handed_out += 1
        return index, task

  def mark_done(self, indices) -> None:
    """Tasks whose trajectories were consumed (or failed for good)."""
    with self._lock:
      for index in indices:
        index = int(index)
        self._outstanding.discard(index)
        self._done_above.add(index)
      frontier = self._frontier()
      self._done_above = {i for i in self._done_above if i >= frontier}

  def _frontier(self) -> int:
    return min(self._outstanding) if self._outstanding else self._stream.cursor

  def state_dict(self) -> dict[str, Any]:
    """JSON-able: the stream resumed at the frontier, and what is done above."""
    with self._lock:
      frontier = self._frontier()
      stream_state = dict(self._stream.state_dict(), cursor=frontier)
      return {'stream': stream_state,
              'done_above': sorted(i for i in self._done_above
                                   if i >= frontier),
              'handed_out': self.handed_out}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    with self._lock:
      self._stream.load_state_dict(state['stream'])
      self._done_above = set(int(i) for i in state['done_above'])
      self._outstanding = set()
      self.handed_out = int(state.get('handed_out', 0))
