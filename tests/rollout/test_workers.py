"""Rollout workers: a GRPO group's members reach the queue as each episode
ends, and a failed member ends its group without losing count of anything.

The episodes are stand-ins that end when the test says (this tests the workers'
scheduling, not the servers: tests/rollout/test_servers.py plays real
episodes against real JetStream servers).
"""

import asyncio

import pytest

from sao_jax.rollout import client as client_lib
from sao_jax.rollout import episodes
from sao_jax.rollout import queue as queue_lib
from sao_jax.rollout import workers

from tests.rollout import test_queue


def make_runner(monkeypatch, group_size, fail_at=None):
  """A runner whose episodes end when the test says: `finish(i, t)` ends
  episode i at time t of the queue's clock. Episode `fail_at` raises
  RequestFailed when it ends."""
  monkeypatch.setattr(episodes, 'ChatFormat', lambda tok: None)
  clock = {'t': 0.0}
  ends = []

  async def fake_episode(*args, group_id=None):
    del args
    number = len(ends)
    ends.append(asyncio.Event())
    await ends[number].wait()
    if number == fail_at:
      raise client_lib.RequestFailed('unavailable', 'scripted failure')
    return [test_queue.fake_traj([0], group_id=group_id,
                                 info={'episode': number})]

  async def finish(number, t):
    clock['t'] = t
    ends[number].set()
    await test_queue.settle()  # the worker puts what ended

  monkeypatch.setattr(episodes, 'run_episode', fake_episode)
  queue = queue_lib.RolloutQueue(group_size, 1, test_queue.VOCAB,
                                 test_queue.MAX_LEN, group_size,
                                 clock=lambda: clock['t'])
  runner = workers.RolloutRunner(
      addresses=[], env=None, next_task=None, queue=queue, tok=None,
      limits=None, num_workers=1, group_size=group_size)
  return runner, queue, ends, finish


class _Task:
  id = 'task'


def test_members_are_queued_as_they_finish_and_their_wait_is_counted(
    monkeypatch):
  """Two members ending at t=1 and t=5: the first is queued at once and
  waits 4 s for its sibling."""
  runner, queue, ends, finish = make_runner(monkeypatch, group_size=2)

  async def main():
    lease = await queue.admit(2)
    with lease:
      play = asyncio.ensure_future(runner._play(lease, 7, _Task(), 'task#7'))
      await test_queue.settle()
      assert len(ends) == 2  # both members run at once
      await finish(0, 1.0)
      assert queue.stats()['waiting_for_group'] == 1
      await finish(1, 5.0)
      assert await play
    batch = await queue.get_batch()
    return batch, queue.stats()

  batch, stats = asyncio.run(main())
  assert [t.info['episode'] for t in batch] == [0, 1]
  assert all(t.info['task_index'] == 7 for t in batch)
  assert stats['group_wait_seconds'] == pytest.approx(4.0)
  assert runner.counters['episodes'] == 2
  test_queue.assert_accounting(stats)


def test_a_failed_member_cancels_its_siblings_and_drops_its_group(
    monkeypatch):
  """Of three members, the first ends and is queued, the second fails: the
  third is cancelled, the lease's open slots are cancelled and the queued
  member is dropped with its group, each counted."""
  runner, queue, ends, finish = make_runner(monkeypatch, group_size=3,
                                            fail_at=1)

  async def main():
    lease = await queue.admit(3)
    with lease:
      play = asyncio.ensure_future(runner._play(lease, 0, _Task(), 'task#0'))
      await test_queue.settle()
      await finish(0, 1.0)
      await finish(1, 2.0)
      assert await play
    return queue.stats()

  stats = asyncio.run(main())
  assert len(ends) == 3 and not ends[2].is_set()  # the third never ended
  assert runner.counters['failed/unavailable'] == 1
  assert runner.counters['episodes'] == 1
  assert stats['dropped_groups'] == 1
  assert stats['dropped_incomplete_group'] == 1
  assert stats['cancelled'] == 2
  assert stats['queued'] == stats['in_flight'] == 0
  test_queue.assert_accounting(stats)
