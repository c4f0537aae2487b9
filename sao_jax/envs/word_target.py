"""A task for the tiny word-vocabulary model: say words from a target set.

The tiny random model (`sao_jax.models.tiny`) has no arithmetic to learn; the
reward here is the fraction of the reply's words that belong to a target set
(even-numbered words `w0, w2, ...`), which it can climb within a CI run while
the whole pipeline runs unchanged. Options, all off by default, make it a
testbed for the benchmarks: phases (`switch_steps`: the target parity flips),
simulated latency per turn, and multi-turn episodes (`turns` > 1, with
observation turns for skip-observation GAE). Details:
docs/design/environments.md.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Sequence
import dataclasses

from sao_jax.envs import arithmetic
from sao_jax.envs import base
from sao_jax.envs import latency
# Task metadata key of the word counts of an episode's earlier replies:
# (words, even-numbered words, odd-numbered words).
_COUNTS = 'word_counts'
#: Which replies' words the reward counts (`WordTarget(scored_reply=...)`).
SCORED_REPLIES = ('all', 'first')


def count_words(text: str) -> tuple[int, int, int]:
  """`(words, even, odd)`: reply words ('w...') and those numbered even / odd.

  A 'w' word without a number (e.g. 'who') counts as a word of neither parity,
  so it lowers the share in every phase.
  """
  words = [w for w in text.split() if w.startswith('w')]
  numbers = [int(w[1:]) for w in words if w[1:].isdigit()]
  even = sum(1 for n in numbers if n % 2 == 0)
  return len(words), even, len(numbers) - even


class WordTarget(base.Environment):
  """Reward: share of the reply's words that are in the target set."""

  name = 'word_target'
  max_turns = 1

  def __init__(self, vocab: int = 64, seed: int = 0,
               switch_steps: Sequence[int] = (), turns: int = 1,
               observation_words: int = 6, delay_median_s: float = 0.0,
               delay_sigma: float = 1.0, delay_max_s: float | None = None,
               scored_reply: str = 'all'):
    """Configures the task, its phases, turns and simulated latency.

    Args:
      vocab: the tiny model's vocabulary size (words are `w0 .. w{vocab-4}`).
      seed: varies observations and latencies between runs.
      switch_steps: strictly increasing policy steps at which the target
        parity flips; empty: even words throughout.
      turns: model turns per episode (`max_turns`); 1 is single-turn.
      observation_words: words of each observation between turns.
      delay_median_s: median simulated latency of a turn; 0 disables it.
      delay_sigma: lognormal sigma (log-space standard deviation).
      delay_max_s: optional cap on one delay.
      scored_reply: 'all' pools the words of every reply; 'first' scores the
        first reply only, with the reward still given at the episode's end:
        the later replies cannot change it, so credit must reach back across
        the observations to the first (a credit-assignment test; a critic
        that reads the first reply can predict the return from there on).
    """
    switch_steps = tuple(switch_steps)
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0
           for s in switch_steps) or list(switch_steps) != sorted(
               set(switch_steps)):
      raise ValueError('switch_steps must be strictly increasing policy steps'
                       f' >= 0, got {switch_steps}')
    if turns < 1 or observation_words < 1:
      raise ValueError(f'need turns >= 1 and observation_words >= 1, got'
                       f' {turns} and {observation_words}')
    latency.check(delay_median_s, delay_sigma, delay_max_s)
    if scored_reply not in SCORED_REPLIES:
      raise ValueError(f'scored_reply must be one of {SCORED_REPLIES}, got'
                       f' {scored_reply!r}')
    self.scored_reply = scored_reply
    self._vocab = vocab
    self._seed = seed
    self.switch_steps = switch_steps
    self.max_turns = turns
    self.observation_words = observation_words
    self.delay_median_s = delay_median_s
    self.delay_sigma = delay_sigma
    self.delay_max_s = delay_max_s
    self.phase = 0

  def on_policy_step(self, step: int) -> None:
    self.phase = bisect.bisect_right(self.switch_steps, step)

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

  def observation(self, task: base.Task, turn: int) -> str:
    """The user turn after reply `turn`: words fixed by task id and turn."""
    rng = arithmetic.seeded_rng('word_target_observation', self._seed, task.id,
                                turn)
    return ' '.join(f'w{rng.randrange(self._vocab - 3)}'
                    for _ in range(self.observation_words))

  def turn_latency(self, task: base.Task, turn: int, reply: str = '') -> float:
    """Seconds turn `turn` of `task` takes to judge `reply` (0 when
    disabled); `latency.lognormal_seconds` says why the reply counts."""
    return latency.lognormal_seconds(self.delay_median_s, self.delay_sigma,
                                     self.delay_max_s, self._seed, task.id,
                                     turn, reply)

  def step(self, task: base.Task, turn: int, action_text: str
           ) -> base.StepResult:
    reply = count_words(action_text)
    if self.scored_reply == 'first' and turn > 0:
      reply = (0, 0, 0)  # read, judged by nothing
    before = task.metadata.get(_COUNTS, (0, 0, 0))
    words, even, odd = (a + b for a, b in zip(before, reply))
    if turn < self.max_turns - 1:
      return base.StepResult(
          done=False, observation=self.observation(task, turn),
          info={'words': reply[0], 'phase': self.phase},
          next_task=dataclasses.replace(
              task, metadata={**task.metadata, _COUNTS: (words, even, odd)}))
    hits = odd if self.phase % 2 else even
    share = hits / words if words else 0.0
    return base.StepResult(done=True, reward=share,
                           info={'correct': share >= 0.75, 'words': words,
                                 'phase': self.phase})

  async def astep(self, task: base.Task, turn: int, action_text: str
                  ) -> base.StepResult:
    """The simulated latency, then `step`: a late verdict sees a new phase."""
    delay = self.turn_latency(task, turn, action_text)
    if delay > 0:
      await asyncio.sleep(delay)
    result = self.step(task, turn, action_text)
    if delay > 0:
      result.info['latency_s'] = delay
    return result


