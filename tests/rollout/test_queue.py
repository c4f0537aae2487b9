"""The rollout queue: admission keeps the staleness bound, the filter is the
last resort, backpressure loses nothing, malformed work is counted, batches.

Everything runs in one asyncio loop driven by `asyncio.run`, with simulated
workers and learner that yield with `asyncio.sleep(0)`: the interleaving is
deterministic for a seed, and no test sleeps except the thread tests.
"""

import asyncio
import collections
import functools
import json
import logging
import threading
import time

import numpy as np
import pytest

from sao_jax import types
from sao_jax.rollout import batching
from sao_jax.rollout import queue as queue_lib
from sao_jax.rollout import trajectory_checks
from sao_jax.rollout import wire

VOCAB = 50
MAX_LEN = 16


def fake_traj(action_versions, *, prompt_len=2, reward=1.0, prompt_id='p',
              group_id=None, logprob=-0.5, info=None):
  """`prompt_len` prompt tokens, then one action token per entry of
  `action_versions`, sampled by that policy version; `info` defaults to {}."""
  n = len(action_versions)
  length = prompt_len + n
  tokens = (np.arange(length, dtype=np.int32) * 7 + 3) % VOCAB
  mask = np.arange(length) >= prompt_len
  logprobs = np.where(mask, logprob, 0.0).astype(np.float32)
  versions = np.full(length, types.NO_VERSION, np.int32)
  versions[prompt_len:] = action_versions
  return types.Trajectory(
      prompt_id=prompt_id, tokens=tokens, action_mask=mask,
      behavior_logprobs=logprobs, versions=versions, reward=reward,
      group_id=group_id, info={} if info is None else info)


async def settle(ticks=20):
  """Lets every runnable task run until it blocks."""
  for _ in range(ticks):
    await asyncio.sleep(0)


def assert_accounting(stats):
  """Every admitted slot is in exactly one place."""
  assert stats['admitted'] == (
      stats['consumed'] + stats['rejected'] + stats['cancelled'] +
      stats['dropped_stale'] + stats['dropped_incomplete_group'] +
      stats['queued'] + stats['in_flight'] + stats['lost_on_restore']), stats


# ------------------------------------------------- admission keeps the bound


async def simulate(*, batch_size, max_staleness, group_size, steps,
                   num_workers, seed):
  """Workers generate token by token with whatever version the servers hold
  (partial rollouts); the learner trains, pushes, tells the queue."""
  queue = queue_lib.RolloutQueue(batch_size, max_staleness, VOCAB, 200,
                                 group_size)
  rng = np.random.default_rng(seed)
  server = {'version': 0}
  consumed_staleness = []
  mixed_versions = []

  async def generate(group_id):
    # Heavy tail: one in eight is a straggler many times the typical length,
    # the case where short rollouts overtake long ones.
    if rng.random() < 0.125:
      n = int(rng.integers(40, 120))
    else:
      n = int(rng.integers(1, 12))
    versions = []
    for _ in range(n):
      versions.append(server['version'])
      await asyncio.sleep(0)
    return fake_traj(versions, prompt_id=group_id, group_id=group_id)

  async def worker(w):
    for i in range(10**6):
      group_id = f'w{w}/{i}'
      try:
        lease = await queue.admit(group_size, group_id=group_id)
        with lease:
          members = await asyncio.gather(
              *(generate(group_id) for _ in range(group_size)))
          for member in members:
            await lease.put(member)
      except queue_lib.QueueClosed:
        return

  async def learner():
    for step in range(steps):
      batch = await queue.get_batch()
      consumed_staleness.extend(step - t.oldest_version for t in batch)
      mixed_versions.extend(t.newest_version != t.oldest_version
                            for t in batch)
      ids = [t.group_id for t in batch]
      for start in range(0, batch_size, group_size):  # whole, adjacent groups
        assert len(set(ids[start:start + group_size])) == 1
      assert len(set(ids)) == batch_size // group_size
      for _ in range(int(rng.integers(0, 15))):  # train
        await asyncio.sleep(0)
      queue.set_learner_version(step + 1)
      if max_staleness == 0:
        await queue.drain()  # sync mode
      server['version'] = step + 1  # the servers swap, then the queue hears
      for _ in range(int(rng.integers(0, 4))):
        await asyncio.sleep(0)
      queue.set_rollout_version(step + 1)
    queue.close()

  tasks = [asyncio.create_task(worker(w)) for w in range(num_workers)]
  await learner()
  await asyncio.gather(*tasks)
  return queue.stats(), consumed_staleness, mixed_versions


@pytest.mark.parametrize('max_staleness,group_size', [
    (0, 1), (1, 1), (4, 1), (0, 4), (2, 4)])
def test_admission_keeps_the_bound_without_drops(max_staleness, group_size):
  batch_size = 8
  steps = 40
  stats, staleness, mixed = asyncio.run(simulate(
      batch_size=batch_size, max_staleness=max_staleness,
      group_size=group_size, steps=steps, num_workers=24, seed=max_staleness))

  assert stats['batches'] == steps
  assert len(staleness) == steps * batch_size
  assert max(staleness) <= max_staleness
  assert stats['dropped_stale'] == 0
  assert stats['dropped_incomplete_group'] == 0
  assert stats['rejected'] == 0
  assert stats['max_consumed_staleness'] == max(staleness)
  want = collections.Counter(staleness)
  assert {k: stats.get(f'staleness/{k}', 0) for k in want} == dict(want)
  assert_accounting(stats)
  if max_staleness == 0:
    # Synchronous: no trajectory ever sees a weight change.
    assert not any(mixed)
    assert set(staleness) == {0}
  else:
    # Not vacuous: rollouts did overlap training and weight swaps.
    assert max(staleness) >= 1
    assert any(mixed)


