"""The calculator tool environment: episodes, limits and simulated latency."""

import asyncio
import math
import statistics
import time

import numpy as np
import pytest

from sao_jax.envs import calculator

def _env(**kwargs):
  return calculator.CalculatorEnvironment(**kwargs)


def test_tasks_hand_checked_and_deterministic():
  env = _env(num_terms=3, digits=3, operators='+*')
  for index in range(30):
    task = env.task('train', index)
    a, op1, b, op2, c = task.metadata['expression'].split()
    assert all(100 <= int(x) <= 999 for x in (a, b, c))
    # Reference: Python's own precedence on the same tokens.
    reference = {('+', '+'): int(a) + int(b) + int(c),
                 ('+', '*'): int(a) + int(b) * int(c),
                 ('*', '+'): int(a) * int(b) + int(c),
                 ('*', '*'): int(a) * int(b) * int(c)}[(op1, op2)]
    assert task.answer == reference
    assert task == _env(num_terms=3, digits=3, operators='+*').task(
        'train', index)
  assert env.task('train', 0) != env.task('eval', 0)


def test_prompt_explains_tool():
  env = _env()
  task = env.task('eval', 0)
  (message,) = env.prompt_messages(task)
  assert message['role'] == 'user'
  assert '<calc>' in message['content'] and '<answer>' in message['content']
  assert message['content'].endswith(task.question)


def test_episode_tool_call_then_answer():
  env = _env(max_turns=3)
  task = env.task('eval', 1)
  expression = task.metadata['expression']
  first = env.step(task, 0, f'Let me compute. <calc>{expression}</calc>')
  assert not first.done
  assert first.observation == f'<result>{task.answer}</result>'
  assert first.info['tool_calls'] == 1 and first.info['tool_errors'] == 0
  final = env.step(task, 1, f'<answer>{task.answer}</answer>')
  assert final.done and final.reward == 1.0
  assert final.info['finish_reason'] == 'answer' and final.info['correct']
  assert env.step(task, 1, f'<answer>{task.answer + 1}</answer>').reward == 0


def test_several_calls_answered_in_order_up_to_cap():
  env = _env(max_calls_per_turn=2)
  task = env.task('eval', 0)
  result = env.step(task, 0, '<calc>2+3</calc> and <calc>4*5</calc> and'
                    ' <calc>1+1</calc> <calc>1/0</calc>')
  assert result.observation.split('\n') == [
      '<result>5</result>', '<result>20</result>',
      '<error>2 calls not run: at most 2 per turn</error>']
  assert result.info == {'tool_calls': 4, 'tool_errors': 1}


def test_bare_number_ends_episode_only_without_tool_call():
  env = _env()
  task = env.task('eval', 0)
  bare = env.step(task, 0, f'The result is {task.answer:,}.')
  assert bare.done and bare.reward == 1.0
  # A number next to a call is not an answer: the call is answered.
  call = env.step(task, 0, 'First 12 * 3: <calc>12*3</calc>')
  assert not call.done and call.observation == '<result>36</result>'
  # An answer tag wins over calls in the same reply.
  both = env.step(task, 0, f'<calc>1+1</calc> <answer>{task.answer}</answer>')
  assert both.done and both.reward == 1.0


def test_no_answer_no_call_continues_then_turn_limit():
  env = _env(max_turns=2)
  task = env.task('eval', 0)
  nothing = env.step(task, 0, 'Hmm, let me think.')
  assert not nothing.done and 'No answer found' in nothing.observation
  last = env.step(task, 1, '<calc>1+1</calc>')
  assert last.done and last.reward == 0.0
  assert last.info['finish_reason'] == 'turns'


