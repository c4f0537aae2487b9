"""Held-out evaluation sets and the training stream that never touches them.

Environments are deterministic in their tasks, so a held-out set is the first
`n` distinct questions of the eval split and a training stream is a cursor
over train indices. Small procedural settings repeat questions across (and
within) splits: reasoning-gym's chain_sum with 2 one-digit terms has only 200
distinct questions, so an eval question shows up in the train split every
~200 tasks. The stream drops every train task whose question text is exactly a
held-out one, and counts the drops, so evaluation measures generalisation and
the skip rate is visible in metrics.

On a multi-host run each process reads its own slice of the train indices,
`start, start + stride, start + 2 * stride, ...` with `start` the process
index and `stride` the process count, so no prompt is rolled out by two hosts
and a global batch of B trajectories holds B distinct prompts (SAO's one
rollout per prompt).

The stream's whole state is `(cursor, skipped)`: `state_dict()` saved with a
checkpoint and `load_state_dict()` on resume continue at the same task. The
state also records a digest of the excluded questions and the slice, and
loading it into a stream with a different held-out set or slice fails: the
resumed run would otherwise train on questions the first part held out, or on
another host's prompts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from sao_jax.envs import base
#: Train indices scanned in a row without a usable task before giving up:
#: every question excluded is a configuration error, not something to wait on.
MAX_CONSECUTIVE_SKIPS = 100_000


def held_out(env: base.Environment, n: int, split: str = 'eval',
             max_scan: int | None = None) -> list[base.Task]:
  """The first `n` tasks of `split` with distinct questions.

  Args:
    env: the environment.
    n: how many tasks.
    split: where they come from ('eval').
    max_scan: indices to scan at most; defaults to `100 * n + 1000`.

  Returns:
    `n` tasks in index order, no two with the same question.

  Raises:
    ValueError: `split` has fewer than `n` distinct questions within
      `max_scan` indices (e.g. asking 300 of chain_sum's 200).
  """
  max_scan = 100 * n + 1000 if max_scan is None else max_scan
  tasks, seen = [], set()
  for index in range(max_scan):
    if len(tasks) == n:
      break
    task = env.task(split, index)
    if task.question not in seen:
      seen.add(task.question)
      tasks.append(task)
  if len(tasks) < n:
    raise ValueError(
        f'{env.name}: only {len(tasks)} distinct {split} questions in the'
        f' first {max_scan} indices, {n} requested')
  return tasks


class TaskStream:
  """Train tasks by index, without the excluded questions.

  Iterating yields `env.task(split, cursor)` for cursor = start,
  start + stride, ..., skipping (and counting) tasks whose question is in
  `exclude_questions`; `last_index` is the index of the task last yielded.
  """

  def __init__(self, env: base.Environment,
               exclude_questions: Iterable[str] = (), start: int = 0,
               split: str = 'train', stride: int = 1):
    if stride < 1 or start < 0:
      raise ValueError(f'TaskStream: need start >= 0 and stride >= 1, got'
                       f' start {start}, stride {stride}')
    self.env = env
    self.split = split
    self.exclude = frozenset(exclude_questions)
    self.start = start
    self.stride = stride
    self.cursor = start  # the next index to look at
    self.last_index = -1  # the index of the task last yielded
    self.skipped = 0  # excluded tasks passed over so far

  def __iter__(self) -> TaskStream:
    return self

  def __next__(self) -> base.Task:
    for _ in range(MAX_CONSECUTIVE_SKIPS):
      index = self.cursor
      task = self.env.task(self.split, index)
      self.cursor += self.stride
      if task.question not in self.exclude:
        self.last_index = index
        return task
      self.skipped += 1
    raise RuntimeError(
        f'{self.env.name}: {MAX_CONSECUTIVE_SKIPS} consecutive {self.split}'
        f' tasks are all held out (before index {self.cursor}); the held-out'
        ' set covers the task space: hold out fewer or make tasks harder')

  @property
  def exclude_digest(self) -> str:
    """SHA-256 of the sorted excluded questions."""
    digest = hashlib.sha256()
    for question in sorted(self.exclude):
      digest.update(question.encode())
      digest.update(b'\0')
    return digest.hexdigest()

  def state_dict(self) -> dict[str, Any]:
    """What a checkpoint keeps to resume at the same task."""
    return {'cursor': self.cursor, 'skipped': self.skipped,
            'exclude_digest': self.exclude_digest,
            'slice': self.start % self.stride, 'stride': self.stride}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Continues from `state`; raises ValueError if it was saved by a stream
    with different excluded questions or another slice of the indices."""
    saved = state.get('exclude_digest')
    if saved is not None and saved != self.exclude_digest:
      raise ValueError('TaskStream state was saved with a different set of'
                       ' excluded questions')
    # States written before streams were sliced read as the one slice.
    mine = (self.start % self.stride, self.stride)
    saved_slice = (int(state.get('slice', 0)), int(state.get('stride', 1)))
    if saved_slice != mine:
      raise ValueError(
          f'TaskStream state was saved by the slice {saved_slice[0]} (mod'
          f' {saved_slice[1]}) of the train indices, this stream reads'
          f' {mine[0]} (mod {mine[1]}): resume with the same number of'
          ' processes, each with its process index')
    if int(state['cursor']) % self.stride != mine[0]:
      raise ValueError(f'TaskStream state: cursor {state["cursor"]} is not'
                       f' in the slice {mine[0]} (mod {mine[1]})')
    self.cursor = int(state['cursor'])
    self.skipped = int(state['skipped'])