def test_a_straggler_overtaken_by_short_rollouts_keeps_new_ones_out():
  """The new rollout alone passes the AReaL test here (v + N // B - v_r =
  1 + 1 - 1 <= 1); admitting it would let the learner reach version 2 while
  the straggler, started at version 0, is still generating."""

  async def main():
    queue = queue_lib.RolloutQueue(1, 1, VOCAB, MAX_LEN)
    straggler = await queue.admit()
    short = await queue.admit()
    third = asyncio.create_task(queue.admit())
    await settle()
    assert not third.done()  # (0 + 1 - 0 + 1) * 1 = 2 already outstanding
    await short.put(fake_traj([0], prompt_id='short'))
    assert [t.prompt_id for t in await queue.get_batch()] == ['short']
    queue.set_learner_version(1)
    queue.set_rollout_version(1)
    await settle()
    assert not third.done()  # the straggler's deadline is version 1
    assert queue.stats()['admission_headroom'] == 0
    await straggler.put(fake_traj([0, 0, 1], prompt_id='straggler'))
    batch = await queue.get_batch()
    assert [t.prompt_id for t in batch] == ['straggler']
    await settle()
    assert third.done()
    stats = queue.stats()
    assert stats['staleness/1'] == 1 and stats['staleness/0'] == 1
    assert stats['dropped_stale'] == 0

  asyncio.run(main())


def test_sync_mode_admits_one_batch_per_version():

  async def main():
    queue = queue_lib.RolloutQueue(2, 0, VOCAB, MAX_LEN)
    lease = await queue.admit(2)
    extra = asyncio.create_task(queue.admit(1))
    await settle()
    assert not extra.done()
    await lease.put(fake_traj([0], prompt_id='a'))
    await lease.put(fake_traj([0, 0], prompt_id='b'))
    await queue.get_batch()
    # The learner now trains version 0 into 1 and has not said so yet: the
    # queue assumes it, so nothing starts on the old weights.
    await settle()
    assert not extra.done()
    queue.set_learner_version(1)
    await queue.drain()  # nothing in flight: returns at once
    await settle()
    assert not extra.done()
    queue.set_rollout_version(1)
    await settle()
    assert extra.done()
    assert extra.result().deadline == 1

  asyncio.run(main())


def test_batches_that_do_not_advance_the_policy_are_not_counted_stale():
  """Critic pretraining consumes batches at a fixed policy version; in sync
  mode, assuming each batch advanced the policy would stop admission."""

  async def main():
    queue = queue_lib.RolloutQueue(1, 0, VOCAB, MAX_LEN)
    for i in range(3):
      lease = await asyncio.wait_for(queue.admit(), 1)
      await lease.put(fake_traj([0], prompt_id=f'p{i}'))
      await queue.get_batch()
      queue.set_learner_version(0)  # the policy did not move
    return queue.stats()

  stats = asyncio.run(main())
  assert stats['staleness/0'] == 3 and stats['dropped_stale'] == 0


# ------------------------------------------------------ the staleness filter


def test_staleness_filter_drops_by_oldest_version_and_reports_lengths():

  async def main():
    queue = queue_lib.RolloutQueue(2, 1, VOCAB, MAX_LEN)
    leases = [await queue.admit(2), await queue.admit(2)]
    # The learner jumps ahead (e.g. it was restored), so admission's
    # assumption is broken and only the filter can keep the bound.
    queue.set_learner_version(3)
    queue.set_rollout_version(3)
    # Fresh newest tokens, stale oldest one: staleness 3 - 0 = 3 > 1.
    await leases[0].put(fake_traj([0, 3, 3, 3], prompt_id='mixed'))  # 6 tok
    await leases[0].put(fake_traj([2, 3], prompt_id='ok1'))  # 4 tokens
    await leases[1].put(fake_traj([3, 3, 3, 3, 3], prompt_id='ok0'))  # 7
    await leases[1].put(fake_traj([1] * 8, prompt_id='old'))  # 10 tokens
    batch = await queue.get_batch()
    assert [t.prompt_id for t in batch] == ['ok1', 'ok0']
    return queue.stats()

  stats = asyncio.run(main())
  assert stats['dropped_stale'] == 2
  assert stats['consumed'] == 2
  assert stats['staleness/1'] == 1 and stats['staleness/0'] == 1
  assert stats['kept_mean_length'] == pytest.approx((4 + 7) / 2)
  assert stats['dropped_stale_mean_length'] == pytest.approx((6 + 10) / 2)
  assert_accounting(stats)


def test_one_stale_member_drops_its_whole_group():

  async def main():
    queue = queue_lib.RolloutQueue(2, 1, VOCAB, MAX_LEN, group_size=2)
    stale = await queue.admit(2, group_id='g')
    fresh = await queue.admit(2, group_id='h')
    queue.set_learner_version(3)
    queue.set_rollout_version(3)
    await stale.put(fake_traj([3], group_id='g'))
    await stale.put(fake_traj([1, 3], group_id='g'))
    await fresh.put(fake_traj([3, 3], group_id='h', prompt_id='h0'))
    await fresh.put(fake_traj([2], group_id='h', prompt_id='h1'))
    batch = await queue.get_batch()
    assert [t.prompt_id for t in batch] == ['h0', 'h1']
    return queue.stats()

  stats = asyncio.run(main())
  assert stats['dropped_stale'] == 2
  assert stats['dropped_stale_groups'] == 1
  assert_accounting(stats)


# ------------------------------------------------------------- backpressure


def test_backpressure_blocks_producers_at_capacity_and_loses_nothing():

  async def main():
    queue = queue_lib.RolloutQueue(2, 10, VOCAB, MAX_LEN, capacity=3)
    finished = []

    async def producer(i):
      with await queue.admit() as lease:
        await lease.put(fake_traj([0] * (1 + i % 5), prompt_id=f'p{i}'))
        finished.append(i)

    tasks = [asyncio.create_task(producer(i)) for i in range(12)]
    await settle()
    stats = queue.stats()
    assert (stats['queued'], stats['blocked_puts'], stats['in_flight']) == (
        3, 9, 9)
    assert len(finished) == 3
    consumed = []
    while len(consumed) < 12:
      consumed += [t.prompt_id for t in await queue.get_batch()]
      await settle()
      assert queue.stats()['queued'] <= 3
    await asyncio.gather(*tasks)
    assert sorted(consumed) == sorted(f'p{i}' for i in range(12))
    return queue.stats()

  stats = asyncio.run(main())
  assert stats['consumed'] == stats['admitted'] == 12
  assert stats['in_flight'] == stats['queued'] == 0
  assert stats['put_wait_seconds'] >= 0
  assert_accounting(stats)


