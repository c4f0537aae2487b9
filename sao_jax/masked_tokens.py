"""Masked `[B, T]` token arrays: argument checks, sanitising, aggregation.

In the base layer, below both folders that use it: the RL math
(`sao_jax.rl.losses`) and the kernels' references and dispatchers
(`sao_jax.kernels`): a token loss
checks its arguments with `check_token_inputs` (or `token_inputs`, which also
zeroes every position off the mask), reduces its per-token terms with
`aggregate`, and reports importance-ratio statistics with `ratio_metrics`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sao_jax import array_checks

_F32 = jnp.float32

# "token_mean": sum over every masked-in token of the batch / number of them
#   (each token weighs the same; the SAO default).
# "seq_mean_token_mean": mean over trajectories of each one's token mean (each
#   trajectory weighs the same, whatever its length; a trajectory is a
#   segment of a row, `TrainBatch.segment_ids_BxT`).
AGGREGATIONS = ('token_mean', 'seq_mean_token_mean')


def aggregate(loss, mask, mode='token_mean', segment_ids=None):
  """Reduces a per-token loss `[B, T]` to a scalar over the masked-in tokens.

  Args:
    loss: float `[B, T]` per-token loss.
    mask: bool or 0/1 `[B, T]`.
    mode: one of `AGGREGATIONS`. Trajectories without a masked-in token are
      left out of the sequence mean; an all-empty batch gives 0.
    segment_ids: int `[B, T]` (`TrainBatch.segment_ids_BxT`): a trajectory
      is a run of one id within a row (packed rows hold several); None: one
      per row.

  Returns:
    float32 scalar.
  """
  where = 'aggregate'
  array_checks.require_rank(where, 'loss', loss, '[B, T]')
  array_checks.require_shape(where, 'mask', mask, jnp.shape(loss), '[B, T]')
  mask_BxT = jnp.asarray(mask).astype(bool)
  loss_BxT = jnp.where(mask_BxT, jnp.asarray(loss, _F32), 0.0)
  if mode == 'token_mean':
    return jnp.sum(loss_BxT) / jnp.maximum(jnp.sum(mask_BxT), 1)
  if mode == 'seq_mean_token_mean':
    local_BxT = row_segments(where, segment_ids, mask_BxT)
    count_BxS = segment_sums(mask_BxT.astype(_F32), local_BxT)
    mean_BxS = segment_sums(loss_BxT, local_BxT) / jnp.maximum(count_BxS, 1)
    return jnp.sum(mean_BxS) / jnp.maximum(jnp.sum(count_BxS > 0), 1)
  raise ValueError(f'aggregate: unknown mode {mode!r}; expected one of'
                   f' {AGGREGATIONS}')


def row_segments(where, segment_ids, mask_BxT):
  """Each token's segment numbered within its row, `1, 2, ...`: int32 `[B, T]`.

  A segment is a run of one id (`TrainBatch.segment_ids_BxT`); None means
  one segment per row. Numbering within the row bounds the segments of a row
  by T, a static size for `segment_sums`.
  """
  if segment_ids is None:
    return jnp.ones(jnp.shape(mask_BxT), jnp.int32)
  array_checks.require_shape(where, 'segment_ids', segment_ids,
                             jnp.shape(mask_BxT), '[B, T] (the mask shape)')
  ids_BxT = jnp.asarray(segment_ids, jnp.int32)
  starts_BxT = ids_BxT != jnp.pad(ids_BxT[:, :-1], ((0, 0), (1, 0)),
                                  constant_values=-1)
  return jnp.cumsum(starts_BxT.astype(jnp.int32), axis=1)


def segment_sums(x_BxT, local_BxT):
  """Per-row sums of `x` over each row-local segment: `[B, T + 1]` (slot 0
  unused)."""
  length = x_BxT.shape[1]
  return jax.vmap(lambda x, s: jax.ops.segment_sum(
      x, s, num_segments=length + 1))(x_BxT, local_BxT)


def segment_token_weights(mask, segment_ids=None):
  """Weights w_t with `seq_mean_token_mean(l) = sum_t w_t l_t`: float32 `[B, T]`.

  `w_t = m_t / (n_s * S)`, n_s the masked-in tokens of t's trajectory and S
  the trajectories with any: the sequence mean as one weighted token sum
  (what the Pallas DIS kernel computes, and what splits over shards).
  """
  where = 'segment_token_weights'
  array_checks.require_rank(where, 'mask', mask, '[B, T]')
  mask_BxT = jnp.asarray(mask).astype(bool)
  local_BxT = row_segments(where, segment_ids, mask_BxT)
  count_BxS = segment_sums(mask_BxT.astype(_F32), local_BxT)
  count_BxT = jnp.take_along_axis(count_BxS, local_BxT, axis=1)
  segments = jnp.maximum(jnp.sum(count_BxS > 0), 1)
  return jnp.where(mask_BxT, 1.0 / (jnp.maximum(count_BxT, 1) * segments),
                   0.0)


def num_segments(mask, segment_ids=None):
  """Trajectories with a masked-in token (the sequence mean's denominator)."""
  mask_BxT = jnp.asarray(mask).astype(bool)
  local_BxT = row_segments('num_segments', segment_ids, mask_BxT)
  return jnp.sum(segment_sums(mask_BxT.astype(_F32), local_BxT) > 0)


def check_token_inputs(where, mask, **arrays):
  """Checks `[B, T]` float arrays against the mask (losses and kernels).

  Returns:
    `(mask_BxT bool, arrays)`, the arrays cast to their common float dtype.
  """
  array_checks.require_rank(where, 'mask', mask, '[B, T]')
  shape = tuple(jnp.shape(mask))
  for name, x in arrays.items():
    array_checks.require_shape(where, name, x, shape, '[B, T] (the mask shape)')
    array_checks.require_float(where, name, x)
  dtype = jnp.result_type(*arrays.values())
  return (jnp.asarray(mask).astype(bool),
          tuple(jnp.asarray(x, dtype) for x in arrays.values()))


def token_inputs(where, mask, **arrays):
  """Checked `[B, T]` arrays, sanitised (0 off the mask) and in float32."""
  mask_BxT, checked = check_token_inputs(where, mask, **arrays)
  return mask_BxT, tuple(
      jnp.where(mask_BxT, jnp.asarray(x, _F32), 0.0) for x in checked)


def ratio_metrics(mask_BxT, log_ratio_BxT, ratio_BxT):
  """Masked statistics of the importance ratio shared by DIS and PPO."""
  num_tokens = jnp.sum(mask_BxT).astype(_F32)
  count = jnp.maximum(num_tokens, 1.0)
  log_ratio_BxT = jax.lax.stop_gradient(log_ratio_BxT)
  ratio_BxT = jax.lax.stop_gradient(ratio_BxT)
  k3_BxT = ratio_BxT - 1.0 - log_ratio_BxT
  has_tokens = num_tokens > 0
  return {
      'num_tokens': num_tokens,
      'ratio_mean': jnp.sum(jnp.where(mask_BxT, ratio_BxT, 0.0)) / count,
      'ratio_min': jnp.where(
          has_tokens, jnp.min(jnp.where(mask_BxT, ratio_BxT, jnp.inf)), 1.0),
      'ratio_max': jnp.where(
          has_tokens, jnp.max(jnp.where(mask_BxT, ratio_BxT, -jnp.inf)), 1.0),
      'kl_k1': jnp.sum(jnp.where(mask_BxT, -log_ratio_BxT, 0.0)) / count,
      'kl_k3': jnp.sum(jnp.where(mask_BxT, k3_BxT, 0.0)) / count,
  }
