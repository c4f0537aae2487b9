"""Losses against numpy formulas and closed-form gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.rl import losses

def random_tokens(seed, batch=4, length=9, spread=0.6):
  rng = np.random.default_rng(seed)
  logp = -rng.uniform(0.1, 3.0, size=(batch, length)).astype(np.float32)
  # behaviour logprobs off by up to +-spread*3 nats: some ratios leave the band
  mu = (logp + rng.normal(scale=spread, size=logp.shape)).astype(np.float32)
  adv = rng.normal(size=logp.shape).astype(np.float32)
  mask = rng.random(logp.shape) < 0.7
  mask[0] = False  # an empty row
  return logp, mu, adv, mask


def dis_numpy(logp, mu, adv, mask, eps_low, eps_high):
  ratio = np.exp(logp.astype(np.float64) - mu)
  keep = (ratio > 1 - eps_low) & (ratio < 1 + eps_high) & mask
  n = max(mask.sum(), 1)
  loss = -np.sum(np.where(keep, ratio, 0) * adv * logp * mask) / n
  grad = -(mask * keep * adv * ratio) / n
  return loss, grad, ratio


@pytest.mark.parametrize('eps', [(0.3, 5.0), (0.2, 0.28)])
def test_dis_loss_and_gradient_closed_form(eps):
  logp, mu, adv, mask = random_tokens(0)
  eps_low, eps_high = eps
  fn = jax.jit(
      jax.value_and_grad(
          lambda lp: losses.dis_policy_loss(lp, mu, adv, mask, eps_low=eps_low,
                                            eps_high=eps_high), has_aux=True))
  (loss, metrics), grad = fn(logp)
  want_loss, want_grad, ratio = dis_numpy(logp, mu, adv, mask, eps_low, eps_high)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)

  n = mask.sum()
  below = ((ratio <= 1 - eps_low) & mask).sum() / n
  above = ((ratio >= 1 + eps_high) & mask).sum() / n
  assert below > 0 or above > 0  # the inputs do exercise the band
  np.testing.assert_allclose(metrics['frac_below'], below, rtol=1e-6)
  np.testing.assert_allclose(metrics['frac_above'], above, rtol=1e-6)
  np.testing.assert_allclose(metrics['num_tokens'], n)
  np.testing.assert_allclose(metrics['ratio_mean'], ratio[mask].mean(), rtol=1e-5)
  np.testing.assert_allclose(metrics['ratio_max'], ratio[mask].max(), rtol=1e-5)
  np.testing.assert_allclose(metrics['ratio_min'], ratio[mask].min(), rtol=1e-5)
  log_r = np.log(ratio[mask])
  np.testing.assert_allclose(metrics['kl_k1'], -log_r.mean(), rtol=1e-4)
  np.testing.assert_allclose(metrics['kl_k3'],
                             (ratio[mask] - 1 - log_r).mean(), rtol=1e-4)


@pytest.mark.parametrize('sign', [1.0, -1.0])
def test_dis_tokens_outside_band_get_exactly_zero_gradient(sign):
  # ratios 0.5 (below 1-0.3), 1.0 (inside), 7.0 (above 1+5): A has one sign.
  mu = np.zeros((1, 3), np.float32)
  logp = np.log(np.array([[0.5, 1.0, 7.0]], np.float32))
  adv = np.full((1, 3), sign, np.float32)
  grad = jax.grad(lambda lp: losses.dis_policy_loss(
      lp, mu, adv, np.ones((1, 3)), eps_low=0.3, eps_high=5.0)[0])(logp)
  assert grad[0, 0] == 0.0 and grad[0, 2] == 0.0
  np.testing.assert_allclose(grad[0, 1], -sign / 3, rtol=1e-6)


def test_dis_band_is_strict_at_the_edges():
  ratio = np.float32(jnp.exp(jnp.float32(-0.25)))  # what the loss computes
  eps_low = float(1.0 - ratio)  # exact in f32: ratio == 1 - eps_low
  logp = np.array([[-0.25, 0.0]], np.float32)
  mu = np.zeros((1, 2), np.float32)
  grad = jax.grad(lambda lp: losses.dis_policy_loss(
      lp, mu, np.ones((1, 2), np.float32), np.ones((1, 2)), eps_low=eps_low,
      eps_high=5.0)[0])(logp)
  assert grad[0, 0] == 0.0 and grad[0, 1] != 0.0


def test_dis_ratio_overflow_and_nan_padding_stay_finite():
  logp = np.array([[-1.0, 0.0, np.nan]], np.float32)
  mu = np.array([[-200.0, 0.0, np.nan]], np.float32)  # exp(199) overflows f32
  adv = np.array([[1.0, 2.0, np.nan]], np.float32)
  mask = np.array([[1, 1, 0]])
  (loss, metrics), grad = jax.value_and_grad(
      lambda lp: losses.dis_policy_loss(lp, mu, adv, mask, eps_low=0.3,
                                        eps_high=5.0),
      has_aux=True)(logp)
  assert np.isfinite(loss) and np.all(np.isfinite(grad))
  np.testing.assert_allclose(grad, [[0.0, -1.0, 0.0]])
  np.testing.assert_allclose(metrics['frac_above'], 0.5)


def test_dis_minus_inf_logp_of_a_dropped_token_stays_finite():
  # A token sampled under top-k/top-p can fall outside the learner's truncated
  # distribution: logp = -inf, ratio 0, below the band, no gradient, no NaN.
  logp = np.array([[-np.inf, -0.5]], np.float32)
  mu = np.array([[-1.0, -0.5]], np.float32)
  (loss, metrics), grad = jax.value_and_grad(
      lambda lp: losses.dis_policy_loss(
          lp, mu, np.ones((1, 2), np.float32), np.ones((1, 2)), eps_low=0.3,
          eps_high=5.0),
      has_aux=True)(
          logp)
  np.testing.assert_allclose(loss, 0.25)
  np.testing.assert_allclose(grad, [[0.0, -0.5]])
  np.testing.assert_allclose(metrics['frac_below'], 0.5)


def test_seq_mean_token_mean_aggregation():
  logp, mu, adv, mask = random_tokens(3, spread=0.0)
  loss, _ = losses.dis_policy_loss(logp, mu, adv, mask, eps_low=0.3,
                                   eps_high=5.0,
                                   aggregation='seq_mean_token_mean')
  per_token = -adv * logp  # ratio 1 everywhere (mu == logp)
  rows = [per_token[b][mask[b]].mean() for b in range(len(mask)) if mask[b].any()]
  np.testing.assert_allclose(loss, np.mean(rows), rtol=1e-5)
  with pytest.raises(ValueError, match='unknown mode'):
    losses.aggregate(per_token, mask, 'sum')


def test_all_masked_batch_gives_zero_loss():
  z = np.zeros((2, 3), np.float32)
  loss, metrics = losses.dis_policy_loss(
      z, z, z + 1, np.zeros((2, 3)), eps_low=0.3, eps_high=5.0)
  assert loss == 0.0 and metrics['num_tokens'] == 0.0


def ppo_numpy(logp, old, adv, mask, eps_low, eps_high, dual=None):
  ratio = np.exp(logp.astype(np.float64) - old)
  l1 = -adv * ratio
  l2 = -adv * np.clip(ratio, 1 - eps_low, 1 + eps_high)
  per = np.maximum(l1, l2)
  if dual is not None:
    per = np.where(adv < 0, np.minimum(per, -adv * dual), per)
  return np.sum(per * mask) / max(mask.sum(), 1)


@pytest.mark.parametrize('dual', [None, 3.0])
def test_ppo_loss_matches_numpy(dual):
  logp, old, adv, mask = random_tokens(4, spread=1.0)
  loss, metrics = jax.jit(
      lambda *a: losses.ppo_policy_loss(*a, eps_low=0.2, eps_high=0.28,
                                        dual_clip=dual))(
          logp, old, adv, mask)
  np.testing.assert_allclose(loss, ppo_numpy(logp, old, adv, mask, 0.2, 0.28,
                                             dual), rtol=1e-5)
  assert 0 < metrics['clip_frac'] < 1
  if dual is not None:
    assert metrics['dual_clip_frac'] > 0


def test_ppo_keeps_gradient_where_dis_drops_it():
  # A > 0 and r = 0.5 < 1 - eps: PPO's unclipped term wins, gradient flows;
  # A > 0 and r = 2 > 1 + eps: clipped, no gradient.
  old = np.zeros((1, 2), np.float32)
  logp = np.log(np.array([[0.5, 2.0]], np.float32))
  adv = np.ones((1, 2), np.float32)
  grad = jax.grad(lambda lp: losses.ppo_policy_loss(
      lp, old, adv, np.ones((1, 2)), eps_low=0.2, eps_high=0.2)[0])(logp)
  np.testing.assert_allclose(grad, [[-0.25, 0.0]], rtol=1e-6)  # -A r / N
  with pytest.raises(ValueError, match='dual_clip must be > 1'):
    losses.ppo_policy_loss(logp, old, adv, np.ones((1, 2)), eps_low=0.2,
                           eps_high=0.2, dual_clip=0.5)


@pytest.mark.parametrize('clip', [None, 0.2])
def test_value_loss_matches_numpy(clip):
  rng = np.random.default_rng(5)
  values = rng.normal(size=(3, 6)).astype(np.float32)
  returns = rng.normal(size=(3, 6)).astype(np.float32)
  old = (values + rng.normal(scale=0.5, size=values.shape)).astype(np.float32)
  mask = rng.random((3, 6)) < 0.7
  (loss, metrics), grad = jax.value_and_grad(
      lambda v: losses.value_loss(v, returns, mask, old_values=old,
                                  clip_eps=clip), has_aux=True)(values)
  sq = (values - returns) ** 2
  if clip is not None:
    sq = np.maximum(sq, (old + np.clip(values - old, -clip, clip) - returns) ** 2)
  np.testing.assert_allclose(loss, 0.5 * np.sum(sq * mask) / mask.sum(),
                             rtol=1e-5)
  if clip is None:
    np.testing.assert_allclose(grad, mask * (values - returns) / mask.sum(),
                               rtol=1e-5, atol=1e-7)
  else:
    assert metrics['value_clip_frac'] > 0
  with pytest.raises(ValueError, match='needs old_values'):
    losses.value_loss(values, returns, mask, clip_eps=0.2)


def test_explained_variance():
  rng = np.random.default_rng(6)
  returns = rng.normal(size=(4, 5)).astype(np.float32)
  values = (returns + rng.normal(scale=0.5, size=returns.shape)).astype(np.float32)
  mask = rng.random((4, 5)) < 0.8
  r, v = returns[mask], values[mask]
  np.testing.assert_allclose(losses.explained_variance(values, returns, mask),
                             1 - np.var(r - v) / np.var(r), rtol=1e-5)
  np.testing.assert_allclose(
      losses.explained_variance(returns, returns, mask), 1.0)
  assert np.isnan(losses.explained_variance(values, np.ones_like(returns), mask))


def test_loss_shape_errors_name_the_shapes():
  x = np.zeros((2, 5), np.float32)
  with pytest.raises(ValueError, match=r'dis_policy_loss: behavior_logp has'
                     r' shape \(2, 4\), expected'):
    losses.dis_policy_loss(
        x, x[:, :4], x, np.ones((2, 5)), eps_low=0.3, eps_high=5.0)
  with pytest.raises(ValueError, match=r'advantages has dtype int32'):
    losses.dis_policy_loss(
        x, x, x.astype(np.int32), np.ones((2, 5)), eps_low=0.3, eps_high=5.0)
  with pytest.raises(ValueError, match=r'mask has shape \(5,\).*rank 2'):
    losses.value_loss(x, x, np.ones(5))


def test_bf16_inputs_match_f32_reference():
  logp, mu, adv, mask = random_tokens(7)
  bf = [jnp.asarray(a, jnp.bfloat16) for a in (logp, mu, adv)]
  loss16, _ = losses.dis_policy_loss(*bf, mask, eps_low=0.3, eps_high=5.0)
  loss32, _ = losses.dis_policy_loss(*[np.asarray(a, np.float32) for a in bf],
                                     mask, eps_low=0.3, eps_high=5.0)
  assert loss16.dtype == jnp.float32
  np.testing.assert_allclose(loss16, loss32, rtol=1e-6)


def test_ppo_token_weights_scale_each_term_and_its_gradient():
  logp, old, adv, mask = random_tokens(5)
  weights = np.where(mask, np.random.default_rng(5).uniform(0, 2, logp.shape),
                     0).astype(np.float32)
  loss_fn = lambda w: lambda lp: losses.ppo_policy_loss(
      lp, old, adv, mask, eps_low=0.2, eps_high=0.28, token_weights=w)[0]
  plain = jax.grad(loss_fn(None))(logp)
  weighted = jax.grad(loss_fn(weights))(logp)
  np.testing.assert_allclose(weighted, weights * plain, rtol=1e-5, atol=1e-7)
  ratio = np.exp(logp.astype(np.float64) - old)
  per_token = np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.28))
  np.testing.assert_allclose(
      loss_fn(weights)(logp),
      np.sum(weights * per_token * mask) / mask.sum(), rtol=1e-5)


def test_truncated_behavior_weights():
  prox, mu, _, mask = random_tokens(6, spread=1.0)
  got = losses.truncated_behavior_weights(prox, mu, mask, cap=2.0)
  want = np.where(mask, np.minimum(np.exp(prox.astype(np.float64) - mu), 2.0),
                  0.0)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert 0 < np.mean(want[mask] == 2.0) < 1  # the cap acts on some tokens


@pytest.mark.parametrize('estimator', ['k1', 'k3'])
def test_reference_kl_value_and_gradient(estimator):
  logp, ref, _, mask = random_tokens(7)
  kl_fn = lambda lp: losses.reference_kl(lp, ref, mask, estimator=estimator)
  log_r = ref.astype(np.float64) - logp  # log pi_ref / pi
  per_token = -log_r if estimator == 'k1' else np.exp(log_r) - 1 - log_r
  # d/dlogp: k1 -> 1, k3 -> 1 - pi_ref / pi
  grad = np.ones_like(log_r) if estimator == 'k1' else 1 - np.exp(log_r)
  n = mask.sum()
  np.testing.assert_allclose(kl_fn(logp), np.sum(per_token * mask) / n,
                             rtol=1e-5)
  np.testing.assert_allclose(jax.grad(kl_fn)(logp), grad * mask / n,
                             rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(kl_fn(ref), 0.0, atol=1e-7)  # pi = pi_ref


def test_r_squared_counts_the_offset_that_explained_variance_ignores():
  rng = np.random.default_rng(8)
  returns = rng.normal(1.0, 0.5, size=(4, 5)).astype(np.float32)
  mask = rng.random((4, 5)) < 0.8
  r = returns[mask]
  offset = returns + 3.0  # perfect up to a constant
  np.testing.assert_allclose(losses.explained_variance(offset, returns, mask),
                             1.0, atol=1e-5)
  np.testing.assert_allclose(losses.r_squared(offset, returns, mask),
                             1 - 9.0 / np.var(r), rtol=1e-4)
  np.testing.assert_allclose(losses.r_squared(returns, returns, mask), 1.0)
  assert np.isnan(losses.r_squared(offset, np.ones_like(returns), mask))


def truncated_support(seed, logp, old):
  """-inf log-probs where a token left one policy's top-k / top-p support."""
  rng = np.random.default_rng(seed)
  logp, old = logp.copy(), old.copy()
  logp[rng.random(logp.shape) < 0.15] = -np.inf
  old[rng.random(old.shape) < 0.15] = -np.inf
  return logp, old


