"""A new environment and a new algorithm preset, added the way a user adds them.

An environment is its module (here, this file) with an `EnvSpec` plus one line
in `registry.ENVIRONMENTS`; a preset is an `algorithms.Spec`'s `presets` plus
one line in `ALGORITHMS`. Nothing else is touched: the config gets the
environment's options section and its check, and the training program trains
on it through a real rollout server.
"""

import os

import pytest

from sao_jax import config_lib
from sao_jax import recipe_checks
from sao_jax import trainer
from sao_jax.envs import base
from sao_jax.envs import registry
from sao_jax.logs import metrics_log
from sao_jax.rl import algorithms
from sao_jax.rollout import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Constant(base.Environment):
  """Word prompts for the tiny model; every reply earns `reward`."""

  name = 'constant'

  def __init__(self, reward: float, prompt_words: int):
    self.reward, self.prompt_words = reward, prompt_words

  def task(self, split, index):
    words = ' '.join(f'w{(index + k) % 50}' for k in range(self.prompt_words))
    return base.Task(id=f'constant/{split}/{index}', question=words)

  def prompt_messages(self, task):
    return [{'role': 'user', 'content': task.question}]

  def step(self, task, turn, action_text):
    return base.StepResult(done=True, reward=self.reward,
                           info={'correct': True})


def _check(check):
  check.closed_interval('reward', 0.0, 1.0)
  check.positive_int('prompt_words')


_SPEC = base.EnvSpec(
    build=lambda task, options: _Constant(options.reward,
                                          options.prompt_words),
    check=_check,
    options={'reward': base.Option(0.25, 'what every reply earns'),
             'prompt_words': base.Option(3, 'words of a prompt')})


@pytest.fixture
def registered(monkeypatch):
  """The toy environment and a toy preset, each on its one registry line."""
  monkeypatch.setitem(registry.ENVIRONMENTS, 'constant', _SPEC)
  monkeypatch.setitem(algorithms.ALGORITHMS, 'running_mean_w3', algorithms.Spec(
      'running_mean', 'dis', {'advantage.running_mean_window': 3,
                              'policy_loss.eps_low': 0.25}))


def _tiny(arg=''):
  return config_lib.load_config(os.path.join(ROOT, 'configs', 'tiny.py')
                                + (f':{arg}' if arg else ''))


def test_the_config_gets_the_environment_options_and_check(registered):
  config = _tiny()
  assert config.task.constant.to_dict() == {'reward': 0.25, 'prompt_words': 3}
  config.task.name = 'constant'
  recipe_checks.validate(config, num_devices=1)
  config.task.constant.reward = 2.0
  with pytest.raises(config_lib.ConfigError,
                     match=r'config.task.constant.reward=2.0 must be in'
                     r' \[0.0, 1.0\]'):
    recipe_checks.validate(config, num_devices=1)
  config.task.name = 'word_target'  # another task: not this one's business
  recipe_checks.validate(config, num_devices=1)


def test_a_preset_applies_its_keys_and_validates(registered):
  config = _tiny('algorithm=running_mean_w3')
  assert config.advantage.estimator == 'running_mean'
  assert config.policy_loss.name == 'dis'
  assert config.advantage.running_mean_window == 3
  assert config.policy_loss.eps_low == 0.25
  assert _tiny().advantage.running_mean_window != 3  # sao is untouched
  recipe_checks.validate(config, num_devices=1)
  config.advantage.estimator = 'grpo'  # no longer what the preset names
  with pytest.raises(config_lib.ConfigError,
                     match="algorithm='running_mean_w3' uses advantage"):
    recipe_checks.validate(config, num_devices=1)


def test_a_preset_of_an_unknown_key_names_it(monkeypatch):
  monkeypatch.setitem(algorithms.ALGORITHMS, 'typo', algorithms.Spec(
      'running_mean', 'dis', {'advantage.running_mean_widow': 3}))
  with pytest.raises(config_lib.ConfigError,
                     match=r"preset of unknown config key"
                     r" 'advantage.running_mean_widow' \(did you mean"
                     r" 'running_mean_window'\?\)"):
    _tiny('algorithm=typo')


@pytest.mark.slow
def test_the_new_environment_and_preset_train_a_step(registered, tmp_path):
  config = _tiny('algorithm=running_mean_w3')
  config.task.name = 'constant'
  config.task.constant.reward = 0.375
  config.total_steps = 2
  config.task.held_out = 4
  config.eval.at_start = False
  config.log.progress = False
  config.log.tensorboard = False
  with launch.serve_in_process(config) as run_config:
    trainer.run(run_config, str(tmp_path))
  records = metrics_log.read_jsonl(tmp_path / 'metrics.jsonl', dedupe=True)
  rewards = [r['train/reward'] for r in records if 'train/reward' in r]
  # The environment's own option reached it: every trajectory earned 0.375.
  assert rewards == [pytest.approx(0.375)] * 2
  steps = [r for r in records if 'policy/grad_norm' in r]
  assert [r['step'] for r in steps] == [1, 2]