def test_backpressure_lets_members_complete_groups_already_queued():
  """Four half groups fill the queue; blocking their siblings would
  deadlock (no group could ever complete)."""

  async def main():
    queue = queue_lib.RolloutQueue(4, 3, VOCAB, MAX_LEN, group_size=2,
                                   capacity=4)
    leases = [await queue.admit(2, group_id=g) for g in 'ab']
    leases += [await queue.admit(2, group_id=g) for g in 'cd']
    for lease, g in zip(leases, 'abcd'):
      await lease.put(fake_traj([0], group_id=g))
    assert queue.stats()['queued'] == 4
    late = await queue.admit(2, group_id='e')
    blocked = asyncio.create_task(late.put(fake_traj([0], group_id='e')))
    await settle()
    assert not blocked.done()  # a new group waits for room
    for lease, g in zip(leases, 'abcd'):
      await asyncio.wait_for(lease.put(fake_traj([0], group_id=g)), 1)
    batch = await queue.get_batch()
    assert [t.group_id for t in batch] == ['a', 'a', 'b', 'b']
    await settle()
    assert not blocked.done()  # c and d still fill the queue
    batch = await queue.get_batch()
    assert [t.group_id for t in batch] == ['c', 'c', 'd', 'd']
    await settle()
    assert blocked.done() and blocked.result()

  asyncio.run(main())


# -------------------------------------------------------------- validation


def _bad(kind):
  good = fake_traj([2, 2, 2])
  if kind == 'nan_reward':
    return 'non_finite_reward', fake_traj([2], reward=float('nan'))
  if kind == 'inf_reward':
    return 'non_finite_reward', fake_traj([2], reward=float('inf'))
  if kind == 'no_action':
    good.action_mask = np.zeros_like(good.action_mask)
    return 'no_action_tokens', good
  if kind == 'token_too_big':
    good.tokens[1] = VOCAB
    return 'token_out_of_range', good
  if kind == 'token_negative':
    good.tokens[3] = -1
    return 'token_out_of_range', good
  if kind == 'too_long':
    return 'too_long', fake_traj([2] * (MAX_LEN - 1))
  if kind == 'future_version':
    return 'future_version', fake_traj([2, 3, 2])
  if kind == 'inconsistent_lengths':
    good.behavior_logprobs = good.behavior_logprobs[:-1]
    return 'inconsistent_lengths', good
  if kind == 'nan_logprob':
    good.behavior_logprobs[3] = np.nan
    return 'bad_logprobs', good
  if kind == 'positive_logprob':
    good.behavior_logprobs[4] = 0.5
    return 'bad_logprobs', good
  if kind == 'action_without_version':
    good.versions[2] = types.NO_VERSION
    return 'missing_version', good
  if kind == 'float_tokens':
    good.tokens = good.tokens.astype(np.float32)
    return 'malformed', good
  if kind == 'int_mask':
    good.action_mask = good.action_mask.astype(np.int32)
    return 'malformed', good
  if kind == 'string_reward':
    return 'non_finite_reward', fake_traj([2], reward='1.0')
  if kind == 'not_a_trajectory':
    return 'malformed', {'tokens': [1, 2]}
  if kind == 'all_action_tokens':  # no prompt token predicts the first
    return 'starts_with_action', fake_traj([2, 2], prompt_len=0)
  if kind == 'float64_logprob_beyond_float32':  # -inf once in a batch
    good.behavior_logprobs = good.behavior_logprobs.astype(np.float64)
    good.behavior_logprobs[3] = -1e39
    return 'bad_logprobs', good
  if kind == 'logprob_below_floor':
    good.behavior_logprobs[3] = -2e4
    return 'bad_logprobs', good
  raise ValueError(kind)


@pytest.mark.parametrize('kind', [
    'nan_reward', 'inf_reward', 'no_action', 'token_too_big',
    'token_negative', 'too_long', 'future_version', 'inconsistent_lengths',
    'nan_logprob', 'positive_logprob', 'action_without_version',
    'float_tokens', 'int_mask', 'string_reward', 'not_a_trajectory',
    'all_action_tokens', 'float64_logprob_beyond_float32',
    'logprob_below_floor'])
def test_malformed_trajectory_is_rejected_counted_and_queue_goes_on(kind):
  reason, bad = _bad(kind)

  async def main():
    queue = queue_lib.RolloutQueue(2, 1, VOCAB, MAX_LEN)
    queue.set_learner_version(2)
    queue.set_rollout_version(2)
    lease = await queue.admit(2)
    assert await lease.put(bad) is False
    assert await lease.put(fake_traj([2], prompt_id='good0')) is True
    lease = await queue.admit(1)
    assert await lease.put(fake_traj([2], prompt_id='good1')) is True
    batch = await queue.get_batch()
    assert [t.prompt_id for t in batch] == ['good0', 'good1']
    return queue.stats()

  stats = asyncio.run(main())
  assert stats[f'rejected/{reason}'] == 1
  assert stats['rejected'] == 1
  assert stats['put'] == 3 and stats['accepted'] == 2
  assert stats['in_flight'] == 0
  assert_accounting(stats)


def test_validation_ignores_non_action_tokens_and_tolerates_rounding():
  traj = fake_traj([2, 2])
  traj.behavior_logprobs[0] = np.nan  # a prompt token: never read
  traj.versions[1] = 7  # a prompt token: never read
  traj.behavior_logprobs[2] = 5e-4  # rounding in the engine's log-softmax
  assert trajectory_checks.rejection_reason(
      traj, vocab_size=VOCAB, max_length=MAX_LEN, newest_version=2) is None
  assert trajectory_checks.rejection_reason(
      traj, vocab_size=VOCAB, max_length=MAX_LEN, newest_version=1) == (
          'future_version')


