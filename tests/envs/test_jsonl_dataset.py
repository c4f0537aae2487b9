"""JSONL prompt datasets through the TFDS ArrayRecord builder."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest

from sao_jax import errors
from sao_jax.envs import jsonl_dataset
from sao_jax.envs import jsonl_tfds

_RECORDS = [
    {'question': 'What is 2 + 2?', 'answer': 4, 'id': 'q-a'},
    {'question': 'Half of one?', 'answer': '0.5', 'source': 'hand'},
    {'question': 'Capital of France?', 'answer': 'Paris'},
    {'question': 'List 1, 2', 'answer': [1, 2], 'id': 7},
] + [{'question': f'What is {i} * 3?', 'answer': 3 * i} for i in range(40)]


def _write(path, records, extra_lines=()):
  with open(path, 'w', encoding='utf-8') as f:
    for record in records:
      f.write(json.dumps(record) + '\n')
    for line in extra_lines:
      f.write(line + '\n')
  return str(path)


def _all_tasks(env, split):
  return [env.task(split, i) for i in range(env.size(split))]


def _in_eval_reference(question, fraction):
  digest = hashlib.sha256(question.encode()).digest()
  return int.from_bytes(digest[:8], 'big') < fraction * 2**64


def test_round_trip_with_eval_fraction(tmp_path):
  path = _write(tmp_path / 'prompts.jsonl', _RECORDS)
  env = jsonl_dataset.JsonlEnvironment(path, scorer='exact', eval_fraction=0.3,
                                       cache_dir=str(tmp_path / 'cache'))
  assert env.name == 'prompts'
  train, evals = _all_tasks(env, 'train'), _all_tasks(env, 'eval')
  assert len(train) + len(evals) == len(_RECORDS)
  assert 0 < len(evals) < len(_RECORDS)
  for split, tasks in (('train', train), ('eval', evals)):
    expected = [(line, r) for line, r in enumerate(_RECORDS, start=1)
                if _in_eval_reference(r['question'], 0.3) == (split == 'eval')]
    # File order within the split, every field back as written.
    assert [t.metadata['line'] for t in tasks] == [line for line, _ in expected]
    for index, (task, (_, record)) in enumerate(zip(tasks, expected)):
      assert task.question == record['question']
      assert task.answer == record['answer']
      assert type(task.answer) is type(record['answer'])
      key = record['id'] if 'id' in record else index
      assert task.id == f'prompts/{split}/{key}'
  half = next(t for t in train + evals if t.question == 'Half of one?')
  assert half.metadata['source'] == 'hand'
  # Indices wrap.
  assert env.task('train', len(train) + 1) == train[1]


def test_built_once_and_reused(tmp_path, monkeypatch):
  path = _write(tmp_path / 'p.jsonl', _RECORDS)
  cache = str(tmp_path / 'cache')
  first = jsonl_dataset.JsonlEnvironment(path, cache_dir=cache)
  assert len(os.listdir(cache)) == 1

  def no_rebuild(*args, **kwargs):
    raise AssertionError('rebuilt a prepared dataset')

  monkeypatch.setattr(jsonl_tfds.JsonlPrompts, 'download_and_prepare',
                      no_rebuild)
  again = jsonl_dataset.JsonlEnvironment(path, cache_dir=cache)
  assert _all_tasks(again, 'train') == _all_tasks(first, 'train')
  monkeypatch.undo()
  # Edited content gets its own build, not the stale records.
  _write(tmp_path / 'p.jsonl', _RECORDS[:3])
  edited = jsonl_dataset.JsonlEnvironment(path, cache_dir=cache)
  assert edited.size('train') == 3 and len(os.listdir(cache)) == 2


def test_eval_path_and_missing_split(tmp_path):
  cache = str(tmp_path / 'cache')
  train_path = _write(tmp_path / 'train.jsonl', _RECORDS[:4])
  # The eval file repeats a train question: it leaves the train split.
  eval_path = _write(tmp_path / 'eval.jsonl', _RECORDS[4:10] + _RECORDS[1:2])
  env = jsonl_dataset.JsonlEnvironment(train_path, eval_path=eval_path,
                                       cache_dir=cache)
  assert env.size('train') == 3 and env.size('eval') == 7
  assert env.task('eval', 0).question == _RECORDS[4]['question']
  assert [t.metadata['line'] for t in _all_tasks(env, 'train')] == [1, 3, 4]
  only_train = jsonl_dataset.JsonlEnvironment(train_path, cache_dir=cache)
  assert only_train.size('eval') == 0
  with pytest.raises(ValueError, match='no eval records'):
    only_train.task('eval', 0)


def test_duplicate_questions_share_a_split(tmp_path):
  records = [{'question': f'Q{i % 25}', 'answer': i % 25} for i in range(100)]
  env = jsonl_dataset.JsonlEnvironment(
      _write(tmp_path / 'dup.jsonl', records), scorer='numeric',
      eval_fraction=0.5, cache_dir=str(tmp_path / 'cache'))
  train = {t.question for t in _all_tasks(env, 'train')}
  evals = {t.question for t in _all_tasks(env, 'eval')}
  assert train and evals and not train & evals


@pytest.mark.parametrize('bad_line, where, message', [
    # Cut short: the column is the end of this line, not 1 of the next.
    ('{"question": "x", "answer": 1', '4:30', 'not valid JSON (Expecting'),
    ('{"question": "x", "answer": 1}}', '4:31', 'not valid JSON (Extra data)'),
    ('[1, 2]', '4', 'expected a JSON object'),
    ('{"question": "x"}', '4', 'missing answer'),
    ('{"answer": 3}', '4', 'missing question'),
    ('{"question": "", "answer": 3}', '4',
     'question must be a non-empty string'),
])
def test_malformed_line_named(tmp_path, bad_line, where, message):
  path = _write(tmp_path / 'bad.jsonl', _RECORDS[:2], ['', bad_line])
  with pytest.raises(ValueError) as error:
    jsonl_dataset.JsonlEnvironment(path, cache_dir=str(tmp_path / 'cache'))
  # Blank line 3 is skipped but counted.
  assert str(error.value).startswith(f'{path}:{where}: {message}')
  assert isinstance(error.value, errors.UserError)


def test_every_bad_line_is_listed(tmp_path):
  path = str(tmp_path / 'bad.jsonl')
  with open(path, 'wb') as f:
    f.write(b'\xef\xbb\xbf{"question": "a", "answer": 1}\r\n')  # BOM, CRLF
    f.write(b'{"question": "b", "answer": 2\r\n')
    f.write(b'{"question": "caf\xc3\xa9 \xff", "answer": 3}\n')
    f.write(b'{"answer": 4}\n')
    f.write(b'  {"question": "d" "answer": 5}\n')
  with pytest.raises(errors.UserError) as error:
    jsonl_dataset.read_records(path)
  assert str(error.value).splitlines() == [
      f'{path}: 4 bad lines:',
      f"  {path}:2:30: not valid JSON (Expecting ',' delimiter)",
      f'  {path}:3:20: not UTF-8 (byte 0xff)',  # characters, not bytes
      f'  {path}:4: missing question',
      f"  {path}:5:20: not valid JSON (Expecting ',' delimiter)",
  ]


def test_a_long_list_of_bad_lines_is_cut(tmp_path):
  path = _write(tmp_path / 'bad.jsonl', _RECORDS[:1], ['nope'] * 25)
  with pytest.raises(errors.UserError) as error:
    jsonl_dataset.read_records(path)
  lines = str(error.value).splitlines()
  assert lines[0] == f'{path}: 25 bad lines:'
  assert lines[1] == f'  {path}:2:1: not valid JSON (Expecting value)'
  assert lines[20] == f'  {path}:21:1: not valid JSON (Expecting value)'
  assert lines[21:] == ['  ... and 5 more']


def test_good_lines_keep_their_numbers_past_a_bom_and_crlf(tmp_path):
  path = str(tmp_path / 'ok.jsonl')
  with open(path, 'wb') as f:
    f.write(b'\xef\xbb\xbf{"question": "a", "answer": 1}\r\n\r\n'
            b'{"question": "b", "answer": "x\\ny"}\r\n')
  records = jsonl_dataset.read_records(path)
  assert [(r.line, r.question, r.answer) for r in records] == [
      (1, 'a', 1), (3, 'b', 'x\ny')]


def test_empty_file(tmp_path):
  path = _write(tmp_path / 'empty.jsonl', [], ['', '  '])
  with pytest.raises(ValueError, match='no records'):
    jsonl_dataset.read_records(path)


def test_scorers(tmp_path):
  cache = str(tmp_path / 'cache')
  path = _write(tmp_path / 's.jsonl', [
      {'question': 'Half?', 'answer': '0.5'},
      {'question': 'Big?', 'answer': 1250},
      {'question': 'City?', 'answer': 'Paris'},
  ])
  half, big, city = (0, 1, 2)
  math = jsonl_dataset.JsonlEnvironment(path, scorer='math_verify',
                                        cache_dir=cache)
  assert math.step(math.task('train', half), 0, r'\boxed{\frac{1}{2}}').reward
  # Unmarked, a fraction is read as its last number: fractions need tags.
  assert math.step(math.task('train', half), 0, 'So 1/2').reward == 0.0
  assert math.step(math.task('train', half), 0, '<answer>1/2</answer>').reward
  assert math.step(math.task('train', big), 0, 'It is 1,250.').reward == 1.0
  numeric = jsonl_dataset.JsonlEnvironment(path, scorer='numeric',
                                           cache_dir=cache)
  assert numeric.step(numeric.task('train', big), 0,
                      'about 1,250.0 total').reward == 1.0
  assert numeric.step(numeric.task('train', big), 0, '1251').reward == 0.0
  exact = jsonl_dataset.JsonlEnvironment(path, scorer='exact', cache_dir=cache)
  task = exact.task('train', city)
  assert exact.step(task, 0, 'Hmm.\n<answer> Paris </answer>').reward == 1.0
  assert exact.step(task, 0, 'Hmm.\nparis').reward == 0.0
  assert exact.prompt_messages(task)[0]['content'] == (
      'City?\nGive only the final answer.')
  with pytest.raises(ValueError, match='scorer'):
    jsonl_dataset.JsonlEnvironment(path, scorer='fuzzy', cache_dir=cache)


def test_reading_does_not_import_tensorflow(tmp_path):
  path = _write(tmp_path / 'p.jsonl', _RECORDS[:5])
  script = textwrap.dedent(f'''
      import sys
      from sao_jax.envs import jsonl_dataset
      env = jsonl_dataset.JsonlEnvironment({path!r},
                                           cache_dir={str(tmp_path / 'c')!r})
      assert env.task('train', 4).question == {_RECORDS[4]['question']!r}
      assert 'tensorflow' not in sys.modules, 'tensorflow was imported'
  ''')
  repo = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      p for p in (repo, os.environ.get('PYTHONPATH')) if p))
  result = subprocess.run([sys.executable, '-c', script], capture_output=True,
                          text=True, timeout=120, check=False, env=env)
  assert result.returncode == 0, result.stderr[-2000:]
