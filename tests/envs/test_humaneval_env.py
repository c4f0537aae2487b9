"""HumanEval environment: split, code extraction, and sandboxed judging."""

import asyncio
import time

import pytest

from sao_jax.envs import base
from sao_jax.envs import humaneval_env

@pytest.fixture(scope='module')
def env():
  return humaneval_env.HumanEvalEnvironment(eval_size=40, timeout_s=5)


def _task(env, task_id):
  """The task of a HumanEval problem, whichever split holds it."""
  for split in base.SPLITS:
    for index in range(env.size(split)):
      task = env.task(split, index)
      if task.metadata['task_id'] == task_id:
        return task
  raise KeyError(task_id)


def _fenced(code):
  return f'Here is my solution:\n\n```python\n{code}```\n\nIt runs in O(n).'


def test_split_is_a_deterministic_partition_of_the_164_problems(env):
  train = [env.task('train', i).metadata['task_id']
           for i in range(env.size('train'))]
  held_out = [env.task('eval', i).metadata['task_id']
              for i in range(env.size('eval'))]
  assert (len(train), len(held_out)) == (124, 40)
  assert len(set(train) | set(held_out)) == 164
  assert not set(train) & set(held_out)
  # Train keeps the dataset's order.
  assert train == sorted(train, key=lambda t: int(t.split('/')[1]))
  again = humaneval_env.HumanEvalEnvironment(eval_size=40)
  assert [again.task('eval', i).metadata['task_id'] for i in range(40)] == (
      held_out)
  larger = humaneval_env.HumanEvalEnvironment(eval_size=50)
  assert [larger.task('eval', i).metadata['task_id'] for i in range(40)] == (
      held_out)
  other_seed = humaneval_env.HumanEvalEnvironment(eval_size=40, seed=1)
  assert {other_seed.task('eval', i).metadata['task_id']
          for i in range(40)} != set(held_out)


def test_tasks_are_stable_and_wrap(env):
  task = env.task('train', 3)
  assert task.id == 'humaneval/train/3'
  assert env.task('train', 3 + env.size('train')) == task
  assert task.question.rstrip().endswith('"""')  # signature and docstring
  assert f'def {task.metadata["entry_point"]}(' in task.question
  assert 'def check(candidate)' in task.metadata['test']
  with pytest.raises(ValueError, match='split'):
    env.task('validation', 0)
  with pytest.raises(ValueError, match='>= 0'):
    env.task('train', -1)
  with pytest.raises(ValueError, match='empty'):
    humaneval_env.HumanEvalEnvironment(eval_size=0).task('eval', 0)
  with pytest.raises(ValueError, match='eval_size'):
    humaneval_env.HumanEvalEnvironment(eval_size=165)


def test_prompt_shows_the_signature_and_asks_for_a_code_block(env):
  task = env.task('eval', 0)
  (message,) = env.prompt_messages(task)
  assert message['role'] == 'user'
  assert f'```python\n{task.question}```' in message['content']
  assert 'code block' in message['content']


def test_extract_code():
  assert humaneval_env.extract_code('x = 1') == 'x = 1'
  assert humaneval_env.extract_code(_fenced('def f():\n  return 1\n')) == (
      'def f():\n  return 1\n')
  two = ('First a helper:\n```python\ndef g():\n  pass\n```\nthen\n'
         '```py\ndef f():\n  return g()\n```\nand a usage example:\n'
         '```\nprint(f())\n```')
  assert humaneval_env.extract_code(two, 'f') == 'def f():\n  return g()\n'
  assert humaneval_env.extract_code(two) == 'print(f())\n'
  cut = 'Sure!\n```python\ndef f():\n  return 2'  # hit the token limit
  assert humaneval_env.extract_code(cut, 'f') == 'def f():\n  return 2'


@pytest.mark.parametrize('task_id', [
    'HumanEval/0',
    'HumanEval/10',  # make_palindrome: calls a helper the prompt defines
    'HumanEval/32',  # find_zero: 100 random polynomials
])
def test_canonical_solutions_pass(env, task_id):
  task = _task(env, task_id)
  # As HumanEval completions (the body after the prompt)...
  result = env.step(task, 0, task.answer)
  assert (result.done, result.reward) == (True, 1.0), result.info
  assert result.info['passed'] and result.info['reason'] == 'ok'
  # ... and as chat replies: the whole function in prose, without the
  # prompt's helpers, which the program keeps.
  function = task.question[task.question.index(
      f'def {task.metadata["entry_point"]}('):] + task.answer
  result = env.step(task, 0, _fenced(function))
  assert result.reward == 1.0, result.info