def _build(task, options) -> WordTarget:
  return WordTarget(
      seed=task.seed, switch_steps=tuple(options.switch_steps),
      turns=options.turns, observation_words=options.observation_words,
      delay_median_s=options.delay_median_s, delay_sigma=options.delay_sigma,
      delay_max_s=options.delay_max_s or None,
      scored_reply=options.scored_reply)


def _check(check) -> None:
  check.positive_int('turns')
  check.positive_int('observation_words')
  check.non_negative('delay_median_s')
  check.non_negative('delay_sigma')
  check.non_negative('delay_max_s')
  check.choice('scored_reply', SCORED_REPLIES)
  steps = check.get('switch_steps')
  if steps is not None:
    steps = tuple(steps) if isinstance(steps, (tuple, list)) else (steps,)
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0
           for s in steps) or list(steps) != sorted(set(steps)):
      check.problem(f'{check.name("switch_steps")}={steps} must be'
                    ' strictly increasing policy steps >= 0')


SPEC = base.EnvSpec(
    build=_build, check=_check, max_turns=lambda options: options.turns,
    options={
        'switch_steps': base.Option(
            (), 'policy steps where the target parity flips; (): none'),
        'turns': base.Option(
            1, 'model turns per episode (max_turns); > 1: multi-turn'),
        'observation_words': base.Option(
            6, 'words of the user turn between replies'),
        'delay_median_s': base.Option(
            0.0, 'median simulated latency of a turn; 0: none'),
        'delay_sigma': base.Option(
            1.0, 'lognormal sigma of that latency (heavy tail)'),
        'delay_max_s': base.Option(0.0, 'cap on one delay; 0: none'),
        'scored_reply': base.Option(
            'all', 'replies the reward counts: all (pooled) | first (the'
            ' first reply only, rewarded at the end: credit must cross the'
            ' observations)'),
    })
