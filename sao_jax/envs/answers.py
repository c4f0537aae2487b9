"""Finding the final answer in a model reply.

Rewards score the extracted answer, never the raw reply:

  answers.extract_answer('so <answer>3 + 4 = 7</answer>', kind='numeric')  # '7'

Extraction picks one answer by a fixed priority (the last `<answer>` span,
else the last `\boxed{}`, else by `kind` the last number or line), so a reply
commits to exactly one. `instruction` / `with_instruction` write the answer
format into a prompt; `math_equal` compares symbolically (math_verify). Why
whole-reply scorers are not trusted: docs/design/environments.md.
"""

from __future__ import annotations

import re

KINDS = ('numeric', 'math', 'expression', 'text')

# A number as people and models write it: optional sign (ASCII or Unicode
# minus), thousands groups of exactly three digits or plain digits, optional
# decimals. The look-behind keeps letters' digits ('x2') and the digits after a
# decimal point from starting a number; the sign counts only when it is not
# preceded by an operand, so '10-5' ends in 5, not -5.
_NUMBER = re.compile(
    r'(?<![\w.])'
    r'(?:(?<![\w)\]])(?P<sign>[-\u2212]))?'
    r'(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)?'
    r'(?P<frac>\.\d+)?'
    r'(?!\d)', re.ASCII)
_BOXED = re.compile(r'\\(?:boxed|fbox)\s*{')


ANSWER_FORMATS = ('plain', 'tagged', 'none')

_INSTRUCTIONS = {
    ('plain', 'numeric'): 'Answer with a number.',
    ('plain', 'math'): 'Answer with a number.',
    ('plain', 'expression'): 'Answer with an expression.',
    ('plain', 'text'): 'Give only the final answer.',
    ('tagged', 'expression'): 'Put the final expression in <answer></answer>.',
}


def instruction(answer_format: str, kind: str = 'numeric') -> str:
  """The line appended to a question to say how to give the final answer.

  'plain' asks for the bare answer, 'tagged' for `<answer>` tags, 'none'
  adds nothing. Whatever the format, extraction accepts all of them: the
  instruction shapes the reply, the priority above judges it.
  """
  if answer_format not in ANSWER_FORMATS:
    raise ValueError(f'unknown answer_format {answer_format!r}; expected one'
                     f' of {ANSWER_FORMATS}')
  if kind not in KINDS:
    raise ValueError(f'unknown answer kind {kind!r}; expected one of {KINDS}')
  if answer_format == 'none':
    return ''
  return _INSTRUCTIONS.get((answer_format, kind),
                           'Put the final answer in <answer></answer>.')


def with_instruction(question: str, answer_format: str,
                     kind: str = 'numeric') -> list[dict[str, str]]:
  """A one-message chat prompt: the question, then the format instruction."""
  line = instruction(answer_format, kind)
  return [{'role': 'user', 'content': f'{question}\n{line}' if line
           else question}]


def extract_tagged(text: str | None, tag: str = 'answer') -> str | None:
  """The stripped content of the last closed `<tag>...</tag>`, or None.

  The last span wins because a reply may revise itself; empty spans are
  skipped because models echo the format instruction ('put it in
  <answer></answer>') before answering. An unclosed tag does not count: the
  reply was cut off before it committed.
  """
  if not text:
    return None
  pattern = re.compile(rf'<{re.escape(tag)}>(.*?)</{re.escape(tag)}>',
                       re.DOTALL | re.IGNORECASE)
  matches = [m.strip() for m in pattern.findall(text) if m.strip()]
  return matches[-1] if matches else None


def extract_boxed(text: str | None) -> str | None:
  """The content of the last `\\boxed{...}` (nested braces matched), or None."""
  if not text:
    return None
  found = None
  for match in _BOXED.finditer(text):
    depth, start = 1, match.end()
    for pos in range(start, len(text)):
      if text[pos] == '{':
        depth += 1
      elif text[pos] == '}':
        depth -= 1
        if depth == 0:
          found = text[start:pos].strip()
          break
  return found


