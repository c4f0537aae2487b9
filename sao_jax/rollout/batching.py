"""Trajectories of a batch laid out in the fixed-shape rows the learner takes.

The rollout queue hands the learner lists of `Trajectory` records of
different lengths; the jitted train step wants numpy arrays of one shape,
[R, T], so that it compiles once. `assemble_batch` lays them out: one
trajectory per row, right-padded (R = N, the number of trajectories), or
packed (`config.batching`): several trajectories back to back in a row, each
a segment with its own positions and segment id, into a fixed R < N rows by
first-fit-decreasing bin packing. Agent trajectories vary by an order of
magnitude in length, so one per row pads most of the batch. When a config
packs, and into how many rows, is decided here too (`packs`, `packed_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from sao_jax import sharding
from sao_jax import types
from sao_jax.envs import registry
from sao_jax.rl import algorithms
from sao_jax.rollout import trajectory_checks


def first_fit_decreasing(lengths: Sequence[int], capacity: int,
                         rows: int) -> list[list[int]] | None:
  """Assigns items to `rows` bins of `capacity` by first-fit decreasing.

  Longest first, each into the first row with room; ties in input order, so
  the layout is deterministic. FFD uses at most 11/9 OPT + 6/9 bins.

  Returns:
    Each row's item indices in increasing order, or None when FFD does not
    fit them into `rows` rows.
  """
  free = [capacity] * rows
  layout: list[list[int]] = [[] for _ in range(rows)]
  for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
    row = next((r for r in range(rows) if free[r] >= lengths[i]), None)
    if row is None:
      return None
    free[row] -= lengths[i]
    layout[row].append(i)
  return [sorted(r) for r in layout]


# What `trajectory_checks.layout_reason`'s reasons mean, for its errors.
_LAYOUT_MESSAGES = {
    'too_long': 'more than max_length {}',
    'no_action_tokens': 'no action token',
    'starts_with_action': 'starts with an action token; it needs a prompt',
}


def assemble_batch(trajectories: Sequence[types.Trajectory],
                   max_length: int, pad_id: int,
                   packed_rows: int = 0) -> types.TrainBatch:
  """Lays trajectories out as a `types.TrainBatch` of rows of T = max_length.

  Its `slot_ids_N` are 0: the trainer sets the running-mean slots.

  T is fixed rather than the batch's longest row so that the jitted train
  step compiles once. Packed (`packed_rows` = R > 0), the rows are R; a
  batch that first-fit-decreasing cannot fit into R rows (a rare batch of
  long trajectories) is packed into N rows instead, which always fits: the
  step then compiles once more for that shape, and no trajectory is dropped.

  Args:
    trajectories: the N trajectories, in the queue's order (the `_N` axis).
    max_length: T.
    pad_id: token id of padding.
    packed_rows: R, rows to pack into; 0: one trajectory per row (R = N).

  Raises:
    ValueError: no trajectories, one longer than max_length, one without an
      action token (its reward would have nowhere to go), one whose first
      token is an action, routing records of different widths, or R > N.

  `routed_experts_BxTxR` is set when any trajectory carries routing records
  (the others' tokens are `types.NOT_RECORDED`), None otherwise.
  """
  num = len(trajectories)
  if not num:
    raise ValueError('assemble_batch: no trajectories')
  if not 0 <= packed_rows <= num:
    raise ValueError(f'assemble_batch: packed_rows={packed_rows} must be in'
                     f' [0, {num}] (the number of trajectories)')
  for n, traj in enumerate(trajectories):
    # The queue's own rules (it rejects by them at `put`): what comes from
    # the queue never fails here.
    reason = trajectory_checks.layout_reason(traj, max_length)
    if reason is not None:
      raise ValueError(f'assemble_batch: trajectory {n} (prompt'
                       f' {traj.prompt_id!r}, {traj.length} tokens):'
                       f' {_LAYOUT_MESSAGES[reason].format(max_length)}')
  widths = {t.routed_experts.shape[-1] for t in trajectories
            if t.routed_experts is not None}
  if len(widths) > 1:
    raise ValueError(f'assemble_batch: routing records of widths'
                     f' {sorted(widths)} in one batch')
  if packed_rows:
    lengths = [t.length for t in trajectories]
    layout = (first_fit_decreasing(lengths, max_length, packed_rows)
              or first_fit_decreasing(lengths, max_length, num))
  else:
    layout = [[n] for n in range(num)]
  rows = len(layout)
  tokens_BxT = np.full((rows, max_length), pad_id, np.int32)
  input_mask_BxT = np.zeros((rows, max_length), bool)
  action_mask_BxT = np.zeros((rows, max_length), bool)
  logprobs_BxT = np.zeros((rows, max_length), np.float32)
  versions_BxT = np.full((rows, max_length), types.NO_VERSION, np.int32)
  rewards_BxT = np.zeros((rows, max_length), np.float32)
  positions_BxT = np.zeros((rows, max_length), np.int32)
  segment_ids_BxT = np.zeros((rows, max_length), np.int32)
  experts_BxTxR = (np.full((rows, max_length, widths.pop()),
                           types.NOT_RECORDED, np.int16) if widths else None)
  for row, members in enumerate(layout):
    start = 0
    for n in members:
      traj = trajectories[n]
      end = start + traj.length
      mask_L = np.asarray(traj.action_mask, bool)
      tokens_BxT[row, start:end] = traj.tokens
      input_mask_BxT[row, start:end] = True
      action_mask_BxT[row, start:end] = mask_L
      logprobs_BxT[row, start:end] = np.where(mask_L, traj.behavior_logprobs,
                                              0.0)
      versions_BxT[row, start:end] = np.where(mask_L, traj.versions,
                                              types.NO_VERSION)
      rewards_BxT[row, start + np.flatnonzero(mask_L)[-1]] = traj.reward
      positions_BxT[row, start:end] = np.arange(traj.length)
      segment_ids_BxT[row, start:end] = n + 1
      if experts_BxTxR is not None and traj.routed_experts is not None:
        experts_BxTxR[row, start:end] = traj.routed_experts
      start = end
  return types.TrainBatch(
      tokens_BxT=tokens_BxT,
      input_mask_BxT=input_mask_BxT,
      action_mask_BxT=action_mask_BxT,
      behavior_logprobs_BxT=logprobs_BxT,
      versions_BxT=versions_BxT,
      rewards_BxT=rewards_BxT,
      positions_BxT=positions_BxT,
      segment_ids_BxT=segment_ids_BxT,
      reward_N=np.array([t.reward for t in trajectories], np.float32),
      num_action_tokens_N=np.array(
          [t.num_action_tokens for t in trajectories], np.int32),
      slot_ids_N=np.zeros(num, np.int32),
      routed_experts_BxTxR=experts_BxTxR)


def padding_fraction(batch: types.TrainBatch) -> float:
  """The share of the batch's token slots that hold no real token."""
  mask = np.asarray(batch.input_mask_BxT)
  return 1.0 - float(mask.sum()) / mask.size


# -- the packing policy (`config.batching`) -------------------------------------

PACK_MODES = ('auto', 'on', 'off')


def packs(config) -> bool:
  """Whether batches are packed (`batching.pack_sequences`, 'auto' resolved:
  on for a task that can take more than one turn, on one process)."""
  mode = config.batching.pack_sequences
  if mode != 'auto':
    return mode == 'on'
  if config.distributed.enabled:
    return False
  return registry.max_turns(config.task) > 1


def packed_rows(config, mesh: dict[str, int] | None = None) -> int:
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
  parts = (sharding.batch_parallelism(mesh)
           * algorithms.row_minibatches(config) * config.optim.microbatches)
  return default_packed_rows(config.batch_size, parts)


def default_packed_rows(batch_size: int, parts: int = 1) -> int:
  """3/8 of the trajectories, rounded up to a multiple of `parts` (<= N).

  Measured (BENCHMARKS.md, packing): calculator-like batches of 16 needed at
  most 6 rows of first-fit decreasing in 2000 samples (mean fill 26% of T);
  6 rows gave 2.94x the one-per-row learner step, 8 rows 2.20x. A batch
  that overflows costs no more than one per row (it takes N rows).
  """
  rows = -(-3 * batch_size // 8)
  return min(batch_size, -(-rows // parts) * parts)


def check_config(check, mesh: dict[str, int], row_parts: int) -> None:
  """`config.batching`: the mode, and rows that split like batch_size.

  Args:
    check: a `config_lib.Checker` of the whole config.
    mesh: the resolved mesh axis sizes ({} when the mesh is invalid).
    row_parts: the mini- x micro-batches each data-parallel shard's rows
      split into (mini-batches: the lcm of the actor's and the critic's).
  """
  mode = check.choice('batching.pack_sequences', PACK_MODES)
  rows = check.non_negative_int('batching.packed_rows')
  batch = check.get('batch_size')
  if mode is None or rows is None or not isinstance(batch, int):
    return
  try:
    on = packs(check.config)
  except (KeyError, AttributeError, TypeError, ValueError):
    return  # the task's own keys are reported by its check
  if not on:
    return
  if check.get('distributed.enabled'):
    # Each process packs its own trajectories; one that overflows its rows
    # would give its shard another shape than the others'.
    check.problem("config.batching.pack_sequences='on' packs batches on one"
                  ' process only; set it to off (or auto) with'
                  ' config.distributed.enabled')
  if rows > batch:
    check.problem(f'config.batching.packed_rows={rows} must be <='
                  f' config.batch_size={batch} (the trajectories of a'
                  ' batch)')
  if rows and mesh:
    parts = sharding.batch_parallelism(mesh) * row_parts
    if rows % parts:
      check.problem(
          f'config.batching.packed_rows={rows} must split into'
          ' config.optim.policy_minibatches (and config.critic.minibatches)'
          ' x config.optim.microbatches'
          f' parts of rows from each data-parallel shard (a multiple of'
          f' {parts})')
