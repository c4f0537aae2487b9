"""The actor's and critic's AdamW against a numpy Adam (first moment f32 or
bf16), and their learning-rate schedules by hand."""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from sao_jax import config_lib
from sao_jax import recipe_checks
from sao_jax.learner import optimizers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _actor_cfg(mu_dtype):
  cfg = config_lib.load_config(
      os.path.join(ROOT, 'configs', 'default.py')).optim.actor
  cfg.learning_rate = 1e-2
  cfg.warmup_steps = 0
  cfg.schedule = 'constant'  # the numpy Adam's rate is fixed
  cfg.grad_clip_norm = 1e9  # clipping is not what this file checks
  cfg.weight_decay = 0.1
  cfg.mu_dtype = mu_dtype
  return cfg


def _bf16(x):
  return x.astype(ml_dtypes.bfloat16).astype(np.float64)


def _numpy_adamw(params_N, grads_SN, cfg, round_mu):
  """Adam with decoupled weight decay; mu kept in bf16 when `round_mu`.

  With a bf16 moment, optax's decay b1 * mu multiplies a bf16 array by a
  Python float, so b1 itself becomes bf16 (0.9 -> 0.8984375); jitted,
  XLA:CPU keeps the product in f32 (eagerly it would be rounded to bf16).
  The new moment drives the update in f32 and is stored rounded.
  """
  p_N = params_N.astype(np.float64)
  m_N = np.zeros_like(p_N)
  v_N = np.zeros_like(p_N)
  for step, g_N in enumerate(grads_SN, start=1):
    b1 = _bf16(np.float64(cfg.b1)) if round_mu else cfg.b1
    decayed_N = b1 * m_N
    m_N = decayed_N + (1 - cfg.b1) * g_N
    v_N = cfg.b2 * v_N + (1 - cfg.b2) * g_N**2
    m_hat_N = m_N / (1 - cfg.b1**step)
    v_hat_N = v_N / (1 - cfg.b2**step)
    p_N = p_N - cfg.learning_rate * (
        m_hat_N / (np.sqrt(v_hat_N) + 1e-8) + cfg.weight_decay * p_N)
    if round_mu:
      m_N = _bf16(m_N)
  return p_N


@pytest.mark.parametrize('mu_dtype', ['float32', 'bfloat16'])
def test_adamw_matches_numpy_with_mu_stored_in_its_dtype(mu_dtype):
  rng = np.random.default_rng(0)
  params_N = rng.normal(size=64).astype(np.float32)
  # Gradients of mixed sign and scale, so a bf16 moment's rounding shows.
  grads_SN = rng.normal(size=(4, 64)).astype(np.float32) * np.float32(
      [1.0, 1e-3, 3.0, 0.1])[:, None]
  cfg = _actor_cfg(mu_dtype)
  tx = optimizers.make(cfg, total_batches=len(grads_SN))
  params = {'w': jnp.asarray(params_N)}
  state = tx.init(params)
  update = jax.jit(tx.update)  # as the learner runs it
  for g_N in grads_SN:
    updates, state = update({'w': jnp.asarray(g_N)}, state, params)
    params = jax.tree.map(lambda p, u: p + u, params, updates)

  want_N = _numpy_adamw(params_N, grads_SN, cfg,
                        round_mu=mu_dtype == 'bfloat16')
  np.testing.assert_allclose(params['w'], want_N, rtol=2e-6, atol=2e-7)
  if mu_dtype == 'bfloat16':
    # The f32-moment run lands elsewhere: the rounding is really there.
    other_N = _numpy_adamw(params_N, grads_SN, cfg, round_mu=False)
    assert np.abs(other_N - want_N).max() > 1e-6

  moments = [leaf for leaf in jax.tree.leaves(state) if leaf.shape == (64,)]
  assert sorted(str(m.dtype) for m in moments) == sorted([mu_dtype, 'float32'])


def test_cosine_schedule_by_hand_after_a_linear_warmup():
  cfg = _actor_cfg('float32')
  cfg.learning_rate, cfg.warmup_steps = 2e-5, 3
  cfg.schedule, cfg.min_lr_ratio = 'cosine', 0.1
  rate = optimizers.schedule(cfg, total_batches=24)
  got = [float(rate(batch)) for batch in (0, 1, 2, 3, 13, 23, 30)]
  # Warm-up (b + 1) / 4 of the rate over batches 0-2 (above 0 from the
  # first); then 2e-5 (0.1 + 0.9 (1 + cos(pi t / 20)) / 2) for t = b - 3,
  # at the floor on the last batch (23).
  want = [5e-6, 1e-5, 1.5e-5, 2e-5, 2e-5 * (0.1 + 0.9 * 0.5), 2e-6, 2e-6]
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)
  cfg.schedule = 'constant'
  constant = optimizers.schedule(cfg, total_batches=24)
  assert float(constant(23)) == pytest.approx(2e-5)


def test_every_optimizer_step_of_a_batch_takes_the_batch_rate():
  # SGD-like check through AdamW's first step: with a constant gradient the
  # update of step k is -rate(k) * sign (Adam's normalisation), so the
  # parameter trajectory reads the rate of each optimizer step.
  cfg = _actor_cfg('float32')
  cfg.learning_rate, cfg.warmup_steps, cfg.weight_decay = 1.0, 2, 0.0
  tx = optimizers.make(cfg, total_batches=5, steps_per_batch=4)
  params = {'w': jnp.zeros(())}
  state = tx.init(params)
  rates = []
  for _ in range(12):
    updates, state = tx.update({'w': jnp.ones(())}, state, params)
    rates.append(-float(updates['w']))
  # Batches 0, 1, 2 at 1/3, 2/3, 1 of the rate, four optimizer steps each.
  np.testing.assert_allclose(rates, [1 / 3] * 4 + [2 / 3] * 4 + [1.0] * 4,
                             rtol=1e-4)  # f32 bias corrections


def test_an_unknown_mu_dtype_is_a_config_error():
  config = config_lib.load_config(os.path.join(ROOT, 'configs', 'default.py'))
  config.optim.critic.mu_dtype = 'float16'
  with pytest.raises(config_lib.ConfigError, match='optim.critic.mu_dtype'):
    recipe_checks.validate(config)
  config.optim.critic.mu_dtype = 'float32'
  config.optim.actor.schedule = 'linear'
  with pytest.raises(config_lib.ConfigError, match='optim.actor.schedule'):
    recipe_checks.validate(config)
