"""The Pallas kernels on a device mesh: one kernel call per batch shard.

XLA's SPMD partitioner cannot split a Mosaic kernel ("Mosaic kernels cannot be
automatically partitioned"), so on a mesh of more than one device the learner
runs each kernel under `jax.shard_map` on its own rows of the batch, and
combines the per-shard results into exactly the global quantities the
one-device kernel would give. The XLA references need none of
this (the partitioner splits them); they are called directly.

Both kernels are row-parallel: GAE is a recursion along T within a row, and
the DIS loss is a masked mean. Rows are split over `sharding.BATCH_AXES` and
replicated over the tensor axis; per-shard partial sums are combined outside
the shard_map.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sao_jax.kernels.dis_loss import api as dis_loss_api
from sao_jax.kernels import dispatch
from sao_jax.kernels.gae import api as gae_api
from sao_jax import sharding

_F32 = jnp.float32
P = jax.sharding.PartitionSpec

# DIS metrics that are means over masked-in tokens (combined token-weighted).
_TOKEN_MEANS = ('ratio_mean', 'kl_k1', 'kl_k3', 'frac_below', 'frac_above')


def _per_shard(mesh, implementation: str) -> bool:
  """Whether the kernel must run under shard_map on `mesh`."""
  return (mesh is not None and mesh.size > 1 and
          dispatch.resolve(implementation)[0] == 'pallas')


def skip_observation_gae(rewards_BxT, values_BxT, action_mask_BxT, gamma,
                         lam, *, mesh=None, implementation: str = 'auto'):
  """`kernels.skip_observation_gae` (SAO §1.4) over `mesh`'s batch shards.

  Args:
    rewards_BxT, values_BxT, action_mask_BxT, gamma, lam: as for
      `sao_jax.kernels.skip_observation_gae` (lam a scalar or `[B]`).
    mesh: the learner's mesh; None or one device calls the kernel directly.
    implementation: 'auto' | 'xla' | 'pallas'.

  Returns:
    `(advantages_BxT, returns_BxT)`, float32.
  """
  if not _per_shard(mesh, implementation):
    return gae_api.skip_observation_gae(rewards_BxT, values_BxT,
                                        action_mask_BxT, gamma, lam,
                                        implementation=implementation)
  lam_B = jnp.broadcast_to(jnp.asarray(lam, _F32), rewards_BxT.shape[:1])
  rows, tokens = P(sharding.BATCH_AXES), P(sharding.BATCH_AXES, None)

  def local(rewards, values, mask, lam_local):
    return gae_api.skip_observation_gae(rewards, values, mask, gamma,
                                        lam_local,
                                        implementation=implementation)

  return jax.shard_map(local, mesh=mesh,
                       in_specs=(tokens, tokens, tokens, rows),
                       out_specs=(tokens, tokens), check_vma=False)(
                           rewards_BxT, values_BxT, action_mask_BxT, lam_B)


def dis_policy_loss(logp_BxT, behavior_logp_BxT, advantages_BxT, mask_BxT,
                    eps_low, eps_high, aggregation='token_mean', *, mesh=None,
                    implementation: str = 'auto'):
  """`kernels.dis_policy_loss` (SAO §1.2, the DIS loss) over `mesh`'s shards.

  Each shard's loss is weighted by its share of the aggregation's
  denominator (masked-in tokens for 'token_mean', non-empty rows for
  'seq_mean_token_mean'); the weighted sum over shards is the global mean
  and differentiates like it. Metrics are combined the same way: counts
  summed, token means token-weighted, extremes by min / max.

  Returns:
    `(loss, metrics)` as `sao_jax.rl.losses.dis_policy_loss`.
  """
  if not _per_shard(mesh, implementation):
    return dis_loss_api.dis_policy_loss(
        logp_BxT, behavior_logp_BxT, advantages_BxT, mask_BxT, eps_low,
        eps_high, aggregation, implementation=implementation)
  axes = sharding.BATCH_AXES
  tokens = P(axes, None)

  def local(logp, mu, adv, mask):
    """This shard's partial sums, each `[1]` (concatenated over shards)."""
    loss, metrics = dis_loss_api.dis_policy_loss(
        logp, mu, adv, mask, eps_low, eps_high, aggregation,
        implementation=implementation)
    if set(metrics) != set(_TOKEN_MEANS) | {'num_tokens', 'ratio_min',
                                             'ratio_max'}:
      raise ValueError('partitioned.dis_policy_loss: no cross-shard'
                       f' combination for the metrics {sorted(metrics)}')
    mask = jnp.asarray(mask).astype(bool)
    if aggregation == 'token_mean':
      share = jnp.sum(mask).astype(_F32)
    else:  # rows with a masked-in token, as `losses.aggregate` counts them
      share = jnp.sum(jnp.any(mask, axis=1)).astype(_F32)
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
  parts = jax.shard_map(local, mesh=mesh, in_specs=(tokens,) * 4,
                        out_specs=P(axes), check_vma=False)(
                            logp_BxT, behavior_logp_BxT, advantages_BxT,
                            mask_BxT)
  n = jnp.sum(parts['num_tokens'])
  loss = jnp.sum(parts['loss']) / jnp.maximum(jnp.sum(parts['share']), 1.0)
  metrics = {'num_tokens': n,
             'ratio_min': jnp.where(n > 0, jnp.min(parts['ratio_min']), 1.0),
             'ratio_max': jnp.where(n > 0, jnp.max(parts['ratio_max']), 1.0)}
  metrics.update({name: jnp.sum(parts[name]) / jnp.maximum(n, 1.0)
                  for name in _TOKEN_MEANS})
  return loss, metrics
