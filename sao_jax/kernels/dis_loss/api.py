"""`dis_policy_loss` (SAO §1.2) with a choice of implementation, on a mesh.

The one entry the learner calls: it picks the XLA reference
(`reference.dis_policy_loss`, the definition) or the Pallas TPU kernel
(`pallas_tpu`), and with a mesh of more than one device runs the kernel once
per batch shard.

XLA's SPMD partitioner cannot split a Mosaic kernel ("Mosaic kernels cannot be
automatically partitioned"), so on a mesh the kernel runs under
`jax.shard_map` on its own rows of the batch (split over
`sharding.BATCH_AXES`, replicated over the tensor axis), and the per-shard
partial sums are combined outside the shard_map into exactly the global loss
and metrics. The XLA reference needs none of this: the partitioner splits it.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from sao_jax import sharding
from sao_jax.kernels import dispatch
from sao_jax.kernels.dis_loss import pallas_tpu
from sao_jax.kernels.dis_loss import reference
from sao_jax import masked_tokens

_F32 = jnp.float32
P = jax.sharding.PartitionSpec

# Metrics that are means over masked-in tokens (combined token-weighted).
_TOKEN_MEANS = ('ratio_mean', 'kl_k1', 'kl_k3', 'frac_below', 'frac_above')


def dis_policy_loss(logp: chex.Array, behavior_logp: chex.Array,
                    advantages: chex.Array, mask: chex.Array, *,
                    eps_low: float, eps_high: float,
                    aggregation='token_mean', segment_ids=None,
                    implementation: str = 'auto',
                    block_b: int | None = None, block_t: int | None = None,
                    interpret: bool | None = None, mesh=None):
  """The DIS loss of SAO §1.2; see `reference.dis_policy_loss`.

  Same arguments and results as the reference (`segment_ids`: the
  trajectories of packed rows, for the sequence mean), plus:

  Args:
    implementation: 'auto' (Pallas on TPU, XLA elsewhere), 'xla', or
      'pallas' (interpret mode off TPU).
    block_b, block_t: Pallas block sizes (block_b a multiple of 32,
      block_t of 128).
    interpret: force Pallas interpret mode on (or off, to compile the Mosaic
      kernel for a TPU target from a CPU host); default: on off TPU.
    mesh: the learner's mesh; with more than one device a Pallas kernel runs
      per batch shard. None: one call.
  """
  name, interpret_off_tpu = dispatch.resolve(implementation)
  if name == 'xla':
    return reference.dis_policy_loss(
        logp, behavior_logp, advantages, mask, eps_low=eps_low,
        eps_high=eps_high, aggregation=aggregation, segment_ids=segment_ids)
  if aggregation not in masked_tokens.AGGREGATIONS:
    raise ValueError(f'dis_policy_loss: unknown aggregation {aggregation!r};'
                     f' expected one of {masked_tokens.AGGREGATIONS}')
  interpret = interpret_off_tpu if interpret is None else interpret
  if aggregation == 'seq_mean_token_mean':
    # The sequence mean as a weighted token sum (`pallas_tpu`'s docstring):
    # the weights are global (S counts the whole batch's trajectories), so
    # the per-shard sums below simply add up. Weighted in float32: bf16
    # would round each weight to 3 digits (the kernel then reads its inputs
    # in float32, as the reference computes).
    weights_BxT = masked_tokens.segment_token_weights(mask, segment_ids)
    advantages = jnp.asarray(advantages, _F32) * weights_BxT
    aggregation = 'token_sum'
  if mesh is not None and mesh.size > 1:
    return _per_shard(mesh, logp, behavior_logp, advantages, mask, eps_low,
                      eps_high, aggregation, block_b, block_t, interpret)
  return _pallas(logp, behavior_logp, advantages, mask, eps_low, eps_high,
                 aggregation, block_b, block_t, interpret)


def _pallas(logp, behavior_logp, advantages, mask, eps_low, eps_high,
            aggregation, block_b, block_t, interpret):
  """The Pallas kernel on one device's arrays, arguments checked."""
  mask_BxT, (logp, behavior_logp, advantages) = masked_tokens.check_token_inputs(
      'dis_policy_loss', mask, logp=logp, behavior_logp=behavior_logp,
      advantages=advantages)
  return pallas_tpu.dis_policy_loss(
      logp, behavior_logp, advantages, mask_BxT.astype(jnp.int8),
      jnp.asarray(eps_low, jnp.float32), jnp.asarray(eps_high, jnp.float32),
      aggregation, block_b, block_t, interpret)


def _per_shard(mesh, logp_BxT, behavior_logp_BxT, advantages_BxT, mask_BxT,
               eps_low, eps_high, aggregation, block_b, block_t, interpret):
  """The kernel once per batch shard of `mesh`, combined into the global loss.

  Each shard's loss is weighted by its share of the aggregation's
  denominator (masked-in tokens for 'token_mean'; 1 for 'token_sum', whose
  weights are already global); the weighted sum over shards is the global
  loss and differentiates like it. Metrics are combined the same way: counts
  summed, token means token-weighted, extremes by min / max.
  """
  axes = sharding.BATCH_AXES
  token_spec = P(axes, None)

  def local(logp, mu, adv, mask):
    """This shard's partial sums, each `[1]` (concatenated over shards)."""
    loss, metrics = _pallas(logp, mu, adv, mask, eps_low, eps_high,
                            aggregation, block_b, block_t, interpret)
    if set(metrics) != set(_TOKEN_MEANS) | {'num_tokens', 'ratio_min',
                                             'ratio_max'}:
      raise ValueError('dis_policy_loss: no cross-shard combination for the'
                       f' metrics {sorted(metrics)}')
    mask = jnp.asarray(mask).astype(bool)
    if aggregation == 'token_mean':
      share = jnp.sum(mask).astype(_F32)
    else:  # a sum: the shards' sums add up
      share = jnp.ones((), _F32)
    n = metrics['num_tokens']
    parts = {'loss': loss * share, 'share': share, 'num_tokens': n,
             'ratio_min': jnp.where(n > 0, metrics['ratio_min'], jnp.inf),
             'ratio_max': jnp.where(n > 0, metrics['ratio_max'], -jnp.inf)}
    parts.update({name: metrics[name] * n for name in _TOKEN_MEANS})
    return {k: jnp.reshape(v, (1,)) for k, v in parts.items()}

  # Partial sums leave the shard_map as one entry per shard and are combined
  # outside it, in ordinary differentiable jnp: no collective inside the
  # kernel's shard_map needs a transpose rule. check_vma is off because a
  # pallas_call's outputs carry no varying-axes annotation.
  parts = jax.shard_map(local, mesh=mesh, in_specs=(token_spec,) * 4,
                        out_specs=P(axes), check_vma=False)(
                            logp_BxT, behavior_logp_BxT, advantages_BxT,
                            mask_BxT)
  n = jnp.sum(parts['num_tokens'])
  loss = jnp.sum(parts['loss'])
  if aggregation == 'token_mean':
    loss = loss / jnp.maximum(jnp.sum(parts['share']), 1.0)
  metrics = {'num_tokens': n,
             'ratio_min': jnp.where(n > 0, jnp.min(parts['ratio_min']), 1.0),
             'ratio_max': jnp.where(n > 0, jnp.max(parts['ratio_max']), 1.0)}
  metrics.update({name: jnp.sum(parts[name]) / jnp.maximum(n, 1.0)
                  for name in _TOKEN_MEANS})
  return loss, metrics