def test_future_version_is_checked_against_the_learner_too():
  """Servers that swapped before the queue heard of it are not corrupt: the
  learner version (set before the push) is the newest that exists."""

  async def main():
    queue = queue_lib.RolloutQueue(1, 2, VOCAB, MAX_LEN)
    lease = await queue.admit()
    queue.set_learner_version(1)  # rollout version still 0
    assert await lease.put(fake_traj([0, 1]))
    lease = await queue.admit()
    assert not await lease.put(fake_traj([0, 2]))

  asyncio.run(main())


def test_rejections_log_loudly_a_few_times_then_at_debug(caplog):

  async def main():
    queue = queue_lib.RolloutQueue(8, 1, VOCAB, MAX_LEN)
    lease = await queue.admit(8)
    for _ in range(8):
      await lease.put(fake_traj([0], reward=float('nan')))

  with caplog.at_level(logging.DEBUG, logger=queue_lib.__name__):
    asyncio.run(main())
  levels = [r.levelno for r in caplog.records]
  assert levels == [logging.WARNING] * 5 + [logging.DEBUG] * 3
  assert 'non_finite_reward' in caplog.records[0].getMessage()


# ------------------------------------------- the queue is the one gate


class _Hostile:
  """Raises on every use a check or a log line could make of it."""

  def __getattr__(self, name):
    raise RuntimeError(f'no {name}')

  def __repr__(self):
    raise RuntimeError('no repr')

  def __float__(self):
    raise RuntimeError('no float')

  def __hash__(self):
    raise RuntimeError('no hash')


class _BadHashStr(str):

  def __hash__(self):
    raise RuntimeError('no hash')


def _gated(index=0, **kwargs):
  """A trajectory the trainer's queue accepts: it reads info['task_index']."""
  return fake_traj([2], info={'task_index': index}, **kwargs)


def _bad_row(kind):
  """(reason, trajectory) of what the trainer would choke on downstream."""
  traj = _gated()
  if kind == 'reward_beyond_float32':
    traj.reward = 1e39  # inf in the batch's float32: a skipped update
    return 'reward_out_of_range', traj
  if kind == 'negative_reward_beyond_float32':
    traj.reward = np.float64(-1e39)
    return 'reward_out_of_range', traj
  if kind == 'absurd_finite_reward':
    traj.reward = 1e30  # a float32, but beyond max_abs_reward
    return 'reward_out_of_range', traj
  if kind == 'int_reward_beyond_float':
    traj.reward = 10**400  # float() raises OverflowError
    return 'reward_out_of_range', traj
  if kind == 'reward_whose_float_raises':
    traj.reward = _Hostile()
    return 'non_finite_reward', traj
  if kind == 'array_reward':
    traj.reward = np.array([1.0])  # would break the batch's reward column
    return 'non_finite_reward', traj
  if kind == 'list_prompt_id':
    traj.prompt_id = ['p']  # unhashable: metrics and slots hash it
    return 'bad_prompt_id', traj
  if kind == 'int_prompt_id':
    traj.prompt_id = 7
    return 'bad_prompt_id', traj
  if kind == 'unhashable_str_prompt_id':
    traj.prompt_id = _BadHashStr('p')
    return 'bad_prompt_id', traj
  if kind == 'list_group_id':
    traj.group_id = ['g']
    return 'bad_group_id', traj
  if kind == 'missing_task_index':
    traj.info = {}
    return 'bad_info', traj
  if kind == 'str_task_index':
    traj.info = {'task_index': '3'}
    return 'bad_info', traj
  if kind == 'bool_task_index':
    traj.info = {'task_index': True}
    return 'bad_info', traj
  if kind == 'float_task_index':
    traj.info = {'task_index': 3.0}
    return 'bad_info', traj
  if kind == 'info_none':
    traj.info = None
    return 'bad_info', traj
  if kind == 'hostile_object':
    return 'malformed', _Hostile()
  raise ValueError(kind)


@pytest.mark.parametrize('kind', [
    'reward_beyond_float32', 'negative_reward_beyond_float32',
    'absurd_finite_reward', 'int_reward_beyond_float',
    'reward_whose_float_raises', 'array_reward', 'list_prompt_id',
    'int_prompt_id', 'unhashable_str_prompt_id', 'list_group_id',
    'missing_task_index', 'str_task_index', 'bool_task_index',
    'float_task_index', 'info_none', 'hostile_object'])
def test_a_bad_row_is_rejected_and_never_costs_the_good_rows(kind, caplog):
  """Everything the trainer reads is checked at `put`, which returns False
  and counts the reason instead of raising; the rows around it still make a
  full batch that assembles into finite float32 arrays."""
  reason, bad = _bad_row(kind)

  async def main():
    queue = queue_lib.RolloutQueue(
        4, 1, VOCAB, MAX_LEN, max_abs_reward=1e6,
        required_info={'task_index': int})
    queue.set_learner_version(2)
    queue.set_rollout_version(2)
    lease = await queue.admit(4)
    assert await lease.put(_gated(0, prompt_id='good0')) is True
    assert await lease.put(bad) is False
    assert await lease.put(_gated(1, prompt_id='good1')) is True
    assert await lease.put(_gated(2, prompt_id='good2', reward=-1e6)) is True
    lease = await queue.admit(1)
    assert await lease.put(_gated(3, prompt_id='good3')) is True
    batch = await queue.get_batch()
    return queue.stats(), batch

  with caplog.at_level(logging.WARNING, logger=queue_lib.__name__):
    stats, batch = asyncio.run(main())
  assert [t.prompt_id for t in batch] == ['good0', 'good1', 'good2', 'good3']
  assert {t.info['task_index'] for t in batch} == {0, 1, 2, 3}
  assembled = batching.assemble_batch(batch, max_length=MAX_LEN, pad_id=0)
  assert np.all(np.isfinite(assembled.reward_N))
  assert stats[f'rejected/{reason}'] == 1
  assert stats['rejected'] == 1
  assert stats['put'] == 5 and stats['accepted'] == 4
  assert stats['in_flight'] == 0
  assert_accounting(stats)
  assert reason in caplog.records[0].getMessage()


