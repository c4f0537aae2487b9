"""The rollout queue's books, and every change to them, none of which waits.

`queue.RolloutQueue` owns one `Books` and adds what waits or crosses threads:
admission, backpressure, the learner's batches and blocking calls. The books
hold the slots admitted and in flight, the queued trajectories (ready units
and partial GRPO groups), the deadlines the admission rule reads, the groups
released or failed, and the counters behind `stats()` and the accounting
identity (docs/design/queue.md). Each method is one step that runs in the
queue's event loop thread, never awaits, and ends by calling `notify` (the
queue wakes its waiters) when it changed something they may wait for.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from sao_jax import types
from sao_jax.rollout import trajectory_checks




@dataclasses.dataclass
class LeaseSlots:
  """One lease's slots, changed by `Books` only (`queue.Lease` holds one).

  Attributes:
    group_id: the GRPO group it was admitted for, or None.
    deadline: the learner version by which its rollouts must be done.
    open: slots neither put nor cancelled.
    pending: slots inside a `put` (validating or blocked).
    groups: groups it delivered members of.
  """
  group_id: str | None
  deadline: int
  open: int
  pending: int = 0
  groups: set[Any] = dataclasses.field(default_factory=set)


# The books include each lease's `LeaseSlots`.
# pylint: disable=protected-access

# The queue's logger: these records are the queue's, whichever module keeps
# the books.
_log = logging.getLogger(__package__ + '.queue')

# Rejections logged at WARNING per reason before the rest go to DEBUG: a worker
# bug repeats on every trajectory and would otherwise flood the log.
_LOUD_REJECTIONS = 5
# Group ids remembered as released or failed, to drop their late members.
_GROUP_MEMORY = 65536
# The most characters of a prompt id a rejection's log line shows: the id of a
# rejected trajectory is whatever a buggy worker put there.
_LOGGED_ID_CHARS = 200

_INT_COUNTERS = (
    'admitted', 'put', 'accepted', 'rejected', 'cancelled', 'consumed',
    'batches', 'dropped_stale', 'dropped_stale_groups',
    'dropped_incomplete_group', 'dropped_groups', 'lost_on_restore',
    'kept_length_sum', 'dropped_stale_length_sum')
# group_wait_seconds and queue_seconds sum, over the consumed trajectories,
# the time from acceptance to their group's completion and to their batch:
# how long finished episodes wait for their GRPO group (0 without groups).
_FLOAT_COUNTERS = (
    'learner_wait_seconds', 'admission_wait_seconds', 'put_wait_seconds',
    'group_wait_seconds', 'queue_seconds')


@dataclasses.dataclass
class _Item:
  """A queued trajectory with what the queue decides on, computed once."""
  traj: types.Trajectory
  oldest: int
  deadline: int  # the last learner version that may consume it
  length: int
  accepted_s: float  # the books' clock when it was accepted
  ready_s: float | None = None  # when its group completed (None: partial)


class Books:
  """What `RolloutQueue` knows, and its changes (see the module docstring).

  The queue reads the public attributes; everything else is the books' own.
  """

  def __init__(self, batch_size: int, max_staleness: int, group_size: int,
               capacity: int | None, notify: Callable[[], None],
               clock: Callable[[], float] = time.monotonic):
    """Empty books at learner and rollout version 0.

    Args:
      batch_size, max_staleness, group_size, capacity: as `RolloutQueue`,
        which checks them.
      notify: called after a change a waiter may wait for.
      clock: seconds, for the time trajectories wait in the queue.
    """
    self.batch_size = int(batch_size)
    self.max_staleness = int(max_staleness)
    self.group_size = int(group_size)
    self.capacity = None if capacity is None else int(capacity)
    self._notify = notify
    self._clock = clock

    self.learner_version = 0
    self.rollout_version = 0
    self._batches_since_version = 0  # batches taken since set_learner_version
    self.closed = False
    self.in_flight = 0
    self.queued = 0  # accepted, not consumed or dropped: ready + partial
    self._ready: collections.deque[list[_Item]] = collections.deque()
    self.ready_count = 0
    self._partial: dict[Any, list[_Item]] = {}  # group id -> members so far
    # group id -> 'released' | 'failed', oldest forgotten first.
    self._finished_groups: collections.OrderedDict[Any, str] = (
        collections.OrderedDict())
    # Deadlines of outstanding trajectories (a multiset; few distinct keys).
    self._deadlines: collections.Counter[int] = collections.Counter()
    self.blocked_puts = 0
    self._stale_drop_events = 0  # for rate-limiting their log lines

    self.counters: dict[str, float] = {k: 0 for k in _INT_COUNTERS}
    self.counters.update({k: 0.0 for k in _FLOAT_COUNTERS})
    self._rejected: collections.Counter[str] = collections.Counter()
    self._staleness: collections.Counter[int] = collections.Counter()

  def admit(self, n: int) -> int:
    """Takes `n` slots in flight (admission said yes); returns their
    deadline, the last learner version that may consume them."""
    deadline = self.rollout_version + self.max_staleness
    self.in_flight += n
    self.counters['admitted'] += n
    self._deadlines[deadline] += n
    return deadline

  def put_must_wait(self, group) -> bool:
    """Whether a put of a member of `group` waits for room (backpressure).

    A member that completes a queued group passes (partial groups must not
    deadlock a full queue); one of a failed group is dropped at once.
    """
    return (self.capacity is not None and self.queued >= self.capacity and
            group not in self._partial and
            self._finished_groups.get(group) != 'failed')

  def newest_version(self) -> int:
    """The newest policy version a token may carry."""
    return max(self.rollout_version, self.learner_version)

  def cancel(self, lease: LeaseSlots, count: int | None) -> int:
    """Gives back open slots of `lease`; see `Lease.cancel`."""
    count = lease.open if count is None else min(int(count), lease.open)
    if count <= 0:
      return 0
    lease.open -= count
    self.counters['cancelled'] += count
    self._release_slots(lease, count)
    if self.group_size > 1 and lease.group_id is not None:
      self._fail_group(lease.group_id)
    self._lease_progress(lease)
    self._notify()
    return count

  def headroom(self) -> int:
    """How many rollouts admission lets start now (may be negative)."""
    deadline = self.rollout_version + self.max_staleness
    if self._deadlines:
      deadline = min(deadline, min(self._deadlines))
    outstanding = self.in_flight + self.queued
    return (deadline - self.next_version() + 1) * self.batch_size - outstanding

  def next_version(self) -> int:
    """The learner version the next batch will be trained at.

    Between taking a batch and reporting its new version the learner is a
    step ahead of what it last said; without assuming so, admission would
    start rollouts in that window that the next batch finds too stale.
    """
    return self.learner_version + self._batches_since_version

  def claim(self, lease: LeaseSlots) -> None:
    """A `put` takes one open slot (before it validates or waits), so that
    concurrent puts cannot overdraw the lease (the caller checked that one
    is open)."""
    lease.open -= 1
    lease.pending += 1

  def unclaim(self, lease: LeaseSlots) -> None:
    """A `put` left without resolving its slot (queue closed, task
    cancelled): the slot is open again, for the lease's exit to cancel."""
    lease.pending -= 1
    lease.open += 1

  def group_reason(self, lease: LeaseSlots, group) -> str | None:
    if group is None:
      return 'missing_group_id'
    if group is _BAD_GROUP:  # `rejection_reason` rejects these first
      return 'bad_group_id'
    if lease.group_id is not None and group != lease.group_id:
      return 'group_mismatch'
    if self._finished_groups.get(group) == 'released':
      return 'group_overflow'
    return None

  def reject(self, lease: LeaseSlots, traj, reason: str, group) -> None:
    """A claimed slot's trajectory is rejected for `reason`."""
    lease.pending -= 1
    self.counters['put'] += 1
    self.counters['rejected'] += 1
    self._rejected[reason] += 1
    self._release_slots(lease, 1)
    count = self._rejected[reason]
    level = logging.WARNING if count <= _LOUD_REJECTIONS else logging.DEBUG
    _log.log(level, 'rollout queue rejected a trajectory of prompt %s: %s'
             ' (%d so far)%s', _describe_prompt(traj), reason, count,
             '; further ones at DEBUG' if count == _LOUD_REJECTIONS else '')
    if self.group_size > 1:
      # The lost member's group cannot complete: drop its queued members now
      # rather than when the lease resolves.
      lost = lease.group_id
      if lost is None and group is not None and group is not _BAD_GROUP:
        lost = group
      if lost is not None and self._finished_groups.get(lost) != 'released':
        self._fail_group(lost)
    self._lease_progress(lease)
    self._notify()

  def accept(self, lease: LeaseSlots, traj: types.Trajectory,
              group) -> bool:
    """A claimed slot's trajectory is queued (or dropped with its failed
    group: False)."""
    lease.pending -= 1
    self.counters['put'] += 1
    self.counters['accepted'] += 1
    self._release_slots(lease, 1)
    oldest = traj.oldest_version
    now = self._clock()
    item = _Item(traj, oldest, oldest + self.max_staleness, traj.length, now)
    kept = True
    if self.group_size == 1:
      item.ready_s = now
      self._enqueue(item)
      self._ready.append([item])
      self.ready_count += 1
    elif self._finished_groups.get(group) == 'failed':
      self.counters['dropped_incomplete_group'] += 1
      kept = False
    else:
      lease.groups.add(group)
      self._enqueue(item)
      members = self._partial.setdefault(group, [])
      members.append(item)
      if len(members) == self.group_size:
        del self._partial[group]
        for member in members:
          member.ready_s = now
        self._ready.append(members)
        self.ready_count += len(members)
        self._remember_group(group, 'released')
    self._lease_progress(lease)
    self._notify()
    return kept

  def _enqueue(self, item: _Item) -> None:
    self.queued += 1
    self._deadlines[item.deadline] += 1

  def _dequeue(self, item: _Item) -> None:
    self.queued -= 1
    self._discard_deadline(item.deadline, 1)

  def _release_slots(self, lease: LeaseSlots, count: int) -> None:
    self.in_flight -= count
    self._discard_deadline(lease.deadline, count)

  def _discard_deadline(self, deadline: int, count: int) -> None:
    self._deadlines[deadline] -= count
    if self._deadlines[deadline] <= 0:
      del self._deadlines[deadline]

  def _lease_progress(self, lease: LeaseSlots) -> None:
    """Once every slot of a lease is resolved, a group it left incomplete
    can never complete: drop it rather than keep it queued forever."""
    if self.group_size == 1 or lease.open or lease.pending:
      return
    groups = set(lease.groups)
    if lease.group_id is not None:
      groups.add(lease.group_id)
    for group in groups:
      if group in self._partial or group == lease.group_id:
        if self._finished_groups.get(group) is None:
          self._fail_group(group)

  def _fail_group(self, group) -> None:
    if self._finished_groups.get(group) is not None:
      return
    for item in self._partial.pop(group, []):
      self._dequeue(item)
      self.counters['dropped_incomplete_group'] += 1
    self.counters['dropped_groups'] += 1
    self._remember_group(group, 'failed')
    _log.debug('rollout queue dropped incomplete group %r', group)

  def _remember_group(self, group, outcome: str) -> None:
    self._finished_groups[group] = outcome
    self._finished_groups.move_to_end(group)
    while len(self._finished_groups) > _GROUP_MEMORY:
      self._finished_groups.popitem(last=False)

  def drop_stale(self, version: int) -> None:
    """Drops ready units (trajectories or whole groups) too stale at
    `version`: the last resort, when admission could not keep the bound."""
    if not any(version - item.oldest > self.max_staleness
               for unit in self._ready for item in unit):
      return
    kept = collections.deque()
    for unit in self._ready:
      if all(version - item.oldest <= self.max_staleness for item in unit):
        kept.append(unit)
        continue
      for item in unit:
        self._dequeue(item)
        self.counters['dropped_stale'] += 1
        self.counters['dropped_stale_length_sum'] += item.length
      self.ready_count -= len(unit)
      if self.group_size > 1:
        self.counters['dropped_stale_groups'] += 1
      self._stale_drop_events += 1
      loud = self._stale_drop_events <= _LOUD_REJECTIONS
      _log.log(logging.WARNING if loud else logging.DEBUG,
               'rollout queue dropped %d stale trajectories (oldest version'
               ' %d at learner version %d, max_staleness %d; %d so far)',
               len(unit), min(item.oldest for item in unit), version,
               self.max_staleness, self.counters['dropped_stale'])
    self._ready = kept
    self._notify()

  def take(self, version: int) -> list[types.Trajectory]:
    batch = []
    now = self._clock()
    while len(batch) < self.batch_size:
      for item in self._ready.popleft():
        self._dequeue(item)
        self.ready_count -= 1
        self.counters['group_wait_seconds'] += item.ready_s - item.accepted_s
        self.counters['queue_seconds'] += now - item.accepted_s
        self._staleness[version - item.oldest] += 1
        self.counters['consumed'] += 1
        self.counters['kept_length_sum'] += item.length
        batch.append(item.traj)
    self.counters['batches'] += 1
    self._batches_since_version += 1
    self._notify()
    return batch

  def set_learner_version(self, version: int) -> None:
    self.learner_version = version
    self._batches_since_version = 0
    self._notify()

  def set_rollout_version(self, version: int) -> None:
    self.rollout_version = version
    self._notify()

  def close(self) -> None:
    self.closed = True
    self._notify()

  def stats(self) -> dict[str, float]:
    c = self.counters
    out = {k: c[k] for k in _INT_COUNTERS + _FLOAT_COUNTERS
           if not k.endswith('_length_sum')}
    out.update(
        in_flight=self.in_flight, queued=self.queued,
        ready=self.ready_count, partial_groups=len(self._partial),
        waiting_for_group=sum(len(m) for m in self._partial.values()),
        blocked_puts=self.blocked_puts,
        admission_headroom=self.headroom(),
        learner_version=self.learner_version,
        rollout_version=self.rollout_version,
        max_consumed_staleness=max(self._staleness, default=0),
        kept_mean_length=c['kept_length_sum'] / max(c['consumed'], 1),
        # Of the time consumed trajectories spent queued, the share spent
        # waiting for the rest of their group; and that wait per trajectory.
        group_wait_share=(c['group_wait_seconds'] / c['queue_seconds']
                          if c['queue_seconds'] > 0 else 0.0),
        group_wait_mean_seconds=(c['group_wait_seconds'] /
                                 max(c['consumed'], 1)),
        dropped_stale_mean_length=(c['dropped_stale_length_sum'] /
                                   max(c['dropped_stale'], 1)))
    for reason in trajectory_checks.REJECT_REASONS:
      out[f'rejected/{reason}'] = self._rejected[reason]
    for staleness, count in sorted(self._staleness.items()):
      out[f'staleness/{staleness}'] = count
    return out

  def state_dict(self) -> dict[str, Any]:
    return {
        'counters': dict(self.counters),
        'rejected': dict(self._rejected),
        'staleness': {str(k): v for k, v in self._staleness.items()},
        'in_flight': self.in_flight,
        'queued': self.queued,
    }

  def load_state_dict(self, state: dict[str, Any]) -> None:
    if self.in_flight or self.queued:
      raise ValueError('RolloutQueue.load_state_dict: the queue is in use'
                       f' ({self.in_flight} in flight, {self.queued}'
                       ' queued); restore into a fresh one')
    counters = {k: 0 for k in _INT_COUNTERS}
    counters.update({k: 0.0 for k in _FLOAT_COUNTERS})
    for key, value in state['counters'].items():
      if key in counters:
        counters[key] = type(counters[key])(value)
    counters['lost_on_restore'] += int(state['in_flight']) + int(
        state['queued'])
    self.counters = counters
    self._rejected = collections.Counter(
        {k: int(v) for k, v in state['rejected'].items()})
    self._staleness = collections.Counter(
        {int(k): int(v) for k, v in state['staleness'].items()})


# The group key of a trajectory whose group id is neither None nor a str.
_BAD_GROUP = object()


def group_key(traj) -> Any:
  """The group id (None or a str) as a dict key; `_BAD_GROUP` if it is
  anything else. Never raises: it runs before the trajectory is judged."""
  try:
    group = getattr(traj, 'group_id', None)
    if group is None:
      return None
    if isinstance(group, str):
      # A plain copy: a str subclass's own hash or == could raise in the
      # group dicts, long after the trajectory was judged.
      return str.__str__(group)
  except Exception:  # pylint: disable=broad-exception-caught
    pass
  return _BAD_GROUP


def _describe_prompt(traj) -> str:
  """The prompt id of a rejected trajectory for a log line, whatever it is:
  never raises, never floods the log."""
  try:
    prompt_id = getattr(traj, 'prompt_id', None)
    if isinstance(prompt_id, str):
      plain = str.__str__(prompt_id)  # past any override of a str subclass
      if len(plain) > _LOGGED_ID_CHARS:
        return repr(plain[:_LOGGED_ID_CHARS]) + '...'
      return repr(plain)
    return f'<{type(prompt_id).__name__}>'
  except Exception:  # pylint: disable=broad-exception-caught
    return '<unreadable>'
