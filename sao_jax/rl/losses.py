"""Policy and value losses: DIS (SAO), PPO clip, value regression, KL terms.

All token losses take `[B, T]` arrays and a 0/1 `mask` (1 on the action tokens
that carry loss). Positions with `mask == 0` are sanitised before any arithmetic,
so garbage (even NaN) at padding never reaches the loss or its gradient.

The DIS loss is defined next to its Pallas kernel
(`sao_jax.kernels.dis_loss.reference`) and aggregation in `sao_jax.masked_tokens`;
both are re-exported here, so `losses.dis_policy_loss` is the definition.
To run DIS through the configured kernel (Pallas on TPU), call
`sao_jax.kernels.dis_loss.api.dis_policy_loss` instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sao_jax.kernels.dis_loss import reference as dis_reference
from sao_jax import masked_tokens

_F32 = jnp.float32

AGGREGATIONS = masked_tokens.AGGREGATIONS
aggregate = masked_tokens.aggregate
check_token_inputs = masked_tokens.check_token_inputs
dis_policy_loss = dis_reference.dis_policy_loss


def ppo_policy_loss(logp, old_logp, advantages, mask, *, eps_low, eps_high,
                    dual_clip=None, aggregation='token_mean',
                    token_weights=None, segment_ids=None):
  """PPO's clipped surrogate with decoupled (clip-higher) bounds and dual clip.

    ratio_t = exp(logp_t - old_logp_t)
    l_t     = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - eps_low, 1 + eps_high))
    l_t     = min(l_t, -A_t * c)  where A_t < 0            (dual clip, if c set)
    l_t     = w_t * l_t                            (token weights, if given)

  Unlike DIS, the gradient survives outside the band whenever the unclipped
  term is the larger one (A > 0 with r < 1 - eps_low, A < 0 with r > 1 + eps_high).

  A token whose `logp` or `old_logp` is not finite leaves the mask (the loss
  and its denominator) before any exp: under top-k / top-p sampling a token
  outside one policy's truncated support has log-prob -inf there, and its
  log-ratio would be NaN or infinite. They are counted in
  `nonfinite_tokens`.

  Args:
    logp: float `[B, T]` log pi_theta.
    old_logp: float `[B, T]` log pi_old, the policy the advantages belong to
      (recomputed by the learner for GRPO/VAPO/PPO).
    advantages: float `[B, T]` A_t.
    mask: bool or 0/1 `[B, T]`.
    eps_low: lower clip width (PPO: 0.2).
    eps_high: upper clip width (symmetric PPO: 0.2; clip-higher/DAPO: 0.28).
    dual_clip: c > 1 bounds the loss of negative-advantage tokens at -c * A;
      None disables it.
    aggregation: one of `AGGREGATIONS`.
    token_weights: float `[B, T]` constant weights w_t of the per-token terms
      (decoupled PPO's truncated behaviour importance weight), or None.
    segment_ids: int `[B, T]` trajectories of packed rows (for the sequence
      mean; `TrainBatch.segment_ids_BxT`), or None: one per row.

  Returns:
    `(loss, metrics)` with `num_tokens` (the finite ones), `clip_frac`
    (tokens whose clipped term was taken), `dual_clip_frac`, `ratio_mean`,
    `ratio_min`, `ratio_max`, `kl_k1`, `kl_k3` (KL(pi_old || pi) estimates),
    `nonfinite_tokens`.

  References:
    Schulman et al., "Proximal Policy Optimization", arXiv 1707.06347;
    Yu et al., "DAPO", arXiv 2503.14476 (clip-higher); Ye et al., "Mastering
    Complex Control in MOBA Games", arXiv 1912.09729 (dual clip).
  """
  where = 'ppo_policy_loss'
  if dual_clip is not None and dual_clip <= 1.0:
    raise ValueError(f'{where}: dual_clip must be > 1 or None, got {dual_clip}')
  masked_tokens.check_token_inputs(where, mask, logp=logp, old_logp=old_logp,
                            advantages=advantages)
  mask, nonfinite = finite_mask(mask, logp, old_logp)
  mask_BxT, (logp_BxT, old_BxT, adv_BxT) = masked_tokens.token_inputs(
      where, mask, logp=logp, old_logp=old_logp, advantages=advantages)
  old_BxT, adv_BxT = jax.lax.stop_gradient((old_BxT, adv_BxT))
  log_ratio_BxT = logp_BxT - old_BxT
  ratio_BxT = jnp.exp(log_ratio_BxT)
  unclipped_BxT = -adv_BxT * ratio_BxT
  clipped_BxT = -adv_BxT * jnp.clip(ratio_BxT, 1.0 - eps_low, 1.0 + eps_high)
  loss_BxT = jnp.maximum(unclipped_BxT, clipped_BxT)
  clip_active_BxT = mask_BxT & (clipped_BxT > unclipped_BxT)
  if dual_clip is not None:
    bound_BxT = -adv_BxT * dual_clip
    dual_active_BxT = mask_BxT & (adv_BxT < 0) & (loss_BxT > bound_BxT)
    loss_BxT = jnp.where(dual_active_BxT, bound_BxT, loss_BxT)
  else:
    dual_active_BxT = jnp.zeros_like(mask_BxT)
  if token_weights is not None:
    _, (weights_BxT,) = masked_tokens.token_inputs(where, mask,
                                            token_weights=token_weights)
    # `where`: a zero weight must silence an overflowed term, not make NaN.
    loss_BxT = jnp.where(weights_BxT != 0,
                         jax.lax.stop_gradient(weights_BxT) * loss_BxT, 0.0)
  loss = masked_tokens.aggregate(loss_BxT, mask_BxT, aggregation, segment_ids)

  metrics = masked_tokens.ratio_metrics(mask_BxT, log_ratio_BxT, ratio_BxT)
  count = jnp.maximum(metrics['num_tokens'], 1.0)
  metrics['clip_frac'] = jnp.sum(clip_active_BxT) / count
  metrics['dual_clip_frac'] = jnp.sum(dual_active_BxT) / count
  metrics['nonfinite_tokens'] = nonfinite
  return loss, metrics


def finite_mask(mask, *logps):
  """`mask` without the tokens where any of `logps` is not finite.

  Truncated sampling (top-k, top-p) gives -inf log-probs to tokens outside a
  policy's support. Dropping them from the mask before any arithmetic keeps
  both branches of every later `where` finite, so neither the loss nor its
  gradient sees NaN (a NaN gradient would make the optimizer skip the whole
  step).

  Returns:
    `(mask_BxT, nonfinite)`: a bool `[B, T]` mask and the float32 count of
    masked-in tokens it dropped.
  """
  mask_BxT = jnp.asarray(mask).astype(bool)
  finite_BxT = jnp.ones_like(mask_BxT)
  for logp_BxT in logps:
    finite_BxT &= jnp.isfinite(jax.lax.stop_gradient(logp_BxT))
  dropped = jnp.sum(mask_BxT & ~finite_BxT).astype(_F32)
  return mask_BxT & finite_BxT, dropped


def truncated_behavior_weights(prox_logp, behavior_logp, mask, *, cap):
  """Decoupled PPO's behaviour weight `min(pi_prox / mu, C)` per token.

  The clip of decoupled PPO is taken against a proximal policy pi_prox (the
  weights at the start of the batch); the importance weight
  `pi_prox(a_t) / mu(a_t)` corrects for the tokens having been sampled by the
  rollout engine's (stale) policy mu, truncated at C for bounded variance.

  Args:
    prox_logp: float `[B, T]` log pi_prox, recomputed by the learner.
    behavior_logp: float `[B, T]` mu_t, recorded by the rollout engine.
    mask: bool or 0/1 `[B, T]`.
    cap: the truncation C (> 0).

  Returns:
    float32 `[B, T]` weights, 0 off the mask (constants: no gradient).

  References:
    Fu et al., "AReaL", arXiv 2505.24298, eq. 5 (decoupled PPO); Yao et al.,
    "Your efficient RL framework secretly brings you off-policy RL training"
    (truncated importance sampling), 2025.
  """
  masked_tokens.check_token_inputs('truncated_behavior_weights', mask,
                            prox_logp=prox_logp, behavior_logp=behavior_logp)
  mask, _ = finite_mask(mask, prox_logp, behavior_logp)
  mask_BxT, (prox_BxT, mu_BxT) = masked_tokens.token_inputs(
      'truncated_behavior_weights', mask, prox_logp=prox_logp,
      behavior_logp=behavior_logp)
  weights_BxT = jnp.minimum(jnp.exp(prox_BxT - mu_BxT), cap)
  return jax.lax.stop_gradient(jnp.where(mask_BxT, weights_BxT, 0.0))


#: verl's bounds (`kl_penalty`, low_var_kl): the log-ratio is clamped to
#: +-20 before the exp, the k3 estimate to +-10, so that one token whose
#: probability collapsed under either policy cannot dominate the batch.
_LOG_RATIO_CLAMP = 20.0
_K3_CLAMP = 10.0

KL_ESTIMATORS = ('k1', 'k3')


def reference_kl(logp, ref_logp, mask, *, estimator='k3',
                 aggregation='token_mean', segment_ids=None):
  """A differentiable estimate of KL(pi_theta || pi_ref) on the sampled tokens.

  With `log r_t = ref_logp_t - logp_t`:
    k1: `-log r_t` (the plain log-ratio; its gradient is `grad logp_t`);
    k3: `r_t - 1 - log r_t` (non-negative, lower variance; GRPO's penalty,
        verl's `low_var_kl`), with `log r_t` clamped to +-20 and the estimate
        to +-10 as verl does.
  Tokens where either log-prob is not finite (outside a truncated support)
  are left out (`finite_mask`).

  Args:
    logp: float `[B, T]` log pi_theta(a_t | s_t).
    ref_logp: float `[B, T]` log pi_ref(a_t | s_t) of the frozen initial policy
      (a constant).
    mask: bool or 0/1 `[B, T]`.
    estimator: one of `KL_ESTIMATORS`.
    aggregation: one of `AGGREGATIONS`.
    segment_ids: int `[B, T]` trajectories of packed rows, or None.

  Returns:
    float32 scalar.

  References:
    Shao et al., "DeepSeekMath", arXiv 2402.03300, eq. 4 (k3 in GRPO);
    Schulman, "Approximating KL divergence", 2020.
  """
  where = 'reference_kl'
  masked_tokens.check_token_inputs(where, mask, logp=logp, ref_logp=ref_logp)
  mask, _ = finite_mask(mask, logp, ref_logp)
  mask_BxT, (logp_BxT, ref_BxT) = masked_tokens.token_inputs(
      where, mask, logp=logp, ref_logp=ref_logp)
  log_r_BxT = jax.lax.stop_gradient(ref_BxT) - logp_BxT
  if estimator == 'k1':
    kl_BxT = -log_r_BxT
  elif estimator == 'k3':
    log_r_BxT = jnp.clip(log_r_BxT, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    kl_BxT = jnp.clip(jnp.exp(log_r_BxT) - 1.0 - log_r_BxT, -_K3_CLAMP,
                      _K3_CLAMP)
  else:
    raise ValueError(f'{where}: unknown estimator {estimator!r}; expected one'
                     f' of {KL_ESTIMATORS}')
  return masked_tokens.aggregate(kl_BxT, mask_BxT, aggregation, segment_ids)


def value_loss(values, returns, mask, *, old_values=None, clip_eps=None,
               aggregation='token_mean', segment_ids=None):
  """Critic regression `0.5 * (V_t - R_t)^2` on action tokens, optionally clipped.

  With `clip_eps` set, PPO-style value clipping:
  `0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2)`.
  SAO's critic target R is the Monte-Carlo return (lambda_critic = 1, gamma = 1).

  Args:
    values: float `[B, T]` V_phi(s_t) under the critic being trained.
    returns: float `[B, T]` targets R_t (treated as constants).
    mask: bool or 0/1 `[B, T]`.
    old_values: float `[B, T]` values at rollout time; needed with `clip_eps`.
    clip_eps: value clip width, or None (SAO default: off).
    aggregation: one of `AGGREGATIONS`.
    segment_ids: int `[B, T]` trajectories of packed rows, or None.

  Returns:
    `(loss, metrics)` with `num_tokens`, `value_mean`, `return_mean`,
    `explained_variance`, `r_squared`, `value_clip_frac`.
  """
  where = 'value_loss'
  inputs = dict(values=values, returns=returns)
  if clip_eps is not None:
    if old_values is None:
      raise ValueError(f'{where}: clip_eps={clip_eps} needs old_values')
    inputs['old_values'] = old_values
  mask_BxT, arrays = masked_tokens.token_inputs(where, mask, **inputs)
  values_BxT = arrays[0]
  returns_BxT = jax.lax.stop_gradient(arrays[1])
  sq_err_BxT = (values_BxT - returns_BxT) ** 2
  if clip_eps is not None:
    old_BxT = jax.lax.stop_gradient(arrays[2])
    clipped_BxT = old_BxT + jnp.clip(values_BxT - old_BxT, -clip_eps, clip_eps)
    sq_clip_BxT = (clipped_BxT - returns_BxT) ** 2
    clip_active_BxT = mask_BxT & (sq_clip_BxT > sq_err_BxT)
    sq_err_BxT = jnp.maximum(sq_err_BxT, sq_clip_BxT)
  else:
    clip_active_BxT = jnp.zeros_like(mask_BxT)
  loss = masked_tokens.aggregate(0.5 * sq_err_BxT, mask_BxT, aggregation,
                          segment_ids)

  num_tokens = jnp.sum(mask_BxT).astype(_F32)
  count = jnp.maximum(num_tokens, 1.0)
  metrics = {
      'num_tokens': num_tokens,
      'value_mean': jnp.sum(values_BxT) / count,
      'return_mean': jnp.sum(returns_BxT) / count,
      'explained_variance': explained_variance(values_BxT, returns_BxT,
                                               mask_BxT),
      'r_squared': r_squared(values_BxT, returns_BxT, mask_BxT),
      'value_clip_frac': jnp.sum(clip_active_BxT) / count,
  }
  return loss, jax.lax.stop_gradient(metrics)


def explained_variance(values, returns, mask):
  """`1 - Var[R - V] / Var[R]` over the masked-in tokens (the critic's health).

  1 is a perfect critic, 0 one no better than a constant, negative one worse.
  NaN when the returns have no variance (e.g. every reward of the batch equal),
  where the quantity is undefined.

  Args:
    values: float `[B, T]` V_t.
    returns: float `[B, T]` R_t.
    mask: bool or 0/1 `[B, T]`.

  Returns:
    float32 scalar.
  """
  mask_BxT, (values_BxT, returns_BxT) = masked_tokens.token_inputs(
      'explained_variance', mask, values=values, returns=returns)
  var_returns = _masked_variance(returns_BxT, mask_BxT)
  ev = 1.0 - _masked_variance(returns_BxT - values_BxT, mask_BxT) / var_returns
  return jnp.where(var_returns > 0, ev, jnp.nan)


def r_squared(values, returns, mask):
  """`1 - E[(R - V)^2] / Var[R]` over the masked-in tokens.

  Unlike `explained_variance`, a constant offset counts against the critic:
  a critic that has not yet learned the mean return scores below 0 here, and
  the two agree once it is unbiased. NaN when the returns have no variance.
  """
  mask_BxT, (values_BxT, returns_BxT) = masked_tokens.token_inputs(
      'r_squared', mask, values=values, returns=returns)
  var_returns = _masked_variance(returns_BxT, mask_BxT)
  # The inputs are 0 off the mask, so the plain sum is the masked one.
  mse = jnp.sum((returns_BxT - values_BxT) ** 2) / jnp.maximum(
      jnp.sum(mask_BxT), 1)
  return jnp.where(var_returns > 0, 1.0 - mse / var_returns, jnp.nan)


def _masked_variance(x_BxT, mask_BxT):
  """Population variance of `x` over the masked-in tokens (x is 0 off it)."""
  count = jnp.maximum(jnp.sum(mask_BxT), 1)
  mean = jnp.sum(x_BxT) / count
  return jnp.sum(jnp.where(mask_BxT, (x_BxT - mean) ** 2, 0.0)) / count
