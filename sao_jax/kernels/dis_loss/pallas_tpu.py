"""The DIS policy loss as a fused Pallas TPU kernel (definition: `reference`).

Forward: one pass over logp, mu, A and the mask computes, per trajectory, the
loss sum, token count, below/above-band counts, ratio sum/min/max and the k1/k3
KL sums. Time blocks of a row are reduced into a lane-shaped VMEM accumulator
(`[9, block_b, 128]`: only adds and min/max across vreg columns per block) and
folded across lanes once, at the row's last block, into a `[B, 128]` output
whose lane k holds statistic k. The wrapper turns those per-row sums into the
loss and the metrics.

Aggregation. 'token_mean' divides the sum by the batch's action tokens N.
'token_sum' takes the plain sum: the dispatcher (`api`) computes the
sequence mean with it, folding each token's weight `1 / (n_s * S)` (its
trajectory's token count n_s, S trajectories; `tokens.segment_token_weights`)
into the advantages, which is exact since A_t enters the loss and its
gradient linearly and the band does not depend on it. So packed rows, whose
trajectories are segments, need nothing of the kernel but the weights.

Backward: `dL/dlogp_t = g * w_b * c_t` with `c_t = -m_t keep_t ratio_t A_t`. When
differentiated, the same forward pass also writes c_t (one store per token),
and the backward is the scale by the row weight w_b (1/N for the token mean,
1 for the weighted sum): an elementwise op XLA fuses into whatever
consumes the gradient. Against a backward kernel that re-reads logp, mu, A
and the mask, this moves 21 instead of 30 bytes per f32 token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sao_jax.kernels import tiling

_F32 = jnp.float32
DEFAULT_BLOCK_B = 128
DEFAULT_BLOCK_T = 1024

# Lanes of the per-row statistics output.
LOSS, COUNT, BELOW, ABOVE, RATIO_SUM, K1, K3, RATIO_MIN, RATIO_MAX = range(9)
_NUM_STATS = 9
_SUMS = (LOSS, COUNT, BELOW, ABOVE, RATIO_SUM, K1, K3)


def _token_terms(eps_ref, logp_ref, mu_ref, adv_ref, mask_ref):
  """Elementwise DIS quantities of one block, in float32, sanitised by mask."""
  # int8 compares are not supported on every TPU generation: widen first.
  mask = mask_ref[...].astype(jnp.int32) > 0
  logp = jnp.where(mask, logp_ref[...].astype(_F32), 0.0)
  mu = jnp.where(mask, mu_ref[...].astype(_F32), 0.0)
  adv = jnp.where(mask, adv_ref[...].astype(_F32), 0.0)
  log_ratio = logp - mu
  ratio = jnp.exp(log_ratio)
  below = mask & (ratio <= 1.0 - eps_ref[0])
  above = mask & (ratio >= 1.0 + eps_ref[1])
  keep = mask & ~below & ~above
  return mask, logp, adv, log_ratio, ratio, below, above, keep


def _forward_kernel(eps_ref, logp_ref, mu_ref, adv_ref, mask_ref, stats_ref,
                    *rest):
  coef_ref, acc_s = rest if len(rest) == 2 else (None, rest[0])
  j = pl.program_id(1)
  block_t = logp_ref.shape[1]

  @pl.when(j == 0)
  def _init():
    acc_s[...] = jnp.zeros_like(acc_s)
    acc_s[RATIO_MIN] = jnp.full(acc_s.shape[1:], jnp.inf, _F32)
    acc_s[RATIO_MAX] = jnp.full(acc_s.shape[1:], -jnp.inf, _F32)

  mask, logp, adv, log_ratio, ratio, below, above, keep = _token_terms(
      eps_ref, logp_ref, mu_ref, adv_ref, mask_ref)
  # `where`, not products: an overflowed ratio (inf) or the -inf logp of a
  # token outside a truncated sampling distribution (ratio 0, dropped) would
  # turn 0 * inf into NaN. Dropped tokens leave the loss entirely.
  coef = jnp.where(keep, -ratio * adv, 0.0)  # dL/dlogp up to the row weight
  if coef_ref is not None:
    coef_ref[...] = coef.astype(coef_ref.dtype)
  terms = {
      LOSS: coef * jnp.where(keep, logp, 0.0),
      COUNT: mask.astype(_F32),
      BELOW: below.astype(_F32),
      ABOVE: above.astype(_F32),
      RATIO_SUM: jnp.where(mask, ratio, 0.0),
      K1: jnp.where(mask, -log_ratio, 0.0),
      K3: jnp.where(mask, ratio - 1.0 - log_ratio, 0.0),
  }
  lo = jnp.where(mask, ratio, jnp.inf)
  hi = jnp.where(mask, ratio, -jnp.inf)
  lanes = tiling.LANES
  for k, term in terms.items():
    total = acc_s[k]
    for c in range(block_t // lanes):
      total = total + term[:, c * lanes:(c + 1) * lanes]
    acc_s[k] = total
  low, high = acc_s[RATIO_MIN], acc_s[RATIO_MAX]
  for c in range(block_t // lanes):
    low = jnp.minimum(low, lo[:, c * lanes:(c + 1) * lanes])
    high = jnp.maximum(high, hi[:, c * lanes:(c + 1) * lanes])
  acc_s[RATIO_MIN] = low
  acc_s[RATIO_MAX] = high

  @pl.when(j == pl.num_programs(1) - 1)
  def _finish():
    lane = jax.lax.broadcasted_iota(jnp.int32, stats_ref.shape, 1)
    out = jnp.zeros(stats_ref.shape, _F32)
    for k in _SUMS:
      out = jnp.where(lane == k, jnp.sum(acc_s[k], axis=1, keepdims=True), out)
    out = jnp.where(lane == RATIO_MIN,
                    jnp.min(acc_s[RATIO_MIN], axis=1, keepdims=True), out)
    out = jnp.where(lane == RATIO_MAX,
                    jnp.max(acc_s[RATIO_MAX], axis=1, keepdims=True), out)
    stats_ref[...] = out


def vmem_bytes(block_b: int, block_t: int, in_dtype) -> int:
  """VMEM of the kernel (with the gradient output) at one block size."""
  block = block_b * block_t
  buffers = 2 * (4 * block * tiling.itemsize(in_dtype) + block
                 + block_b * tiling.LANES * 4)
  return buffers + _NUM_STATS * block_b * tiling.LANES * 4


class Blocks:
  """Resolved, checked block sizes and padded shape for one input shape."""

  def __init__(self, shape, dtype, block_b, block_t):
    batch, length = shape
    self.block_b = block_b or tiling.fit_block(batch, DEFAULT_BLOCK_B,
                                               tiling.INT8_SUBLANES)
    self.block_t = block_t or tiling.fit_block(length, DEFAULT_BLOCK_T,
                                               tiling.LANES)
    tiling.check_block('dis_loss kernel', self.block_b, self.block_t,
                       tiling.INT8_SUBLANES,
                       vmem_bytes(self.block_b, self.block_t, dtype))
    self.padded = (tiling.round_up(batch, self.block_b),
                   tiling.round_up(length, self.block_t))
    self.grid = (self.padded[0] // self.block_b, self.padded[1] // self.block_t)

  def pad(self, x):
    return tiling.pad_to(x, *self.padded)

  @property
  def token_spec(self):
    return pl.BlockSpec((self.block_b, self.block_t), lambda b, j: (b, j))


def _eps(eps_low, eps_high):
  return jnp.stack([jnp.asarray(eps_low, _F32), jnp.asarray(eps_high, _F32)])


def row_stats(logp, mu, adv, mask_i8, eps_low, eps_high, blocks: Blocks,
              interpret: bool, with_coef: bool):
  """Per-row statistics `[B, 9]` (`LOSS`..`RATIO_MAX`) and, if asked, c_t.

  Returns:
    `(stats_Bx9, coef_BxT or None)`; c_t in the dtype of logp.
  """
  batch, length = logp.shape
  elements = blocks.padded[0] * blocks.padded[1]
  stats_shape = jax.ShapeDtypeStruct((blocks.padded[0], tiling.LANES), _F32)
  stats_spec = pl.BlockSpec((blocks.block_b, tiling.LANES), lambda b, j: (b, 0))
  out_shape, out_specs = [stats_shape], [stats_spec]
  bytes_moved = (3 * logp.dtype.itemsize + 1) * elements
  if with_coef:
    out_shape.append(jax.ShapeDtypeStruct(blocks.padded, logp.dtype))
    out_specs.append(blocks.token_spec)
    bytes_moved += logp.dtype.itemsize * elements
  call = pl.pallas_call(
      _forward_kernel,
      out_shape=tuple(out_shape),
      grid=blocks.grid,
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)] + [blocks.token_spec] * 4,
      out_specs=tuple(out_specs),
      scratch_shapes=[pltpu.VMEM((_NUM_STATS, blocks.block_b, tiling.LANES),
                                 _F32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'arbitrary'),
          vmem_limit_bytes=tiling.VMEM_LIMIT_BYTES,
          allow_input_fusion=[False, True, True, True, True]),
      cost_estimate=pl.CostEstimate(flops=30 * elements,
                                    transcendentals=elements,
                                    bytes_accessed=bytes_moved),
      interpret=interpret,
  )
  outs = call(_eps(eps_low, eps_high),
              *map(blocks.pad, (logp, mu, adv, mask_i8)))
  stats = outs[0][:batch, :_NUM_STATS]
  coef = outs[1][:batch, :length] if with_coef else None
  return stats, coef


AGGREGATIONS = ('token_mean', 'token_sum')


def loss_weights(stats, aggregation: str):
  """Row weights w_b with `loss = sum_b w_b * loss_sum_b`."""
  count_B = stats[:, COUNT]
  if aggregation == 'token_mean':
    return jnp.full(count_B.shape, 1.0, _F32) / jnp.maximum(jnp.sum(count_B), 1)
  if aggregation == 'token_sum':
    return jnp.ones(count_B.shape, _F32)
  raise ValueError(f'dis_loss kernel: unknown aggregation {aggregation!r};'
                   f' expected one of {AGGREGATIONS}')


def metrics_from_stats(stats):
  """The metrics of `reference.dis_policy_loss` from per-row statistics."""
  num_tokens = jnp.sum(stats[:, COUNT])
  count = jnp.maximum(num_tokens, 1.0)
  has_tokens = num_tokens > 0
  return {
      'num_tokens': num_tokens,
      'ratio_mean': jnp.sum(stats[:, RATIO_SUM]) / count,
      'ratio_min': jnp.where(has_tokens, jnp.min(stats[:, RATIO_MIN]), 1.0),
      'ratio_max': jnp.where(has_tokens, jnp.max(stats[:, RATIO_MAX]), 1.0),
      'kl_k1': jnp.sum(stats[:, K1]) / count,
      'kl_k3': jnp.sum(stats[:, K3]) / count,
      'frac_below': jnp.sum(stats[:, BELOW]) / count,
      'frac_above': jnp.sum(stats[:, ABOVE]) / count,
  }


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def dis_policy_loss(logp, mu, adv, mask_i8, eps_low, eps_high, aggregation,
                    block_b, block_t, interpret):
  """Kernel entry: `(loss, metrics)`, differentiable in `logp`.

  Arguments are checked `[B, T]` arrays (`mask_i8` int8); `eps_low`/`eps_high`
  are float32 scalars. Only `logp` is differentiated: mu is the rollout
  engine's record and A a target (both constants of the DIS objective).
  """
  loss, metrics, _, _ = _forward(logp, mu, adv, mask_i8, eps_low, eps_high,
                                 aggregation, block_b, block_t, interpret,
                                 with_coef=False)
  return loss, metrics


def _forward(logp, mu, adv, mask_i8, eps_low, eps_high, aggregation, block_b,
             block_t, interpret, with_coef):
  blocks = Blocks(logp.shape, logp.dtype, block_b, block_t)
  stats, coef = row_stats(logp, mu, adv, mask_i8, eps_low, eps_high, blocks,
                          interpret, with_coef)
  weight_B = loss_weights(stats, aggregation)
  loss = jnp.sum(weight_B * stats[:, LOSS])
  return loss, metrics_from_stats(stats), weight_B, coef


def _fwd(logp, mu, adv, mask_i8, eps_low, eps_high, aggregation, block_b,
         block_t, interpret):
  loss, metrics, weight_B, coef = _forward(
      logp, mu, adv, mask_i8, eps_low, eps_high, aggregation, block_b, block_t,
      interpret, with_coef=True)
  return (loss, metrics), (weight_B, coef, mu, adv, mask_i8, eps_low, eps_high)


def _bwd(aggregation, block_b, block_t, interpret, residuals, cotangents):
  del aggregation, block_b, block_t, interpret
  weight_B, coef, mu, adv, mask_i8, eps_low, eps_high = residuals
  g_loss, _ = cotangents  # the metrics are reported, not differentiated
  scale_Bx1 = (g_loss * weight_B)[:, None]
  grad = (scale_Bx1 * coef.astype(_F32)).astype(coef.dtype)
  zeros = jnp.zeros_like
  return (grad, zeros(mu), zeros(adv), None, zeros(eps_low), zeros(eps_high))


dis_policy_loss.defvjp(_fwd, _bwd)
