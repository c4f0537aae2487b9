"""Config files, overrides and validation: every bad setting is one clear line."""

import glob
import os
import subprocess
import sys

import numpy as np
import pytest

from sao_jax import config_lib
from sao_jax import recipe_checks
from sao_jax import sharding
from sao_jax.rl import algorithms
from sao_jax.rollout import batching

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, 'configs', 'default.py')
CONFIG_FILES = sorted(glob.glob(os.path.join(ROOT, 'configs', '*.py')))


def default(arg=None):
  return config_lib.load_config(DEFAULT + (f':{arg}' if arg else ''))


@pytest.mark.parametrize('path', CONFIG_FILES, ids=os.path.basename)
def test_config_files_document_their_command_and_validate(path):
  module = config_lib.load_module(path)
  assert 'python -m sao_jax.' in (module.__doc__ or ''), (
      f'{path}: the module docstring must give the command that runs it')
  assert module.get_config.__doc__
  config = module.get_config()
  sizes = [config.mesh.get(axis, 1) for axis in sharding.MESH_AXES]
  # A pod preset fixes its mesh (checked on its own device count); the rest
  # fill whatever there is (checked on the 8 test devices).
  devices = int(np.prod(sizes)) if min(sizes) > 0 else 8
  mesh = recipe_checks.validate(config, num_devices=devices)
  assert int(np.prod(list(mesh.values()))) == devices


@pytest.mark.parametrize('algorithm', list(algorithms.ALGORITHMS))
def test_every_algorithm_preset_is_valid(algorithm):
  config = default(f'algorithm={algorithm}')
  recipe_checks.validate(config, num_devices=1)
  want = algorithms.ALGORITHMS[algorithm]
  assert config.policy_loss.name == want.loss
  assert config.advantage.estimator == want.estimator


def test_presets_follow_the_paper():
  sao = default()
  assert (sao.policy_loss.eps_low, sao.policy_loss.eps_high) == (0.3, 5.0)
  assert sao.critic.steps_per_policy_step == 2 and sao.critic.frozen_attention
  assert sao.optim.critic.learning_rate == pytest.approx(
      5 * sao.optim.actor.learning_rate)
  assert sao.group_size == 1
  grpo = default('algorithm=grpo')
  assert grpo.group_size == 8
  assert (grpo.policy_loss.eps_low, grpo.policy_loss.eps_high) == (0.2, 0.28)


@pytest.mark.parametrize('key, value, message', [
    ('policy_loss.eps_low', 1.5, r'config.policy_loss.eps_low=1.5 must be in \(0.0, 1.0\)'),
    ('policy_loss.eps_low', 0.0, r'config.policy_loss.eps_low=0.0 must be in'),
    ('policy_loss.eps_high', -1.0, r'config.policy_loss.eps_high=-1.0 must be positive'),
    ('critic.steps_per_policy_step', 0, r'config.critic.steps_per_policy_step=0 must be >= 1'),
    ('advantage.gamma', 1.2, r'config.advantage.gamma=1.2 must be in \[0.0, 1.0\]'),
    ('policy_loss.dual_clip', 0.5, r'config.policy_loss.dual_clip=0.5 must be > 1'),
    ('policy_loss.aggregation', 'sum', r"config.policy_loss.aggregation='sum' is not one of"),
    ('model.dtype', 'float16', r"config.model.dtype='float16' is not one of"),
    ('optim.actor.learning_rate', 0.0, r'config.optim.actor.learning_rate=0.0 must be positive'),
    ('rollout.sync_every', 0, r'config.rollout.sync_every=0 must be >= 1'),
    ('batch_size', 30, r'config.batch_size=30 is not divisible by the data-parallel size 8'),
    ('rollout.max_prefill_length', 100, r"max_prefill_length=100 must be one of JetStream's padding buckets"),
    ('rollout.sync_every', 4, r'max_staleness=2 must be >= config.rollout.sync_every - 1 = 3'),
    ('rollout.top_p', 0.0, r'config.rollout.top_p=0.0 must be in \(0, 1\]'),
    ('rollout.max_sequence_length', 4096, r'max_sequence_length=4096 must be <= config.rollout.max_target_length=160'),
    ('kernels.implementation', 'cuda', r"config.kernels.implementation='cuda' is not one of"),
    ('model.attention', 'flash', r"config.model.attention='flash' is not one of auto, dense, blockwise, splash"),
    ('rollout.prefix_cache_gib', -1.0, r'config.rollout.prefix_cache_gib=-1.0 must be >= 0'),
    ('rollout.param_dtype', 'float16', r"config.rollout.param_dtype='float16' is not one of , float32, bfloat16"),
    ('rollout.dtype', 'float16', r"config.rollout.dtype='float16' is not one of , float32, bfloat16"),
    ('eval.temperature', -0.5, r'config.eval.temperature=-0.5 must be >= 0'),
    ('rollout.temperature', 0.0, r'config.rollout.temperature=0.0 must be > 0: a greedy rollout has no sampling distribution mu'),
    ('critic.minibatches', 3, r'config.batch_size=16 must split into config.critic.minibatches=3 mini-batches'),
    ('critic.minibatches', -1, r'config.critic.minibatches=-1 must be >= 0'),
    ('rollout.weight_delta', 'xor', r"config.rollout.weight_delta='xor' is not one of off, sparse"),
    ('rollout.weight_delta_rtol', -0.1, r'config.rollout.weight_delta_rtol=-0.1 must be >= 0'),
])
def test_validate_names_the_bad_key(key, value, message):
  config = default()
  section, _, field = key.rpartition('.')
  node = config
  for part in filter(None, section.split('.')):
    node = node[part]
  node[field] = value
  with pytest.raises(config_lib.ConfigError, match=message) as info:
    recipe_checks.validate(config, num_devices=8)
  assert '\n' not in str(info.value)


