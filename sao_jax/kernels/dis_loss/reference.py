"""The DIS policy loss (SAO §1.2) in plain JAX: its definition.

Every implementation is tested against this function (forward value, metrics
and gradient); it runs under XLA anywhere. `sao_jax.rl.losses.dis_policy_loss`
is this function, and `sao_jax.kernels.dis_loss.api` picks between it and the
Pallas kernel (and runs the kernel per batch shard on a mesh).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from sao_jax import masked_tokens


def dis_policy_loss(logp: chex.Array, behavior_logp: chex.Array,
                    advantages: chex.Array, mask: chex.Array, *,
                    eps_low: float, eps_high: float,
                    aggregation='token_mean', segment_ids=None):
  """Direct double-sided importance sampling loss (SAO §1.2, paper eq. 1-3).

  The ratio is taken directly against the rollout engine's own logprob mu_t
  (no recomputed old policy), and tokens outside the open band get no gradient
  whatever the sign of their advantage:

    ratio_t = exp(logp_t - mu_t)
    keep_t  = (1 - eps_low < ratio_t) & (ratio_t < 1 + eps_high)
    L       = -sum_t m_t * sg(ratio_t * keep_t) * A_t * logp_t / max(sum_t m_t, 1)

  so `dL/dlogp_t = -m_t * keep_t * A_t * ratio_t / N`. With
  `aggregation="seq_mean_token_mean"` the per-token terms are averaged per
  trajectory first (per segment of a packed row: `segment_ids`).

  Args:
    logp: float `[B, T]` log pi_theta(a_t | s_t) under the learner's parameters.
    behavior_logp: float `[B, T]` mu_t, recorded by the rollout engine.
    advantages: float `[B, T]` A_t.
    mask: bool or 0/1 `[B, T]` m_t (action tokens).
    eps_low: lower band width; the band starts at 1 - eps_low (paper: 0.3).
    eps_high: upper band width; the band ends at 1 + eps_high (paper: 5.0).
    aggregation: one of `masked_tokens.AGGREGATIONS`.
    segment_ids: int `[B, T]` (`TrainBatch.segment_ids_BxT`), the
      trajectories of packed rows; None: one per row.

  Returns:
    `(loss, metrics)`: the scalar loss and a dict of float32 scalars:
    `num_tokens` (sum of m), `frac_below` / `frac_above` (fraction of masked-in
    tokens with ratio <= 1 - eps_low / >= 1 + eps_high), `ratio_mean`,
    `ratio_min`, `ratio_max`, and `kl_k1`, `kl_k3`: estimates of KL(mu || pi)
    from the tokens sampled by mu (k1 = -log r, k3 = r - 1 - log r).

  References:
    SAO, arXiv 2607.07508, §3 "direct double-sided importance sampling";
    Schulman, "Approximating KL divergence" (k1, k3), 2020.
  """
  where = 'dis_policy_loss'
  mask_BxT, (logp_BxT, mu_BxT, adv_BxT) = masked_tokens.token_inputs(
      where, mask, logp=logp, behavior_logp=behavior_logp,
      advantages=advantages)
  # mu_t is the rollout engine's record and A_t a target: constants.
  mu_BxT, adv_BxT = jax.lax.stop_gradient((mu_BxT, adv_BxT))
  log_ratio_BxT = logp_BxT - mu_BxT
  ratio_BxT = jnp.exp(log_ratio_BxT)
  below_BxT = mask_BxT & (ratio_BxT <= 1.0 - eps_low)
  above_BxT = mask_BxT & (ratio_BxT >= 1.0 + eps_high)
  keep_BxT = mask_BxT & ~below_BxT & ~above_BxT
  # `where`, not a product: an overflowed ratio (inf) times keep=0 would be NaN.
  coef_BxT = jax.lax.stop_gradient(jnp.where(keep_BxT, ratio_BxT, 0.0))
  # Dropped tokens leave the product entirely: a -inf logp (a token outside a
  # truncated sampling distribution) must not turn 0 * -inf into NaN.
  kept_logp_BxT = jnp.where(keep_BxT, logp_BxT, 0.0)
  loss = masked_tokens.aggregate(-coef_BxT * adv_BxT * kept_logp_BxT, mask_BxT,
                          aggregation, segment_ids)

  metrics = masked_tokens.ratio_metrics(mask_BxT, log_ratio_BxT, ratio_BxT)
  count = jnp.maximum(metrics['num_tokens'], 1.0)
  metrics['frac_below'] = jnp.sum(below_BxT) / count
  metrics['frac_above'] = jnp.sum(above_BxT) / count
  return loss, metrics
