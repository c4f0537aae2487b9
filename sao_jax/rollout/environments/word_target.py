"""A task for the tiny word-vocabulary model: say words from a target set.

The tiny random model (`sao_jax.models.tiny`) has no arithmetic to learn; this
environment gives it a reward it can climb within a CI run: the fraction of the
reply's words that belong to a target set (even-numbered words `w0, w2, ...`).
The whole training pipeline (servers, workers, queue, learner, checkpoints)
runs unchanged on it, in seconds per step.
"""

from __future__ import annotations

from sao_jax.rollout.environments import base


class WordTarget(base.Environment):
  """Reward: share of the reply's words that are in the target set."""

  name = 'word_target'
  max_turns = 1

  def __init__(self, vocab: int = 64, seed: int = 0):
    self._vocab = vocab
    self._seed = seed

  def task(self, split: str, index: int) -> base.Task:
    if split not in base.SPLITS:
      raise ValueError(f'unknown split {split!r}')
    offset = 0 if split == 'train' else 7919  # disjoint prompt sequences
    words = [f'w{(index * 7 + offset + k * 13) % (self._vocab - 3)}'
             for k in range(3)]
    return base.Task(id=f'{self.name}/{split}/{index}',
                     question=' '.join(words) + f' #{split}{index}')

  def prompt_messages(self, task: base.Task) -> list[dict[str, str]]:
    return [{'role': 'user', 'content': task.question.split(' #')[0]}]

  def step(self, task: base.Task, turn: int, action_text: str
           ) -> base.StepResult:
    del task, turn
    words = [w for w in action_text.split() if w.startswith('w')]
    hits = sum(1 for w in words if w[1:].isdigit() and int(w[1:]) % 2 == 0)
    share = hits / len(words) if words else 0.0
    return base.StepResult(done=True, reward=share,
                           info={'correct': share >= 0.75, 'words': len(words)})
