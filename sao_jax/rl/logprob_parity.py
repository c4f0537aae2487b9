"""Train/inference log-prob parity per token: how far the learner's log pi_old
is from the rollout engine's log mu on the tokens the engine sampled.

The first complaint in every RL-framework tracker is this mismatch hidden by
means (bf16 kernels, other attention, other reductions): a mean ratio near 1
can hide a tail of tokens off by orders of magnitude. On tokens sampled with
the learner's current weights (staleness 0) the two log-probs are of the same
policy, so any difference is numerics; on older tokens it adds the policy's
drift, which is what DIS's band and the staleness bound act on.
"""

from __future__ import annotations

import jax.numpy as jnp

_F32 = jnp.float32

# |log pi_old - log mu| thresholds of the reported fractions.
THRESHOLDS = (0.01, 0.1, 1.0)


def _pearson(x, y, mask):
  """Pearson correlation of x and y over `mask` (NaN for < 2 tokens or no
  spread)."""
  n = jnp.sum(mask).astype(_F32)
  safe_n = jnp.maximum(n, 1.0)
  mx = jnp.sum(jnp.where(mask, x, 0.0)) / safe_n
  my = jnp.sum(jnp.where(mask, y, 0.0)) / safe_n
  dx = jnp.where(mask, x - mx, 0.0)
  dy = jnp.where(mask, y - my, 0.0)
  denominator = jnp.sqrt(jnp.sum(dx * dx) * jnp.sum(dy * dy))
  return jnp.where((n >= 2) & (denominator > 0),
                   jnp.sum(dx * dy) / jnp.maximum(denominator, 1e-30),
                   jnp.nan)


def parity_metrics(old_logp_BxT, behavior_logp_BxT, action_mask_BxT,
                   staleness_BxT, max_staleness: int) -> dict:
  """Per-token parity of log pi_old and log mu, overall and by staleness.

  Args:
    old_logp_BxT: log pi_old, the learner's log-probs under the weights at the
      start of the batch.
    behavior_logp_BxT: log mu_t, the engine's.
    action_mask_BxT: the sampled tokens.
    staleness_BxT: int, learner version minus the version that sampled each
      token.
    max_staleness: the largest staleness reported on its own.

  Returns:
    `{name: scalar}`: for staleness-0 tokens (the version the learner is at)
    `frac_gt_<e>` (the fraction with |log pi_old - log mu| > e, e in
    `THRESHOLDS`), `mean_abs_diff`, `pearson` (of the two log-probs) and
    `tokens`; the same under `staleness_<s>/` for s = 1..max_staleness.
    Tokens outside the learner's truncated support (log pi_old = -inf) are
    left out (`losses.finite_mask` masks them from the losses).
  """
  old_BxT = jnp.asarray(old_logp_BxT, _F32)
  mu_BxT = jnp.asarray(behavior_logp_BxT, _F32)
  finite_BxT = (jnp.asarray(action_mask_BxT, bool) & jnp.isfinite(old_BxT)
                & jnp.isfinite(mu_BxT))
  diff_BxT = jnp.where(finite_BxT, jnp.abs(old_BxT - mu_BxT), 0.0)
  old_BxT = jnp.where(finite_BxT, old_BxT, 0.0)
  mu_BxT = jnp.where(finite_BxT, mu_BxT, 0.0)
  metrics = {}
  for s in range(max_staleness + 1):
    mask_BxT = finite_BxT & (staleness_BxT == s)
    n = jnp.sum(mask_BxT).astype(_F32)
    safe_n = jnp.maximum(n, 1.0)
    prefix = '' if s == 0 else f'staleness_{s}/'
    for e in THRESHOLDS:
      metrics[f'{prefix}frac_gt_{e:g}'] = jnp.sum(
          mask_BxT & (diff_BxT > e)) / safe_n
    metrics[f'{prefix}mean_abs_diff'] = jnp.sum(
        jnp.where(mask_BxT, diff_BxT, 0.0)) / safe_n
    metrics[f'{prefix}pearson'] = _pearson(old_BxT, mu_BxT, mask_BxT)
    metrics[f'{prefix}tokens'] = n
  return metrics
