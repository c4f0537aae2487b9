"""config.task builds the environment it names."""

import os

import pytest

from sao_jax import config_lib
from sao_jax.envs import nonstationary
from sao_jax.envs import registry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def task_config(**changes):
  config = config_lib.load_config(os.path.join(ROOT, 'configs', 'default.py'))
  for key, value in changes.items():
    node = config.task
    *parents, leaf = key.split('.')
    for part in parents:
      node = node[part]
    node[leaf] = value
  return config.task


@pytest.mark.parametrize('name, max_turns', [
    ('chain_sum', 1), ('arith_chain_sum', 1), ('arith_countdown', 1),
    ('calculator', 4), ('humaneval', 1), ('basic_arithmetic', 1)])
def test_named_environments_build_and_pose_tasks(name, max_turns):
  env = registry.make(task_config(name=name))
  assert env.max_turns == max_turns
  task = env.task('train', 3)
  assert task.question and task.id
  assert env.task('train', 3) == task  # deterministic
  messages = env.prompt_messages(task)
  assert messages[-1]['role'] == 'user'


def test_demo_task_is_one_digit_two_term_chain_sum():
  env = registry.make(task_config())
  questions = {env.task('train', i).question for i in range(2000)}
  assert len(questions) == 200  # 10 x 10 operands x {+, -}
  assert all(q.count(' + ') + q.count(' - ') == 1 for q in questions)


def test_nonstationary_wraps_the_base_task():
  env = registry.make(task_config(**{'nonstationary.enabled': True}))
  assert isinstance(env, nonstationary.NonStationaryEnvironment)
  env.on_policy_step(150)
  assert env.phase == 1


def test_unknown_task_names_the_key():
  with pytest.raises(ValueError, match=r"config.task.name='nope' is neither"):
    registry.make(task_config(name='nope'))
  with pytest.raises(ValueError, match=r'config.task.jsonl.path must name'):
    registry.make(task_config(name='jsonl'))
