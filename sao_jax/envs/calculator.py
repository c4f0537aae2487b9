"""A multi-turn tool environment: arithmetic with a calculator.

Tasks are products and sums of multi-digit integers ('What is 4821 * 37 +
912?'). In a turn the model may call the tool with `<calc>EXPR</calc>` and is
answered `<result>VALUE</result>` (or `<error>...</error>`); the episode ends
at a final answer (`<answer>N</answer>`, or a reply without a call whose last
number is taken) or at `max_turns`. Tool calls are evaluated by
`arithmetic.evaluate` under `CALCULATOR_LIMITS`, so hostile expressions come
back as error observations. Each call waits a seeded heavy-tailed latency
(`tool_delay_median_s`, `tool_delay_sigma`) with asyncio. The rules and why:
docs/design/environments.md.
"""

from __future__ import annotations

import asyncio
import re

from sao_jax.envs import answers
from sao_jax.envs import arithmetic
from sao_jax.envs import base
from sao_jax.envs import latency

CALCULATOR_LIMITS = arithmetic.Limits(
    operators=('+', '-', '*', '/', '**', '//', '%'), unary=True,
    max_length=100, max_exponent=12, max_abs=10**24)

_CALL = re.compile(r'<calc>(.*?)</calc>', re.DOTALL | re.IGNORECASE)

INSTRUCTIONS = (
    'You can use a calculator: write <calc>EXPRESSION</calc>, for example'
    ' <calc>12 * 34</calc>, and you will get <result>VALUE</result>. When you'
    ' know the answer, write <answer>N</answer>.')


def tool_calls(text: str | None) -> list[str]:
  """The expressions of the `<calc>` calls in `text`, in order."""
  return [m.strip() for m in _CALL.findall(text or '')]


def run_calculator(expression: str,
                   limits: arithmetic.Limits = CALCULATOR_LIMITS) -> str:
  """The observation for one call: `<result>V</result>` or `<error>E</error>`.
  """
  try:
    value = arithmetic.evaluate(expression, limits)
  except arithmetic.ExpressionError as e:
    return f'<error>{e}</error>'
  return f'<result>{arithmetic.format_value(value)}</result>'