def test_reward_bounds_default_to_float32_and_accept_bools():
  check = functools.partial(trajectory_checks.rejection_reason,
                            vocab_size=VOCAB, max_length=MAX_LEN,
                            newest_version=2)
  assert check(fake_traj([2], reward=1e30)) is None  # no max_abs_reward
  assert check(fake_traj([2], reward=1e39)) == 'reward_out_of_range'
  assert check(fake_traj([2], reward=-(10**400))) == 'reward_out_of_range'
  assert check(fake_traj([2], reward=1e6), max_abs_reward=1e6) is None
  assert check(fake_traj([2], reward=-1e6 * 1.001),
               max_abs_reward=1e6) == 'reward_out_of_range'
  # A correctness verdict is a reward of 0 or 1.
  assert check(fake_traj([2], reward=True)) is None
  assert check(fake_traj([2], reward=np.bool_(False))) is None
  assert check(fake_traj([2], reward=np.float32(0.5))) is None
  assert check(fake_traj([2], reward=np.int64(3))) is None
  assert check(fake_traj([2], reward=None)) == 'non_finite_reward'


def test_required_info_types():
  check = functools.partial(trajectory_checks.rejection_reason,
                            vocab_size=VOCAB, max_length=MAX_LEN,
                            newest_version=2)
  assert check(fake_traj([2], info={'task_index': 3}),
               required_info={'task_index': int}) is None
  assert check(fake_traj([2]), required_info=None) is None
  assert check(fake_traj([2], info={'correct': True}),
               required_info={'correct': bool}) is None
  assert check(fake_traj([2], info={'x': True}),
               required_info={'x': (int, bool)}) is None
  assert check(fake_traj([2], info={'x': 1.5}),
               required_info={'x': (int, float)}) is None
  assert check(fake_traj([2], info={'x': 'a'}),
               required_info={'x': (int, float)}) == 'bad_info'
  bad = fake_traj([2])
  bad.info = [('task_index', 3)]  # not a dict, even with nothing required
  assert check(bad) == 'bad_info'
  assert check(fake_traj([2], group_id='g')) is None


def test_queue_refuses_bad_reward_bounds_and_info_specs():
  for bound in (0, -1.0, float('inf'), float('nan'), True, '1e6'):
    with pytest.raises(ValueError, match='max_abs_reward'):
      queue_lib.RolloutQueue(2, 1, VOCAB, MAX_LEN, max_abs_reward=bound)
  for spec in (['task_index'], {'task_index': 'int'}, {'task_index': ()},
               {'task_index': (int, 'str')}):
    with pytest.raises(ValueError, match='required_info'):
      queue_lib.RolloutQueue(2, 1, VOCAB, MAX_LEN, required_info=spec)
  spec = {'task_index': int}
  queue = queue_lib.RolloutQueue(2, 1, VOCAB, MAX_LEN, max_abs_reward=10,
                                 required_info=spec)
  spec['other'] = str  # the queue keeps its own copy
  assert queue.required_info == {'task_index': int}
  assert queue.max_abs_reward == 10.0


def test_rejection_log_line_is_bounded_and_safe(caplog):

  async def main():
    queue = queue_lib.RolloutQueue(3, 1, VOCAB, MAX_LEN)
    lease = await queue.admit(3)
    assert not await lease.put(fake_traj([0], prompt_id='x' * 10**6,
                                         reward=np.nan))
    assert not await lease.put(fake_traj([0], prompt_id=['p']))
    assert not await lease.put(_Hostile())

  with caplog.at_level(logging.WARNING, logger=queue_lib.__name__):
    asyncio.run(main())
  messages = [r.getMessage() for r in caplog.records]
  assert len(messages) == 3
  assert len(messages[0]) < 400
  assert 'prompt <list>: bad_prompt_id' in messages[1]
  assert 'prompt <unreadable>: malformed' in messages[2]


def test_a_bad_group_id_in_a_group_lease_drops_the_group():

  async def main():
    queue = queue_lib.RolloutQueue(2, 1, VOCAB, MAX_LEN, group_size=2)
    lease = await queue.admit(2, group_id='g')
    assert await lease.put(fake_traj([0], group_id='g'))
    assert not await lease.put(fake_traj([0], group_id=['g']))
    lease = await queue.admit(2)  # no group named at admission
    assert not await lease.put(fake_traj([0], group_id={'g': 1}))
    assert not await lease.put(fake_traj([0], group_id=_Hostile()))
    return queue.stats()

  stats = asyncio.run(main())
  assert stats['rejected/bad_group_id'] == 3
  assert stats['dropped_groups'] == 1 and stats['dropped_incomplete_group'] == 1
  assert stats['queued'] == stats['in_flight'] == 0
  assert_accounting(stats)


# ------------------------------------------------------------------ groups


def test_a_rejected_member_drops_its_group_before_and_after():

  async def main():
    queue = queue_lib.RolloutQueue(4, 1, VOCAB, MAX_LEN, group_size=4)
    lease = await queue.admit(4, group_id='g')
    assert await lease.put(fake_traj([0], group_id='g'))
    assert queue.stats()['queued'] == 1
    assert not await lease.put(fake_traj([0], group_id='g', reward=np.inf))
    assert queue.stats()['queued'] == 0  # its sibling went at once
    assert not await lease.put(fake_traj([0], group_id='g'))  # late sibling
    assert not await lease.put(fake_traj([0], group_id='other'))
    return queue.stats()

  stats = asyncio.run(main())
  assert stats['dropped_groups'] == 1
  assert stats['dropped_incomplete_group'] == 2
  assert stats['rejected/non_finite_reward'] == 1
  assert stats['rejected/group_mismatch'] == 1
  assert stats['in_flight'] == stats['queued'] == 0
  assert_accounting(stats)


