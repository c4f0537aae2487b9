"""ChainSum, Countdown and the safe expression evaluator."""

import collections
import fractions
import time

import pytest

from sao_jax.envs import arithmetic

_ALL_OPS = arithmetic.Limits(operators=('+', '-', '*', '/', '//', '%', '**'),
                             max_exponent=12, max_abs=10**24)


@pytest.mark.parametrize('expression, expected', [
    ('1 + 2 * 3', 7),
    ('(1 + 2) * 3', 9),
    ('7 / 2 * 2', 7),  # exact: no 7.000000000000001
    ('0.1 + 0.2', fractions.Fraction(3, 10)),
    ('1 / 3', fractions.Fraction(1, 3)),
    ('2 ** 10', 1024),
    ('2 ** -2', fractions.Fraction(1, 4)),
    ('-(3) + +4', 1),
    ('17 // 5', 3),
    ('17 % 5', 2),
    ('12 \u00d7 3 \u2212 1', 35),  # multiplication and minus signs as text
])
def test_evaluate_values(expression, expected):
  assert arithmetic.evaluate(expression, _ALL_OPS) == expected


@pytest.mark.parametrize('expression, message', [
    ('9**9**9', 'exponent'),
    ('99999999999 ** 12', 'too large'),
    ('10**12 * 10**12 * 10', 'too large'),
    ('2 ** 0.5', 'integer'),
    ('1 / 0', 'division by zero'),
    ('5 % 0', 'division by zero'),
    ('0 ** -1', 'division by zero'),
    ('abc + 1', 'only numbers'),
    ('x.__class__', 'only numbers'),
    ('(1).real', 'only numbers'),
    ('__import__("os").system("true")', 'only numbers'),
    ('[1, 2][0]', 'only numbers'),
    ('1 if 1 else 2', 'only numbers'),
    ('3 > 2', 'only numbers'),
    ('"a" * 3', 'not a number'),
    ('True + 1', 'not a number'),
    ('1e400', 'finite'),
    ('1; 2', 'not a valid expression'),
    ('lambda: 1', 'only numbers'),
    ('', 'empty'),
    ('1 +' * 300, 'longer than'),
])
def test_evaluate_rejects(expression, message):
  with pytest.raises(arithmetic.ExpressionError, match=message):
    arithmetic.evaluate(expression, _ALL_OPS)


def test_operator_subset_enforced():
  limits = arithmetic.Limits(operators=('+', '-'), unary=False)
  assert arithmetic.evaluate('5 - 3 + 1', limits) == 3
  for expression in ('2 * 3', '2 ** 3', '-2 + 3'):
    with pytest.raises(arithmetic.ExpressionError, match='not allowed'):
      arithmetic.evaluate(expression, limits)
  with pytest.raises(ValueError, match='unknown operators'):
    arithmetic.Limits(operators=('<<',))


def test_integer_literals():
  limits = arithmetic.Limits(integer_literals=True)
  with pytest.raises(arithmetic.ExpressionError, match='not an integer'):
    arithmetic.evaluate('2.0 + 1', limits)


def test_hostile_expressions_fail_fast():
  start = time.perf_counter()
  for expression in ('9**9**9**9', '(10**12)**12', '((((2**12)**12)**12)**12)',
                     '9' * 199, '(' * 99 + '1' + ')' * 99):
    try:
      arithmetic.evaluate(expression, _ALL_OPS)
    except arithmetic.ExpressionError:
      pass
  assert time.perf_counter() - start < 1.0


def test_literals():
  assert arithmetic.literals('2 * (3 + 2)') == [2, 3, 2]


def test_format_value():
  assert arithmetic.format_value(fractions.Fraction(12)) == '12'
  assert arithmetic.format_value(fractions.Fraction(-1, 4)) == '-0.25'
  assert arithmetic.format_value(fractions.Fraction(1, 3)) == '0.333333333333'


def test_chain_sum_tasks_hand_checked_and_deterministic():
  env = arithmetic.ChainSum(num_terms=3, digits=2)
  for index in range(50):
    task = env.task('train', index)
    expression = task.metadata['expression']
    terms = expression.split()
    assert len(terms) == 5 and all(len(t) == 2 for t in terms[::2])
    # Independent reference: left-to-right evaluation of the tokens.
    total = int(terms[0])
    for sign, term in zip(terms[1::2], terms[2::2]):
      total += int(term) if sign == '+' else -int(term)
    assert task.answer == total
    assert task.question == f'What is {expression}?'
    same = arithmetic.ChainSum(num_terms=3, digits=2)
    assert same.task('train', index) == task
  assert env.task('train', 0) != env.task('eval', 0)
  assert env.task('train', 0) != arithmetic.ChainSum(3, 2, seed=1).task(
      'train', 0)


