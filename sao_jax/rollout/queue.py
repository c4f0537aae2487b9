"""The bounded host-side queue between rollout workers and the learner.

Workers (asyncio, in the queue's event loop thread) produce trajectories; the
learner (the main thread) takes batches of exactly `batch_size`. The queue
keeps SAO's staleness bound (learner version at consumption - oldest token
version <= max_staleness) by admission control first, and drops what still
arrives too stale last; it validates every trajectory, applies backpressure,
and hands out GRPO groups only whole. docs/design/queue.md gives the admission
rule, why it keeps the bound, and the accounting identity `stats()` satisfies.

Workers, in the loop:

  with await queue.admit(n, group_id=gid) as lease:   # waits for headroom
    for traj in trajectories:
      await lease.put(traj)                           # waits for room

The learner, from its own thread (see `RolloutQueue` for the protocol):

  batch = queue.get_batch_blocking(timeout)
  queue.set_learner_version(v + 1)
  queue.set_rollout_version(v + 1)                    # once servers serve it

The books (counts, deadlines, queued items) are a `queue_books.Books` the
queue owns; this module holds what waits and the bridge between threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import numbers
import time
from collections.abc import Callable, Mapping
from typing import Any

from sao_jax import types
from sao_jax.rollout import queue_books
from sao_jax.rollout import trajectory_checks
from sao_jax.rollout import wire

# Lease and RolloutQueue are one unit split in two for the worker's API; a
# lease's slot counts are a `queue_books.LeaseSlots` that only the books
# change.
# pylint: disable=protected-access

# How often a thread waiting on the loop checks that the loop still runs.
_POLL_S = 0.5


class QueueClosed(Exception):
  """Raised in every waiter, and every later call that would wait, once the
  queue is closed (or its event loop stopped under a waiting thread)."""


class Lease:
  """`size` admitted rollout slots; each ends in `put` or `cancel`.

  The in-flight count (and so admission) is exact only if every slot is
  resolved, so use the lease as a context manager: leaving the block cancels
  the slots not yet put (a failed request), exceptions propagate. Use it in
  the queue's event loop only.

    with await queue.admit(group_size, group_id=gid) as lease:
      for traj in await asyncio.gather(*samples):
        await lease.put(traj)
  """

  def __init__(self, queue: RolloutQueue, size: int, deadline: int,
               group_id: str | None):
    self._queue = queue
    self.size = size
    self.deadline = deadline
    self.group_id = group_id
    self._slots = queue_books.LeaseSlots(group_id, deadline, open=size)

  @property
  def remaining(self) -> int:
    """Slots not yet put or cancelled."""
    return self._slots.open

  async def put(self, traj: types.Trajectory) -> bool:
    """Hands one finished trajectory to the queue (one slot).

    Blocks while the queue is at capacity (backpressure). A malformed
    trajectory, whatever `traj` is, is rejected and counted
    (`rejected/<reason>` in `stats()`), never raised: only the caller's own
    misuse below raises.

    Returns:
      True if it was queued; False if it was rejected or dropped because its
      group had already failed.

    Raises:
      RuntimeError: the lease has no open slot (a worker bug).
      QueueClosed: the queue was closed.
    """
    return await self._queue._put(self, traj)

  def cancel(self, count: int | None = None) -> int:
    """Gives back `count` slots (default: all open ones) of failed requests.

    Returns:
      The number of slots cancelled.
    """
    return self._queue._books.cancel(self._slots, count)

  def __enter__(self) -> Lease:
    return self

  def __exit__(self, *exc_info) -> None:
    self.cancel()

  async def __aenter__(self) -> Lease:
    return self

  async def __aexit__(self, *exc_info) -> None:
    self.cancel()


class RolloutQueue:
  """Admission control, validation, backpressure, staleness filter, batches.

  docs/design/queue.md gives the admission rule and the accounting identity;
  the books and their changes are a `queue_books.Books` the queue owns.

  Learner protocol (one policy version per batch):

    batch = queue.get_batch_blocking()        # trained at version v
    ... train ...
    queue.set_learner_version(v + 1)          # before pushing the weights
    ... (sync mode: queue.drain_blocking()) push v + 1 to every server ...
    queue.set_rollout_version(v + 1)          # once every server serves it

  The order matters: the learner version is the newest that exists, so tokens
  sampled by a server that swapped before `set_rollout_version` are not taken
  for "from the future"; and the rollout version must not run ahead of the
  servers, or admission would count new rollouts as fresher than they are.
  """

  def __init__(self, batch_size: int, max_staleness: int, vocab_size: int,
               max_length: int, group_size: int = 1,
               capacity: int | None = None, *,
               logprob_tolerance: float = 1e-3,
               max_abs_reward: float | None = None,
               required_info: Mapping[str, type | tuple[type, ...]]
               | None = None,
               routing: wire.RoutingLayout = wire.RoutingLayout(),
               loop: asyncio.AbstractEventLoop | None = None,
               clock: Callable[[], float] = time.monotonic):
    """Creates an empty queue at learner and rollout version 0.

    Args:
      batch_size: B, trajectories per batch (whole groups: a multiple of G).
      max_staleness: the bound on learner version - oldest token version.
      vocab_size: token ids must lie in [0, vocab_size).
      max_length: T, the longest trajectory accepted (prompt + actions +
        observations), the padded length of batches.
      group_size: G, trajectories per GRPO group (1: no groups, SAO).
      capacity: most trajectories queued before `put` blocks; None leaves the
        bound to admission, which keeps at most (max_staleness + 1) * B
        outstanding. At least B, or a batch could never form. Members that
        complete a group already queued are let through, so that partial
        groups cannot fill the queue and deadlock it.
      logprob_tolerance: action log-probs above this are rejected; a little
        above 0 is rounding in the engine's log-softmax.
      max_abs_reward: rewards of larger magnitude are rejected
        ('reward_out_of_range'): an environment bug, not something to train
        on. None bounds them by float32 only. Positive and finite.
      required_info: info key -> the type (or tuple of types) its value must
        have, for the keys the consumer of the batches reads (e.g.
        {'task_index': int}); a trajectory lacking one is rejected
        ('bad_info') rather than crashing the training loop later.
      routing: an MoE policy's routing records
        (`trajectory_checks.rejection_reason`); the default: a dense policy.
      loop: the event loop the workers run in. Needed only if the learner
        thread calls a `*_blocking` method before any coroutine of the queue
        ran in the loop (which binds it).
      clock: seconds, for the time finished trajectories wait (`stats()`'s
        group_wait_seconds and queue_seconds); tests pass a fake one.
    """
    for name, value, low in (('batch_size', batch_size, 1),
                             ('max_staleness', max_staleness, 0),
                             ('vocab_size', vocab_size, 1),
                             ('max_length', max_length, 1),
                             ('group_size', group_size, 1)):
      if not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f'RolloutQueue: {name} must be an integer >= {low},'
                         f' got {value!r}')
    if batch_size % group_size:
      raise ValueError(f'RolloutQueue: batch_size={batch_size} is not a'
                       f' multiple of group_size={group_size}')
    if capacity is not None and capacity < batch_size:
      raise ValueError(f'RolloutQueue: capacity={capacity} is below'
                       f' batch_size={batch_size}; no batch could ever form')
    if max_abs_reward is not None and (
        isinstance(max_abs_reward, bool) or
        not isinstance(max_abs_reward, numbers.Real) or
        not 0 < max_abs_reward < math.inf):
      raise ValueError('RolloutQueue: max_abs_reward must be a positive finite'
                       f' number or None, got {max_abs_reward!r}')
    if required_info is not None:
      if not isinstance(required_info, Mapping):
        raise ValueError('RolloutQueue: required_info must map info keys to'
                         f' types, got {required_info!r}')
      for key, kind in required_info.items():
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not kinds or not all(isinstance(k, type) for k in kinds):
          raise ValueError(f'RolloutQueue: required_info[{key!r}]={kind!r}'
                           ' must be a type or a tuple of types')
    self.vocab_size = int(vocab_size)
    self.max_length = int(max_length)
    self.logprob_tolerance = float(logprob_tolerance)
    self.max_abs_reward = (None if max_abs_reward is None else
                           float(max_abs_reward))
    # A copy: the caller's mapping changing later must not change the gate.
    self.required_info = (None if required_info is None else
                          dict(required_info))
    self.routing = routing
    self._books = queue_books.Books(batch_size, max_staleness, group_size,
                                    capacity, notify=self._notify,
                                    clock=clock)
    self._loop = loop
    # Futures of waiting coroutines; a dict keeps wake-up order deterministic.
    self._waiters: dict[asyncio.Future, None] = {}

  # ---------------------------------------------------------------- workers

  async def admit(self, n: int = 1, *, group_id: str | None = None) -> Lease:
    """Waits until n more rollouts may start within the staleness bound.

    Args:
      n: rollouts to start; a multiple of group_size (groups are admitted
        whole, or partial groups could hold the slots their siblings need),
        and at most batch_size (more could never be admitted synchronously).
      group_id: the group the n rollouts form (when n == group_size > 1);
        lets a cancelled member drop its group at once and rejects members of
        another group.

    Returns:
      A `Lease` of n slots, each to be resolved by `put` or `cancel`.

    Raises:
      QueueClosed: the queue is or gets closed.
    """
    self._bind()
    books = self._books
    if n < 1 or n % self.group_size or n > self.batch_size:
      raise ValueError(f'RolloutQueue.admit: n={n} must be a positive multiple'
                       f' of group_size={self.group_size} and at most'
                       f' batch_size={self.batch_size}')
    start = time.monotonic()
    try:
      while books.headroom() < n:
        self._raise_if_closed()
        await self._wait()
      self._raise_if_closed()
    finally:
      books.counters['admission_wait_seconds'] += time.monotonic() - start
    return Lease(self, n, books.admit(n), group_id)

  async def _put(self, lease: Lease, traj: types.Trajectory) -> bool:
    """Validates, waits for room, queues; see `Lease.put`."""
    self._bind()
    books = self._books
    slots = lease._slots
    if slots.open < 1:
      raise RuntimeError('Lease.put: no open slot left (every slot was put or'
                         ' cancelled)')
    self._raise_if_closed()
    # Claim the slot now, so that concurrent puts cannot overdraw the lease;
    # give it back if we leave without resolving it (closed, cancelled task),
    # so that the lease's exit cancels it and in-flight stays exact.
    books.claim(slots)
    resolved = False
    try:
      reason = trajectory_checks.rejection_reason(
          traj, vocab_size=self.vocab_size, max_length=self.max_length,
          newest_version=books.newest_version(),
          logprob_tolerance=self.logprob_tolerance,
          max_abs_reward=self.max_abs_reward,
          required_info=self.required_info, routing=self.routing)
      group = queue_books.group_key(traj) if self.group_size > 1 else None
      if reason is None and self.group_size > 1:
        reason = books.group_reason(slots, group)
      if reason is not None:
        resolved = True
        books.reject(slots, traj, reason, group)
        return False
      start = time.monotonic()
      while books.put_must_wait(group):
        self._raise_if_closed()
        books.blocked_puts += 1
        try:
          await self._wait()
        finally:
          books.blocked_puts -= 1
      self._raise_if_closed()
      books.counters['put_wait_seconds'] += time.monotonic() - start
      resolved = True
      return books.accept(slots, traj, group)
    finally:
      if not resolved:
        books.unclaim(slots)

  # ---------------------------------------------------------------- learner

  def set_learner_version(self, version: int) -> None:
    """The version of the policy the learner holds (thread-safe).

    Call it after every step, before pushing the weights, even when the
    version did not change (a skipped update, critic pretraining): until it
    is called again the queue assumes each batch it hands out advances the
    policy by one, so that nothing is admitted on the strength of a version
    the learner is already training past. The next batch is taken to be
    trained at `version + batches taken since this call`.
    """
    self._call(self._books.set_learner_version, int(version))

  def set_rollout_version(self, version: int) -> None:
    """The version every server now samples with (thread-safe).

    Call it once the swap completed on all servers, never before: admission
    takes rollouts started from now on to be at least this fresh.
    """
    self._call(self._books.set_rollout_version, int(version))

  async def get_batch(self, timeout: float | None = None
                      ) -> list[types.Trajectory]:
    """Takes exactly batch_size trajectories, oldest first (FIFO).

    Whole groups only, each on consecutive rows. Trajectories too stale for
    the version the batch is trained at are dropped first (counted). Waits
    while fewer are ready; the time waited is the learner's idle time.

    Args:
      timeout: seconds to wait at most; None waits forever.

    Raises:
      TimeoutError: no full batch within `timeout` (nothing is taken).
      QueueClosed: the queue is or gets closed.
    """
    self._bind()
    books = self._books
    start = time.monotonic()
    end = None if timeout is None else start + timeout
    try:
      while True:
        self._raise_if_closed()
        version = books.next_version()
        books.drop_stale(version)
        if books.ready_count >= self.batch_size:
          return books.take(version)
        remaining = None if end is None else end - time.monotonic()
        if remaining is not None and remaining <= 0:
          raise TimeoutError(
              f'RolloutQueue.get_batch: no batch of {self.batch_size} within'
              f' {timeout} s ({books.ready_count} ready, {books.queued}'
              f' queued, {books.in_flight} in flight)')
        await self._wait(remaining)
    finally:
      books.counters['learner_wait_seconds'] += time.monotonic() - start

  def get_batch_blocking(self, timeout: float | None = None
                         ) -> list[types.Trajectory]:
    """`get_batch` for the learner thread (not the loop's); same semantics.

    The timeout runs inside the loop, so a batch is either taken and returned
    or not taken at all: none is lost to a timeout race.
    """
    return self._run_blocking(self.get_batch(timeout))

  async def drain(self, timeout: float | None = None) -> None:
    """Waits until nothing is in flight (sync mode, before a weight push).

    A put blocked by capacity is still in flight: draining a full queue needs
    the learner to consume.

    Raises:
      TimeoutError: something is still in flight after `timeout` seconds.
      QueueClosed: the queue is or gets closed.
    """
    self._bind()
    end = None if timeout is None else time.monotonic() + timeout
    while self._books.in_flight:
      self._raise_if_closed()
      remaining = None if end is None else end - time.monotonic()
      if remaining is not None and remaining <= 0:
        raise TimeoutError(f'RolloutQueue.drain: {self._books.in_flight}'
                           f' rollouts still in flight after {timeout} s')
      await self._wait(remaining)

  def drain_blocking(self, timeout: float | None = None) -> None:
    """`drain` for the learner thread."""
    self._run_blocking(self.drain(timeout))

  def close(self) -> None:
    """Stops the queue (thread-safe, idempotent): every waiter, and every
    later admit, put, get_batch or drain, raises `QueueClosed`. Counters stay
    readable; `Lease.cancel` still works so accounting can finish."""
    self._call(self._books.close)

  @property
  def closed(self) -> bool:
    return self._books.closed

  @property
  def batch_size(self) -> int:
    return self._books.batch_size

  @property
  def max_staleness(self) -> int:
    return self._books.max_staleness

  @property
  def group_size(self) -> int:
    return self._books.group_size

  @property
  def capacity(self) -> int | None:
    return self._books.capacity

  # ---------------------------------------------------------------- metrics

  def stats(self) -> dict[str, float]:
    """Counters and gauges for metrics (thread-safe), a flat dict:

    admitted, put, accepted, rejected, rejected/<reason>, cancelled, consumed,
    batches, dropped_stale (trajectories), dropped_stale_groups,
    dropped_incomplete_group (trajectories), dropped_groups, lost_on_restore;
    gauges in_flight, queued, ready, partial_groups, waiting_for_group
    (trajectories in partial groups), blocked_puts, admission_headroom,
    learner_version, rollout_version; staleness/<k> (how
    many consumed trajectories had staleness k, from the oldest version),
    max_consumed_staleness; kept_mean_length and dropped_stale_mean_length
    (tokens; 0 when none); learner_wait_seconds, admission_wait_seconds
    (summed over concurrent admits: worker-seconds), put_wait_seconds;
    group_wait_seconds and queue_seconds (summed over consumed trajectories:
    from acceptance to their group's completion, and to their batch),
    group_wait_share (their ratio) and group_wait_mean_seconds (per consumed
    trajectory).
    """
    return self._call(self._books.stats)

  def state_dict(self) -> dict[str, Any]:
    """The counters, JSON-able (thread-safe); trajectories are not saved."""
    return self._call(self._books.state_dict)

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores counters into a queue with nothing queued or in flight.

    What was queued or in flight at save time is gone; it is counted in
    `lost_on_restore`, so that the accounting identity still holds.
    """
    self._call(self._books.load_state_dict, state)

  # ---------------------------------------------------------------- internals

  def _raise_if_closed(self) -> None:
    if self._books.closed:
      raise QueueClosed('the rollout queue is closed')

  # ------------------------------------------------------ event-loop bridge

  def bind_running_loop(self) -> None:
    """Binds the queue to the event loop this is called from.

    Call it from the workers' loop before the learner thread uses a
    `*_blocking` method (otherwise the first coroutine binds it).
    """
    self._bind()

  def _bind(self) -> None:
    """Binds the queue to the running loop (its first coroutine does)."""
    loop = asyncio.get_running_loop()
    if self._loop is loop:
      return
    if (self._loop is not None and not self._loop.is_closed() and
        self._loop.is_running()):
      raise RuntimeError('RolloutQueue: used from two running event loops')
    self._loop = loop
    self._waiters = {}

  def _notify(self) -> None:
    """Wakes every waiter to re-check its condition (state changed)."""
    waiters, self._waiters = self._waiters, {}
    for fut in waiters:
      if not fut.done():
        fut.set_result(None)

  async def _wait(self, timeout: float | None = None) -> None:
    """Sleeps until the next state change or `timeout` (no error)."""
    fut = self._loop.create_future()
    self._waiters[fut] = None
    try:
      if timeout is None:
        await fut
      else:
        await asyncio.wait_for(fut, timeout)
    except TimeoutError:
      pass
    finally:
      self._waiters.pop(fut, None)

  def _call(self, fn: Callable[..., Any], *args) -> Any:
    """Runs `fn` in the loop thread and returns its result.

    Directly when on the loop thread or when no loop runs (nothing else can
    touch the state then); otherwise scheduled in the loop and waited for,
    which also keeps calls from one thread in order.
    """
    loop = self._loop
    if (loop is None or loop.is_closed() or not loop.is_running() or
        _running_loop() is loop):
      return fn(*args)
    fut = concurrent.futures.Future()

    def run():
      try:
        fut.set_result(fn(*args))
      except BaseException as e:  # pylint: disable=broad-exception-caught
        fut.set_exception(e)

    loop.call_soon_threadsafe(run)
    return _wait_future(fut, loop)

  def _run_blocking(self, coro) -> Any:
    loop = self._loop
    if loop is None or loop.is_closed() or not loop.is_running():
      coro.close()
      raise RuntimeError('RolloutQueue: the blocking methods need the queue'
                         ' event loop running in another thread (pass loop='
                         ' or run a coroutine of the queue in it first)')
    if _running_loop() is loop:
      coro.close()
      raise RuntimeError('RolloutQueue: a *_blocking method called from the'
                         ' event loop thread would deadlock; await instead')
    return _wait_future(asyncio.run_coroutine_threadsafe(coro, loop), loop)


def _running_loop() -> asyncio.AbstractEventLoop | None:
  try:
    return asyncio.get_running_loop()
  except RuntimeError:
    return None


def _wait_future(fut: concurrent.futures.Future,
                 loop: asyncio.AbstractEventLoop) -> Any:
  """Waits for a future the loop completes; `QueueClosed` if the loop stops
  first (otherwise a dead worker thread would hang the learner forever)."""
  while True:
    done, _ = concurrent.futures.wait([fut], timeout=_POLL_S)
    if done:
      return fut.result()
    if loop.is_closed() or not loop.is_running():
      fut.cancel()
      raise QueueClosed('the rollout queue event loop stopped')