def test_cancel_frees_admission_and_drops_the_group():

  async def main():
    queue = queue_lib.RolloutQueue(4, 0, VOCAB, MAX_LEN, group_size=2)
    whole = await queue.admit(2, group_id='a')
    for _ in range(2):
      await whole.put(fake_traj([0], group_id='a'))
    with pytest.raises(RuntimeError, match='no open slot'):
      await whole.put(fake_traj([0], group_id='a'))
    with pytest.raises(ZeroDivisionError):
      with await queue.admit(2, group_id='b') as failing:
        await failing.put(fake_traj([0], group_id='b'))
        raise ZeroDivisionError  # the second request failed
    assert failing.remaining == 0
    # Sync mode: B = 4 per version; the failed slots are free again.
    again = await asyncio.wait_for(queue.admit(2, group_id='c'), 1)
    for _ in range(2):
      await again.put(fake_traj([0], group_id='c'))
    batch = await queue.get_batch()
    assert [t.group_id for t in batch] == ['a', 'a', 'c', 'c']
    return queue.stats()

  stats = asyncio.run(main())
  assert stats['cancelled'] == 1
  assert stats['dropped_groups'] == 1
  assert stats['dropped_incomplete_group'] == 1
  assert_accounting(stats)


def test_a_lease_resolved_without_completing_a_group_drops_it():
  """Undeclared groups in a two-group lease: the member whose group cannot
  be read is rejected; its group is known to be short only once the lease
  is resolved."""

  async def main():
    queue = queue_lib.RolloutQueue(4, 1, VOCAB, MAX_LEN, group_size=2)
    lease = await queue.admit(4)
    await lease.put(fake_traj([0], group_id='a'))
    await lease.put(fake_traj([0], group_id='b'))
    await lease.put(fake_traj([0], group_id='a'))
    assert queue.stats()['partial_groups'] == 1
    await lease.put('not a trajectory')
    return queue.stats()

  stats = asyncio.run(main())
  assert stats['partial_groups'] == 0
  assert stats['ready'] == 2
  assert stats['dropped_groups'] == 1
  assert stats['dropped_incomplete_group'] == 1
  assert_accounting(stats)


def test_admit_rejects_sizes_that_split_groups_or_exceed_a_batch():

  async def main():
    queue = queue_lib.RolloutQueue(4, 1, VOCAB, MAX_LEN, group_size=2)
    for n in (0, 1, 3, 6):
      with pytest.raises(ValueError, match='multiple of group_size'):
        await queue.admit(n)

  asyncio.run(main())
  with pytest.raises(ValueError, match='multiple of group_size'):
    queue_lib.RolloutQueue(6, 1, VOCAB, MAX_LEN, group_size=4)
  with pytest.raises(ValueError, match='capacity'):
    queue_lib.RolloutQueue(6, 1, VOCAB, MAX_LEN, capacity=5)


# ------------------------------------------------- threads, close, restore


@pytest.fixture
def loop_thread():
  loop = asyncio.new_event_loop()
  thread = threading.Thread(target=loop.run_forever, daemon=True)
  thread.start()
  asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(5)
  yield loop
  loop.call_soon_threadsafe(loop.stop)
  thread.join(5)
  loop.close()


def test_get_batch_blocking_from_the_learner_thread(loop_thread):
  queue = queue_lib.RolloutQueue(2, 1, VOCAB, MAX_LEN, loop=loop_thread)

  async def produce(names):
    lease = await queue.admit(len(names))
    for name in names:
      await lease.put(fake_traj([0], prompt_id=name))

  start = time.monotonic()
  with pytest.raises(TimeoutError):
    queue.get_batch_blocking(timeout=0.05)
  assert 0.05 <= time.monotonic() - start < 2
  asyncio.run_coroutine_threadsafe(produce(['a']), loop_thread).result(5)
  with pytest.raises(TimeoutError):
    queue.get_batch_blocking(timeout=0.02)  # one short: nothing taken
  assert queue.stats()['ready'] == 1
  asyncio.run_coroutine_threadsafe(produce(['b']), loop_thread).result(5)
  batch = queue.get_batch_blocking(timeout=5)
  assert [t.prompt_id for t in batch] == ['a', 'b']
  queue.set_learner_version(1)
  stats = queue.stats()
  assert stats['learner_version'] == 1 and stats['consumed'] == 2
  assert stats['learner_wait_seconds'] >= 0.07

  # close() from one thread wakes a learner blocked in another.
  outcome = []

  def learner():
    try:
      queue.get_batch_blocking()
    except queue_lib.QueueClosed:
      outcome.append('closed')

  thread = threading.Thread(target=learner)
  thread.start()
  time.sleep(0.05)
  assert thread.is_alive()
  queue.close()
  thread.join(5)
  assert outcome == ['closed']


def test_blocking_calls_refuse_to_deadlock(loop_thread):
  with pytest.raises(RuntimeError, match='running in another thread'):
    queue_lib.RolloutQueue(2, 1, VOCAB, MAX_LEN).get_batch_blocking()
  queue = queue_lib.RolloutQueue(2, 1, VOCAB, MAX_LEN, loop=loop_thread)

  async def on_loop():
    with pytest.raises(RuntimeError, match='deadlock'):
      queue.get_batch_blocking()

  asyncio.run_coroutine_threadsafe(on_loop(), loop_thread).result(5)