def test_deltas_need_the_streamed_transport():
  config = default()
  config.rollout.weight_delta = 'sparse'
  recipe_checks.validate(config, num_devices=8)
  config.rollout.weight_transport = 'files'
  with pytest.raises(config_lib.ConfigError,
                     match='weight_delta=.sparse. needs config.rollout'
                     '.weight_transport=stream'):
    recipe_checks.validate(config, num_devices=8)


def test_queue_capacity_is_checked_against_each_hosts_share():
  """The queue holds one host's share of a batch (B / hosts rows)."""
  config = default()  # batch_size 16
  config.rollout.queue_capacity = 8
  with pytest.raises(config_lib.ConfigError,
                     match=r'queue_capacity=8 must be 0 or >= config.batch_size'
                     r' / hosts = 16'):
    recipe_checks.validate(config, num_devices=8)
  config.distributed.enabled = True
  config.distributed.coordinator_address = 'localhost:1234'
  config.distributed.num_processes = 2
  config.distributed.process_id = 0
  recipe_checks.validate(config, num_devices=8)  # 8 >= 16 / 2
  config.rollout.queue_capacity = 7
  with pytest.raises(config_lib.ConfigError, match=r'>= config.batch_size'
                     r' / hosts = 8'):
    recipe_checks.validate(config, num_devices=8)


@pytest.mark.parametrize('key, value, message', [
    ('delay_median_s', -1.0, r'config.task.word_target.delay_median_s=-1.0 must be >= 0'),
    ('delay_sigma', -0.5, r'config.task.word_target.delay_sigma=-0.5 must be >= 0'),
    ('delay_max_s', -2.0, r'config.task.word_target.delay_max_s=-2.0 must be >= 0'),
    ('switch_steps', (40, 20), r'config.task.word_target.switch_steps=\(40, 20\) must be strictly increasing policy steps >= 0'),
    ('switch_steps', (20, 20), r'switch_steps=\(20, 20\) must be strictly increasing'),
    ('switch_steps', (-5, 20), r'switch_steps=\(-5, 20\) must be strictly increasing'),
    ('turns', 0, r'config.task.word_target.turns=0 must be >= 1'),
    ('observation_words', 0, r'config.task.word_target.observation_words=0 must be >= 1'),
    ('scored_reply', 'last', r"config.task.word_target.scored_reply='last' is not one of all, first"),
])
def test_word_target_options_are_validated(key, value, message):
  config = default()
  config.task.name = 'word_target'
  config.task.word_target[key] = value
  with pytest.raises(config_lib.ConfigError, match=message) as info:
    recipe_checks.validate(config, num_devices=1)
  assert '\n' not in str(info.value)
  config.task.name = 'chain_sum'  # another task ignores the options
  recipe_checks.validate(config, num_devices=1)


