"""Held-out sets and the training stream that excludes them."""

import itertools

import pytest

from sao_jax.envs import arithmetic
from sao_jax.envs import reasoning_gym_env
from sao_jax.envs import task_stream

def _one_digit_pairs():
  # reasoning-gym chain_sum with 2 one-digit terms: 200 distinct questions.
  return reasoning_gym_env.ReasoningGymEnvironment(
      'chain_sum', seed=0, size=100_000, min_terms=2, max_terms=2,
      min_digits=1, max_digits=1)


def test_held_out_first_distinct_questions():
  env = _one_digit_pairs()
  tasks = task_stream.held_out(env, 50)
  questions = [t.question for t in tasks]
  assert len(set(questions)) == 50
  # Independent reference: scan eval indices by hand.
  expected, seen = [], set()
  for index in itertools.count():
    question = env.task('eval', index).question
    if question not in seen:
      seen.add(question)
      expected.append(index)
    if len(expected) == 50:
      break
  assert [t.id for t in tasks] == [f'chain_sum/eval/{i}' for i in expected]
  assert expected[-1] > 49  # small spaces repeat: some indices were skipped


def test_held_out_too_many_raises():
  env = arithmetic.ChainSum(num_terms=2, digits=1)  # exactly 200 questions
  assert len(task_stream.held_out(env, 200)) == 200
  with pytest.raises(ValueError, match='distinct'):
    task_stream.held_out(env, 201, max_scan=5000)


def test_stream_never_yields_held_out_questions():
  env = _one_digit_pairs()
  held = {t.question for t in task_stream.held_out(env, 50)}
  stream = task_stream.TaskStream(env, held)
  drawn = list(itertools.islice(stream, 5000))
  assert not held & {t.question for t in drawn}
  # 150 of 200 questions remain, and every one of them shows up.
  assert len({t.question for t in drawn}) == 150
  # Every index was either yielded or skipped, in order.
  yielded = [int(t.id.rsplit('/', 1)[1]) for t in drawn]
  assert yielded == sorted(yielded)
  assert stream.cursor == yielded[-1] + 1
  assert stream.skipped == stream.cursor - len(drawn)
  # A quarter of the questions are held out: about a quarter is skipped.
  assert stream.skipped / stream.cursor == pytest.approx(0.25, abs=0.03)


def test_resume_continues_at_same_task():
  env = _one_digit_pairs()
  held = [t.question for t in task_stream.held_out(env, 20)]
  straight = task_stream.TaskStream(env, held)
  reference = [t.id for t in itertools.islice(straight, 300)]

  first = task_stream.TaskStream(env, held)
  part = [t.id for t in itertools.islice(first, 137)]
  state = first.state_dict()
  resumed = task_stream.TaskStream(env, held)
  resumed.load_state_dict(state)
  part += [t.id for t in itertools.islice(resumed, 163)]
  assert part == reference
  assert resumed.state_dict() == straight.state_dict()


def test_resume_with_other_held_out_set_refused():
  env = _one_digit_pairs()
  stream = task_stream.TaskStream(env, ['a'])
  with pytest.raises(ValueError, match='different'):
    task_stream.TaskStream(env, ['b']).load_state_dict(stream.state_dict())


def test_start_and_split():
  env = arithmetic.ChainSum()
  stream = task_stream.TaskStream(env, (), start=40)
  assert next(stream) == env.task('train', 40)
  assert stream.cursor == 41
  eval_stream = task_stream.TaskStream(env, (), split='eval')
  assert next(eval_stream) == env.task('eval', 0)


def test_everything_held_out_raises(monkeypatch):
  monkeypatch.setattr(task_stream, 'MAX_CONSECUTIVE_SKIPS', 2000)
  env = arithmetic.ChainSum(num_terms=2, digits=1)
  held = [t.question for t in task_stream.held_out(env, 200)]
  with pytest.raises(RuntimeError, match='held out'):
    next(task_stream.TaskStream(env, held))


def test_slices_of_processes_partition_the_stream():
  env = _one_digit_pairs()
  held = [t.question for t in task_stream.held_out(env, 20)]
  whole = task_stream.TaskStream(env, held)
  reference = []
  for task in itertools.islice(whole, 300):
    reference.append(whole.last_index)
  slices = []
  for process in range(3):
    stream = task_stream.TaskStream(env, held, start=process, stride=3)
    drawn = []
    for _ in range(100):
      task = next(stream)
      assert task == env.task('train', stream.last_index)
      drawn.append(stream.last_index)
    assert all(i % 3 == process for i in drawn)
    slices.append(drawn)
  merged = sorted(itertools.chain(*slices))
  assert len(set(merged)) == 300  # no index drawn by two processes
  # Together they read the stream the one process reads, up to where the
  # slowest slice stopped.
  end = min(s[-1] for s in slices)
  assert [i for i in merged if i <= end] == [i for i in reference if i <= end]


def test_sliced_resume_continues_the_slice_and_refuses_another():
  env = _one_digit_pairs()
  held = [t.question for t in task_stream.held_out(env, 20)]
  straight = task_stream.TaskStream(env, held, start=1, stride=2)
  reference = [t.id for t in itertools.islice(straight, 60)]
  first = task_stream.TaskStream(env, held, start=1, stride=2)
  part = [t.id for t in itertools.islice(first, 25)]
  resumed = task_stream.TaskStream(env, held, start=1, stride=2)
  resumed.load_state_dict(first.state_dict())
  part += [t.id for t in itertools.islice(resumed, 35)]
  assert part == reference
  with pytest.raises(ValueError, match='slice 1 \\(mod 2\\).*0 \\(mod 2\\)'):
    task_stream.TaskStream(env, held, start=0, stride=2).load_state_dict(
        first.state_dict())
  with pytest.raises(ValueError, match='same number of processes'):
    task_stream.TaskStream(env, held).load_state_dict(first.state_dict())
