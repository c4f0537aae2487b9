"""Held-out evaluation of the policy: accuracy, its standard error, a report.

  tasks = evaluation.held_out_tasks(env, n=200)
  before = evaluation.evaluate(model, tok, env, tasks, max_new_tokens=32)
  ...
  after = evaluation.evaluate(model, tok, env, tasks, max_new_tokens=32)
  print(evaluation.format_report(before, after))  # `compare` gives the numbers

The trainer runs this at the start, every `eval.every` steps and at the end.
Generation is greedy by default, batched so that repeated evaluations reuse
their compiled steps. Why the set allows repeats and how batching keeps replies
independent of their batch: docs/design/evaluation.md.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import jax

from sao_jax import host_gather
from sao_jax.envs import base
from sao_jax.envs import task_stream
from sao_jax.models import decoding
from sao_jax.models import sampling
from sao_jax.models import tokenizer as tokenizer_lib
from sao_jax.models import transformer
#: Argmax decoding: evaluation measures the policy's mode, not a sample of it.
GREEDY = sampling.SamplingParams(temperature=0.0)


def held_out_tasks(env: base.Environment, n: int,
                   distinct: bool = False) -> list[base.Task]:
  """The held-out set: the first `n` tasks of the eval split.

  Args:
    env: the environment.
    n: how many tasks.
    distinct: keep only the first `n` distinct questions
      (`task_stream.held_out`) instead of a sample with repeats. Repeats make
      accuracy an estimate over the task distribution, where a frequent
      question counts as often as it is asked.

  Returns:
    `n` tasks in eval-index order.
  """
  if n < 0:
    raise ValueError(f'held_out_tasks: n must be >= 0, got {n}')
  if distinct:
    return task_stream.held_out(env, n)
  return [env.task('eval', index) for index in range(n)]


@dataclasses.dataclass(frozen=True)
class EvalResult:
  """The outcome of one evaluation.

  Attributes:
    accuracy: fraction of tasks judged correct.
    standard_error: `sqrt(p (1 - p) / n)`, the binomial standard error of
      `accuracy` as an estimate over the task distribution.
    n: number of tasks.
    mean_reward: mean episode reward (differs from accuracy with partial
      credit or shaped rewards).
    correct: per task, in the order the tasks were given.
    replies: per task, the decoded text after the prompt (special tokens
      skipped); for multi-turn episodes the observations are included.
    seconds: wall time of the evaluation, compilation included.
    task_ids: per task, so that two results can be paired question by question.
  """
  accuracy: float
  standard_error: float
  n: int
  mean_reward: float
  correct: list[bool]
  replies: list[str]
  seconds: float
  task_ids: list[str] = dataclasses.field(default_factory=list)

  @classmethod
  def from_outcomes(cls, correct: Sequence[bool], rewards: Sequence[float],
                    replies: Sequence[str], seconds: float,
                    task_ids: Sequence[str] = ()) -> EvalResult:
    """Aggregates per-task outcomes; raises ValueError on no tasks."""
    n = len(correct)
    if n == 0:
      raise ValueError('an evaluation needs at least one task')
    if len(rewards) != n or len(replies) != n:
      raise ValueError(f'{n} outcomes but {len(rewards)} rewards and'
                       f' {len(replies)} replies')
    p = sum(bool(c) for c in correct) / n
    return cls(accuracy=p, standard_error=math.sqrt(p * (1 - p) / n), n=n,
               mean_reward=sum(float(r) for r in rewards) / n,
               correct=[bool(c) for c in correct], replies=list(replies),
               seconds=float(seconds), task_ids=list(task_ids))


def _generate_batched(model, prompts, *, max_new_tokens, batch_size, params,
                      key, stop_ids, pad_id, bucket, row_sharding=None):
  """`decoding.generate` over `prompts` in length-sorted, equal batches.

  The prompts are split into the fewest batches of at most `batch_size` rows,
  all of one row count: the last is padded with repeats of its longest
  prompt, which add no prompt length and, under greedy decoding, no decode
  steps (a row stops when its twin does). Equal batches waste at most one row
  per batch, where padding the last batch to `batch_size` could waste nearly a
  whole batch; and the same prompts always give the same shapes, so repeated
  evaluations reuse the compiled prefill and decode steps.

  With `row_sharding` (several processes) `prompts` are this host's and
  `batch_size` counts each host's rows: the hosts agree on the number of
  batches (the most any host needs) and decode each one together.

  Returns:
    One `Generation` per prompt, in the order of `prompts`.
  """
  order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
  most = len(prompts)
  if row_sharding is not None:
    most = max(host_gather.allgather_json(len(prompts)))
  num_batches = -(-most // batch_size)
  rows = -(-most // num_batches) if num_batches else 0
  outputs = [None] * len(prompts)
  for start in range(0, num_batches * rows, rows):
    indices = order[start:start + rows]
    batch = [prompts[i] for i in indices]
    if row_sharding is None:
      batch += [batch[-1]] * (rows - len(batch))
    key, sub = jax.random.split(key)
    generations = decoding.generate(
        model, batch, max_new_tokens, params=params, key=sub,
        stop_ids=stop_ids, pad_id=pad_id, bucket=bucket,
        row_sharding=row_sharding)
    for index, generation in zip(indices, generations):
      outputs[index] = generation
  return outputs


def _generate(model, prompts, *, params, **kwargs):
  """`_generate_batched`, generating each distinct prompt once when greedy.

  Under greedy decoding a continuation is a function of its prompt, so a
  held-out set sampled with repeats (chain_sum's first 200 eval tasks hold
  ~130 distinct questions) costs only its distinct prompts. Sampled
  continuations are independent draws and are all generated.
  """
  if not params.greedy:
    return _generate_batched(model, prompts, params=params, **kwargs)
  unique = list(dict.fromkeys(tuple(p) for p in prompts))
  generations = _generate_batched(model, [list(p) for p in unique],
                                  params=params, **kwargs)
  by_prompt = dict(zip(unique, generations))
  return [by_prompt[tuple(p)] for p in prompts]


def evaluate(model: transformer.CausalLM, tok: tokenizer_lib.Tokenizer,
             env: base.Environment, tasks: Sequence[base.Task], *,
             max_new_tokens: int, batch_size: int = 64,
             params: sampling.SamplingParams = GREEDY, key=None,
             bucket: int = 16,
             row_sharding: jax.sharding.NamedSharding | None = None
             ) -> EvalResult:
  """Plays every task once with the model and judges it with the environment.

  Multi-turn environments (`env.max_turns > 1`) are played turn by turn, all
  open episodes batched together: the reply of turn t is judged with
  `env.step(task, t, text)` (the task replaced by the previous turn's
  `next_task` where one was given); an observation is appended
  token-in/token-out in the model's chat template (`episodes.ChatFormat`, as
  the rollout workers do) and the episode continues. An episode the
  environment has not ended after `env.max_turns` turns scores 0. Tool
  latency (`astep`) is not simulated: evaluation measures answers, not time.

  Args:
    model: the policy, used as given.
    tok: its tokenizer (chat template, stop and pad ids).
    env: the environment that poses and judges the tasks.
    tasks: the tasks, e.g. `held_out_tasks(env, n)`.
    max_new_tokens: generation budget per model turn.
    batch_size: most prompts per `decoding.generate` call; the prompts are
      split into equal batches of at most this many.
    params: sampling settings; greedy by default. Sampled replies depend on
      the batching (keys are drawn per batch).
    key: PRNG key for sampling; defaults to key 0.
    bucket: prompt lengths are padded to a multiple of this.
    row_sharding: on several processes, the learner's batch-axis sharding
      (`Learner.row_sharding`) over every process's devices. Each host then
      plays every `jax.process_count()`-th task (`tasks[p::P]`, which
      interleaves long and short ones), the hosts decode their rows as one
      global batch, and every host returns the whole result. A collective:
      every process calls it with the same `tasks`. Without it, on several
      processes each would decode the whole set (the same work P times).

  Returns:
    An `EvalResult` with per-task outcomes in the order of `tasks`; a task is
    correct per `result.info['correct']`, or `reward >= 1` when the
    environment does not say.
  """
  if not tasks:
    raise ValueError('evaluate: no tasks')
  if batch_size < 1 or max_new_tokens < 1:
    raise ValueError(f'evaluate: batch_size ({batch_size}) and max_new_tokens'
                     f' ({max_new_tokens}) must be >= 1')
  if row_sharding is not None and jax.process_count() == 1:
    row_sharding = None  # one host decodes the whole set anyway
  all_tasks = tasks
  if row_sharding is not None:
    batch_size = max(batch_size // jax.process_count(), 1)
    tasks = all_tasks[jax.process_index()::jax.process_count()]
  start_time = time.perf_counter()
  key = jax.random.key(0) if key is None else key
  pad_id = tok.pad_id if tok.pad_id is not None else (
      tok.stop_ids[0] if tok.stop_ids else 0)
  chat = None
  if env.max_turns > 1:
    # Imported here: the rollout client it lives beside is slow to import and
    # single-turn evaluation does not need it.
    from sao_jax.rollout import episodes  # pylint: disable=g-import-not-at-top
    chat = episodes.ChatFormat(tok)

  prompts = [tok.encode_chat(env.prompt_messages(task)) for task in tasks]
  contexts = [list(prompt) for prompt in prompts]
  rewards = [0.0] * len(tasks)
  correct = [False] * len(tasks)
  judged = list(tasks)  # each row's task for its next turn (next_task)
  open_rows = list(range(len(tasks)))
  for turn in range(env.max_turns):
    any_open = bool(open_rows)
    if row_sharding is not None:
      any_open = any(host_gather.allgather_json(any_open))
    if not any_open:
      break
    key, sub = jax.random.split(key)
    generations = _generate(
        model, [contexts[row] for row in open_rows],
        max_new_tokens=max_new_tokens, batch_size=batch_size, params=params,
        key=sub, stop_ids=tok.stop_ids, pad_id=pad_id, bucket=bucket,
        row_sharding=row_sharding)
    still_open = []
    for row, generation in zip(open_rows, generations):
      contexts[row] += generation.tokens
      text = tok.decode(generation.tokens, skip_special_tokens=True)
      result = env.step(judged[row], turn, text)
      if result.done:
        rewards[row] = float(result.reward)
        correct[row] = bool(result.info.get('correct', result.reward >= 1))
      elif chat is not None and turn + 1 < env.max_turns:
        contexts[row] += chat.observation_tokens(generation.tokens,
                                                 result.observation or '')
        if result.next_task is not None:
          judged[row] = result.next_task
        still_open.append(row)
    open_rows = still_open

  replies = [tok.decode(context[len(prompt):], skip_special_tokens=True)
             for context, prompt in zip(contexts, prompts)]
  seconds = time.perf_counter() - start_time
  if row_sharding is not None:
    correct, rewards, replies, seconds = _gather_outcomes(
        len(all_tasks), correct, rewards, replies, seconds)
  return EvalResult.from_outcomes(
      correct, rewards, replies, seconds,
      task_ids=[task.id for task in all_tasks])


def _gather_outcomes(n, correct, rewards, replies, seconds):
  """Every host's outcomes of its `tasks[p::P]`, back in the tasks' order;
  the seconds of the slowest host."""
  every = host_gather.allgather_json(
      {'correct': correct, 'rewards': rewards, 'replies': replies,
       'seconds': seconds})
  out = {'correct': [False] * n, 'rewards': [0.0] * n, 'replies': [''] * n}
  for process, host in enumerate(every):
    for name, values in out.items():
      values[process::len(every)] = host[name]
  return (out['correct'], out['rewards'], out['replies'],
          max(host['seconds'] for host in every))


def compare(before: EvalResult,
            after: EvalResult) -> dict[str, float | int | bool]:
  """How much `after` improves on `before`, with its uncertainty.

  Two standard errors are given. `standard_error` treats the two sets as
  independent samples, `sqrt(se_before^2 + se_after^2)`. The sets are in fact
  the same questions, so the per-question differences are paired: only the
  discordant questions (`gained`: wrong before, right after; `lost`: the
  reverse) carry information, and `paired_standard_error` is the standard
  error of the mean difference, `sqrt((gained + lost) - (gained - lost)^2 /
  n) / n`. It is usually smaller, since a question's difficulty is shared.
  `significant` uses the conservative independent one: after beats before by
  more than two of them.

  Raises:
    ValueError: the results are not over the same tasks in the same order.
  """
  if before.n != after.n:
    raise ValueError(f'compare: results over {before.n} and {after.n} tasks;'
                     ' they must be the same held-out set')
  if before.task_ids and after.task_ids and before.task_ids != after.task_ids:
    raise ValueError('compare: results are over different tasks (task_ids)')
  difference = after.accuracy - before.accuracy
  standard_error = math.sqrt(before.standard_error**2 +
                             after.standard_error**2)
  gained = sum(not b and a for b, a in zip(before.correct, after.correct))
  lost = sum(b and not a for b, a in zip(before.correct, after.correct))
  n = before.n
  paired_variance = max((gained + lost) - (gained - lost)**2 / n, 0.0)
  return {
      'difference': difference,
      'standard_error': standard_error,
      'paired_standard_error': math.sqrt(paired_variance) / n,
      'gained': gained,
      'lost': lost,
      'significant': difference > 2 * standard_error,
  }


def format_report(before: EvalResult, after: EvalResult) -> str:
  """A side-by-side text table of two evaluations and their difference."""
  def accuracy(result):
    return f'{result.accuracy:.3f} ± {result.standard_error:.3f}'

  rows = [
      ('', 'before', 'after'),
      ('accuracy', accuracy(before), accuracy(after)),
      ('n', str(before.n), str(after.n)),
      ('mean reward', f'{before.mean_reward:.3f}', f'{after.mean_reward:.3f}'),
      ('seconds', f'{before.seconds:.1f}', f'{after.seconds:.1f}'),
  ]
  widths = [max(len(row[col]) for row in rows) for col in range(3)]
  lines = [f'{row[0]:<{widths[0]}}  {row[1]:>{widths[1]}}  '
           f'{row[2]:>{widths[2]}}' for row in rows]
  paired = before.n == after.n and (
      not before.task_ids or not after.task_ids or
      before.task_ids == after.task_ids)
  if paired:
    c = compare(before, after)
    lines.append(
        f'difference {c["difference"]:+.3f} ± {c["standard_error"]:.3f}'
        f' (paired ± {c["paired_standard_error"]:.3f}; gained {c["gained"]},'
        f' lost {c["lost"]}); significant: '
        f'{"yes" if c["significant"] else "no"}')
  return '\n'.join(lines)