@pytest.mark.parametrize('expression, error', [
    ('9**9**9', 'exponent'),
    ('10**12 * 10**12 * 10', 'too large'),
    ('__import__("os").getcwd()', 'only numbers'),
    ('(1).__class__', 'only numbers'),
    ('abs(-3)', 'only numbers'),
    ('x + 1', 'only numbers'),
    ('1/0', 'division by zero'),
    ('1 + ' * 50 + '1', 'longer than'),
    ('1 +', 'not a valid expression'),
    ('', 'empty'),
])
def test_hostile_calls_become_error_observations(expression, error):
  env = _env()
  task = env.task('eval', 0)
  start = time.perf_counter()
  result = env.step(task, 0, f'<calc>{expression}</calc>')
  assert time.perf_counter() - start < 0.5
  assert not result.done and result.info['tool_errors'] == 1
  assert result.observation.startswith('<error>') and error in (
      result.observation)


def test_calculator_values():
  assert calculator.run_calculator('7 / 2') == '<result>3.5</result>'
  assert calculator.run_calculator('2 ** 10 - 24') == '<result>1000</result>'
  assert calculator.run_calculator('17 // 5 + 17 % 5') == '<result>5</result>'
  assert calculator.tool_calls('<calc> 1+1 </calc><CALC>2</CALC>') == [
      '1+1', '2']


def test_latency_deterministic_and_heavy_tailed():
  env = _env(tool_delay_median_s=0.5, tool_delay_sigma=1.0)
  tasks = [env.task('train', i) for i in range(2000)]
  delays = np.array([env.tool_latency(t, turn) for t in tasks
                     for turn in range(2)])
  again = _env(tool_delay_median_s=0.5, tool_delay_sigma=1.0)
  assert [again.tool_latency(t, 0) for t in tasks[:50]] == list(delays[:100:2])
  assert env.tool_latency(tasks[0], 0) != env.tool_latency(tasks[0], 1)
  # Lognormal(log 0.5, 1): median 0.5, p99 = 0.5 * e^2.326 = 5.12; the mean
  # (0.5 * e^0.5 = 0.82) sits well above the median.
  assert statistics.median(delays) == pytest.approx(0.5, rel=0.08)
  assert np.quantile(delays, 0.99) == pytest.approx(
      0.5 * math.exp(2.326), rel=0.2)
  assert delays.mean() == pytest.approx(0.5 * math.exp(0.5), rel=0.1)
  assert _env().tool_latency(tasks[0], 0) == 0.0
  capped = _env(tool_delay_median_s=0.5, tool_delay_max_s=1.0)
  assert max(capped.tool_latency(t, 0) for t in tasks) == 1.0


def test_astep_sleeps_only_on_tool_turns(monkeypatch):
  env = _env(tool_delay_median_s=0.05, tool_delay_sigma=0.5)
  task = env.task('eval', 0)
  delay = env.tool_latency(task, 0, '<calc>2*3</calc>')

  start = time.perf_counter()
  result = asyncio.run(env.astep(task, 0, '<calc>2*3</calc>'))
  assert time.perf_counter() - start >= delay * 0.95
  assert result.observation == '<result>6</result>'
  assert result.info['tool_latency_s'] == delay

  slept = []

  async def record(seconds):
    slept.append(seconds)

  monkeypatch.setattr(asyncio, 'sleep', record)
  asyncio.run(env.astep(task, 0, '<calc>2*3</calc>'))
  assert slept == [delay]
  for reply in (f'<answer>{task.answer}</answer>', 'thinking...'):
    result = asyncio.run(env.astep(task, 0, reply))
    assert 'tool_latency_s' not in result.info
  assert slept == [delay]  # no tool call, no latency


def test_concurrent_episodes_overlap_their_latency():
  env = _env(tool_delay_median_s=0.1, tool_delay_sigma=0.3)
  tasks = [env.task('eval', i) for i in range(8)]

  async def run_all():
    return await asyncio.gather(
        *(env.astep(t, 0, '<calc>1+1</calc>') for t in tasks))

  start = time.perf_counter()
  asyncio.run(run_all())
  elapsed = time.perf_counter() - start
  total = sum(env.tool_latency(t, 0, '<calc>1+1</calc>') for t in tasks)
  assert elapsed < 0.6 * total  # slept concurrently, not one after another
