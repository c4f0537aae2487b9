"""reasoning-gym procedural datasets as environments.

  env = reasoning_gym_env.ReasoningGymEnvironment('chain_sum', seed=0)

(or `config.task.name='<dataset>'`). The eval split uses a seed far from the
train one, so no eval item is a shifted copy of a train item; indices wrap, so
a training stream never runs out. The reward scores the extracted final answer
with the dataset's own scorer where that is sound, and replaces the scorers
found unsound (gsm_symbolic, countdown). What was checked per dataset, and
why: docs/design/environments.md. Review a dataset's scorer before training on
one not listed there.
"""

from __future__ import annotations

import logging

from sao_jax.envs import answers
from sao_jax.envs import arithmetic
from sao_jax.envs import base

_log = logging.getLogger(__name__)

#: Added to the train seed for the eval split; sizes must stay below it.
EVAL_SEED_OFFSET = 2**30

#: Reviewed datasets: the answer kind extracted and the scorer applied.
SCORING = {
    'chain_sum': ('numeric', 'dataset'),
    'basic_arithmetic': ('numeric', 'dataset'),
    'gsm_symbolic': ('numeric', 'math_verify'),
    'countdown': ('expression', 'countdown'),
}


class ReasoningGymEnvironment(base.Environment):
  """One reasoning-gym dataset; single turn."""

  max_turns = 1

  def __init__(self, dataset_name: str, seed: int = 0, size: int = 100_000,
               eval_size: int | None = None, answer_format: str = 'plain',
               partial_credit: bool = False, **dataset_kwargs):
    """Creates the train and eval datasets.

    Args:
      dataset_name: a reasoning-gym dataset, e.g. 'chain_sum'.
      seed: train split seed; eval uses `seed + EVAL_SEED_OFFSET`.
      size: train items before indices wrap.
      eval_size: eval items before indices wrap; defaults to `size`.
      answer_format: the answer instruction appended to the question,
        'plain' | 'tagged' | 'none' (see `answers.instruction`).
      partial_credit: keep the dataset scorer's fractional scores as rewards;
        by default only full credit counts (see the module docstring).
      **dataset_kwargs: the dataset's config, e.g. `min_terms=2`.
    """
    eval_size = size if eval_size is None else eval_size
    if not 0 < size <= EVAL_SEED_OFFSET or not 0 < eval_size <= (
        EVAL_SEED_OFFSET):
      raise ValueError(f'sizes must be in (0, {EVAL_SEED_OFFSET}], got'
                       f' {size} and {eval_size}')
    self.kind, self.scorer = SCORING.get(dataset_name, ('text', 'dataset'))
    answers.instruction(answer_format, self.kind)  # validates it
    if dataset_name not in SCORING:
      _log.warning('reasoning-gym dataset %r has an unreviewed scorer; see'
                   ' reasoning_gym_env.SCORING', dataset_name)
    self.name = dataset_name
    self.answer_format = answer_format
    self.partial_credit = partial_credit
    # reasoning-gym only now: it takes seconds to import, and a config check
    # (which reads this module's SPEC) must not pay for it.
    import reasoning_gym  # pylint: disable=g-import-not-at-top
    self._datasets = {
        'train': reasoning_gym.create_dataset(
            dataset_name, seed=seed, size=size, **dataset_kwargs),
        'eval': reasoning_gym.create_dataset(
            dataset_name, seed=seed + EVAL_SEED_OFFSET, size=eval_size,
            **dataset_kwargs),
    }

  def size(self, split: str) -> int:
    """Distinct indices of `split` before they wrap."""
    return len(self._datasets[split])

  def task(self, split: str, index: int) -> base.Task:
    arithmetic.check_task_args(split, index)
    index %= self.size(split)
    entry = self._datasets[split][index]
    return base.Task(id=f'{self.name}/{split}/{index}',
                     question=entry['question'], answer=entry['answer'],
                     metadata=dict(entry['metadata']))

  def prompt_messages(self, task: base.Task) -> list[dict[str, str]]:
    return answers.with_instruction(task.question, self.answer_format,
                                    self.kind)

  def score(self, task: base.Task, answer: str | None) -> float:
    """The reward for an extracted `answer` (None: no answer found)."""
    if answer is None:
      return 0.0
    if self.scorer == 'math_verify':
      return float(answers.math_equal(answer, task.answer))
    if self.scorer == 'countdown':
      correct, _ = arithmetic.check_countdown(
          answer, task.metadata['numbers'], task.metadata['target'],
          use_all=True)
      return float(correct)
    entry = {'question': task.question, 'answer': task.answer,
             'metadata': task.metadata}
    score = float(self._datasets['train'].score_answer(answer, entry))
    return score if self.partial_credit or score >= 1.0 else 0.0

  def step(self, task: base.Task, turn: int, action_text: str
           ) -> base.StepResult:
    del turn
    answer = answers.extract_answer(action_text, self.kind)
    reward = self.score(task, answer)
    return base.StepResult(
        done=True, reward=reward,
        info={'correct': reward >= 1.0, 'answer': answer,
              'expected': task.answer})


def _build(task, options) -> ReasoningGymEnvironment:
  return ReasoningGymEnvironment(
      task.name, seed=task.seed, answer_format=task.answer_format,
      partial_credit=options.partial_credit, **dict(options.dataset_kwargs))


# Every task name the registry does not own is a reasoning-gym dataset; they
# share these options (`config.task.reasoning_gym`).
SPEC = base.EnvSpec(
    build=_build,
    options={
        'partial_credit': base.Option(
            False, "reasoning-gym's partial scores as reward"),
        'dataset_kwargs': base.Option(
            {}, "the dataset's parameters (reasoning-gym's config of it)"),
    })
