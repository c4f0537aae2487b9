"""Rollout workers: asyncio episodes from the task stream into the queue.

`RolloutRunner` owns an asyncio event loop in a background thread (the learner
keeps the main thread for JAX). Each of `num_workers` workers loops: wait for
admission (the staleness bound), take the next task, play the episode (or a
GRPO group's episodes, concurrently) against the server pool, and put each
trajectory into the queue as its episode ends.
Any failure of a request is counted and its admission released; nothing is
silently lost, and a worker never dies of one bad episode.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Callable, Sequence

from sao_jax.envs import base
from sao_jax.models import tokenizer as tokenizer_lib
from sao_jax.rollout import client as client_lib
from sao_jax.rollout import episodes
from sao_jax.rollout import queue as queue_lib

# The info key of the index of a trajectory's task in the training stream,
# which `RolloutSystem.next_batch` hands out and the ledger marks done.
TASK_INDEX = 'task_index'

_log = logging.getLogger(__name__)


class RolloutRunner:
  """Feeds a `RolloutQueue` from rollout servers in a background thread."""

  def __init__(self, *, addresses: Sequence[str], env: base.Environment,
               next_task: Callable[[], tuple[int, base.Task]],
               queue: queue_lib.RolloutQueue, tok: tokenizer_lib.Tokenizer,
               limits: episodes.EpisodeLimits, num_workers: int,
               group_size: int = 1, group_in_one_request: bool = False,
               pool_options: dict | None = None):
    """Sets up (does not start) the runner.

    Args:
      addresses: rollout servers `host:port`.
      env: the environment episodes run in.
      next_task: returns `(task_index, task)`, the next training task (called
        in the loop thread; the index is recorded in each trajectory's info so
        the learner can account for consumed tasks).
      queue: the queue, created for this runner's loop (`start` binds it).
      tok: the policy's tokenizer.
      limits: token budgets.
      num_workers: concurrent episodes (admission control decides how many
        actually run).
      group_size: G trajectories per task (GRPO); 1 for SAO.
      group_in_one_request: servers answer one request with G samples
        (single-turn only).
      pool_options: keyword arguments of `client.ServerPool`.
    """
    self._addresses = list(addresses)
    self._env = env
    self._next_task = next_task
    self._queue = queue
    self._tok = tok
    self._chat = episodes.ChatFormat(tok)
    self._limits = limits
    self._num_workers = num_workers
    self._group_size = group_size
    self._one_request = group_in_one_request
    self._pool_options = dict(pool_options or {})
    self.counters = collections.Counter()
    self.pool: client_lib.ServerPool | None = None
    self.loop: asyncio.AbstractEventLoop | None = None
    self._thread: threading.Thread | None = None
    self._stopping: asyncio.Event | None = None
    self._started = threading.Event()
    self._error: BaseException | None = None

  # -- lifecycle ---------------------------------------------------------------

  def start(self) -> None:
    """Starts the loop thread; returns once workers are running."""
    self._thread = threading.Thread(target=self._run, name='rollouts',
                                    daemon=True)
    self._thread.start()
    self._started.wait()
    if self._error is not None:
      raise RuntimeError('rollout runner failed to start') from self._error

  def _run(self) -> None:
    self.loop = asyncio.new_event_loop()
    asyncio.set_event_loop(self.loop)
    try:
      self.loop.run_until_complete(self._main())
    except BaseException as e:  # pylint: disable=broad-except
      self._error = e
      _log.exception('rollout runner stopped with an error')
    finally:
      self._started.set()
      self.loop.close()

  async def _main(self) -> None:
    self._stopping = asyncio.Event()
    self._queue.bind_running_loop()
    async with client_lib.ServerPool(self._addresses,
                                     **self._pool_options) as pool:
      self.pool = pool
      workers = [asyncio.create_task(self._worker(i))
                 for i in range(self._num_workers)]
      self._started.set()
      await self._stopping.wait()
      for worker in workers:
        worker.cancel()
      await asyncio.gather(*workers, return_exceptions=True)

  def stop(self, timeout: float = 30.0) -> None:
    """Stops the workers, closes the queue, and joins the thread."""
    if self.loop is None or self._thread is None:
      return
    self._queue.close()
    if not self.loop.is_closed():
      self.loop.call_soon_threadsafe(self._stopping.set)
    self._thread.join(timeout=timeout)

  def call(self, coroutine, timeout: float | None = None):
    """Runs a coroutine in the runner's loop from another thread."""
    return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(
        timeout)

  def stats(self) -> dict[str, float]:
    """Worker counters and the server pool's counters, flat."""
    out = {f'workers/{k}': float(v) for k, v in self.counters.items()}
    if self.pool is not None:
      out.update({f'client/{k}': float(v)
                  for k, v in self.pool.counters.items()})
      out['client/live_servers'] = float(len(self.pool.live_servers))
      out['client/generator_idle_fraction'] = (
          self.pool.generator_idle_fraction())
    return out

  # -- workers ---------------------------------------------------------------

  async def _worker(self, worker_id: int) -> None:
    del worker_id
    group = self._group_size
    while True:
      try:
        lease = await self._queue.admit(group)
      except queue_lib.QueueClosed:
        return
      with lease:
        index, task = self._next_task()
        group_id = f'{task.id}#{index}' if group > 1 else None
        if not await self._play(lease, index, task, group_id):
          return

  async def _play(self, lease: queue_lib.Lease, index: int, task,
                  group_id: str | None) -> bool:
    """Plays the task's episode (or a GRPO group's G episodes) and puts each
    trajectory into the queue as soon as its episode ends.

    A group's members are not held back here until the slowest is done: a
    finished member waits for its siblings in the queue, which counts that
    wait (`group_wait_seconds`). A failed episode ends the group: the others
    are cancelled, and leaving the lease cancels their slots and drops the
    members already queued (counted by the queue).

    Returns:
      False once the queue is closed (the worker stops), else True.
    """
    args = (self.pool, self._env, task, self._tok, self._chat, self._limits)
    count = 1 if self._group_size == 1 or self._one_request else (
        self._group_size)
    runs = [asyncio.ensure_future(episodes.run_episode(*args,
                                                       group_id=group_id))
            for _ in range(count)]
    try:
      for finished in asyncio.as_completed(runs):
        try:
          trajectories = await finished
        except client_lib.RequestFailed as e:
          self.counters[f'failed/{e.reason}'] += 1
          return True
        except asyncio.CancelledError:
          raise
        except Exception:  # pylint: disable=broad-except
          self.counters['failed/episode_error'] += 1
          _log.exception('episode on task %s failed', task.id)
          return True
        for trajectory in trajectories:
          trajectory.info[TASK_INDEX] = index
          try:
            await lease.put(trajectory)
          except queue_lib.QueueClosed:
            return False
        self.counters['episodes'] += len(trajectories)
      return True
    finally:
      for run in runs:
        run.cancel()
      await asyncio.gather(*runs, return_exceptions=True)
