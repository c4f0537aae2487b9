"""reasoning-gym environments: splits, scoring on extracted answers, gaming."""

import logging
import re
import sys

import pytest
import reasoning_gym

from sao_jax.envs import reasoning_gym_env

_ONE_DIGIT_PAIRS = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)
# reasoning-gym's gsm_symbolic scorer reads the first match of this.
_GSM_NUMBER = re.compile(r'\b-?\d+(?:\.\d+)?\b')


def _env(name, **kwargs):
  return reasoning_gym_env.ReasoningGymEnvironment(name, seed=0, size=1000,
                                                   **kwargs)


def _first(env, predicate, split='eval', limit=3000):
  """The first task of `split` satisfying `predicate`."""
  for index in range(limit):
    task = env.task(split, index)
    if predicate(task):
      return task
  raise AssertionError('no such task')


def test_nearby_seeds_share_items_so_eval_is_offset():
  # The hazard the offset avoids: item i+1 of seed s is item i of seed s+1.
  a = reasoning_gym.create_dataset('chain_sum', seed=5, size=100)
  b = reasoning_gym.create_dataset('chain_sum', seed=6, size=100)
  assert [a[i + 1]['question'] for i in range(20)] == [
      b[i]['question'] for i in range(20)]
  # In a space too large for chance repeats (4-6 terms of 3-4 digits), no
  # eval question appears among the train questions.
  env = _env('chain_sum', min_terms=4, max_terms=6, min_digits=3, max_digits=4)
  train = {env.task('train', i).question for i in range(1000)}
  assert not train & {env.task('eval', i).question for i in range(1000)}


def test_tasks_deterministic_and_wrap_modulo_size():
  env, again = _env('chain_sum'), _env('chain_sum')
  for split in ('train', 'eval'):
    assert env.task(split, 7) == again.task(split, 7)
    assert env.task(split, 1007) == env.task(split, 7)
  task = env.task('train', 1007)
  assert task.id == 'chain_sum/train/7'
  assert env.task('train', 7) != env.task('eval', 7)
  with pytest.raises(ValueError, match='split'):
    env.task('valid', 0)


def test_prompt_default_plain():
  env = _env('chain_sum', **_ONE_DIGIT_PAIRS)
  task = env.task('eval', 0)
  assert env.prompt_messages(task) == [
      {'role': 'user', 'content': task.question + '\nAnswer with a number.'}]
  tagged = _env('chain_sum', answer_format='tagged').prompt_messages(task)
  assert tagged[0]['content'].endswith('Put the final answer in'
                                       ' <answer></answer>.')


def test_chain_sum_scores_extracted_answer():
  env = _env('chain_sum', **_ONE_DIGIT_PAIRS)
  task = env.task('eval', 0)
  expression = task.metadata['expression']
  a, op, b = expression.split()
  expected = int(a) + int(b) if op == '+' else int(a) - int(b)
  assert task.answer == str(expected)
  for reply in (f'{expression} = {expected}', f'The answer is {expected}.',
                f'<answer>{expected}.0</answer>', f'So it is {expected}. ',
                rf'\boxed{{{expected}}}'):
    result = env.step(task, 0, reply)
    assert result.done and result.reward == 1.0, reply
    assert result.info['correct'] and result.info['expected'] == str(expected)
  assert env.step(task, 0, f'The answer is {expected + 1}.').reward == 0.0
  assert env.step(task, 0, '').reward == 0.0


def test_partial_credit_off_by_default():
  env = _env('chain_sum', **_ONE_DIGIT_PAIRS)
  task = _first(env, lambda t: t.answer == '7')
  entry = {'question': task.question, 'answer': task.answer,
           'metadata': task.metadata}
  scorer = reasoning_gym.create_dataset('chain_sum').score_answer
  # The dataset scorer credits a wrong number containing the right digits.
  assert scorer('17', entry) == 0.5
  assert scorer('-7', entry) == 0.5
  assert env.step(task, 0, 'The answer is 17.').reward == 0.0
  assert env.step(task, 0, 'The answer is -7.').reward == 0.0
  lenient = _env('chain_sum', partial_credit=True, **_ONE_DIGIT_PAIRS)
  assert lenient.step(task, 0, 'The answer is 17.').reward == 0.5


