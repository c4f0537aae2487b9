"""Prompt datasets from local JSONL files, prepared once with TFDS.

Each line of the file is a JSON object with `question`, `answer` (any JSON
value) and an optional `id`; other keys travel as task metadata. The file is
parsed and validated first (every bad line is reported, as 'path:line: why' or
'path:line:column: why' for a JSON syntax error), then
written by a `tfds.core.GeneratorBasedBuilder` to ArrayRecord files under
`cache_dir/<key>/`, where the key hashes the file's bytes and the split
settings: a later run with the same file reuses the prepared data, and an
edited file gets a fresh build instead of stale records. Reading goes through
`builder.as_data_source()`, random access by index without TensorFlow, which
is what `Environment.task(split, index)` needs.

Splits. With `eval_path` the two files are the splits, less any train record
whose question is also in the eval file. With `eval_fraction` each record goes
to eval when a hash of its question falls below the fraction, so the split is
stable across runs and file reorderings, and duplicated questions always land
on the same side. Either way no eval question is in the train split.
Records keep their file order within a split (shuffling is disabled), so
index i is the i-th such line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import Any

from sao_jax import errors
from sao_jax.envs import answers
from sao_jax.envs import arithmetic
from sao_jax.envs import base

_log = logging.getLogger(__name__)

SCORERS = ('math_verify', 'exact', 'numeric')
DEFAULT_CACHE_DIR = os.path.join(
    os.environ.get('XDG_CACHE_HOME', os.path.expanduser('~/.cache')),
    'sao_jax', 'jsonl_prompts')

_REQUIRED = ('question', 'answer')
# Bad lines listed in one error; the rest are counted.
_MAX_LISTED = 20


@dataclasses.dataclass(frozen=True)
class Record:
  """One validated line: where it came from and what it holds."""
  line: int  # 1-based
  question: str
  answer: Any
  id: str | None
  metadata: dict[str, Any]


def read_records(path: str) -> list[Record]:
  """Parses and validates a JSONL prompt file.

  Blank lines are skipped; a UTF-8 byte order mark is allowed.

  Raises:
    errors.UserError: for an empty file, or listing every bad line (the first
      `_MAX_LISTED`, then how many more), each as 'path:line: why', or
      'path:line:column: why' where a column is known: not UTF-8, not JSON,
      not an object, lacking `question` or `answer`, or with a question that
      is not a non-empty string. A `ValueError`.
  """
  records, problems = [], []
  with open(path, 'rb') as f:
    for number, raw in enumerate(f, start=1):
      if number == 1 and raw.startswith(b'\xef\xbb\xbf'):
        raw = raw[3:]
      try:
        record = _parse_line(raw, number)
      except _BadLine as e:
        column = '' if e.column is None else f':{e.column}'
        problems.append(f'{path}:{number}{column}: {e}')
        continue
      if record is not None:
        records.append(record)
  if len(problems) == 1:
    raise errors.UserError(problems[0])
  if problems:
    listed = problems[:_MAX_LISTED]
    if len(problems) > _MAX_LISTED:
      listed.append(f'... and {len(problems) - _MAX_LISTED} more')
    raise errors.UserError(f'{path}: {len(problems)} bad lines:\n  '
                           + '\n  '.join(listed))
  if not records:
    raise errors.UserError(f'{path}: no records')
  return records


class _BadLine(Exception):
  """Why a line is not a record, and the 1-based column if one is known."""

  def __init__(self, why: str, column: int | None = None):
    super().__init__(why)
    self.column = column


def _parse_line(raw: bytes, number: int) -> Record | None:
  """The record of one line (None for a blank line); raises `_BadLine`."""
  # Without the line break: json places the end of a line cut short at
  # column 1 of the next line.
  raw = raw.rstrip(b'\r\n')
  try:
    line = raw.decode('utf-8')
  except UnicodeDecodeError as e:
    raise _BadLine(f'not UTF-8 (byte {raw[e.start]:#04x})',
                   len(raw[:e.start].decode('utf-8')) + 1) from None
  if not line.strip():
    return None
  try:
    obj = json.loads(line)
  except json.JSONDecodeError as e:
    raise _BadLine(f'not valid JSON ({e.msg})', e.colno) from None
  if not isinstance(obj, dict):
    raise _BadLine(f'expected a JSON object, got {type(obj).__name__}')
  missing = [k for k in _REQUIRED if k not in obj]
  if missing:
    raise _BadLine(f'missing {", ".join(missing)}')
  if not isinstance(obj['question'], str) or not obj['question'].strip():
    raise _BadLine('question must be a non-empty string')
  record_id = obj.get('id')
  return Record(
      line=number, question=obj['question'], answer=obj['answer'],
      id=None if record_id is None else str(record_id),
      metadata={k: v for k, v in obj.items()
                if k not in ('question', 'answer', 'id')})


def in_eval(question: str, eval_fraction: float) -> bool:
  """Whether `question` belongs to the eval split: a hash of the text below
  the fraction (stable, order-free, equal for duplicates)."""
  digest = hashlib.sha256(question.encode()).digest()
  return int.from_bytes(digest[:8], 'big') / 2**64 < eval_fraction


def prepare(path: str, eval_fraction: float = 0.0, eval_path: str | None = None,
            cache_dir: str | None = None):
  """Builds (once) and opens the dataset; returns `{split: data source}`.

  Args:
    path: the JSONL file (train, or both splits with `eval_fraction`).
    eval_fraction: share of questions (by hash) put in eval; ignored with
      `eval_path`.
    eval_path: a separate JSONL file for the eval split.
    cache_dir: where prepared data lives; defaults to `DEFAULT_CACHE_DIR`.

  Returns:
    A dict 'train' / 'eval' of random-access TFDS data sources; a split with
    no records is absent.
  """
  if not 0.0 <= eval_fraction < 1.0:
    raise ValueError(f'eval_fraction must be in [0, 1), got {eval_fraction}')
  key = hashlib.sha256()
  for p in (path, eval_path):
    key.update(b'-' if p is None else _file_digest(p).encode())
  key.update(f'{eval_fraction if eval_path is None else 0.0}'.encode())
  # TFDS only now: it is slow to import, and a config check (which reads
  # this module's SPEC) must not pay for it.
  from sao_jax.envs import jsonl_tfds  # pylint: disable=g-import-not-at-top
  key.update(str(jsonl_tfds.JsonlPrompts.VERSION).encode())
  data_dir = os.path.join(cache_dir or DEFAULT_CACHE_DIR,
                          key.hexdigest()[:20])
  builder = jsonl_tfds.JsonlPrompts(splits={}, data_dir=data_dir,
                                    file_format='array_record')
  if not builder.is_prepared():
    records = read_records(path)
    if eval_path is not None:
      held = read_records(eval_path)
      questions = {r.question for r in held}
      splits = {'train': [r for r in records if r.question not in questions],
                'eval': held}
      if len(splits['train']) < len(records):
        _log.warning('%s: dropped %d train records whose question is in %s',
                     path, len(records) - len(splits['train']), eval_path)
    else:
      splits = {'train': [r for r in records
                          if not in_eval(r.question, eval_fraction)],
                'eval': [r for r in records
                         if in_eval(r.question, eval_fraction)]}
    splits = {name: rs for name, rs in splits.items() if rs}
    builder = jsonl_tfds.JsonlPrompts(splits=splits, data_dir=data_dir,
                                      file_format='array_record')
    builder.download_and_prepare()
  return builder.as_data_source()


def _file_digest(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      digest.update(block)
  return digest.hexdigest()


class JsonlEnvironment(base.Environment):
  """Single-turn prompts from JSONL, scored on the extracted answer."""

  max_turns = 1

  def __init__(self, path: str, scorer: str = 'math_verify',
               eval_fraction: float = 0.0, eval_path: str | None = None,
               answer_format: str = 'plain', cache_dir: str | None = None,
               name: str | None = None):
    """Prepares the dataset (once per file content) and opens it.

    Args:
      path: the JSONL file.
      scorer: 'math_verify' (symbolic equality of the extracted answer),
        'numeric' (the extracted number equals the answer's), or 'exact'
        (the extracted text equals str(answer) after stripping).
      eval_fraction: share of questions held out as the eval split.
      eval_path: a separate eval file instead of `eval_fraction`.
      answer_format: see `answers.instruction`.
      cache_dir: where prepared data lives.
      name: the environment's name; defaults to the file's stem.
    """
    if scorer not in SCORERS:
      raise ValueError(f'unknown scorer {scorer!r}; expected one of {SCORERS}')
    self.kind = {'math_verify': 'math', 'numeric': 'numeric',
                 'exact': 'text'}[scorer]
    answers.instruction(answer_format, self.kind)  # validates it
    self.scorer = scorer
    self.answer_format = answer_format
    self.name = name or os.path.splitext(os.path.basename(path))[0]
    self._sources = prepare(path, eval_fraction, eval_path, cache_dir)

  def size(self, split: str) -> int:
    return len(self._sources[split]) if split in self._sources else 0

  def task(self, split: str, index: int) -> base.Task:
    arithmetic.check_task_args(split, index)
    if not self.size(split):
      raise ValueError(f'{self.name}: no {split} records (set eval_fraction'
                       ' or eval_path)')
    index %= self.size(split)
    example = self._sources[split][index]
    record_id = _text(example['id'])
    metadata = json.loads(_text(example['metadata']))
    metadata['line'] = int(example['line'])
    return base.Task(
        id=f'{self.name}/{split}/{record_id or index}',
        question=_text(example['question']),
        answer=json.loads(_text(example['answer'])), metadata=metadata)

  def prompt_messages(self, task: base.Task) -> list[dict[str, str]]:
    return answers.with_instruction(task.question, self.answer_format,
                                    self.kind)

  def score(self, task: base.Task, answer: str | None) -> bool:
    if answer is None:
      return False
    if self.scorer == 'math_verify':
      return answers.math_equal(answer, task.answer)
    if self.scorer == 'numeric':
      expected = answers.parse_number(str(task.answer))
      return expected is not None and answers.parse_number(answer) == expected
    return answer.strip() == str(task.answer).strip()

  def step(self, task: base.Task, turn: int, action_text: str
           ) -> base.StepResult:
    del turn
    answer = answers.extract_answer(action_text, self.kind)
    correct = self.score(task, answer)
    return base.StepResult(
        done=True, reward=float(correct),
        info={'correct': correct, 'answer': answer, 'expected': task.answer})


def _text(value) -> str:
  return value.decode('utf-8') if isinstance(value, bytes) else str(value)


def _build(task, options) -> JsonlEnvironment:
  if not options.path:
    raise ValueError("config.task.jsonl.path must name a JSONL file when"
                     " config.task.name='jsonl'")
  return JsonlEnvironment(
      options.path, scorer=options.scorer, eval_fraction=options.eval_fraction,
      eval_path=options.eval_path or None, answer_format=task.answer_format,
      cache_dir=options.cache_dir or None)


def _check(check) -> None:
  check.choice('scorer', SCORERS)
  fraction = check.get('eval_fraction')
  if fraction is not None and not (
      isinstance(fraction, (int, float)) and 0 <= fraction < 1):
    check.problem(f'{check.name("eval_fraction")}={fraction!r} must be in'
                  ' [0, 1)')


def _check_inputs(options, section: str) -> list[str]:
  problems = []
  if not options.path:
    problems.append(f"config.{section}.path must name a JSONL file when"
                    " config.task.name='jsonl'")
  for key in ('path', 'eval_path'):
    if options[key] and not os.path.isfile(options[key]):
      problems.append(f'config.{section}.{key}={options[key]!r}: no such'
                      ' file')
  return problems


SPEC = base.EnvSpec(
    build=_build, check=_check, check_inputs=_check_inputs,
    options={
        'path': base.Option('', 'the JSONL file of questions and answers'),
        'scorer': base.Option('math_verify', 'math_verify | exact | numeric'),
        'eval_fraction': base.Option(
            0.1, 'share of questions held out (by hash) for eval'),
        'eval_path': base.Option(
            '', "a separate eval JSONL file instead; '': none"),
        'cache_dir': base.Option(
            '', "where the prepared data goes; '': ~/.cache/sao_jax"),
    })
