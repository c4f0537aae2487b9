"""In-project arithmetic tasks, and the safe evaluator their judges share.

Two generators that need no third-party task package, for tests and demos
that must not depend on reasoning-gym's generators:

  ChainSum   'What is 31 + 7 - 22?': `num_terms` integers of `digits` digits
             joined by + and -.
  Countdown  reach a target from given numbers with + - * /, each number at
             most once; the reply's expression is evaluated, never trusted.

Tasks are a pure function of (name, seed, split, index): each draws its own
`random.Random` from a hash of those, so any index is generated directly
(no state carried between tasks) and a resumed run sees the same tasks.

Expressions written by a model are evaluated with `simpleeval` restricted to
numeric literals, the allowed binary operators and (optionally) unary signs:
no names, calls, attributes, subscripts, strings or comparisons. Arithmetic is
exact (`fractions.Fraction`), so '7 / 2 * 2' is 7, not 7.000000000000001, and
every intermediate result is bounded so that '9**9**9' or a long product of
large literals fails fast with `ExpressionError` instead of hanging.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import fractions
import hashlib
import math
import operator
import random
from typing import Any

import simpleeval

from sao_jax.envs import answers
from sao_jax.envs import base

_BINARY = {
    '+': ast.Add, '-': ast.Sub, '*': ast.Mult, '/': ast.Div,
    '//': ast.FloorDiv, '%': ast.Mod, '**': ast.Pow,
}


class ExpressionError(ValueError):
  """A model-written expression that is malformed, forbidden or too big.

  The message is short and safe to show to the model as a tool observation.
  """


@dataclasses.dataclass(frozen=True)
class Limits:
  """What an evaluated expression may contain and produce.

  Attributes:
    operators: allowed binary operators, from '+ - * / // % **'.
    unary: allow a leading '-' or '+' on an operand.
    integer_literals: literals must be integers (Countdown's numbers).
    max_length: longest expression, in characters (bounds parse time and the
      size of literals).
    max_exponent: largest |exponent| of '**' (exponents must be integers).
    max_abs: largest |value| of any intermediate result, and largest
      denominator: bounds memory and time whatever the nesting.
  """
  operators: tuple[str, ...] = ('+', '-', '*', '/')
  unary: bool = True
  integer_literals: bool = False
  max_length: int = 200
  max_exponent: int = 16
  max_abs: int = 10**30

  def __post_init__(self):
    unknown = set(self.operators) - set(_BINARY)
    if unknown:
      raise ValueError(f'unknown operators {sorted(unknown)}; allowed:'
                       f' {sorted(_BINARY)}')


class _Evaluator(simpleeval.SimpleEval):
  """SimpleEval with only literals, binary and unary operators enabled.

  SimpleEval's defaults allow names, calls, attributes, subscripts and
  string literals; here every node type but these three is removed, so
  anything else raises `FeatureNotAvailable` before it is evaluated.
  """

  def __init__(self, limits: Limits):
    self.limits = limits
    ops = {_BINARY[symbol]: self._guard(_operation(symbol, limits))
           for symbol in limits.operators}
    if limits.unary:
      ops[ast.USub] = self._guard(operator.neg)
      ops[ast.UAdd] = self._guard(operator.pos)
    super().__init__(operators=ops, functions={}, names={})
    self.nodes = {
        ast.BinOp: self._eval_binop,
        ast.UnaryOp: self._eval_unaryop,
        ast.Constant: self._eval_number,
    }

  def _guard(self, fn):
    def guarded(*args):
      return self._check_size(fn(*args))
    return guarded

  def _check_size(self, value):
    if abs(value) > self.limits.max_abs:
      raise ExpressionError('result too large')
    if value.denominator > self.limits.max_abs:
      raise ExpressionError('result too small to represent')
    return value

  def _eval_number(self, node):
    value = node.value
    # bool is an int subclass: 'True + 1' must not evaluate.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ExpressionError(f'not a number: {value!r}')
    if self.limits.integer_literals and not isinstance(value, int):
      raise ExpressionError(f'not an integer: {value!r}')
    if isinstance(value, float) and not math.isfinite(value):
      raise ExpressionError('not a finite number')
    # A float literal becomes the shortest decimal that reads back as it
    # (0.1 -> 1/10), not its binary value (0.1000000000000000055...).
    if isinstance(value, float):
      return self._check_size(fractions.Fraction(repr(value)))
    return self._check_size(fractions.Fraction(value))


def _div(a, b):
  if b == 0:
    raise ExpressionError('division by zero')
  return a / b


def _floordiv(a, b):
  if b == 0:
    raise ExpressionError('division by zero')
  return fractions.Fraction(a // b)


def _mod(a, b):
  if b == 0:
    raise ExpressionError('division by zero')
  return a % b


def _pow(a, b, max_exponent, max_abs):
  if b.denominator != 1:
    raise ExpressionError('exponent must be an integer')
  if abs(b) > max_exponent:
    raise ExpressionError(f'exponent larger than {max_exponent}')
  if a == 0 and b < 0:
    raise ExpressionError('division by zero')
  # Refuse before computing: a big base to a big exponent is the expensive
  # case, and its size is known from logarithms.
  big = max(abs(a.numerator), a.denominator)
  if big > 1 and abs(int(b)) * math.log10(big) > math.log10(max_abs) + 1:
    raise ExpressionError('result too large')
  return a ** int(b)


def _operation(symbol: str, limits: Limits):
  if symbol == '**':
    return lambda a, b: _pow(a, b, limits.max_exponent, limits.max_abs)
  return {'+': operator.add, '-': operator.sub, '*': operator.mul, '/': _div,
          '//': _floordiv, '%': _mod}[symbol]


def parse(expression: str, limits: Limits = Limits()) -> ast.expr:
  """The syntax tree of `expression` if it is one well-formed expression."""
  if not isinstance(expression, str) or not expression.strip():
    raise ExpressionError('empty expression')
  if len(expression) > limits.max_length:
    raise ExpressionError(
        f'expression longer than {limits.max_length} characters')
  # Models write the multiplication and division signs as text often enough.
  expression = (expression.strip().replace('\u00d7', '*')
                .replace('\u00f7', '/').replace('\u2212', '-'))
  try:
    return ast.parse(expression, mode='eval').body
  except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
    raise ExpressionError('not a valid expression') from e


def evaluate(expression: str, limits: Limits = Limits()) -> fractions.Fraction:
  """The exact value of a model-written arithmetic expression.

  Args:
    expression: e.g. '(3 + 5) * 2'.
    limits: what is allowed (operators, literal kinds, sizes).

  Returns:
    The value as a `fractions.Fraction`.

  Raises:
    ExpressionError: malformed, forbidden (names, calls, attributes, other
      operators), division by zero, or beyond `limits`. Never any other
      exception, so callers can turn it into an observation or a 0 reward.
  """
  node = parse(expression, limits)
  evaluator = _Evaluator(limits)
  try:
    return evaluator.eval(expression, previously_parsed=node)
  except ExpressionError:
    raise
  except simpleeval.OperatorNotDefined as e:
    raise ExpressionError('operator not allowed') from e
  except simpleeval.InvalidExpression as e:
    raise ExpressionError('only numbers and arithmetic operators are'
                          ' allowed') from e
  except (ArithmeticError, ValueError, TypeError, RecursionError,
          MemoryError) as e:
    raise ExpressionError(f'cannot evaluate ({type(e).__name__})') from e


def literals(expression: str, limits: Limits = Limits()) -> list[Any]:
  """The numeric literals of `expression`, in order ('2 * (3 + 2)' -> [2, 3,
  2]); a sign is an operator, not part of the literal."""
  return [n.value for n in ast.walk(parse(expression, limits))
          if isinstance(n, ast.Constant)]


def format_value(value: fractions.Fraction) -> str:
  """How a calculator shows a value: integers exactly, others to 12
  significant digits."""
  if value.denominator == 1:
    return str(value.numerator)
  return f'{float(value):.12g}'


def seeded_rng(*parts: Any) -> random.Random:
  """A `random.Random` seeded from a hash of `parts`.

  Python's `hash` is salted per process, and `Random(seed + index)` makes
  neighbouring seeds share tasks, so the seed is a SHA-256 of the parts.
  """
  key = '\x1f'.join(str(p) for p in parts).encode()
  return random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], 'big'))


def check_task_args(split: str, index: int) -> None:
  """Raises ValueError for an unknown split or a negative index."""
  if split not in base.SPLITS:
    raise ValueError(f'unknown split {split!r}; expected one of {base.SPLITS}')
  if index < 0:
    raise ValueError(f'task index must be >= 0, got {index}')


def _operand(rng: random.Random, digits: int) -> int:
  # One-digit operands include 0, as in reasoning-gym's chain_sum.
  low = 0 if digits == 1 else 10**(digits - 1)
  return rng.randint(low, 10**digits - 1)


def _numeric_result(expected: Any, reply: str) -> base.StepResult:
  answer = answers.extract_answer(reply, 'numeric')
  value = answers.parse_number(answer)
  correct = value is not None and value == expected
  return base.StepResult(
      done=True, reward=float(correct),
      info={'correct': correct, 'answer': answer, 'expected': expected})


class ChainSum(base.Environment):
  """'What is 31 + 7 - 22?': sums and differences of integers.

  Difficulty is `num_terms` and `digits`; with 2 one-digit terms there are
  only 200 distinct questions, so held-out exclusion matters (task_stream).
  """

  max_turns = 1

  def __init__(self, num_terms: int = 3, digits: int = 2, seed: int = 0,
               answer_format: str = 'plain', name: str = 'arith_chain_sum'):
    if num_terms < 2 or digits < 1:
      raise ValueError(f'need num_terms >= 2 and digits >= 1, got {num_terms}'
                       f' and {digits}')
    answers.instruction(answer_format)  # validates it
    self.num_terms, self.digits, self.seed = num_terms, digits, seed
    self.answer_format = answer_format
    self.name = name

  def task(self, split: str, index: int) -> base.Task:
    check_task_args(split, index)
    rng = seeded_rng(self.name, self.seed, split, index)
    terms = [_operand(rng, self.digits) for _ in range(self.num_terms)]
    signs = [rng.choice('+-') for _ in terms[1:]]
    expression = str(terms[0])
    total = terms[0]
    for sign, term in zip(signs, terms[1:]):
      expression += f' {sign} {term}'
      total += term if sign == '+' else -term
    return base.Task(
        id=f'{self.name}/{split}/{index}', question=f'What is {expression}?',
        answer=total,
        metadata={'expression': expression, 'num_terms': self.num_terms,
                  'digits': self.digits})

  def prompt_messages(self, task: base.Task) -> list[dict[str, str]]:
    return answers.with_instruction(task.question, self.answer_format)

  def step(self, task: base.Task, turn: int, action_text: str
           ) -> base.StepResult:
    del turn
    return _numeric_result(task.answer, action_text)


COUNTDOWN_LIMITS = Limits(operators=('+', '-', '*', '/'), unary=False,
                          integer_literals=True, max_length=200)


def check_countdown(expression: str | None, numbers, target,
                    use_all: bool = False) -> tuple[bool, str]:
  """Whether `expression` reaches `target` from `numbers`, and why not.

  Each given number may be used at most once (exactly once with `use_all`);
  only + - * / between integer literals; the value must equal the target
  exactly (fractions, no rounding).

  Returns:
    `(correct, reason)`, reason one of 'ok', 'no_answer', 'invalid' (did not
    evaluate: the message follows a colon), 'numbers' (used a number not
    given, or too often), 'wrong_value'.
  """
  if not expression:
    return False, 'no_answer'
  try:
    value = evaluate(expression, COUNTDOWN_LIMITS)
    used = collections.Counter(literals(expression, COUNTDOWN_LIMITS))
  except ExpressionError as e:
    return False, f'invalid: {e}'
  given = collections.Counter(numbers)
  if any(count > given[n] for n, count in used.items()):
    return False, 'numbers'
  if use_all and used != given:
    return False, 'numbers'
  if value != target:
    return False, 'wrong_value'
  return True, 'ok'


class Countdown(base.Environment):
  """Reach a target from given numbers with + - * /, each used at most once.

  Every target is constructed from a random subset of the numbers (with exact
  integer intermediate results), so each task has a solution; it is kept in
  `metadata['solution']` but is never the only accepted one: any expression
  that evaluates to the target counts.
  """

  max_turns = 1

  def __init__(self, num_numbers: int = 4, max_value: int = 10,
               max_target: int = 100, seed: int = 0,
               answer_format: str = 'plain', name: str = 'arith_countdown'):
    if num_numbers < 2 or max_value < 1 or max_target < 1:
      raise ValueError('need num_numbers >= 2, max_value >= 1, max_target >= 1')
    answers.instruction(answer_format)  # validates it
    self.num_numbers, self.max_value = num_numbers, max_value
    self.max_target, self.seed = max_target, seed
    self.answer_format = answer_format
    self.name = name

  def _construct(self, rng: random.Random, numbers: list[int]):
    """A random left-to-right solution over a subset of `numbers`, or None."""
    chosen = rng.sample(numbers, rng.randint(2, len(numbers)))
    value, expression = chosen[0], str(chosen[0])
    for n in chosen[1:]:
      options = ['+', '*']
      if value - n > 0:
        options.append('-')
      if value % n == 0:
        options.append('/')
      op = rng.choice(options)
      value = {'+': value + n, '-': value - n, '*': value * n,
               '/': value // n}[op]
      # Parenthesise the running value so the expression reads left to right
      # whatever the precedence.
      expression = (f'({expression}) {op} {n}' if op in '*/' and ' ' in
                    expression else f'{expression} {op} {n}')
    if 1 <= value <= self.max_target:
      return value, expression
    return None

  def task(self, split: str, index: int) -> base.Task:
    check_task_args(split, index)
    rng = seeded_rng(self.name, self.seed, split, index)
    numbers = [rng.randint(1, self.max_value) for _ in range(self.num_numbers)]
    for _ in range(1000):
      made = self._construct(rng, numbers)
      if made is not None:
        break
    else:
      raise ValueError(f'{self.name}: no target in [1, {self.max_target}]'
                       f' from {numbers}; raise max_target')
    target, solution = made
    listed = ', '.join(map(str, numbers))
    question = (f'Using the numbers {listed}, make {target}. You may use'
                ' + - * / and each number at most once.')
    return base.Task(
        id=f'{self.name}/{split}/{index}', question=question, answer=target,
        metadata={'numbers': numbers, 'target': target, 'solution': solution})

  def prompt_messages(self, task: base.Task) -> list[dict[str, str]]:
    return answers.with_instruction(task.question, self.answer_format,
                                    'expression')

  def step(self, task: base.Task, turn: int, action_text: str
           ) -> base.StepResult:
    del turn
    expression = answers.extract_answer(action_text, 'expression')
    correct, reason = check_countdown(expression, task.metadata['numbers'],
                                      task.answer)
    return base.StepResult(
        done=True, reward=float(correct),
        info={'correct': correct, 'answer': expression,
              'expected': task.answer, 'reason': reason})


def check_operands(check) -> None:
  """`num_terms` >= 2 and `digits` >= 1 (a config_lib.Checker, scoped)."""
  if check.positive_int('num_terms') == 1:
    check.problem(f'{check.name("num_terms")}=1 must be >= 2')
  check.positive_int('digits')


def _chain_sum(task, options) -> ChainSum:
  return ChainSum(num_terms=options.num_terms, digits=options.digits,
                  seed=task.seed, answer_format=task.answer_format)


def _countdown(task, options) -> Countdown:
  del options
  return Countdown(seed=task.seed, answer_format=task.answer_format)


CHAIN_SUM_SPEC = base.EnvSpec(
    build=_chain_sum,
    options={'num_terms': base.Option(2, 'operands of a problem (>= 2)'),
             'digits': base.Option(3, 'digits of each operand (>= 1)')},
    check=check_operands)
COUNTDOWN_SPEC = base.EnvSpec(build=_countdown)
