"""The environment interface every task, tool and code environment implements.

An environment is deterministic in its tasks: `task(split, index)` always
returns the same task, so a training stream is just a cursor over indices
(checkpointed and resumed exactly) and a held-out set is the first N indices
of the eval split. Episodes are driven by the rollout worker:

  messages = env.prompt_messages(task)             # chat messages to start
  loop:
    action_text = policy(...)                       # one model turn
    result = await env.astep(task, turn, action_text)  # observation or end
    if result.done: reward = result.reward
    else: append result.observation as a user/tool message (never trained on)
          and judge the next turn with result.next_task if it is set
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import ml_collections

SPLITS = ('train', 'eval')


@dataclasses.dataclass(frozen=True)
class Task:
  """One prompt instance.

  Attributes:
    id: unique and stable, e.g. 'chain_sum/train/123'.
    question: the text posed to the model; also the exact-match key that keeps
      held-out questions out of training streams.
    answer: the ground truth the scorer needs (any JSON-able value).
    metadata: anything else the environment needs (difficulty, tests, ...).
  """
  id: str
  question: str
  answer: Any = None
  metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class StepResult:
  """What the environment says after one model turn.

  Attributes:
    done: the episode is over (answer given, or no valid continuation).
    reward: the outcome reward, set when done (0/1 or a score).
    observation: text to show the model next (tool output, feedback) when not
      done; it becomes observation tokens, never trained on.
    info: details for metrics, e.g. {'correct': bool, 'answer': str}.
    next_task: when not done, the task to judge the episode's next turn with
      in place of the current one (same id); None keeps it. An environment
      whose verdict depends on earlier turns carries them here, in the task's
      metadata: a Task is immutable and `step` sees only the current reply,
      so this is episode state that concurrent episodes of one task (a GRPO
      group) never share.
  """
  done: bool
  reward: float = 0.0
  observation: str | None = None
  info: dict[str, Any] = dataclasses.field(default_factory=dict)
  next_task: Task | None = None


class Environment(abc.ABC):
  """A source of tasks and a judge of replies."""

  #: Stable name used in configs, ids and metrics.
  name: str = 'environment'
  #: Most model turns in one episode (1 for single-turn tasks).
  max_turns: int = 1

  @abc.abstractmethod
  def task(self, split: str, index: int) -> Task:
    """The task at `index` of `split` ('train' or 'eval'); deterministic."""

  @abc.abstractmethod
  def prompt_messages(self, task: Task) -> list[dict[str, str]]:
    """Chat messages (`{'role', 'content'}`) that open the episode."""

  @abc.abstractmethod
  def step(self, task: Task, turn: int, action_text: str) -> StepResult:
    """Judges the model's turn `turn` (0-based) of an episode on `task`."""

  async def astep(self, task: Task, turn: int, action_text: str) -> StepResult:
    """`step` for the asyncio rollout workers.

    Environments with real latency (a tool call, a sandboxed program) override
    it so that one slow episode never blocks the others; the default runs
    `step` inline, which suits pure-Python judges that take microseconds.
    """
    return self.step(task, turn, action_text)

  def on_policy_step(self, step: int) -> None:
    """Told the learner's policy step (non-stationary environments use it)."""
    del step


class Option(NamedTuple):
  """One option of an environment: its default and what it means."""
  default: Any
  help: str


def _single_turn(options) -> int:
  del options
  return 1


@dataclasses.dataclass(frozen=True)
class EnvSpec:
  """What a config needs of one environment (`registry.ENVIRONMENTS`).

  The environment's options are `config.task.<name>`, exactly the keys of
  `options`; `config.task` itself holds only what every task has (name,
  seed, answer_format, held_out, the nonstationary wrapper).

  Attributes:
    build: `build(task, options) -> Environment`, with `task` the config's
      `task` section and `options` its `task.<name>` section.
    options: name -> `Option`, or a nested mapping of them (a sub-section).
    check: `check(checker)` of the options beyond their types (which the
      locked config enforces), the `config_lib.Checker` scoped to the
      options' section; None: no more to check.
    max_turns: `max_turns(options)`, the most model turns of one episode
      (`batching.pack_sequences='auto'` packs tasks of more than one).
    check_inputs: `check_inputs(options, section) -> [problem]` about the
      files a run reads, checked on the machine that reads them; `section`
      is the options' dotted path, to name keys by.
  """
  build: Callable[[Any, Any], Environment]
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  check: Callable[[Any], None] | None = None
  max_turns: Callable[[Any], int] = _single_turn
  check_inputs: Callable[[Any, str], list[str]] | None = None


def option_defaults(options: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """A config section of `options` (name -> `Option` or a nested mapping)
  at their defaults."""
  return ml_collections.ConfigDict(_defaults(options))


def option_meanings(options: Mapping[str, Any],
                    prefix: str = '') -> dict[str, str]:
  """`{prefix + dotted option: help}`, for the configuration reference."""
  return dict(_meanings(options, prefix))


def _defaults(options: Mapping[str, Any]) -> dict[str, Any]:
  return {key: (value.default if isinstance(value, Option)
                else _defaults(value)) for key, value in options.items()}


def _meanings(options: Mapping[str, Any], prefix: str):
  for key, value in options.items():
    if isinstance(value, Option):
      yield prefix + key, value.help
    else:
      yield from _meanings(value, f'{prefix}{key}.')
