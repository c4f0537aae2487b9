"""A whole config checked: each owner's section, then the rules across them.

`validate` asks each component to check the section it owns (the algorithm's
registries, the optimisers, the model, the environment, the rollout system,
the packing policy) with one `config_lib.Checker`, then checks what no single
owner can: how the batch splits over the mesh, the groups, the hosts and the
mini- and micro-batches, and which settings of one section another rules out.
Every problem is collected and raised as one `ConfigError` line, so a recipe
for a TPU pod is checked in full on a laptop. `check_inputs` then checks the
files a run reads, on the machine that reads them.
"""

from __future__ import annotations

import math

import jax
import ml_collections

from sao_jax import config_lib
from sao_jax import kernels
from sao_jax import sharding
from sao_jax.envs import registry
from sao_jax.kernels.attention import api as attention_api
from sao_jax.learner import optimizers
from sao_jax.models import model_config
from sao_jax.models import pretrained
from sao_jax.rl import algorithms
from sao_jax.rollout import batching
from sao_jax.rollout import options as rollout_options


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
  check = config_lib.Checker(config)
  algorithms.check_config(check)
  optimizers.check_config(check)
  model_config.check_config(check)
  registry.check_task(check)
  rollout_options.check_config(check)
  check.choice('kernels.implementation', kernels.IMPLEMENTATIONS)
  check.positive_int('total_steps')
  for key in ('eval.max_new_tokens', 'eval.batch_size', 'checkpoint.every',
              'checkpoint.max_to_keep', 'checkpoint.write_concurrent_gb'):
    check.positive_int(key)
  check.non_negative_int('eval.every')
  check.non_negative('eval.temperature')
  mesh = _check_batch_splits(config, check, num_devices)
  _check_across_sections(config, check, mesh)
  check.raise_if_any()
  return mesh