def ppo_numpy_grad(logp, old, adv, mask, eps_low, eps_high):
  """d loss / d logp_t: -A_t r_t / N where the unclipped term is taken."""
  ratio = np.exp(logp.astype(np.float64) - old)
  l1 = -adv * ratio
  l2 = -adv * np.clip(ratio, 1 - eps_low, 1 + eps_high)
  return np.where(mask & (l1 >= l2), -adv * ratio, 0.0) / max(mask.sum(), 1)


def test_ppo_nonfinite_logprobs_leave_the_mask_before_any_exp():
  logp, old, adv, mask = random_tokens(11, spread=1.0)
  logp, old = truncated_support(0, logp, old)
  finite = mask & np.isfinite(logp) & np.isfinite(old)
  assert 0 < (mask & ~finite).sum() < finite.sum()
  fn = jax.jit(lambda lp: losses.ppo_policy_loss(
      lp, old, adv, mask, eps_low=0.2, eps_high=0.28))
  (loss, metrics), grad = fn(logp), jax.grad(lambda lp: fn(lp)[0])(logp)
  # The numpy reference sees only the finite tokens.
  safe_logp, safe_old = np.where(finite, logp, 0), np.where(finite, old, 0)
  np.testing.assert_allclose(
      loss, ppo_numpy(safe_logp, safe_old, adv, finite, 0.2, 0.28), rtol=1e-5)
  assert np.all(np.isfinite(grad))
  np.testing.assert_allclose(
      grad, ppo_numpy_grad(safe_logp, safe_old, adv, finite, 0.2, 0.28),
      rtol=1e-5, atol=1e-8)
  assert metrics['nonfinite_tokens'] == (mask & ~finite).sum()
  assert metrics['num_tokens'] == finite.sum()
  assert all(np.isfinite(v) for v in metrics.values())