class CalculatorEnvironment(base.Environment):
  """Multi-digit arithmetic with a `<calc>` tool."""

  def __init__(self, num_terms: int = 2, digits: int = 3,
               operators: str = '+*', max_turns: int = 4,
               max_calls_per_turn: int = 4, seed: int = 0,
               tool_delay_median_s: float = 0.0, tool_delay_sigma: float = 1.0,
               tool_delay_max_s: float | None = None,
               name: str = 'calculator'):
    """Configures tasks, turns and simulated tool latency.

    Args:
      num_terms: integers per problem (>= 2).
      digits: digits per integer.
      operators: the binary operators problems use, from '+-*'.
      max_turns: model turns per episode.
      max_calls_per_turn: tool calls answered per turn; the rest of a reply's
        calls get one error line, so one reply cannot run unbounded work.
      seed: varies tasks and latencies between runs.
      tool_delay_median_s: median simulated latency of a turn with tool
        calls; 0 disables the delay.
      tool_delay_sigma: lognormal sigma (log-space standard deviation).
      tool_delay_max_s: optional cap on one delay.
      name: the environment's name in ids and metrics.
    """
    if num_terms < 2 or digits < 1 or max_turns < 1:
      raise ValueError('need num_terms >= 2, digits >= 1 and max_turns >= 1')
    if not operators or set(operators) - set('+-*'):
      raise ValueError(f"operators must be drawn from '+-*', got {operators!r}")
    latency.check(tool_delay_median_s, tool_delay_sigma, tool_delay_max_s,
                  'tool delay')
    self.num_terms, self.digits, self.operators = num_terms, digits, operators
    self.max_turns = max_turns
    self.max_calls_per_turn = max_calls_per_turn
    self.seed = seed
    self.tool_delay_median_s = tool_delay_median_s
    self.tool_delay_sigma = tool_delay_sigma
    self.tool_delay_max_s = tool_delay_max_s
    self.name = name

  def task(self, split: str, index: int) -> base.Task:
    arithmetic.check_task_args(split, index)
    rng = arithmetic.seeded_rng(self.name, self.seed, split, index)
    low, high = 10**(self.digits - 1), 10**self.digits - 1
    terms = [rng.randint(low, high) for _ in range(self.num_terms)]
    expression = str(terms[0])
    for term in terms[1:]:
      expression += f' {rng.choice(self.operators)} {term}'
    value = arithmetic.evaluate(expression, arithmetic.Limits(
        operators=('+', '-', '*'), max_length=len(expression),
        max_abs=10**(self.digits * self.num_terms + 1)))
    return base.Task(id=f'{self.name}/{split}/{index}',
                     question=f'What is {expression}?', answer=int(value),
                     metadata={'expression': expression})

  def prompt_messages(self, task: base.Task) -> list[dict[str, str]]:
    return [{'role': 'user', 'content': f'{INSTRUCTIONS}\n\n{task.question}'}]

  def _final(self, task: base.Task, answer: str | None,
             calls: int) -> base.StepResult:
    # Calls in a reply that also answers are not run: the answer ends it.
    correct = answers.parse_number(answer) == task.answer
    return base.StepResult(
        done=True, reward=float(correct),
        info={'correct': correct, 'answer': answer, 'expected': task.answer,
              'finish_reason': 'answer', 'tool_calls': calls})

  def step(self, task: base.Task, turn: int, action_text: str
           ) -> base.StepResult:
    calls = tool_calls(action_text)
    tagged = answers.extract_tagged(action_text)
    if tagged is not None:
      return self._final(task, answers.last_number(tagged), len(calls))
    if not calls and answers.last_number(action_text) is not None:
      return self._final(task, answers.last_number(action_text), 0)
    if turn >= self.max_turns - 1:
      return base.StepResult(
          done=True, reward=0.0,
          info={'correct': False, 'answer': None, 'expected': task.answer,
                'finish_reason': 'turns', 'tool_calls': len(calls)})
    if not calls:
      return base.StepResult(
          done=False,
          observation=('No answer found. Use <calc>EXPRESSION</calc> or'
                       ' give <answer>N</answer>.'),
          info={'tool_calls': 0})
    results = [run_calculator(c) for c in calls[:self.max_calls_per_turn]]
    if len(calls) > self.max_calls_per_turn:
      results.append(f'<error>{len(calls) - self.max_calls_per_turn} calls'
                     f' not run: at most {self.max_calls_per_turn} per'
                     ' turn</error>')
    return base.StepResult(
        done=False, observation='\n'.join(results),
        info={'tool_calls': len(calls),
              'tool_errors': sum(r.startswith('<error>') for r in results)})

  def tool_latency(self, task: base.Task, turn: int, calls: str = '') -> float:
    """Seconds the tool takes on turn `turn` of `task` for the reply
    `calls` (0 when disabled; `latency.lognormal_seconds`)."""
    return latency.lognormal_seconds(
        self.tool_delay_median_s, self.tool_delay_sigma, self.tool_delay_max_s,
        self.seed, task.id, turn, calls)

  async def astep(self, task: base.Task, turn: int, action_text: str
                  ) -> base.StepResult:
    """`step`, then the simulated tool latency if the turn called the tool."""
    result = self.step(task, turn, action_text)
    if not result.done and result.info.get('tool_calls'):
      delay = self.tool_latency(task, turn, action_text)
      if delay > 0:
        await asyncio.sleep(delay)
      result.info['tool_latency_s'] = delay
    return result


def _build(task, options) -> CalculatorEnvironment:
  return CalculatorEnvironment(
      num_terms=options.num_terms, digits=options.digits,
      operators=options.operators, max_turns=options.max_turns,
      max_calls_per_turn=options.max_calls_per_turn, seed=task.seed,
      tool_delay_median_s=options.tool_delay_median_s,
      tool_delay_sigma=options.tool_delay_sigma,
      tool_delay_max_s=options.tool_delay_max_s or None)


def _check(check) -> None:
  arithmetic.check_operands(check)
  operators = check.get('operators')
  if operators is not None and (not operators or set(operators) - set('+-*')):
    check.problem(f'{check.name("operators")}={operators!r} must be some of'
                  " '+-*'")
  check.positive_int('max_turns')
  check.positive_int('max_calls_per_turn')
  check.non_negative('tool_delay_median_s')
  check.non_negative('tool_delay_sigma')
  check.non_negative('tool_delay_max_s')


SPEC = base.EnvSpec(
    build=_build, check=_check, max_turns=lambda options: options.max_turns,
    options={
        'num_terms': base.Option(2, 'operands of a problem (>= 2)'),
        'digits': base.Option(3, 'digits of each operand'),
        'operators': base.Option('+*', "binary operators of the problems,"
                                 " from '+-*'"),
        'max_turns': base.Option(4, 'model turns per episode'),
        'max_calls_per_turn': base.Option(
            4, 'tool calls answered per turn; more get an error'),
        'tool_delay_median_s': base.Option(
            0.0, 'median simulated latency of a turn with calls; 0: none'),
        'tool_delay_sigma': base.Option(
            1.0, 'lognormal sigma of that latency (heavy-tailed)'),
        'tool_delay_max_s': base.Option(0.0, 'cap on one delay; 0: none'),
    })
