"""Configs: `get_config(arg)` shorthands, loading, validation, one-line errors.

Every recipe in `configs/` is a Python file with `get_config(arg=None)` returning
an `ml_collections.ConfigDict`. Entry points take it with absl flags,
big_vision style:

  python -m sao_jax.tools.show_config --config=configs/default.py:algorithm=grpo \
      --config.policy_loss.eps_low=0.2

The config is locked, so an override of a key that does not exist fails, and
`validate` turns inconsistent settings into one error line naming the keys.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import os
import sys
from collections.abc import Callable, Sequence

import jax
import ml_collections
from absl import app
from absl import flags
from ml_collections import config_flags

from sao_jax import checksums
from sao_jax import errors
from sao_jax import kernels
from sao_jax import sharding
from sao_jax.kernels.attention import api as attention_api
from sao_jax.envs import registry
from sao_jax.envs import word_target
from sao_jax.models import model_config
from sao_jax.models import pretrained
from sao_jax.rl import algorithms
from sao_jax.rl import losses

RUNNING_MEAN_SCOPES = ('prompt', 'global')
ADVANTAGE_VALUES = ('pre_update', 'post_update')
DTYPES = ('float32', 'bfloat16')
# Learning-rate schedules after the warm-up (learner.optimizers builds them).
LR_SCHEDULES = ('constant', 'cosine')
PACK_MODES = ('auto', 'on', 'off')
# Where a task's turns are set: `batching.pack_sequences='auto'` packs the
# tasks that can take more than one turn (BENCHMARKS.md, packing).
_TURNS_KEYS = {'calculator': ('calculator', 'max_turns'),
               'word_target': ('word_target', 'turns'),
               'humaneval': ('humaneval_max_turns',)}
# JetStream 0.2.2's prefill padding lengths (its engine contract requires
# max_prefill_length to be one of them); kept here so that validating a config
# does not import JetStream, which pulls in TensorFlow.
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                   32768)


class ConfigError(errors.UserError):
  """An invalid configuration; the message is one line naming the keys."""


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """Parses a `get_config` argument `"k1=v1,k2=v2"` against typed defaults.

  Each value is converted to the type of its default (bool accepts
  true/false/1/0). An unknown key fails with the known ones listed.

  Args:
    arg: the text after the colon in `--config=file.py:arg`, or None.
    **defaults: every accepted key with its default value.

  Returns:
    A ConfigDict of all keys, overridden where `arg` says so.
  """
  values = dict(defaults)
  for item in filter(None, (arg or '').split(',')):
    key, sep, text = item.partition('=')
    key = key.strip()
    if not sep:
      raise ConfigError(f'config argument {item!r} is not key=value')
    if key not in defaults:
      raise ConfigError(f'unknown config argument {key!r}{did_you_mean(key, defaults)};'
                        f' known: {", ".join(sorted(defaults))}')
    values[key] = _convert(key, text.strip(), defaults[key])
  return ml_collections.ConfigDict(values)


def load_config(spec: str) -> ml_collections.ConfigDict:
  """Loads `path.py[:arg]` the way the `--config` flag does (for tests, tools)."""
  path, _, arg = spec.partition(':')
  module = load_module(path)
  return module.get_config(arg or None)


def load_module(path: str):
  """Imports a config file by path (recipes use it to extend a sibling)."""
  if not os.path.isfile(path):
    raise ConfigError(f'config file {path!r} does not exist')
  name = 'sao_jax_config_' + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def sibling(config_file: str, name: str) -> str:
  """Path of config file `name` next to `config_file` (usually `__file__`)."""
  return os.path.join(os.path.dirname(os.path.abspath(config_file)), name)


def write_config_file(config: ml_collections.ConfigDict, path: str) -> None:
  """Writes `config` as a recipe file (`get_config()` returning it as is).

  How a trainer hands the exact config, overrides included, to the rollout
  servers it starts: `--config=<path>`.
  """
  with open(path, 'w') as f:
    f.write('"""Written by sao_jax: the config of a training run."""\n\n'
            'import ml_collections\n\n\n'
            'def get_config(arg=None):\n'
            '  del arg\n'
            f'  return ml_collections.ConfigDict({config.to_dict()!r})\n')


def validate(config: ml_collections.ConfigDict,
             num_devices: int | None = None) -> dict[str, int]:
  """Checks a config for inconsistent settings; raises one `ConfigError`.

  Args:
    config: a full sao_jax config.
    num_devices: devices the mesh must cover; defaults to `jax.device_count()`.

  Returns:
    The resolved mesh axis sizes `{axis: size}`.

  Raises:
    ConfigError: with every problem found, each naming its key, on one line.
  """
  if num_devices is None:
    num_devices = jax.device_count()
  problems = []
  check = _Checker(config, problems)

  # The names are the registries' keys (`sao_jax.rl.algorithms`); the recipe
  # files apply each algorithm's presets (SAO.md §3).
  algorithm = check.choice('algorithm', tuple(algorithms.ALGORITHMS))
  estimator = check.choice('advantage.estimator',
                           tuple(algorithms.ESTIMATORS))
  loss = check.choice('policy_loss.name', tuple(algorithms.POLICY_LOSSES))
  if algorithm in algorithms.ALGORITHMS and estimator and loss:
    want = algorithms.ALGORITHMS[algorithm]
    family = algorithms.ESTIMATORS[estimator].variant_of or estimator
    if (family, loss) != (want.estimator, want.loss):
      problems.append(
          f'config.algorithm={algorithm!r} uses advantage.estimator'
          f' {want.estimator!r} and policy_loss.name {want.loss!r}, but'
          f' the config has {estimator!r} and {loss!r}; choose algorithms with'
          f' the recipe argument (--config=configs/<recipe>.py:algorithm='
          f'{algorithm}) so that their presets apply')

  check.open_interval('policy_loss.eps_low', 0.0, 1.0)
  check.positive('policy_loss.eps_high')
  dual_clip = check.get('policy_loss.dual_clip')
  if dual_clip is not None and dual_clip != 0 and dual_clip <= 1:
    problems.append(f'config.policy_loss.dual_clip={dual_clip} must be > 1'
                    ' (or 0 to disable it)')
  check.choice('policy_loss.aggregation', losses.AGGREGATIONS)
  check.choice('policy_loss.old_logprobs', tuple(algorithms.OLD_POLICIES))
  check.positive('policy_loss.behavior_weight_cap')
  check.non_negative('policy_loss.behavior_kl_coef')
  check.non_negative('policy_loss.ref_kl_coef')
  check.choice('policy_loss.ref_kl_estimator', losses.KL_ESTIMATORS)
  check.non_negative('policy_loss.entropy_coef')

  check.closed_interval('advantage.gamma', 0.0, 1.0)
  check.closed_interval('advantage.lam', 0.0, 1.0)
  check.positive('advantage.alpha')
  check.choice('advantage.values_from', ADVANTAGE_VALUES)
  check.positive_int('advantage.running_mean_window')
  check.positive_int('advantage.running_mean_global_window')
  check.positive_int('advantage.running_mean_slots')
  check.choice('advantage.running_mean_scope', RUNNING_MEAN_SCOPES)

  check.positive_int('critic.steps_per_policy_step')
  critic_minibatches_ = check.non_negative_int('critic.minibatches')
  if not (estimator and algorithms.ESTIMATORS[estimator].uses_critic):
    critic_minibatches_ = None  # no critic: its split does not matter
  check.closed_interval('critic.lam', 0.0, 1.0)
  check.non_negative('critic.value_clip')
  check.non_negative_int('critic.pretrain_steps')

  for role in ('actor', 'critic'):
    check.positive(f'optim.{role}.learning_rate')
    check.non_negative_int(f'optim.{role}.warmup_steps')
    check.positive(f'optim.{role}.grad_clip_norm')
    check.choice(f'optim.{role}.mu_dtype', DTYPES)
    check.choice(f'optim.{role}.schedule', LR_SCHEDULES)
    check.closed_interval(f'optim.{role}.min_lr_ratio', 0.0, 1.0)

  task_name = check.get('task.name')
  if task_name is not None:
    problem = registry.check_name(task_name)
    if problem:
      problems.append(problem)
  if task_name == 'word_target':
    _check_word_target(check, problems)
  check.non_negative_int('task.held_out')
  check.positive_int('total_steps')
  check.non_negative_int('eval.every')
  check.positive_int('eval.max_new_tokens')
  check.positive_int('eval.batch_size')
  check.non_negative('eval.temperature')
  check.positive_int('checkpoint.every')
  check.positive_int('checkpoint.max_to_keep')
  check.positive_int('checkpoint.write_concurrent_gb')
  check.choice('kernels.implementation', kernels.IMPLEMENTATIONS)
  check.choice('model.dtype', DTYPES)
  check.choice('model.param_dtype', DTYPES)
  check.choice('model.logits_dtype', ('',) + DTYPES)
  check.choice('model.attention', model_config.ATTENTIONS)
  check.choice('rollout.param_dtype', ('',) + DTYPES)
  check.choice('rollout.dtype', ('',) + DTYPES)
  check.choice('model.layer_loop', model_config.LAYER_LOOPS)
  check.non_negative_int('model.logits_chunk_size')
  check.choice('model.moe_routing', tuple(model_config.MOE_ROUTINGS))
  check.non_negative('model.router_aux_loss_coef')

  batch = check.positive_int('batch_size')
  check.positive_int('optim.policy_epochs')
  minibatches = check.positive_int('optim.policy_minibatches')
  microbatches = check.positive_int('optim.microbatches')
  group = check.positive_int('group_size')
  if batch and group and batch % group:
    problems.append(f'config.batch_size={batch} is not divisible by'
                    f' config.group_size={group}')
  min_group = (algorithms.ESTIMATORS[estimator].min_group_size if estimator
               else 1)
  if group is not None and group < min_group:
    problems.append(f'config.group_size={group}: advantage estimator'
                    f' {estimator!r} needs groups of at least {min_group}'
                    ' samples')

  staleness = check.non_negative_int('rollout.max_staleness')
  sync_every = check.positive_int('rollout.sync_every')
  if staleness is not None and sync_every and staleness < sync_every - 1:
    problems.append(
        f'config.rollout.max_staleness={staleness} must be >='
        f' config.rollout.sync_every - 1 = {sync_every - 1}: with weights'
        ' pushed every sync_every steps, a smaller bound admits no rollout'
        ' and the learner waits forever')
  # The queue is per host and holds that host's share of a batch; with the
  # process count unknown until jax.distributed starts (-1), the queue
  # itself checks its capacity against the share (RolloutQueue).
  capacity = check.non_negative_int('rollout.queue_capacity')
  hosts = (config.distributed.num_processes if config.distributed.enabled
           else 1)
  if capacity and batch and hosts > 0 and capacity < batch // hosts:
    problems.append(f'config.rollout.queue_capacity={capacity} must be 0 or'
                    f' >= config.batch_size / hosts = {batch // hosts}'
                    ' (each host queues its own share of a batch)')
  check.positive('rollout.logprob_tolerance')
  check.open_interval('rollout.max_abs_reward', 0, float('inf'))
  check.positive_int('rollout.num_workers')
  check.positive_int('rollout.max_concurrent_decodes')
  check.non_negative('rollout.prefix_cache_gib')
  # A bucket is the unit checksummed and checked on arrival.
  check.closed_interval('rollout.weight_bucket_mib', 1 / 1024, 512)
  check.choice('rollout.weight_checksum', tuple(checksums.CHECKSUMS))
  delta = check.choice('rollout.weight_delta', ('off', 'sparse'))
  check.non_negative('rollout.weight_delta_rtol')
  check.non_negative_int('rollout.weight_delta_anchor_every')
  if delta not in (None, 'off') and check.get(
      'rollout.weight_transport') != 'stream':
    problems.append(f'config.rollout.weight_delta={delta!r} needs'
                    ' config.rollout.weight_transport=stream (a checkpoint'
                    ' is always whole)')
  port = check.get('rollout.weight_data_port')
  if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                           or not 0 <= port < 65536):
    problems.append(f'config.rollout.weight_data_port={port!r} must be a port'
                    ' number, 0..65535 (0: a free one)')
  check.positive_int('rollout.max_in_flight_per_server')
  check.positive_int('rollout.max_new_tokens')
  check.non_negative_int('rollout.max_retries')
  check.positive('rollout.request_deadline_s')
  for key in ('health_interval_s', 'health_timeout_s', 'push_timeout_s',
              'no_server_grace_s', 'max_restart_backoff_s',
              'weight_bucket_timeout_s'):
    check.positive(f'rollout.{key}')
  temperature = check.get('rollout.temperature')
  if temperature is not None and not (isinstance(temperature, (int, float))
                                      and temperature > 0):
    problems.append(
        f'config.rollout.temperature={temperature} must be > 0: a greedy'
        ' rollout has no sampling distribution mu for the importance ratio'
        ' (greedy decoding is for evaluation: config.eval.temperature=0)')
  check.non_negative_int('rollout.top_k')
  top_p = check.get('rollout.top_p')
  if top_p is not None and not 0 < top_p <= 1:
    problems.append(f'config.rollout.top_p={top_p} must be in (0, 1]')
  prefill = check.get('rollout.max_prefill_length')
  target = check.get('rollout.max_target_length')
  sequence = check.positive_int('rollout.max_sequence_length')
  if prefill is not None and prefill not in PREFILL_BUCKETS:
    problems.append(f'config.rollout.max_prefill_length={prefill} must be one'
                    f" of JetStream's padding buckets {PREFILL_BUCKETS}")
  if prefill and target and target <= prefill:
    problems.append(f'config.rollout.max_target_length={target} must exceed'
                    f' config.rollout.max_prefill_length={prefill}')
  if sequence and target and sequence > target:
    problems.append(f'config.rollout.max_sequence_length={sequence} must be'
                    f' <= config.rollout.max_target_length={target} (the'
                    ' server cache holds the whole sequence)')
  if check.get('rollout.group_in_one_request') and group and group < 2:
    problems.append('config.rollout.group_in_one_request needs'
                    ' config.group_size >= 2')

  if batch and minibatches and microbatches and (
      batch % (minibatches * microbatches)):
    problems.append(
        f'config.batch_size={batch} must split into'
        f' config.optim.policy_minibatches={minibatches} mini-batches of'
        f' config.optim.microbatches={microbatches} equal micro-batches')
  if (batch and critic_minibatches_ and microbatches
      and batch % (critic_minibatches_ * microbatches)):
    problems.append(
        f'config.batch_size={batch} must split into'
        f' config.critic.minibatches={critic_minibatches_} mini-batches of'
        f' config.optim.microbatches={microbatches} equal micro-batches')
  minibatch_keys = 'config.optim.policy_minibatches'
  if minibatches and critic_minibatches_ not in (None, 0, minibatches):
    # Every split below must hold for the actor's and the critic's.
    minibatches = math.lcm(minibatches, critic_minibatches_)
    minibatch_keys = ('lcm(config.optim.policy_minibatches,'
                      ' config.critic.minibatches)')
  mesh = {}
  try:
    mesh = sharding.mesh_shape(dict(config.mesh), num_devices)
  except (ValueError, AttributeError, TypeError) as e:
    problems.append(str(e))
  if mesh and batch:
    shards = sharding.batch_parallelism(mesh)
    if batch % shards:
      problems.append(
          f'config.batch_size={batch} is not divisible by the data-parallel'
          f' size {shards} (config.mesh data x fsdp = {mesh["data"]} x'
          f' {mesh["fsdp"]})')
    elif minibatches and microbatches and batch % (
        shards * minibatches * microbatches):
      # Every mini- and micro-batch takes rows from every batch shard.
      parts = minibatches * microbatches
      problems.append(
          f'config.batch_size={batch} must split into'
          f' {minibatch_keys} x config.optim.microbatches = {parts} parts of'
          f' rows from each of the {shards} data-parallel shards (batch_size'
          f' a multiple of {shards * parts})')

  sequence = mesh.get(sharding.SEQUENCE_AXIS, 1) if mesh else 1
  length = check.get('rollout.max_sequence_length')
  if sequence > 1 and isinstance(length, int) and length % sequence:
    problems.append(
        f'config.rollout.max_sequence_length={length} must be a multiple of'
        f' config.mesh.sequence={sequence} (each row\'s tokens split evenly)')
  attention = check.get('model.attention')
  if attention in attention_api.ONE_SEGMENT_ONLY and packs(config):
    problems.append(
        f"config.model.attention={attention!r} attends each row as one"
        " trajectory, but this config packs several per row: set"
        " config.batching.pack_sequences='off' or another attention")
  # Packed rows split as the batch's trajectories do (the lcm above).
  _check_packing(config, check, problems, mesh,
                 row_parts=(minibatches or 1) * (microbatches or 1))
  if problems:
    raise ConfigError('invalid config: ' + '; '.join(problems))
  return mesh


def packs(config: ml_collections.ConfigDict) -> bool:
  """Whether batches are packed (`batching.pack_sequences`, 'auto' resolved:
  on for a task that can take more than one turn, on one process)."""
  mode = config.batching.pack_sequences
  if mode != 'auto':
    return mode == 'on'
  if config.distributed.enabled:
    return False
  keys = _TURNS_KEYS.get(config.task.name)
  if keys is None:
    return False
  node = config.task
  for key in keys:
    node = node[key]
  return node > 1


def packed_rows(config: ml_collections.ConfigDict,
                mesh: dict[str, int] | None = None) -> int:
  """R, the rows of a packed batch; 0 when the config does not pack.

  `batching.packed_rows`, or (0) `default_packed_rows` for the mini- x
  micro-batches on every data-parallel shard of `mesh` (axis sizes;
  default: `config.mesh` over `jax.device_count()`).
  """
  if not packs(config):
    return 0
  if config.batching.packed_rows:
    return config.batching.packed_rows
  if mesh is None:
    mesh = sharding.mesh_shape(dict(config.mesh), jax.device_count())
  parts = (sharding.batch_parallelism(mesh) * _row_minibatches(config)
           * config.optim.microbatches)
  return default_packed_rows(config.batch_size, parts)


def critic_minibatches(config: ml_collections.ConfigDict) -> int:
  """M_c, the critic's mini-batches per pass: `critic.minibatches`, or (0)
  the actor's `optim.policy_minibatches`."""
  return (config.critic.get('minibatches', 1)
          or config.optim.policy_minibatches)