@pytest.mark.parametrize('task, options', [
    ('word_target', {'turns': 2, 'switch_steps': (10, 20)}),
    ('calculator', {'max_turns': 2}),
])
def test_a_multi_turn_task_needs_a_request_per_episode(task, options):
  # The rule is the registry's (any EnvSpec's max_turns), not one task's.
  config = default('algorithm=grpo')
  config.task.name = task
  config.task[task].update(options)
  recipe_checks.validate(config, num_devices=1)
  config.rollout.group_in_one_request = True
  with pytest.raises(config_lib.ConfigError,
                     match=rf"config.task.name='{task}' plays up to 2 turns,"
                     ' which need separate requests per episode'):
    recipe_checks.validate(config, num_devices=1)
  config.task[task][next(iter(options))] = 1  # one turn: one request is fine
  recipe_checks.validate(config, num_devices=1)


def test_skip_observations_defaults_to_sao_gae():
  for algorithm in algorithms.ALGORITHMS:
    assert default(f'algorithm={algorithm}').advantage.skip_observations
  config = default()
  config.advantage.skip_observations = False  # naive GAE, the ablation
  recipe_checks.validate(config, num_devices=1)

def test_validate_reports_every_problem_on_one_line():
  config = default()
  config.policy_loss.eps_low = 2.0
  config.critic.steps_per_policy_step = 0
  with pytest.raises(config_lib.ConfigError) as info:
    recipe_checks.validate(config, num_devices=1)
  text = str(info.value)
  assert 'eps_low' in text and 'steps_per_policy_step' in text
  assert '\n' not in text


def test_cudnn_attention_needs_unpacked_rows():
  config = default()
  config.model.attention = 'cudnn'
  config.task.name = 'word_target'
  config.task.word_target.turns = 3  # 'auto' packs multi-turn episodes
  with pytest.raises(config_lib.ConfigError,
                     match="attention='cudnn' attends each row as one"):
    recipe_checks.validate(config, num_devices=1)
  config.batching.pack_sequences = 'off'
  recipe_checks.validate(config, num_devices=1)


def test_a_sequence_axis_must_split_the_rows_evenly():
  config = default()
  config.mesh.data, config.mesh.sequence = 2, 4
  config.rollout.max_sequence_length = 150
  with pytest.raises(config_lib.ConfigError,
                     match=r'max_sequence_length=150 must be a multiple of'
                     r' config.mesh.sequence=4'):
    recipe_checks.validate(config, num_devices=8)
  config.rollout.max_sequence_length = 152
  assert recipe_checks.validate(config, num_devices=8)['sequence'] == 4


def test_mesh_must_fit_the_devices():
  config = default()
  config.mesh.tensor = 3
  with pytest.raises(config_lib.ConfigError, match='multiple of 3 devices'):
    recipe_checks.validate(config, num_devices=8)
  config.mesh.data, config.mesh.tensor = 4, 4
  with pytest.raises(config_lib.ConfigError, match='needs 16 devices, but there are 8'):
    recipe_checks.validate(config, num_devices=8)
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, -1, 2
  assert recipe_checks.validate(config, num_devices=8) == dict(
      data=2, fsdp=2, expert=1, sequence=1, tensor=2)


def test_grpo_needs_groups_and_algorithm_must_match_its_parts():
  config = default('algorithm=grpo')
  config.group_size = 1
  with pytest.raises(config_lib.ConfigError, match='needs groups of at least 2'):
    recipe_checks.validate(config, num_devices=1)
  config = default()
  config.algorithm = 'grpo'
  with pytest.raises(config_lib.ConfigError, match=r'algorithm=grpo\) so that'):
    recipe_checks.validate(config, num_devices=1)


def test_parse_arg_types_and_unknown_keys():
  arg = config_lib.parse_arg('seed=3,flag=false,name=x, rate=0.5', seed=0,
                             flag=True, name='a', rate=1.0)
  assert (arg.seed, arg.flag, arg.name, arg.rate) == (3, False, 'x', 0.5)
  with pytest.raises(config_lib.ConfigError, match="did you mean 'seed'"):
    config_lib.parse_arg('sed=1', seed=0)
  with pytest.raises(config_lib.ConfigError, match='expected a int'):
    config_lib.parse_arg('seed=x', seed=0)


