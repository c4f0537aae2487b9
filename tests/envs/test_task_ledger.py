"""The task ledger: nothing lost or trained twice across a resume."""

import pytest

from sao_jax.envs import arithmetic
from sao_jax.envs import task_ledger
from sao_jax.envs import task_stream


def _ledger(start=0, stride=1):
  env = arithmetic.ChainSum()
  return task_ledger.TaskLedger(
      task_stream.TaskStream(env, (), start=start, stride=stride))


@pytest.mark.parametrize('start,stride', [(0, 1), (1, 3)])
def test_resume_replays_outstanding_and_skips_done(start, stride):
  ledger = _ledger(start, stride)
  handed = [ledger.next_task()[0] for _ in range(6)]
  assert handed == [start + k * stride for k in range(6)]
  # Consumed out of order: the 1st and 4th are still in flight.
  ledger.mark_done([handed[0], handed[2], handed[3], handed[5]])
  state = ledger.state_dict()
  assert state['stream']['cursor'] == handed[1]  # the frontier
  assert state['done_above'] == [handed[2], handed[3], handed[5]]
  resumed = _ledger(start, stride)
  resumed.load_state_dict(state)
  replayed = [resumed.next_task()[0] for _ in range(3)]
  # The in-flight ones come again, then the stream goes on; nothing done
  # is handed out twice.
  assert replayed == [handed[1], handed[4], start + 6 * stride]


def test_ledger_refuses_another_processes_state():
  first = _ledger(0, 2)
  first.next_task()
  with pytest.raises(ValueError, match='same number of processes'):
    _ledger(1, 2).load_state_dict(first.state_dict())