def _check_batch_splits(config, check, num_devices) -> dict[str, int]:
  """B over groups, hosts, mini- and micro-batches and the mesh's shards."""
  batch = check.positive_int('batch_size')
  group = check.get('group_size')
  if batch and isinstance(group, int) and group > 0 and batch % group:
    check.problem(f'config.batch_size={batch} is not divisible by'
                  f' config.group_size={group}')
  # The queue is per host and holds that host's share of a batch; with the
  # process count unknown until jax.distributed starts (-1), the queue
  # itself checks its capacity against the share (RolloutQueue).
  capacity = check.get('rollout.queue_capacity')
  hosts = (config.distributed.num_processes if config.distributed.enabled
           else 1)
  if (isinstance(capacity, int) and capacity > 0 and batch and hosts > 0
      and capacity < batch // hosts):
    check.problem(f'config.rollout.queue_capacity={capacity} must be 0 or'
                  f' >= config.batch_size / hosts = {batch // hosts}'
                  ' (each host queues its own share of a batch)')

  minibatches = check.get('optim.policy_minibatches')
  microbatches = check.get('optim.microbatches')
  critic_minibatches = check.get('critic.minibatches')
  estimator = check.get('advantage.estimator')
  if not (estimator in algorithms.ESTIMATORS
          and algorithms.ESTIMATORS[estimator].uses_critic):
    critic_minibatches = None  # no critic: its split does not matter
  if not all(isinstance(n, int) and n > 0 for n in (minibatches,
                                                     microbatches)):
    minibatches = microbatches = None  # reported by the optimiser's check
  if not (isinstance(critic_minibatches, int) and critic_minibatches >= 0):
    critic_minibatches = None
  if batch and minibatches and batch % (minibatches * microbatches):
    check.problem(
        f'config.batch_size={batch} must split into'
        f' config.optim.policy_minibatches={minibatches} mini-batches of'
        f' config.optim.microbatches={microbatches} equal micro-batches')
  if (batch and critic_minibatches and microbatches
      and batch % (critic_minibatches * microbatches)):
    check.problem(
        f'config.batch_size={batch} must split into'
        f' config.critic.minibatches={critic_minibatches} mini-batches of'
        f' config.optim.microbatches={microbatches} equal micro-batches')
  minibatch_keys = 'config.optim.policy_minibatches'
  if minibatches and critic_minibatches not in (None, 0, minibatches):
    # Every split below must hold for the actor's and the critic's.
    minibatches = math.lcm(minibatches, critic_minibatches)
    minibatch_keys = ('lcm(config.optim.policy_minibatches,'
                      ' config.critic.minibatches)')
  mesh = {}
  try:
    mesh = sharding.mesh_shape(dict(config.mesh), num_devices)
  except (ValueError, AttributeError, TypeError) as e:
    check.problem(str(e))
  if mesh and batch:
    shards = sharding.batch_parallelism(mesh)
    if batch % shards:
      check.problem(
          f'config.batch_size={batch} is not divisible by the data-parallel'
          f' size {shards} (config.mesh data x fsdp = {mesh["data"]} x'
          f' {mesh["fsdp"]})')
    elif minibatches and batch % (shards * minibatches * microbatches):
      # Every mini- and micro-batch takes rows from every batch shard.
      parts = minibatches * microbatches
      check.problem(
          f'config.batch_size={batch} must split into'
          f' {minibatch_keys} x config.optim.microbatches = {parts} parts of'
          f' rows from each of the {shards} data-parallel shards (batch_size'
          f' a multiple of {shards * parts})')
  # Packed rows split as the batch's trajectories do (the lcm above).
  batching.check_config(check, mesh,
                        row_parts=(minibatches or 1) * (microbatches or 1))
  return mesh


def _check_across_sections(config, check, mesh) -> None:
  """Settings of one section that another section's settings rule out."""
  group = check.get('group_size')
  one_request = check.get('rollout.group_in_one_request')
  if one_request and isinstance(group, int) and group < 2:
    check.problem('config.rollout.group_in_one_request needs'
                  ' config.group_size >= 2')
  turns = _max_turns(config)
  if one_request and turns > 1:
    # One request with G samples plays its episodes' first turn only.
    check.problem(f'config.task.name={config.task.name!r} plays up to'
                  f' {turns} turns, which need separate requests per'
                  ' episode: set config.rollout.group_in_one_request=False')
  sequence = mesh.get(sharding.SEQUENCE_AXIS, 1) if mesh else 1
  length = check.get('rollout.max_sequence_length')
  if sequence > 1 and isinstance(length, int) and length % sequence:
    check.problem(
        f'config.rollout.max_sequence_length={length} must be a multiple of'
        f' config.mesh.sequence={sequence} (each row\'s tokens split evenly)')
  attention = check.get('model.attention')
  if attention in attention_api.ONE_SEGMENT_ONLY and _packs(config):
    check.problem(
        f"config.model.attention={attention!r} attends each row as one"
        " trajectory, but this config packs several per row: set"
        " config.batching.pack_sequences='off' or another attention")


def _max_turns(config) -> int:
  try:
    return registry.max_turns(config.task)
  except (KeyError, AttributeError, TypeError, ValueError):
    return 1  # the task's own check reports its keys


def _packs(config) -> bool:
  try:
    return batching.packs(config)
  except (KeyError, AttributeError, TypeError, ValueError):
    return False  # reported by the packing and task checks


def check_inputs(config: ml_collections.ConfigDict, *,
                 task: bool = True) -> None:
  """Checks that the files a run reads exist, before its slow start-up.

  `validate` checks settings only, so that a recipe for a TPU pod validates on
  a laptop; training and serving call this too, on the machine that reads the
  files: the model source and (with `task`) the task's files.

  Raises:
    ConfigError: with every problem found, each naming its key, on one line.
  """
  problems = pretrained.source_problems(config.model.source)
  if task:
    problems += registry.check_inputs(config.task)
  if problems:
    raise config_lib.ConfigError('; '.join(problems))