def run_show_config(*args):
  proc = subprocess.run(
      [sys.executable, '-m', 'sao_jax.tools.show_config', *args], cwd=ROOT,
      capture_output=True, text=True, timeout=120,
      env=dict(os.environ, JAX_PLATFORMS='cpu'))
  lines = [l for l in proc.stderr.splitlines() if l.startswith('error:')]
  return proc, lines


def test_entry_point_applies_overrides():
  # batch 32: GRPO's 4 mini-batches take rows from each of the 8 devices.
  proc, _ = run_show_config('--config=configs/default.py:algorithm=grpo',
                            '--config.policy_loss.eps_low=0.1',
                            '--config.batch_size=32')
  assert proc.returncode == 0, proc.stderr
  assert 'eps_low: 0.1' in proc.stdout and 'name: ppo' in proc.stdout


def test_minibatches_that_do_not_cover_the_devices_are_refused():
  proc, _ = run_show_config('--config=configs/default.py:algorithm=grpo')
  assert proc.returncode == 2
  assert ('config.batch_size=16 must split into config.optim.policy_minibatches'
          ' x config.optim.microbatches = 4 parts of rows from each of the 8'
          ' data-parallel shards' in proc.stderr)


@pytest.mark.parametrize('args, message', [
    (['--config.policy_loss.eps_lo=0.1'],
     "unknown config key --config.policy_loss.eps_lo: config.policy_loss has no"
     " field 'eps_lo' (did you mean 'eps_low'?)"),
    (['--config.policy_loss.eps_low=abc'], "could not convert string to float: 'abc'"),
    (['--config.critic.steps_per_policy_step=0'],
     'config.critic.steps_per_policy_step=0 must be >= 1'),
])
def test_entry_point_errors_are_one_line(args, message):
  proc, lines = run_show_config('--config=configs/default.py', *args)
  assert proc.returncode == 2
  assert len(lines) == 1 and message in lines[0], proc.stderr


# The task keys that moved into their environment's section, and keys
# whose name is close to an existing one in the same section.
@pytest.mark.parametrize('old, new', [
    ('task.num_terms', '--config.task.arith_chain_sum.num_terms or'
     ' --config.task.calculator.num_terms'),
    ('task.digits', '--config.task.arith_chain_sum.digits or'
     ' --config.task.calculator.digits'),
    ('task.dataset_kwargs.max_terms',
     '--config.task.reasoning_gym.dataset_kwargs.max_terms'),
    ('task.partial_credit', '--config.task.reasoning_gym.partial_credit'),
    ('task.humaneval_max_turns', '--config.task.humaneval.max_turns'),
    ('task.humaneval_eval_size', '--config.task.humaneval.eval_size'),
    ('task.sandbox.timeout_s', '--config.task.humaneval.sandbox.timeout_s'),
    ('task.calculator.max_turn', "'max_turns'"),
    ('polcy_loss.eps_low', '--config.policy_loss.eps_low'),
])
def test_an_old_or_misspelt_key_suggests_its_place(old, new):
  assert config_lib.suggest_key(default(), old) == f' (did you mean {new}?)'


def test_an_override_of_a_moved_key_names_the_new_one():
  proc, lines = run_show_config('--config=configs/default.py',
                                '--config.task.humaneval_max_turns=2')
  assert proc.returncode == 2
  assert lines == ['error: unknown config key --config.task.humaneval_max_turns:'
                   " config.task has no field 'humaneval_max_turns' (did you"
                   ' mean --config.task.humaneval.max_turns?)'], proc.stderr


@pytest.mark.parametrize('spec, message', [
    ('configs/nope.py', "config file 'configs/nope.py' does not exist"),
    ('configs/default.py:algo=grpo', "unknown config argument 'algo'"),
    ('configs/default.py:algorithm=reinforce', "unknown algorithm 'reinforce'"),
])
def test_entry_point_bad_config_file_or_argument(spec, message):
  proc, lines = run_show_config(f'--config={spec}')
  assert proc.returncode == 2
  assert lines and message in lines[0], proc.stderr
  assert 'Traceback' not in proc.stderr
