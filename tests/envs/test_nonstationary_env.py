"""The non-stationary answer-format environment."""

import asyncio

import pytest

from sao_jax.envs import arithmetic
from sao_jax.envs import calculator
from sao_jax.envs import nonstationary

def _env(**kwargs):
  kwargs.setdefault('formats', ('tagged', 'sentence', 'bracket'))
  kwargs.setdefault('switch_steps', (10, 20))
  return nonstationary.NonStationaryEnvironment(
      arithmetic.ChainSum(num_terms=2, digits=2, answer_format='none'),
      **kwargs)


def _replies(n):
  return {'tagged': f'I think <answer>{n}</answer>',
          'sentence': f'3 and 4 give it. The answer is {n}.',
          'bracket': f'Computing... [{n}]',
          'statement': f'The sum is {n}.',
          'equation': f'12 + 30 = {n}'}


@pytest.mark.parametrize('step, phase', [
    (0, 0), (9, 0), (10, 1), (19, 1), (20, 2), (1000, 2)])
def test_phase_follows_policy_step(step, phase):
  env = _env()
  env.on_policy_step(step)
  assert env.phase == phase
  assert env.current_format == ('tagged', 'sentence', 'bracket')[phase]


def test_reward_needs_current_format_and_correct_answer():
  env = _env()
  task = env.task('train', 4)
  right, wrong = _replies(task.answer), _replies(task.answer + 1)
  for step, fmt in ((0, 'tagged'), (15, 'sentence'), (25, 'bracket')):
    env.on_policy_step(step)
    for other in ('tagged', 'sentence', 'bracket'):
      result = env.step(task, 0, right[other])
      assert result.reward == float(other == fmt), (step, other)
      # The answer is right whatever the format: 'correct' says so.
      assert result.info['correct']
      assert result.info['phase'] == env.phase
      assert result.info['format'] == fmt
      assert result.info['format_ok'] == (other == fmt)
    wrong_result = env.step(task, 0, wrong[fmt])
    assert wrong_result.reward == 0.0 and wrong_result.info['format_ok']
    assert not wrong_result.info['correct']


def test_format_number_is_the_one_judged():
  env = _env()
  task = env.task('train', 0)
  env.on_policy_step(15)  # 'sentence'
  # Tag carries the right number, the sentence a wrong one: the phase's
  # format decides.
  reply = f'<answer>{task.answer}</answer> The answer is {task.answer + 1}.'
  result = env.step(task, 0, reply)
  assert result.reward == 0.0 and result.info['correct']
  assert result.info['format_answer'] == str(task.answer + 1)


@pytest.mark.parametrize('fmt, text, number', [
    ('tagged', 'x <answer> -12 </answer> y', '-12'),
    ('tagged', '<answer>twelve</answer>', None),
    ('sentence', 'so. the answer is 1,024', '1024'),
    ('sentence', 'The answer is 7. Done.', None),  # not at the end
    ('bracket', 'result [ 3.50 ]', '3.5'),
    ('bracket', '[3] is it', None),
    ('statement', '3 + 4 is 7.', '7'),
    ('statement', 'This 7.', None),
    ('equation', '3 + 4 = 7', '7'),
    ('equation', '3 + 4 = 7 is it', None),
])
def test_formatted_answer(fmt, text, number):
  assert nonstationary.formatted_answer(text, fmt) == number


def test_default_phases_and_validation():
  env = nonstationary.NonStationaryEnvironment(arithmetic.ChainSum())
  assert env.formats == ('statement', 'equation', 'statement')
  assert env.switch_steps == (100, 200)
  with pytest.raises(ValueError, match='unknown formats'):
    _env(formats=('tagged', 'emoji', 'bracket'))
  with pytest.raises(ValueError, match='switch steps'):
    _env(switch_steps=(10,))
  with pytest.raises(ValueError, match='increase'):
    _env(switch_steps=(20, 10))


def test_delegates_tasks_and_prompts():
  base_env = arithmetic.ChainSum(answer_format='none')
  env = nonstationary.NonStationaryEnvironment(base_env)
  task = env.task('eval', 3)
  assert task == base_env.task('eval', 3)
  assert env.prompt_messages(task) == base_env.prompt_messages(task)
  before = env.prompt_messages(task)
  env.on_policy_step(500)
  assert env.prompt_messages(task) == before  # the switch is felt in reward
  assert env.name == 'arith_chain_sum_nonstationary'


def test_multi_turn_base_passes_tool_turns_through():
  env = nonstationary.NonStationaryEnvironment(
      calculator.CalculatorEnvironment(), formats=('tagged', 'bracket'),
      switch_steps=(5,))
  task = env.task('eval', 0)
  tool = asyncio.run(env.astep(task, 0, '<calc>2+2</calc>'))
  assert not tool.done and tool.observation == '<result>4</result>'
  done = asyncio.run(env.astep(task, 1, f'<answer>{task.answer}</answer>'))
  assert done.done and done.reward == 1.0 and done.info['phase'] == 0
  env.on_policy_step(5)
  done = env.step(task, 1, f'<answer>{task.answer}</answer>')
  assert done.reward == 0.0 and done.info['correct']
  assert env.step(task, 1, f'It is [{task.answer}]').reward == 1.0
