"""A task whose rewarded answer format changes during training.

  env = nonstationary.NonStationaryEnvironment(
      base_env, formats=('statement', 'equation'), switch_steps=(100,))

For the online-learning experiment: phase p (the number of `switch_steps` the
learner's policy step has reached, told through `on_policy_step`) rewards the
format `formats[p]` (tagged, sentence, bracket, statement, equation), and the
reward is 1 only when the reply is in that format and its number is correct
by the base environment's judgement. The prompt never changes; an episode is
judged by the phase current when it ends. Why the defaults alternate
'statement' and 'equation', and the other design choices:
docs/design/environments.md.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
import re

from sao_jax.envs import answers
from sao_jax.envs import base

_NUMBER = r'([-\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)'

#: The recognised formats: a pattern whose group 1 is the number, searched in
#: the stripped reply, and a description for docs and logs.
FORMATS = {
    'tagged': (re.compile(rf'<answer>\s*{_NUMBER}\s*</answer>', re.IGNORECASE),
               '<answer>N</answer>'),
    'sentence': (re.compile(rf'The answer is\s+{_NUMBER}\.?\Z', re.IGNORECASE),
                 'ends with "The answer is N."'),
    'bracket': (re.compile(rf'\[\s*{_NUMBER}\s*\]\Z'), 'ends with "[N]"'),
    'statement': (re.compile(rf'\bis\s+{_NUMBER}\.?\Z'), 'ends with "is N."'),
    'equation': (re.compile(rf'=\s*{_NUMBER}\.?\Z'), 'ends with "= N"'),
}


def formatted_answer(text: str | None, fmt: str) -> str | None:
  """The number `text` gives in format `fmt` (normalised), or None if the
  reply is not in that format. With several tagged answers, the last counts."""
  pattern, _ = FORMATS[fmt]
  matches = list(pattern.finditer((text or '').strip()))
  if not matches:
    return None
  return answers.normalize_number(matches[-1].group(1))


class NonStationaryEnvironment(base.Environment):
  """Wraps a numeric environment; the rewarded answer format switches."""

  def __init__(self, base_env: base.Environment,
               formats: Sequence[str] = ('statement', 'equation', 'statement'),
               switch_steps: Sequence[int] = (100, 200)):
    """Configures the phases.

    Args:
      base_env: supplies tasks, prompts and the correctness judgement.
      formats: the rewarded format of each phase, keys of `FORMATS`.
      switch_steps: increasing policy steps at which phase i+1 begins; one
        fewer than `formats`.
    """
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
      raise ValueError(f'unknown formats {unknown}; expected {list(FORMATS)}')
    if len(switch_steps) != len(formats) - 1:
      raise ValueError(f'{len(formats)} formats need {len(formats) - 1}'
                       f' switch steps, got {len(switch_steps)}')
    if list(switch_steps) != sorted(set(switch_steps)):
      raise ValueError(f'switch_steps must increase strictly: {switch_steps}')
    self.base_env = base_env
    self.formats = tuple(formats)
    self.switch_steps = tuple(switch_steps)
    self.name = f'{base_env.name}_nonstationary'
    self.max_turns = base_env.max_turns
    self.phase = 0
    self.policy_step = 0

  @property
  def current_format(self) -> str:
    return self.formats[self.phase]

  def on_policy_step(self, step: int) -> None:
    self.policy_step = step
    self.phase = bisect.bisect_right(self.switch_steps, step)
    self.base_env.on_policy_step(step)

  def task(self, split: str, index: int) -> base.Task:
    return self.base_env.task(split, index)

  def prompt_messages(self, task: base.Task) -> list[dict[str, str]]:
    return self.base_env.prompt_messages(task)

  def step(self, task: base.Task, turn: int, action_text: str
           ) -> base.StepResult:
    plain = self.base_env.step(task, turn, action_text)
    if not plain.done:
      return plain  # a tool turn of a multi-turn base: nothing to judge yet
    fmt = self.current_format
    number = formatted_answer(action_text, fmt)
    if number is None:
      reward = 0.0
    else:
      judged = self.base_env.step(task, turn, f'<answer>{number}</answer>')
      reward = float(judged.reward >= 1.0)
    info = dict(plain.info)
    info.update({
        # 'correct' stays the base judgement of the whole reply, so metrics
        # separate knowing the answer from using the rewarded format.
        'phase': self.phase, 'format': fmt, 'format_ok': number is not None,
        'format_answer': number, 'rewarded': reward >= 1.0,
    })
    return base.StepResult(done=True, reward=reward, info=info)

  async def astep(self, task: base.Task, turn: int, action_text: str
                  ) -> base.StepResult:
    plain = await self.base_env.astep(task, turn, action_text)
    if not plain.done:
      return plain
    return self.step(task, turn, action_text)


# `config.task.nonstationary`: the wrapper's options (any task can be wrapped).
OPTIONS = {
    'enabled': base.Option(False, 'wrap the task in the switching reward'),
    'formats': base.Option(('statement', 'equation', 'statement'),
                           'the rewarded answer format of each phase'),
    'switch_steps': base.Option(
        (100, 200), 'policy steps where the next phase starts'),
}


def check_options(check) -> None:
  """`config.task.nonstationary` (a config_lib.Checker scoped to it)."""
  formats = check.get('formats')
  steps = check.get('switch_steps')
  if formats is None or steps is None:
    return
  unknown = [f for f in formats if f not in FORMATS]
  if unknown:
    check.problem(f'{check.name("formats")}={tuple(formats)}: {unknown} not'
                  f' among {", ".join(FORMATS)}')
  if len(tuple(steps)) != len(tuple(formats)) - 1:
    check.problem(f'{check.name("switch_steps")} needs one step fewer than'
                  f' {check.name("formats")} (one per switch)')
