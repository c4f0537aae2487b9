"""The environments a config can name (`config.task`), and building one.

`ENVIRONMENTS` maps `config.task.name` to the environment's `base.EnvSpec`;
every other name is a reasoning-gym dataset (`REASONING_GYM`). Each spec's
options are the section `config.task.<name>` (reasoning-gym's:
`config.task.reasoning_gym`), which `task_config` builds from the specs and
`check_task` hands to the environment's own check. A new environment is its
module, with a `SPEC`, and one line here.
"""

from __future__ import annotations

from collections.abc import Mapping

import ml_collections

from sao_jax.envs import answers
from sao_jax.envs import arithmetic
from sao_jax.envs import base
from sao_jax.envs import calculator
from sao_jax.envs import humaneval_env
from sao_jax.envs import jsonl_dataset
from sao_jax.envs import nonstationary
from sao_jax.envs import reasoning_gym_env
from sao_jax.envs import word_target

ENVIRONMENTS: dict[str, base.EnvSpec] = {
    'arith_chain_sum': arithmetic.CHAIN_SUM_SPEC,
    'arith_countdown': arithmetic.COUNTDOWN_SPEC,
    'calculator': calculator.SPEC,
    'humaneval': humaneval_env.SPEC,
    'jsonl': jsonl_dataset.SPEC,
    'word_target': word_target.SPEC,
}
REASONING_GYM = 'reasoning_gym'  # the options section of the other names

# The options of every task, beside each environment's section.
_TASK_OPTIONS = {
    'name': base.Option('chain_sum', 'the task: a name of ENVIRONMENTS'
                        ' (sao_jax/envs/registry.py) or a reasoning-gym'
                        ' dataset'),
    'seed': base.Option(
        0, 'which problems the task generates, and their order'),
    'answer_format': base.Option(
        'plain', 'plain | tagged | none (the prompt\'s answer instruction)'),
    'held_out': base.Option(
        200, 'eval problems (their questions excluded from training)'),
}


def reasoning_gym_names() -> tuple[str, ...]:
  from reasoning_gym import factory  # pylint: disable=g-import-not-at-top
  return tuple(sorted(factory.DATASETS))


def options_key(name: str) -> str:
  """The section of `config.task` that holds the options of task `name`."""
  return name if name in ENVIRONMENTS else REASONING_GYM


def spec(name: str) -> base.EnvSpec:
  """The `EnvSpec` of task `name` (reasoning-gym's for a name not ours)."""
  return ENVIRONMENTS.get(name, reasoning_gym_env.SPEC)


def check_name(name: str) -> str | None:
  """None if `name` is a known task, else a one-line problem naming it."""
  if name in ENVIRONMENTS:
    return None
  known = reasoning_gym_names()
  if name in known:
    return None
  return (f'config.task.name={name!r} is neither one of'
          f' {tuple(ENVIRONMENTS)} nor a reasoning-gym dataset (e.g.'
          ' chain_sum, countdown, basic_arithmetic, gsm_symbolic)')


def task_config(**values) -> ml_collections.ConfigDict:
  """`config.task`: every environment's options at their defaults.

  Args:
    **values: the task-wide options to set (name, seed, answer_format,
      held_out); the others keep their defaults.
  """
  unknown = set(values) - set(_TASK_OPTIONS)
  if unknown:
    raise ValueError(f'unknown task options {sorted(unknown)}; known:'
                     f' {sorted(_TASK_OPTIONS)}')
  task = ml_collections.ConfigDict(
      {key: values.get(key, option.default)
       for key, option in _TASK_OPTIONS.items()})
  for name, env_spec in _sections().items():
    task[name] = base.option_defaults(env_spec.options)
  task.nonstationary = base.option_defaults(nonstationary.OPTIONS)
  return task


def meanings() -> dict[str, str]:
  """`{task.<option>: help}` of every option `task_config` builds."""
  found = base.option_meanings(_TASK_OPTIONS, 'task.')
  for name, env_spec in _sections().items():
    found.update(base.option_meanings(env_spec.options, f'task.{name}.'))
  found.update(base.option_meanings(nonstationary.OPTIONS,
                                    'task.nonstationary.'))
  return found


def _sections() -> Mapping[str, base.EnvSpec]:
  return dict(ENVIRONMENTS, **{REASONING_GYM: reasoning_gym_env.SPEC})


def check_task(check) -> None:
  """`config.task`: the task-wide options and the named task's own section.

  Args:
    check: a `config_lib.Checker` of the whole config.
  """
  name = check.get('task.name')
  if name is not None:
    problem = check_name(name)
    if problem:
      check.problem(problem)
      name = None
  check.non_negative_int('task.held_out')
  check.choice('task.answer_format', answers.ANSWER_FORMATS)
  nonstationary.check_options(check.scope('task.nonstationary'))
  if name is None:
    return
  key = options_key(name)
  if check.get(f'task.{key}') is None:
    return
  env_spec = spec(name)
  if env_spec.check is not None:
    env_spec.check(check.scope(f'task.{key}'))


def max_turns(task) -> int:
  """The most model turns of an episode of `task` (the config's section)."""
  return spec(task.name).max_turns(task[options_key(task.name)])


def check_inputs(task) -> list[str]:
  """Problems with the files the task of `task` reads (none: [])."""
  env_spec = spec(task.name)
  if env_spec.check_inputs is None:
    return []
  key = options_key(task.name)
  return env_spec.check_inputs(task[key], f'task.{key}')


def make(task) -> base.Environment:
  """The environment of `config.task` (a ConfigDict), wrapped as configured.

  Raises:
    ValueError: for an unknown task name, naming `config.task.name`.
  """
  problem = check_name(task.name)
  if problem:
    raise ValueError(problem)
  env = spec(task.name).build(task, task[options_key(task.name)])
  if task.nonstationary.enabled:
    env = nonstationary.NonStationaryEnvironment(
        env, formats=tuple(task.nonstationary.formats),
        switch_steps=tuple(task.nonstationary.switch_steps))
  return env