def test_basic_arithmetic_string_scorer_sees_canonical_numbers():
  env = _env('basic_arithmetic')
  task = env.task('eval', 0)
  dataset = reasoning_gym.create_dataset('basic_arithmetic')
  entry = {'question': task.question, 'answer': task.answer,
           'metadata': task.metadata}
  assert dataset.score_answer(task.answer + '.0', entry) < 1.0  # raw: strings
  assert env.step(task, 0, f'It is {task.answer}.0').reward == 1.0
  assert env.step(task, 0, f'It is {task.answer}').reward == 1.0


def test_gsm_symbolic_restated_question_gaming_closed():
  env = _env('gsm_symbolic')
  dataset = reasoning_gym.create_dataset('gsm_symbolic')

  def answer_is_first_not_last(task):
    numbers = [float(n) for n in _GSM_NUMBER.findall(task.question)]
    return numbers and numbers[0] == float(task.answer) != numbers[-1]

  task = _first(env, answer_is_first_not_last)
  entry = {'question': task.question, 'answer': task.answer,
           'metadata': task.metadata}
  wrong = int(float(task.answer)) + 1
  reply = f'{task.question} So the answer is {wrong}.'
  # The raw scorer reads the restated question's first number: full credit
  # for a wrong conclusion.
  assert dataset.score_answer(reply, entry) == 1.0
  assert env.step(task, 0, reply).reward == 0.0
  # Repeating just the question: its last number is not the answer.
  assert dataset.score_answer(task.question, entry) == 1.0
  assert env.step(task, 0, task.question).reward == 0.0
  # A reply that only repeats a number of the question that is not the
  # answer earns the raw scorer's 0.01 'format' credit, and 0 here.
  other = next(n for n in _GSM_NUMBER.findall(task.question)
               if float(n) != float(task.answer))
  assert dataset.score_answer(other, entry) == 0.01
  assert env.step(task, 0, other).reward == 0.0


def test_gsm_symbolic_worked_solution_judged_by_final_answer():
  env = _env('gsm_symbolic')
  dataset = reasoning_gym.create_dataset('gsm_symbolic')
  task = _first(env, lambda t: float(t.answer) >= 1000
                and float(t.answer).is_integer())
  entry = {'question': task.question, 'answer': task.answer,
           'metadata': task.metadata}
  value = int(float(task.answer))
  worked = f'First, 2 * 3 = 6. Then the total is {value}.'
  assert dataset.score_answer(worked, entry) == 0.01  # judged on '2'
  assert env.step(task, 0, worked).reward == 1.0
  with_commas = f'The answer is {value:,}.'
  assert dataset.score_answer(with_commas, entry) == 0.01  # reads '1' of '1,2'
  assert env.step(task, 0, with_commas).reward == 1.0
  assert env.step(task, 0, f'<answer>{value}</answer>').reward == 1.0
  assert env.step(task, 0, f'The answer is {value + 1}.').reward == 0.0


def test_countdown_checked_safely():
  env = _env('countdown')
  task = env.task('eval', 0)
  solution = task.metadata['expression']
  assert env.step(task, 0, solution).reward == 1.0
  assert env.step(task, 0, f'<answer>{solution}</answer>').reward == 1.0
  numbers = task.metadata['numbers']
  # reasoning-gym's rule: every number exactly once.
  partial = ' + '.join(map(str, numbers[:2]))
  assert env.step(task, 0, partial).reward == 0.0
  # The dataset scorer would exec this via sympy's parse_expr; here it is an
  # invalid expression, and nothing runs.
  payload = "__import__('sys').modules.setdefault('sao_rg_probe', 1)"
  assert env.step(task, 0, payload).reward == 0.0
  assert 'sao_rg_probe' not in sys.modules
  assert env.step(task, 0, '9**9**9**9').reward == 0.0


def test_unreviewed_dataset_warns(caplog):
  with caplog.at_level(logging.WARNING):
    env = _env('leg_counting')
  assert 'unreviewed' in caplog.text
  assert env.kind == 'text'


def test_size_limits():
  with pytest.raises(ValueError, match='sizes'):
    reasoning_gym_env.ReasoningGymEnvironment(
        'chain_sum', size=reasoning_gym_env.EVAL_SEED_OFFSET + 1)