def test_wrong_solutions_fail(env):
  task = _task(env, 'HumanEval/0')  # has_close_elements(numbers, threshold)
  off = task.answer.replace('distance < threshold', 'distance > threshold')
  assert off != task.answer
  for reply in (_fenced('def has_close_elements(numbers, threshold):\n'
                        '    return False\n'),
                task.question + off,
                _fenced('def has_close_elements(numbers, threshold):\n'
                        '    return undefined_name\n')):
    result = env.step(task, 0, reply)
    assert (result.done, result.reward) == (True, 0.0)
    assert not result.info['passed']
    assert result.info['reason'] == 'exit 1'
  assert result.info['error'].startswith('NameError')


def test_replies_without_code_score_zero_without_running(env):
  task = env.task('train', 0)
  result = env.step(task, 0, 'Here you go:\n```python\n\n```')
  assert result.reward == 0.0
  assert result.info['reason'] == 'no_code'
  assert 'wall_s' not in result.info  # nothing ran


def test_exiting_early_or_faking_equality_earns_nothing(env):
  task = _task(env, 'HumanEval/0')
  hacks = {
      'no_sentinel': [
          _fenced('import sys\nsys.exit(0)\n'),
          _fenced('def has_close_elements(numbers, threshold):\n'
                  '    import os\n    os._exit(0)\n')],
      'exit 1': [
          _fenced('class Anything:\n    def __eq__(self, other):\n'
                  '        return True\n\n'
                  'def has_close_elements(numbers, threshold):\n'
                  '    return Anything()\n')],
  }
  for reason, replies in hacks.items():
    for reply in replies:
      result = env.step(task, 0, reply)
      assert result.reward == 0.0
      assert result.info['reason'] == reason
  assert 'not a plain built-in value' in result.info['error']


def test_infinite_loop_scores_zero_within_the_timeout():
  # A CPU limit above the wall-clock one: the loop must hit the timeout, not
  # race it for the CPU limit (both default to the same second).
  env = humaneval_env.HumanEvalEnvironment(timeout_s=1, cpu_s=5)
  task = _task(env, 'HumanEval/0')
  start = time.monotonic()
  result = env.step(task, 0, _fenced(
      'def has_close_elements(numbers, threshold):\n    while True:\n'
      '        pass\n'))
  assert time.monotonic() - start < 6
  assert (result.done, result.reward) == (True, 0.0)
  assert result.info['reason'] == 'timeout'


def test_astep_judges_like_step_and_runs_concurrently(env):
  tasks = [_task(env, f'HumanEval/{i}') for i in range(4)]

  async def judge_all():
    return await asyncio.gather(
        *[env.astep(task, 0, task.answer) for task in tasks],
        env.astep(tasks[0], 0, _fenced(
            'def has_close_elements(numbers, threshold):\n    return True\n')))

  results = asyncio.run(judge_all())
  assert [r.reward for r in results] == [1.0, 1.0, 1.0, 1.0, 0.0]


def test_failures_are_fed_back_when_turns_remain():
  env = humaneval_env.HumanEvalEnvironment(max_turns=2, timeout_s=5)
  task = _task(env, 'HumanEval/0')
  wrong = _fenced('def has_close_elements(numbers, threshold):\n'
                  '    return 1 / 0\n')
  first = env.step(task, 0, wrong)
  assert not first.done and first.reward == 0.0
  assert 'ZeroDivisionError' in first.observation
  last = env.step(task, 1, wrong)
  assert last.done and last.reward == 0.0 and last.observation is None
  assert env.step(task, 0, task.answer).done  # a pass ends it at once


def test_astep_runs_at_most_max_concurrent_runs_at_once():
  env = humaneval_env.HumanEvalEnvironment(max_concurrent_runs=1, timeout_s=5)
  task = _task(env, 'HumanEval/0')
  slow = task.question + '    import time\n    time.sleep(0.05)\n' + task.answer

  async def judge_three():
    start = time.monotonic()
    results = await asyncio.gather(*[env.astep(task, 0, slow)
                                     for _ in range(3)])
    return results, time.monotonic() - start

  results, elapsed = asyncio.run(judge_three())
  assert [r.reward for r in results] == [1.0, 1.0, 1.0]
  # Seven calls of 0.05 s each (HumanEval/0 has seven asserts), one run at a
  # time.
  assert elapsed >= 3 * 0.35