def test_close_wakes_every_async_waiter():

  async def main():
    queue = queue_lib.RolloutQueue(2, 0, VOCAB, MAX_LEN, capacity=2)
    leases = [await queue.admit(), await queue.admit()]
    await leases[0].put(fake_traj([0]))
    await leases[1].put(fake_traj([0]))
    taken = await queue.get_batch()
    assert len(taken) == 2
    # Fill again so that a put blocks: a new version, two slots, capacity 2.
    queue.set_learner_version(1)
    queue.set_rollout_version(1)
    more = [await queue.admit(), await queue.admit()]
    waiters = [
        asyncio.create_task(queue.admit()),  # bound reached
        asyncio.create_task(queue.drain()),  # two in flight
        asyncio.create_task(queue.get_batch()),  # nothing ready
    ]
    await settle()
    assert not any(w.done() for w in waiters)
    queue.close()
    await settle()
    for waiter in waiters:
      assert isinstance(waiter.exception(), queue_lib.QueueClosed)
    with pytest.raises(queue_lib.QueueClosed):
      await more[0].put(fake_traj([1]))
    assert more[0].remaining == 1  # the slot stays for the lease to cancel
    for lease in more:
      lease.cancel()
    return queue.stats()

  stats = asyncio.run(main())
  assert stats['cancelled'] == 2 and stats['in_flight'] == 0
  assert_accounting(stats)


def test_close_wakes_a_put_blocked_on_capacity():

  async def main():
    queue = queue_lib.RolloutQueue(2, 3, VOCAB, MAX_LEN, capacity=2)
    lease = await queue.admit(2)
    await lease.put(fake_traj([0]))
    await lease.put(fake_traj([0]))
    lease = await queue.admit(1)
    blocked = asyncio.create_task(lease.put(fake_traj([0])))
    await settle()
    assert not blocked.done()
    queue.close()
    await settle()
    assert isinstance(blocked.exception(), queue_lib.QueueClosed)
    assert lease.remaining == 1

  asyncio.run(main())


def test_state_dict_round_trip_counts_what_was_lost():

  async def main():
    queue = queue_lib.RolloutQueue(2, 1, VOCAB, MAX_LEN)
    lease = await queue.admit(2)
    await lease.put(fake_traj([0]))
    await lease.put(fake_traj([0], reward=np.nan))
    lease = await queue.admit(2)
    await lease.put(fake_traj([0, 0]))
    await queue.get_batch()
    lease = await queue.admit(1)
    await lease.put(fake_traj([0]))  # queued; one slot of the last still out
    return queue

  queue = asyncio.run(main())
  state = json.loads(json.dumps(queue.state_dict()))
  restored = queue_lib.RolloutQueue(2, 1, VOCAB, MAX_LEN)
  restored.load_state_dict(state)
  before, after = queue.stats(), restored.stats()
  for key in ('admitted', 'consumed', 'rejected', 'rejected/non_finite_reward',
              'staleness/0', 'batches', 'kept_mean_length'):
    assert after[key] == before[key], key
  assert after['lost_on_restore'] == 2  # one queued, one in flight
  assert after['queued'] == after['in_flight'] == 0
  assert_accounting(before)
  assert_accounting(after)
  with pytest.raises(ValueError, match='fresh'):
    queue.load_state_dict(state)


# ------------------------------------------------------------ assemble_batch


