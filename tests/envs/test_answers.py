"""Answer extraction: hand-worked replies, priorities and number spelling."""

import decimal

import hypothesis
from hypothesis import strategies as st
import pytest

from sao_jax.envs import answers

@pytest.mark.parametrize('text, expected', [
    ('The answer is 42.', '42'),
    ('It is -7', '-7'),
    ('The answer is \u22128.', '-8'),  # Unicode minus
    ('Total: 1,234,567 apples', '1234567'),
    ('about 3.50 dollars.', '3.5'),
    ('So 10-5 leaves 5', '5'),  # '-' between operands is not a sign
    ('(3)-5', '5'),
    ('first 2, then 3 -4', '-4'),  # a sign after a space is a sign
    ('1,2,3', '3'),  # a list, not thousands groups
    ('1,2345', '2345'),
    ('H2O is 18', '18'),  # digits inside a word do not start a number
    ('7.', '7'),
    ('.5', '0.5'),
    ('007', '7'),
    ('-0', '0'),
    ('no digits here', None),
    ('', None),
    (None, None),
])
def test_last_number(text, expected):
  assert answers.last_number(text) == expected


def test_tag_beats_boxed_beats_last_number():
  reply = r'Maybe 3. \boxed{4} <answer>5</answer> and 6 later'
  assert answers.extract_answer(reply) == '5'
  assert answers.extract_answer(r'Maybe 3. \boxed{4} and 6 later') == '4'
  assert answers.extract_answer('Maybe 3 and 6 later') == '6'


def test_tagged_span_reduced_to_its_last_number():
  assert answers.extract_answer('<answer>3 + 4 = 7</answer>') == '7'
  # A restated question is not an answer: its last number is a question term.
  assert answers.extract_answer('<answer>3 + 4</answer>') == '4'
  # A commitment without a number is no answer (the trailing 9 is ignored).
  assert answers.extract_answer('<answer>seven</answer> 9') is None


def test_extract_tagged_last_nonempty_closed_span():
  # The instruction echo '<answer></answer>' is not a commitment.
  text = ('Put it in <answer></answer>. <answer> 12 </answer>'
          ' <answer>13</answer>')
  assert answers.extract_tagged(text) == '13'
  assert answers.extract_tagged('Put it in <answer></answer>.') is None
  assert answers.extract_tagged('<answer>12') is None  # cut off: unclosed
  assert answers.extract_tagged('<ANSWER>x</ANSWER>') == 'x'
  assert answers.extract_tagged('<calc>1+1</calc>', tag='calc') == '1+1'


def test_extract_boxed_nested_and_last():
  assert answers.extract_boxed(r'\boxed{\frac{1}{2}}') == r'\frac{1}{2}'
  assert answers.extract_boxed(r'\boxed{1} then \boxed{ 2 }') == '2'
  assert answers.extract_boxed(r'\boxed{unclosed') is None
  assert answers.extract_boxed('none') is None


def test_math_kind_keeps_span_for_symbolic_checker():
  boxed = r'\boxed{\frac{1}{2}}'
  assert answers.extract_answer(boxed, 'math') == r'\frac{1}{2}'
  assert answers.extract_answer('so it is 0.25', 'math') == '0.25'


def test_expression_and_text_kinds():
  reply = 'Let me try.\n(3 + 5) * 2 = 16\n'
  assert answers.extract_answer(reply, 'expression') == '(3 + 5) * 2'
  assert answers.extract_answer('<answer>7*3</answer>', 'expression') == '7*3'
  assert answers.extract_answer('a\n\n  Paris  \n', 'text') == 'Paris'
  with pytest.raises(ValueError, match='unknown answer kind'):
    answers.extract_answer('x', 'bogus')


@pytest.mark.parametrize('token, expected', [
    ('-01,000.50', '-1000.5'), ('7.0', '7'), ('+3', '3'), ('0.000', '0'),
    ('-0.50', '-0.5'), ('\u22122', '-2'),
])
def test_normalize_number(token, expected):
  assert answers.normalize_number(token) == expected


def test_parse_number():
  assert answers.parse_number('1,250') == 1250.0
  assert answers.parse_number('-2.5') == -2.5
  assert answers.parse_number(' 7 ') == 7.0
  for text in ('abc', 'nan', 'inf', '3 + 4', '', '-'):
    assert answers.parse_number(text) is None, text
  assert answers.parse_number(None) is None


def test_instructions():
  assert answers.instruction('plain') == 'Answer with a number.'
  assert answers.instruction('tagged') == (
      'Put the final answer in <answer></answer>.')
  assert answers.instruction('none') == ''
  assert answers.with_instruction('Q?', 'none') == [
      {'role': 'user', 'content': 'Q?'}]
  assert answers.with_instruction('Q?', 'plain')[0]['content'] == (
      'Q?\nAnswer with a number.')
  with pytest.raises(ValueError, match='answer_format'):
    answers.instruction('fancy')


def test_math_equal():
  assert answers.math_equal('1250', '1250')
  assert answers.math_equal(r'\frac{1}{2}', '0.5')
  assert not answers.math_equal('6', '5')
  assert not answers.math_equal(None, '5')
  assert not answers.math_equal('1' * 500, '1' * 500)  # over the length cap


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(
    value=st.integers(min_value=-10**12, max_value=10**12),
    commas=st.booleans(),
    template=st.sampled_from(['{}', 'The answer is {}.', 'so x = {}!',
                              '3 + 4 and then {}', '<answer>{}</answer>',
                              r'\boxed{{{}}}', 'It is **{}**.']))
def test_integer_round_trip(value, commas, template):
  written = f'{value:,}' if commas else str(value)
  assert answers.extract_answer(template.format(written)) == str(value)
  assert answers.parse_number(written) == value


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(st.decimals(min_value=-10**6, max_value=10**6, places=3,
                              allow_nan=False, allow_infinity=False))
def test_decimal_round_trip(value):
  reply = f'Result: {value:f}.'
  assert decimal.Decimal(answers.last_number(reply)) == value