def test_decoupled_ppo_with_nonfinite_proximal_logprobs_has_finite_gradient():
  # The case: a `where` over a NaN branch gave a finite loss and a
  # NaN gradient. pi_prox = -inf at a token gives weight 0 there.
  logp, mu, adv, mask = random_tokens(12, spread=1.0)
  logp, prox = truncated_support(1, logp, mu)
  weights = losses.truncated_behavior_weights(prox, mu, mask, cap=2.0)
  assert np.all(np.isfinite(weights))
  grad = jax.grad(lambda lp: losses.ppo_policy_loss(
      lp, prox, adv, mask, eps_low=0.2, eps_high=0.28, token_weights=weights)[0]
                 )(
                     logp)
  finite = mask & np.isfinite(logp) & np.isfinite(prox)
  want = ppo_numpy_grad(np.where(finite, logp, 0), np.where(finite, prox, 0),
                        adv, finite, 0.2, 0.28) * np.asarray(weights)
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize('estimator', ['k1', 'k3'])
def test_reference_kl_leaves_out_nonfinite_tokens_and_clamps_k3(estimator):
  logp, ref, _, mask = random_tokens(13)
  logp, ref = truncated_support(2, logp, ref)
  finite = mask & np.isfinite(logp) & np.isfinite(ref)
  kl_fn = lambda lp: losses.reference_kl(lp, ref, mask, estimator=estimator)
  log_r = (np.where(finite, ref, 0).astype(np.float64)
           - np.where(finite, logp, 0))
  per_token = -log_r if estimator == 'k1' else np.exp(log_r) - 1 - log_r
  np.testing.assert_allclose(kl_fn(logp), np.sum(per_token * finite)
                             / finite.sum(), rtol=1e-5)
  assert np.all(np.isfinite(jax.grad(kl_fn)(logp)))
  # verl's clamp: a log-ratio of 30 counts as 20, and k3 as at most 10.
  one = np.ones((1, 1), bool)
  far = losses.reference_kl(
      np.zeros((1, 1), np.float32), np.full((1, 1), 30.0, np.float32), one,
      estimator=estimator)
  np.testing.assert_allclose(far, -30.0 if estimator == 'k1' else 10.0)