def test_assemble_batch_places_reward_on_last_action_and_pads_right():
  # Row 0: prompt(2) act(2) obs(2) act(1); row 1: prompt(1) act(2).
  first = types.Trajectory(
      prompt_id='p0', group_id='g',
      tokens=np.array([5, 6, 7, 8, 9, 10, 11], np.int32),
      action_mask=np.array([0, 0, 1, 1, 0, 0, 1], bool),
      behavior_logprobs=np.array([9, 9, -.1, -.2, 9, 9, -.3], np.float32),
      versions=np.array([-1, -1, 4, 4, 7, -1, 5], np.int32),
      reward=2.5)
  second = types.Trajectory(
      prompt_id='p1', group_id=None,
      tokens=np.array([1, 2, 3], np.int32),
      action_mask=np.array([0, 1, 1], bool),
      behavior_logprobs=np.array([0, -1, -2], np.float32),
      versions=np.array([-1, 3, 3], np.int32),
      reward=-1.0)
  batch = batching.assemble_batch([first, second], max_length=8, pad_id=0)

  np.testing.assert_array_equal(batch.tokens_BxT, [
      [5, 6, 7, 8, 9, 10, 11, 0], [1, 2, 3, 0, 0, 0, 0, 0]])
  assert batch.tokens_BxT.dtype == np.int32
  np.testing.assert_array_equal(batch.input_mask_BxT, [
      [1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(batch.action_mask_BxT, [
      [0, 0, 1, 1, 0, 0, 1, 0], [0, 1, 1, 0, 0, 0, 0, 0]])
  np.testing.assert_allclose(batch.behavior_logprobs_BxT, [
      [0, 0, -.1, -.2, 0, 0, -.3, 0], [0, -1, -2, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(batch.rewards_BxT, [
      [0, 0, 0, 0, 0, 0, 2.5, 0], [0, 0, -1, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(batch.positions_BxT, [
      [0, 1, 2, 3, 4, 5, 6, 0], [0, 1, 2, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(batch.segment_ids_BxT, [
      [1, 1, 1, 1, 1, 1, 1, 0], [2, 2, 2, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(batch.reward_N, [2.5, -1.0])
  np.testing.assert_array_equal(batch.num_action_tokens_N, [3, 2])
  np.testing.assert_array_equal(batch.slot_ids_N, [0, 0])  # set by trainer
  assert batch.routed_experts_BxTxR is None  # no routing records
  for name, dtype in types.TRAIN_BATCH_DTYPES.items():
    if types.field_rank(name) < 3:
      assert getattr(batch, name).dtype == dtype, name


def test_assemble_batch_refuses_rows_it_cannot_hold():
  with pytest.raises(ValueError, match='more than max_length'):
    batching.assemble_batch([fake_traj([0] * 7)], max_length=8, pad_id=0)
  traj = fake_traj([0])
  traj.action_mask[:] = False
  with pytest.raises(ValueError, match='no action token'):
    batching.assemble_batch([traj], max_length=8, pad_id=0)
  with pytest.raises(ValueError, match='no trajectories'):
    batching.assemble_batch([], max_length=8, pad_id=0)
  with pytest.raises(ValueError, match='starts with an action token'):
    batching.assemble_batch([fake_traj([0], prompt_len=0)], max_length=8,
                            pad_id=0)
  with pytest.raises(ValueError, match=r'packed_rows=2 must be in \[0, 1\]'):
    batching.assemble_batch([fake_traj([0])], max_length=8, pad_id=0,
                            packed_rows=2)


@pytest.mark.parametrize('kind', ['too_long', 'no_action',
                                  'all_action_tokens'])
def test_every_rule_assemble_batch_enforces_is_a_rejection_reason(kind):
  """assemble_batch refuses a trajectory only by the queue's own rules
  (`trajectory_checks.layout_reason`), so a batch of what the queue accepted
  never fails in the trainer."""
  reason, bad = _bad(kind)
  assert trajectory_checks.rejection_reason(
      bad, vocab_size=VOCAB, max_length=MAX_LEN, newest_version=2) == reason
  with pytest.raises(ValueError, match='assemble_batch: trajectory 0'):
    batching.assemble_batch([bad], max_length=MAX_LEN, pad_id=0)
  assert batching._LAYOUT_MESSAGES.keys() == {  # pylint: disable=protected-access
      _bad(k)[0] for k in ('too_long', 'no_action', 'all_action_tokens')}


def test_assemble_batch_lays_routing_records_out_with_their_tokens():
  """Packed two to a row: each record lands on its trajectory's tokens; a
  trajectory without one, and the padding, read NOT_RECORDED."""
  a, b = fake_traj([0]), fake_traj([0, 0])
  a.routed_experts = np.arange(a.length * 2, dtype=np.int16).reshape(-1, 2)
  batch = batching.assemble_batch([a, b], max_length=16, pad_id=0,
                                  packed_rows=1)
  records = batch.routed_experts_BxTxR
  assert records.shape == (1, 16, 2) and records.dtype == np.int16
  seg = batch.segment_ids_BxT[0]
  np.testing.assert_array_equal(records[0, seg == 1], a.routed_experts)
  assert (records[0, seg != 1] == types.NOT_RECORDED).all()
  b.routed_experts = np.zeros((b.length, 3), np.int16)
  with pytest.raises(ValueError, match='widths'):
    batching.assemble_batch([a, b], max_length=16, pad_id=0)


def test_finished_members_wait_for_their_group_and_the_wait_is_counted():
  """Hand-worked times: a1 at t=0, b1 at 1, a2 at 3, b2 at 4, batch at 10.
  Group a completes at 3 (a1 waited 3), group b at 4 (b1 waited 3); the four
  spent 10 + 7 + 9 + 6 = 32 s queued, 6 of them waiting for a sibling."""
  now = {'t': 0.0}

  async def main():
    queue = queue_lib.RolloutQueue(4, 1, VOCAB, MAX_LEN, group_size=2,
                                   clock=lambda: now['t'])
    waiting = []
    lease = await queue.admit(4)
    for t, group in ((0, 'a'), (1, 'b'), (3, 'a'), (4, 'b')):
      now['t'] = float(t)
      await lease.put(fake_traj([0], group_id=group))
      waiting.append(queue.stats()['waiting_for_group'])
    now['t'] = 10.0
    await queue.get_batch()
    return waiting, queue.stats()

  waiting, stats = asyncio.run(main())
  assert waiting == [1, 2, 1, 0]
  assert stats['group_wait_seconds'] == pytest.approx(6.0)
  assert stats['queue_seconds'] == pytest.approx(32.0)
  assert stats['group_wait_share'] == pytest.approx(6 / 32)
  assert stats['group_wait_mean_seconds'] == pytest.approx(1.5)
  assert_accounting(stats)


def test_single_rollouts_never_wait_for_a_group():
  now = {'t': 0.0}

  async def main():
    queue = queue_lib.RolloutQueue(2, 1, VOCAB, MAX_LEN,
                                   clock=lambda: now['t'])
    lease = await queue.admit(2)
    await lease.put(fake_traj([0]))
    now['t'] = 2.0
    await lease.put(fake_traj([0]))
    now['t'] = 5.0
    await queue.get_batch()
    return queue.stats()

  stats = asyncio.run(main())
  assert stats['waiting_for_group'] == 0
  assert stats['group_wait_seconds'] == 0.0
  assert stats['queue_seconds'] == pytest.approx(5.0 + 3.0)
  assert stats['group_wait_share'] == 0.0


@pytest.mark.parametrize('kind', ['dense_run', 'wrong_width', 'wrong_length',
                                  'expert_out_of_range', 'partly_recorded',
                                  'float_ids', 'good', 'none'])
def test_routing_records_are_checked_at_the_gate(kind):
  """An MoE run's queue (R = 4 ids per token, E = 4 experts) takes a
  record of the right shape whose rows are wholly set or wholly
  NOT_RECORDED, or none at all; a dense run's takes none."""
  traj = fake_traj([2])
  record = np.full((traj.length, 4), types.NOT_RECORDED, np.int16)
  record[np.asarray(traj.action_mask)] = [0, 3, 1, 2]
  routing = wire.RoutingLayout(4, 4)
  if kind == 'dense_run':
    routing = wire.RoutingLayout()
  elif kind == 'wrong_width':
    record = record[:, :2]
  elif kind == 'wrong_length':
    record = record[:-1]
  elif kind == 'expert_out_of_range':
    record[-1] = [0, 1, 2, 4]
  elif kind == 'partly_recorded':
    record[-1, 0] = types.NOT_RECORDED
  elif kind == 'float_ids':
    record = record.astype(np.float32)
  elif kind == 'none':
    record = None
  traj.routed_experts = record

  async def main():
    queue = queue_lib.RolloutQueue(1, 1, VOCAB, MAX_LEN, routing=routing)
    queue.set_rollout_version(2)
    queue.set_learner_version(2)
    lease = await queue.admit(1)
    accepted = await lease.put(traj)
    return accepted, queue.stats()

  accepted, stats = asyncio.run(main())
  assert accepted == (kind in ('good', 'none'))
  assert stats['rejected/bad_routing_record'] == (0 if accepted else 1)
