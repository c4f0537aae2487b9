"""`config.rollout`: what the servers, clients, queue and weight pushes take.

The rollout section's own rules, checked without starting or importing any of
them (`engine.py` imports JetStream, which pulls in TensorFlow): the engine's
padding buckets, the sampling distribution, the client's and supervisor's
deadlines, the weight stream's buckets and deltas.
"""

from __future__ import annotations

from sao_jax import checksums
from sao_jax import config_lib

# JetStream 0.2.2's prefill padding lengths: its engine contract requires
# max_prefill_length to be one of them (`engine.PREFILL_BUCKETS`).
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                   32768)
WEIGHT_DELTAS = ('off', 'sparse')
_DEADLINES = ('health_interval_s', 'health_timeout_s', 'push_timeout_s',
              'no_server_grace_s', 'max_restart_backoff_s',
              'weight_bucket_timeout_s', 'request_deadline_s')


def check_config(check) -> None:
  """`config.rollout`, key by key and among its own keys.

  Args:
    check: a `config_lib.Checker` of the whole config.
  """
  rollout = check.scope('rollout')
  staleness = rollout.non_negative_int('max_staleness')
  sync_every = rollout.positive_int('sync_every')
  if staleness is not None and sync_every and staleness < sync_every - 1:
    check.problem(
        f'config.rollout.max_staleness={staleness} must be >='
        f' config.rollout.sync_every - 1 = {sync_every - 1}: with weights'
        ' pushed every sync_every steps, a smaller bound admits no rollout'
        ' and the learner waits forever')
  rollout.non_negative_int('queue_capacity')
  rollout.positive('logprob_tolerance')
  rollout.open_interval('max_abs_reward', 0, float('inf'))
  rollout.positive_int('num_workers')
  rollout.positive_int('max_concurrent_decodes')
  rollout.non_negative('prefix_cache_gib')
  rollout.positive_int('max_in_flight_per_server')
  rollout.positive_int('max_new_tokens')
  rollout.non_negative_int('max_retries')
  for key in _DEADLINES:
    rollout.positive(key)
  _check_weights(rollout, check)
  _check_sampling(rollout, check)
  _check_engine_shape(rollout, check)


def _check_weights(rollout, check) -> None:
  # A bucket is the unit checksummed and checked on arrival.
  rollout.closed_interval('weight_bucket_mib', 1 / 1024, 512)
  rollout.choice('weight_checksum', checksums.CHECKSUMS)
  delta = rollout.choice('weight_delta', WEIGHT_DELTAS)
  rollout.non_negative('weight_delta_rtol')
  rollout.non_negative_int('weight_delta_anchor_every')
  if delta not in (None, 'off') and rollout.get('weight_transport') != 'stream':
    check.problem(f'config.rollout.weight_delta={delta!r} needs'
                  ' config.rollout.weight_transport=stream (a checkpoint'
                  ' is always whole)')
  port = rollout.get('weight_data_port')
  if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                           or not 0 <= port < 65536):
    check.problem(f'config.rollout.weight_data_port={port!r} must be a port'
                  ' number, 0..65535 (0: a free one)')


def _check_sampling(rollout, check) -> None:
  temperature = rollout.get('temperature')
  if temperature is not None and not (isinstance(temperature, (int, float))
                                      and temperature > 0):
    check.problem(
        f'config.rollout.temperature={temperature} must be > 0: a greedy'
        ' rollout has no sampling distribution mu for the importance ratio'
        ' (greedy decoding is for evaluation: config.eval.temperature=0)')
  rollout.non_negative_int('top_k')
  top_p = rollout.get('top_p')
  if top_p is not None and not 0 < top_p <= 1:
    check.problem(f'config.rollout.top_p={top_p} must be in (0, 1]')


def _check_engine_shape(rollout, check) -> None:
  # The servers' weights and compute: '' keeps the model's.
  rollout.choice('param_dtype', ('',) + config_lib.DTYPES)
  rollout.choice('dtype', ('',) + config_lib.DTYPES)
  prefill = rollout.get('max_prefill_length')
  target = rollout.get('max_target_length')
  sequence = rollout.positive_int('max_sequence_length')
  if prefill is not None and prefill not in PREFILL_BUCKETS:
    check.problem(f'config.rollout.max_prefill_length={prefill} must be one'
                  f" of JetStream's padding buckets {PREFILL_BUCKETS}")
  if prefill and target and target <= prefill:
    check.problem(f'config.rollout.max_target_length={target} must exceed'
                  f' config.rollout.max_prefill_length={prefill}')
  if sequence and target and sequence > target:
    check.problem(f'config.rollout.max_sequence_length={sequence} must be'
                  f' <= config.rollout.max_target_length={target} (the'
                  ' server cache holds the whole sequence)')