def numbers(text: str | None) -> list[str]:
  """Every number in `text`, normalised (see `normalize_number`), in order."""
  if not text:
    return []
  found = []
  for match in _NUMBER.finditer(text):
    if match.group('int') is None and match.group('frac') is None:
      continue  # the pattern matched a bare sign or nothing
    found.append(normalize_number(match.group(0)))
  return found


def last_number(text: str | None) -> str | None:
  """The last number in `text`, normalised, or None when there is none.

  'The answer is -1,234.50.' -> '-1234.5'; 'It is 7.' -> '7';
  '3 - 5' -> '5' (an operator, not a sign).
  """
  found = numbers(text)
  return found[-1] if found else None


def normalize_number(token: str) -> str:
  """Canonical spelling of a number, so that string-comparing scorers agree
  with numeric ones: ASCII minus, no thousands commas, no leading zeros, no
  trailing fractional zeros, no '-0' ('-01,000.50' -> '-1000.5',
  '7.0' -> '7', '.5' -> '0.5')."""
  token = token.strip().replace('\u2212', '-').replace(',', '')
  sign = '-' if token.startswith('-') else ''
  whole, _, frac = token.lstrip('+-').partition('.')
  whole = whole.lstrip('0') or '0'
  frac = frac.rstrip('0')
  body = f'{whole}.{frac}' if frac else whole
  return body if body == '0' else sign + body


def extract_answer(text: str | None, kind: str = 'numeric') -> str | None:
  """The reply's final answer by the module's priority, or None.

  Args:
    text: the model's reply (None or empty gives None).
    kind: 'numeric' (answers are integers or decimals), 'math' (answers for
      a symbolic checker: fractions, LaTeX), 'expression' (answers are
      arithmetic expressions, e.g. Countdown), or 'text' (anything else).

  Returns:
    The answer string, stripped; for 'numeric', a normalised number.
  """
  if kind not in KINDS:
    raise ValueError(f'unknown answer kind {kind!r}; expected one of {KINDS}')
  if not text or not text.strip():
    return None
  span = extract_tagged(text)
  if span is None:
    span = extract_boxed(text)
  if kind == 'numeric' or (kind == 'math' and span is None):
    return last_number(text if span is None else span)
  if span is None:
    lines = [line.strip() for line in text.strip().splitlines()
             if line.strip()]
    span = lines[-1]
  if kind == 'expression':
    # 'Countdown' replies often restate the target: '(3 + 5) * 2 = 16'.
    span = span.split('=')[0].strip()
  return span or None


def parse_number(text: str | None) -> float | None:
  """The value of `text` if it is exactly one number as `numbers` reads them
  ('1,250', '-3.5'), else None ('nan', 'inf' and '3 + 4' are not)."""
  if text is None:
    return None
  match = _NUMBER.fullmatch(text.strip())
  if not match or (match.group('int') is None and match.group('frac') is None):
    return None
  return float(normalize_number(match.group(0)))


def math_equal(answer: str | None, expected) -> bool:
  """`math_verify`'s verdict on an extracted `answer` against the truth.

  Timeouts are off (None): math_verify implements them with SIGALRM, which
  raises outside the main thread, and rollout workers are not on it. The
  length cap on `answer` is what keeps sympy's parsing quick instead.
  """
  if not answer or len(answer) > 200:
    return False
  # Imported here: math_verify brings sympy (0.5 s), and every process that
  # reads a config imports this module; most never score symbolically.
  import math_verify  # pylint: disable=g-import-not-at-top
  gold = math_verify.parse(str(expected), parsing_timeout=None)
  pred = math_verify.parse(answer, parsing_timeout=None)
  if not gold or not pred:
    return False
  return bool(math_verify.verify(gold, pred, timeout_seconds=None))