def test_chain_sum_one_digit_space():
  env = arithmetic.ChainSum(num_terms=2, digits=1)
  questions = {env.task('train', i).question for i in range(3000)}
  assert len(questions) == 200  # 10 * 10 operand pairs * 2 signs


def test_chain_sum_step():
  env = arithmetic.ChainSum()
  task = env.task('eval', 3)
  good = env.step(task, 0, f'The answer is {task.answer}.')
  assert good.done and good.reward == 1.0
  assert good.info == {'correct': True, 'answer': str(task.answer),
                       'expected': task.answer}
  bad = env.step(task, 0, f'The answer is {task.answer + 1}.')
  assert bad.reward == 0.0 and not bad.info['correct']
  assert env.step(task, 0, '').reward == 0.0
  # Restating the question is not answering it (on a task whose last term
  # is not also the answer).
  task = next(t for t in (env.task('eval', i) for i in range(100))
              if t.metadata['expression'].split()[-1] != str(t.answer))
  assert env.step(task, 0, task.metadata['expression']).reward == 0.0


def test_chain_sum_prompt_formats():
  task = arithmetic.ChainSum().task('train', 0)
  plain = arithmetic.ChainSum().prompt_messages(task)
  assert plain == [{'role': 'user',
                    'content': f'{task.question}\nAnswer with a number.'}]
  tagged = arithmetic.ChainSum(answer_format='tagged').prompt_messages(task)
  assert tagged[0]['content'].endswith('<answer></answer>.')
  with pytest.raises(ValueError):
    arithmetic.ChainSum(answer_format='fancy')


def test_task_args_validated():
  env = arithmetic.ChainSum()
  with pytest.raises(ValueError, match='split'):
    env.task('test', 0)
  with pytest.raises(ValueError, match='index'):
    env.task('train', -1)


def test_countdown_solutions_reach_targets():
  env = arithmetic.Countdown(num_numbers=4, max_value=10, max_target=100)
  for index in range(100):
    task = env.task('train', index)
    numbers = task.metadata['numbers']
    assert len(numbers) == 4 and all(1 <= n <= 10 for n in numbers)
    assert 1 <= task.answer <= 100
    solution = task.metadata['solution']
    assert arithmetic.evaluate(solution) == task.answer
    used = collections.Counter(arithmetic.literals(solution))
    assert all(used[n] <= numbers.count(n) for n in used)
    assert env.step(task, 0, solution).reward == 1.0
    assert env.task('train', index) == task


def test_countdown_checker_hand_worked():
  numbers, target = [3, 5, 7, 2], 22
  check = arithmetic.check_countdown
  assert check('3 * 5 + 7', numbers, target) == (True, 'ok')
  assert check('(7 + 3) * 2 + 5 - 3', numbers, target) == (False, 'numbers')
  assert check('7 * 7 - 27', numbers, target) == (False, 'numbers')
  assert check('3 * 5 + 2', numbers, target) == (False, 'wrong_value')
  assert check('3 * 5 + 7', numbers, target, use_all=True) == (False, 'numbers')
  assert check('(5 + 2) * 3 + 7 / 7', numbers, target) == (False, 'numbers')
  # Exact arithmetic: in floats this is 3.0000000000000004.
  assert (1 / 10 + 2 / 10) * 10 != 3
  assert check('(1 / 10 + 2 / 10) * 10', [1, 2, 10, 10, 10], 3) == (True, 'ok')
  assert check('(7 - 2 / 2)', [7, 2, 2], 6) == (True, 'ok')
  assert check(None, numbers, target) == (False, 'no_answer')
  correct, reason = check('__import__("os")', numbers, target)
  assert not correct and reason.startswith('invalid')
  correct, reason = check('-3 + 25', [3, 25], 22)  # no unary minus
  assert not correct and reason.startswith('invalid')
  correct, reason = check('3.0 * 5 + 7', numbers, target)
  assert not correct and reason.startswith('invalid')


def test_countdown_step_uses_extracted_expression():
  env = arithmetic.Countdown()
  task = env.task('eval', 0)
  solution = task.metadata['solution']
  reply = f'Let me think.\n{solution} = {task.answer}'
  result = env.step(task, 0, reply)
  assert result.reward == 1.0
  assert result.info['answer'] == solution
  assert env.step(task, 0, f'<answer>{solution}</answer>').reward == 1.0
  # Just the target is not an expression over the given numbers.
  task = next(t for t in (env.task('eval', i) for i in range(100))
              if t.answer not in t.metadata['numbers'])
  result = env.step(task, 0, f'The answer is {task.answer}')
  assert result.reward == 0.0 and result.info['reason'].startswith('invalid')
  assert env.step(task, 0, str(task.answer)).info['reason'] == 'numbers'