def _row_minibatches(config) -> int:
  """The mini-batch count every batch's rows must split into: the actor's
  and (with a critic) the critic's."""
  actor = config.optim.policy_minibatches
  if not algorithms.ESTIMATORS[config.advantage.estimator].uses_critic:
    return actor
  return math.lcm(actor, critic_minibatches(config))


def default_packed_rows(batch_size: int, parts: int = 1) -> int:
  """3/8 of the trajectories, rounded up to a multiple of `parts` (<= N).

  Measured (BENCHMARKS.md, packing): calculator-like batches of 16 needed at
  most 6 rows of first-fit decreasing in 2000 samples (mean fill 26% of T);
  6 rows gave 2.94x the one-per-row learner step, 8 rows 2.20x. A batch
  that overflows costs no more than one per row (it takes N rows).
  """
  rows = -(-3 * batch_size // 8)
  return min(batch_size, -(-rows // parts) * parts)


def _check_packing(config, check: _Checker, problems: list[str],
                   mesh: dict[str, int], row_parts: int) -> None:
  """`config.batching`: the mode, and rows that split like batch_size.

  `row_parts`: the mini- x micro-batches each data-parallel shard's rows
  split into (mini-batches: the lcm of the actor's and the critic's).
  """
  mode = check.choice('batching.pack_sequences', PACK_MODES)
  rows = check.non_negative_int('batching.packed_rows')
  batch = check.get('batch_size')
  if mode is None or rows is None or not isinstance(batch, int):
    return
  try:
    on = packs(config)
  except (KeyError, AttributeError, TypeError):
    return  # the task's own keys are reported above
  if not on:
    return
  if check.get('distributed.enabled'):
    # Each process packs its own trajectories; one that overflows its rows
    # would give its shard another shape than the others'.
    problems.append("config.batching.pack_sequences='on' packs batches on one"
                    ' process only; set it to off (or auto) with'
                    ' config.distributed.enabled')
  if rows > batch:
    problems.append(f'config.batching.packed_rows={rows} must be <='
                    f' config.batch_size={batch} (the trajectories of a'
                    ' batch)')
  if rows and mesh:
    parts = sharding.batch_parallelism(mesh) * row_parts
    if rows % parts:
      problems.append(
          f'config.batching.packed_rows={rows} must split into'
          ' config.optim.policy_minibatches (and config.critic.minibatches)'
          ' x config.optim.microbatches'
          f' parts of rows from each data-parallel shard (a multiple of'
          f' {parts})')


def _check_word_target(check: _Checker, problems: list[str]) -> None:
  """The word_target task's options (`config.task.word_target`)."""
  turns = check.positive_int('task.word_target.turns')
  check.positive_int('task.word_target.observation_words')
  check.non_negative('task.word_target.delay_median_s')
  check.non_negative('task.word_target.delay_sigma')
  check.non_negative('task.word_target.delay_max_s')
  check.choice('task.word_target.scored_reply', word_target.SCORED_REPLIES)
  steps = check.get('task.word_target.switch_steps')
  if steps is not None:
    steps = tuple(steps) if isinstance(steps, (tuple, list)) else (steps,)
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0
           for s in steps) or list(steps) != sorted(set(steps)):
      problems.append(f'config.task.word_target.switch_steps={steps} must be'
                      ' strictly increasing policy steps >= 0')
  if turns and turns > 1 and check.get('rollout.group_in_one_request'):
    # One request with G samples plays its episodes' first turn only.
    problems.append(f'config.task.word_target.turns={turns} needs separate'
                    ' requests per episode: set'
                    ' config.rollout.group_in_one_request=False')


def check_inputs(config: ml_collections.ConfigDict, *,
                 task: bool = True) -> None:
  """Checks that the files a run reads exist, before its slow start-up.

  `validate` checks settings only, so that a recipe for a TPU pod validates on
  a laptop; training and serving call this too, on the machine that reads the
  files: the model source and (with `task`) a JSONL task's files.

  Raises:
    ConfigError: with every problem found, each naming its key, on one line.
  """
  problems = []
  source = config.model.source
  if source.startswith('arch:'):
    problems.append(f'config.model.source={source!r} is an architecture'
                    ' without weights (for compiles only): set it to a'
                    ' Hugging Face checkpoint directory')
  elif source not in pretrained.NAMED_MODELS:
    if not os.path.isdir(source):
      problems.append(f'config.model.source={source!r}: no such directory'
                      ' (expected a Hugging Face checkpoint directory or one'
                      f' of {", ".join(pretrained.NAMED_MODELS)})')
    elif not os.path.isfile(os.path.join(source, 'config.json')):
      problems.append(f'config.model.source={source!r} has no config.json'
                      ' (not a Hugging Face checkpoint directory)')
  if task and config.task.name == 'jsonl':
    jsonl = config.task.jsonl
    if not jsonl.path:
      problems.append("config.task.jsonl.path must name a JSONL file when"
                      " config.task.name='jsonl'")
    for key in ('path', 'eval_path'):
      if jsonl[key] and not os.path.isfile(jsonl[key]):
        problems.append(f'config.task.jsonl.{key}={jsonl[key]!r}: no such'
                        ' file')
  if problems:
    raise ConfigError('; '.join(problems))


def define_config_flag(name: str = 'config',
                       default: str | None = None) -> flags.FlagHolder:
  """`--config=file.py[:arg]` with locked `--config.a.b=value` overrides."""
  return config_flags.DEFINE_config_file(
      name, default, help_string='recipe file, e.g. configs/default.py[:arg]',
      lock_config=True)


def run(main: Callable[[Sequence[str]], None]) -> None:
  """`absl.app.run` whose user errors are one line on stderr and exit 2.

  Covers a missing or broken config file, an override of an unknown key, a
  value of the wrong type, and, raised from `main`: a `UserError` (such as
  `ConfigError` from `validate`), an `OSError` (a missing file, a workdir that
  is a file) and a `TimeoutError` (see `errors`). `--verbose` shows their
  tracebacks instead; any other exception is a bug and always keeps its
  traceback.
  """
  if 'verbose' not in flags.FLAGS:
    flags.DEFINE_boolean('verbose', False,
                         'show the traceback of an error instead of one line')

  def parse(argv):
    spec = _config_spec(argv)
    if spec is not None and not os.path.isfile(spec.partition(':')[0]):
      _fail(f'config file {spec.partition(":")[0]!r} does not exist')
    try:
      remaining = flags.FLAGS(argv)
      flags.FLAGS['config'].value.keys()  # A failed file load raises here.
      return remaining
    except flags.Error as e:
      _fail(_config_file_error(e) or str(e))
    except (AttributeError, KeyError) as e:
      _fail(_unknown_override(argv) or f'bad config override: {e}')
    except (OSError, ConfigError) as e:
      _fail(f'could not load the config: {_root_cause(e)}')

  def guarded(argv):
    try:
      main(argv)
    except (errors.UserError, OSError, TimeoutError) as e:
      if flags.FLAGS.verbose:
        raise
      _fail(user_message(e))

  app.run(guarded, flags_parser=parse)


def user_message(e: BaseException) -> str:
  """The text after `error:` for an exception `run` reports without trace."""
  if isinstance(e, OSError) and e.filename is not None:
    where = f'{e.filename} -> {e.filename2}' if e.filename2 else e.filename
    return f'{where}: {e.strerror or type(e).__name__}'
  if isinstance(e, TimeoutError):
    return str(e) or 'timed out'
  return str(e) or type(e).__name__


def _fail(message: str) -> None:
  print(f'error: {message}', file=sys.stderr)
  sys.exit(2)


def _config_file_error(e: BaseException) -> str | None:
  """The one-line message of a `ConfigError` raised inside `get_config`.

  ml_collections re-raises errors of `get_config` with the traceback pasted into
  the message; the user needs only its last line.
  """
  while e is not None and not isinstance(e, ConfigError):
    e = e.__cause__ or e.__context__
  if e is None:
    return None
  last = [line for line in str(e).splitlines() if line.strip()][-1]
  return last.split('ConfigError: ', 1)[-1]


def _root_cause(e: BaseException) -> str:
  while e.__cause__ is not None:
    e = e.__cause__
  return f'{type(e).__name__}: {e}'


def _unknown_override(argv: Sequence[str]) -> str | None:
  """Names the first `--config.x.y` override whose key the config lacks."""
  spec = _config_spec(argv)
  overrides = [item[len('--config.'):].split('=', 1)[0]
               for item in argv if item.startswith('--config.')]
  if spec is None:
    return None
  try:
    config = load_config(spec)
  except Exception:  # pylint: disable=broad-except  (reported by the caller)
    return None
  for path in overrides:
    node, walked = config, 'config'
    for part in path.split('.'):
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        known = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
        return (f'unknown config key --config.{path}: {walked} has no field'
                f' {part!r}{did_you_mean(part, known)}')
      node, walked = node[part], f'{walked}.{part}'
  return None


def _config_spec(argv: Sequence[str]) -> str | None:
  """The `path[:arg]` value of `--config` in `argv`, if given."""
  spec = None
  for i, item in enumerate(argv):
    if item.startswith('--config='):
      spec = item.split('=', 1)[1]
    elif item == '--config' and i + 1 < len(argv):
      spec = argv[i + 1]
  return spec


def did_you_mean(key: str, known) -> str:
  close = difflib.get_close_matches(key, list(known), n=1)
  return f' (did you mean {close[0]!r}?)' if close else ''


def model_overrides(config: ml_collections.ConfigDict) -> dict:
  """The `ModelConfig` fields `config.model` sets (for `from_pretrained`)."""
  m = config.model
  return dict(dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat,
              layer_loop=m.layer_loop, logits_dtype=m.get('logits_dtype', ''),
              attention=m.get('attention', 'auto'))


def set_from_text(config: ml_collections.ConfigDict, key: str,
                  text: str) -> None:
  """Sets dotted `key` from command-line `text`, typed like its present value.

  For scripts that take `key=value` overrides outside absl flags (the
  benchmarks); an unknown key raises ConfigError naming it.
  """
  node = config
  *parents, leaf = key.split('.')
  try:
    for part in parents:
      node = node[part]
    default = node[leaf]
  except (KeyError, AttributeError):
    raise ConfigError(f'unknown config key {key!r}') from None
  node[leaf] = _convert(key, text, default)


def _convert(key: str, text: str, default):
  try:
    if isinstance(default, bool):
      if text.lower() in ('true', '1', 'yes'):
        return True
      if text.lower() in ('false', '0', 'no'):
        return False
      raise ValueError(text)
    if isinstance(default, int):
      return int(text)
    if isinstance(default, float):
      return float(text)
  except ValueError:
    raise ConfigError(f'config argument {key}={text!r}: expected a'
                      f' {type(default).__name__}') from None
  return text


class _Checker:
  """Reads dotted config keys and records one problem per bad key."""

  def __init__(self, config, problems):
    self._config = config
    self._problems = problems

  def get(self, key):
    node = self._config
    for part in key.split('.'):
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        self._problems.append(f'config.{key} is missing')
        return None
      node = node[part]
    return node

  def _number(self, key, integer=False):
    value = self.get(key)
    if value is None:
      return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
      kind = 'an integer' if integer else 'a number'
      self._problems.append(f'config.{key}={value!r} must be {kind}')
      return None
    return value

  def _require(self, key, ok, text, integer=False):
    value = self._number(key, integer)
    if value is not None and not ok(value):
      self._problems.append(f'config.{key}={value} must be {text}')
      return None
    return value

  def choice(self, key, options):
    value = self.get(key)
    if value is not None and value not in options:
      self._problems.append(
          f'config.{key}={value!r} is not one of {", ".join(options)}'
          f'{did_you_mean(str(value), options)}')
      return None
    return value

  def open_interval(self, key, lo, hi):
    return self._require(key, lambda v: lo < v < hi, f'in ({lo}, {hi})')

  def closed_interval(self, key, lo, hi):
    return self._require(key, lambda v: lo <= v <= hi, f'in [{lo}, {hi}]')

  def positive(self, key):
    return self._require(key, lambda v: v > 0, 'positive')

  def non_negative(self, key):
    return self._require(key, lambda v: v >= 0, '>= 0')

  def positive_int(self, key):
    return self._require(key, lambda v: v >= 1, '>= 1', integer=True)

  def non_negative_int(self, key):
    return self._require(key, lambda v: v >= 0, '>= 0', integer=True)
