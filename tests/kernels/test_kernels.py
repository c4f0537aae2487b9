"""Every kernel implementation against its reference: forward and gradient.

The Pallas kernels run in interpret mode here (CPU); the Mosaic compile for
real TPUs is checked in test_tpu_compile.py. Shapes are small and not
multiples of the blocks, with blocks small enough that rows span several time
blocks (the GAE carry and the DIS accumulators cross block boundaries).
"""

import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax import config_lib
from sao_jax import kernels
from sao_jax import recipe_checks
from sao_jax import sharding
from sao_jax.rl import advantages
from sao_jax.rl import losses

IMPLEMENTATIONS = ['xla', 'pallas']
DTYPES = {'f32': (jnp.float32, 1e-5), 'bf16': (jnp.bfloat16, 1e-2)}


def ragged_mask(rng, batch, length):
  """Random action runs with observation runs, incl. the edge cases."""
  mask = rng.random((batch, length)) < 0.6
  mask[0] = False  # all masked
  mask[1, :40] = False  # observation run at the start
  mask[2, -70:] = False  # observation run (or padding) at the end
  mask[3] = True  # all actions
  return mask


def gae_inputs(seed, batch=6, length=300, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  rewards = rng.normal(size=(batch, length)).astype(np.float32)
  values = rng.normal(size=(batch, length)).astype(np.float32)
  lam = rng.uniform(0.0, 1.0, size=batch).astype(np.float32)
  return (jnp.asarray(rewards, dtype), jnp.asarray(values, dtype),
          ragged_mask(rng, batch, length), lam)


@pytest.mark.parametrize('implementation', IMPLEMENTATIONS)
@pytest.mark.parametrize('dtype', list(DTYPES))
@pytest.mark.parametrize('gamma', [1.0, 0.95])
def test_gae_matches_reference(implementation, dtype, gamma):
  rewards, values, mask, lam = gae_inputs(0, dtype=DTYPES[dtype][0])
  got = kernels.skip_observation_gae(rewards, values, mask, gamma=gamma,
                                     lam=lam, implementation=implementation,
                                     block_t=128)
  want = advantages.skip_observation_gae(rewards, values, mask, gamma=gamma,
                                         lam=lam)
  for g, w in zip(got, want):
    assert g.dtype == jnp.float32 and g.shape == w.shape
    # Both upcast bf16 inputs to f32: the results agree to f32 rounding.
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(g)[~mask], 0.0)


def test_gae_kernel_scalar_lambda_and_nan_off_actions():
  rewards, values, mask, _ = gae_inputs(1, batch=5, length=131)
  rewards = jnp.where(mask, rewards, jnp.nan)  # junk off the actions
  values = jnp.where(mask, values, jnp.inf)
  got = kernels.skip_observation_gae(rewards, values, mask, gamma=1.0, lam=0.9,
                                     implementation='pallas')
  want = advantages.skip_observation_gae(
      rewards, values, mask, gamma=1.0, lam=0.9)
  chex.assert_tree_all_finite(got)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-4)


def dis_inputs(seed, batch=10, length=300, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  logp = -rng.uniform(0.05, 3.0, size=(batch, length))
  behaviour = logp + rng.normal(scale=0.7, size=logp.shape)
  adv = rng.normal(size=logp.shape)
  cast = lambda x: jnp.asarray(x.astype(np.float32), dtype)
  return cast(logp), cast(behaviour), cast(adv), ragged_mask(rng, batch, length)


@pytest.mark.parametrize('implementation', IMPLEMENTATIONS)
@pytest.mark.parametrize('dtype', list(DTYPES))
@pytest.mark.parametrize('aggregation', list(losses.AGGREGATIONS))
def test_dis_forward_and_gradient_match_reference(implementation, dtype,
                                                  aggregation):
  dt, tol = DTYPES[dtype]
  logp, mu, adv, mask = dis_inputs(2, dtype=dt)

  def run(fn, **kw):
    return jax.value_and_grad(
        lambda lp: fn(lp, mu, adv, mask, eps_low=0.3, eps_high=5.0,
                      aggregation=aggregation, **kw),
        has_aux=True)(logp)

  (loss, metrics), grad = run(kernels.dis_policy_loss,
                              implementation=implementation, block_b=32,
                              block_t=128)
  (want_loss, want_metrics), want_grad = run(losses.dis_policy_loss)
  assert metrics['frac_below'] > 0 and metrics['frac_above'] > 0
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-7)
  for name, value in want_metrics.items():
    np.testing.assert_allclose(metrics[name], value, rtol=1e-5, err_msg=name)
  assert grad.dtype == logp.dtype
  np.testing.assert_allclose(np.asarray(grad, np.float32),
                             np.asarray(want_grad, np.float32),
                             rtol=tol, atol=tol * np.abs(want_grad).max())


def test_dis_kernel_zero_gradient_outside_band_and_empty_batch():
  mu = jnp.zeros((1, 3))
  logp = jnp.log(jnp.array([[0.5, 1.0, 7.0]]))
  for sign in (1.0, -1.0):
    grad = jax.grad(lambda lp: kernels.dis_policy_loss(
        lp, mu, jnp.full((1, 3), sign), jnp.ones((1, 3)), eps_low=0.3,
        eps_high=5.0, implementation='pallas')[0])(logp)
    np.testing.assert_allclose(grad, [[0.0, -sign / 3, 0.0]], rtol=1e-6)
  z = jnp.zeros((2, 5))
  loss, metrics = kernels.dis_policy_loss(
      z, z, z, jnp.zeros((2, 5)), eps_low=0.3, eps_high=5.0,
      implementation='pallas')
  assert loss == 0.0 and metrics['num_tokens'] == 0.0
  assert metrics['ratio_min'] == 1.0 and metrics['ratio_max'] == 1.0


@pytest.mark.parametrize('aggregation', list(losses.AGGREGATIONS))
def test_dis_kernel_minus_inf_logp_is_dropped_not_nan(aggregation):
  # A token outside the learner's truncated top-k/top-p distribution has
  # logp = -inf: ratio 0, below the band, so it must contribute exactly 0.
  logp, mu, adv, mask = dis_inputs(4, batch=6, length=200)
  minus_inf = np.zeros(mask.shape, bool)
  minus_inf[1, 50:53] = minus_inf[3, 7] = minus_inf[4, 199] = True
  minus_inf[5, 10] = True  # and one masked out, which is ignored anyway
  mask[1, 50:53] = mask[3, 7] = mask[4, 199] = True
  mask[5, 10] = False
  logp = jnp.where(minus_inf, -jnp.inf, logp)

  def run(fn, **kw):
    return jax.value_and_grad(
        lambda lp: fn(lp, mu, adv, mask, eps_low=0.3, eps_high=5.0,
                      aggregation=aggregation, **kw),
        has_aux=True)(logp)

  (loss, metrics), grad = run(kernels.dis_policy_loss, implementation='pallas',
                              block_b=32, block_t=128)
  (want_loss, want_metrics), want_grad = run(losses.dis_policy_loss)
  assert np.isfinite(want_loss) and np.all(np.isfinite(want_grad))
  assert np.isfinite(loss) and np.all(np.isfinite(grad))
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5,
                             atol=1e-5 * np.abs(want_grad).max())
  np.testing.assert_array_equal(np.asarray(grad)[minus_inf], 0.0)
  # The KL estimates are truly infinite (pi gives the sampled token no mass).
  for name, value in want_metrics.items():
    np.testing.assert_allclose(metrics[name], value, rtol=1e-5, err_msg=name)
  assert metrics['kl_k1'] == np.inf and metrics['ratio_min'] == 0.0


def test_bad_implementation_and_blocks_are_clear_errors():
  logp, mu, adv, mask = dis_inputs(3, batch=4, length=20)
  with pytest.raises(ValueError, match="implementation='cuda' is not one of"):
    kernels.dis_policy_loss(logp, mu, adv, mask, eps_low=0.3, eps_high=5.0,
                            implementation='cuda')
  with pytest.raises(ValueError, match=r'block \(32, 100\) is not a multiple'
                     r' of the TPU tile \(32, 128\)'):
    kernels.dis_policy_loss(logp, mu, adv, mask, eps_low=0.3, eps_high=5.0,
                            implementation='pallas', block_t=100)
  # An oversized block is refused before Mosaic sees it.
  with pytest.raises(ValueError, match=r'block \(4096, 65536\) needs .* MiB of'
                     r' VMEM .* over the 32 MiB budget; use a smaller block'):
    kernels.skip_observation_gae(*gae_inputs(4, batch=4, length=20)[:3],
                                 gamma=1.0, lam=1.0, implementation='pallas',
                                 block_b=4096, block_t=65536)
  with pytest.raises(ValueError, match='values has shape'):
    kernels.skip_observation_gae(logp, logp[:, :5], mask, gamma=1.0, lam=1.0,
                                 implementation='pallas')


def test_config_switches_implementation_with_identical_results():
  # What the learner does: pass config.kernels.implementation through.
  root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
  logp, mu, adv, mask = dis_inputs(5, batch=4, length=140)
  results = {}
  for implementation in ('xla', 'pallas'):
    config = config_lib.load_config(os.path.join(root, 'configs', 'default.py'))
    config.kernels.implementation = implementation
    recipe_checks.validate(config, num_devices=1)
    (loss, _), grad = jax.value_and_grad(
        lambda lp, c=config: kernels.dis_policy_loss(
            lp, mu, adv, mask, eps_low=c.policy_loss.eps_low,
            eps_high=c.policy_loss.eps_high,
            aggregation=c.policy_loss.aggregation,
            implementation=c.kernels.implementation),
        has_aux=True)(logp)
    adv_gae, _ = kernels.skip_observation_gae(
        adv, logp, mask, gamma=config.advantage.gamma, lam=0.9,
        implementation=config.kernels.implementation)
    results[implementation] = (loss, grad, adv_gae)
  chex.assert_trees_all_close(results['pallas'], results['xla'], rtol=1e-5,
                              atol=1e-6)


# -- packed rows: trajectories as segments -------------------------------------


def packed_segments(rng, batch, length, max_segments=5):
  """Segment ids of packed rows: runs 1, 2, ... (unique over the batch),
  varying lengths, padding (0) at the end of most rows."""
  ids = np.zeros((batch, length), np.int32)
  next_id = 1
  for row in range(batch):
    start = 0
    for _ in range(int(rng.integers(1, max_segments + 1))):
      size = int(rng.integers(1, length // 2))
      if start + size > length:
        break
      ids[row, start:start + size] = next_id
      next_id += 1
      start += size
  ids[0, :] = next_id  # one row that is a single full segment
  return ids


def numpy_gae_per_segment(rewards, values, mask, gamma, lam_BxT, ids):
  """Skip-observation GAE of each trajectory on its own, in float64."""
  adv = np.zeros(rewards.shape)
  for n in np.unique(ids[ids > 0]):
    rows, cols = np.nonzero(ids == n)
    actions = [(r, c) for r, c in zip(rows, cols) if mask[r, c]]
    next_value = next_adv = 0.0
    for r, c in reversed(actions):
      delta = rewards[r, c] + gamma * next_value - values[r, c]
      adv[r, c] = delta + gamma * lam_BxT[r, c] * next_adv
      next_value, next_adv = values[r, c], adv[r, c]
  return adv, np.where(mask, adv + values, 0.0)


def packed_gae_inputs(seed, batch=6, length=300):
  rewards, values, mask, _ = gae_inputs(seed, batch, length)
  rng = np.random.default_rng(seed + 100)
  ids = packed_segments(rng, batch, length)
  mask = mask & (ids > 0)
  lam = rng.uniform(0.0, 1.0, size=ids.max() + 1).astype(np.float32)
  return rewards, values, mask, lam[ids], ids  # one lambda per trajectory


@pytest.mark.parametrize('gamma', [1.0, 0.95])
def test_gae_reference_packed_is_gae_of_each_trajectory_alone(gamma):
  rewards, values, mask, lam_BxT, ids = packed_gae_inputs(6)
  got = advantages.skip_observation_gae(
      rewards, values, mask, gamma=gamma, lam=lam_BxT, segment_ids=ids)
  want = numpy_gae_per_segment(np.asarray(rewards, np.float64),
                               np.asarray(values, np.float64), mask, gamma,
                               lam_BxT, ids)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('implementation', IMPLEMENTATIONS)
@pytest.mark.parametrize('per_token_lambda', [True, False])
def test_gae_packed_matches_reference(implementation, per_token_lambda):
  rewards, values, mask, lam_BxT, ids = packed_gae_inputs(7)
  lam = lam_BxT if per_token_lambda else lam_BxT[:, 0]
  got = kernels.skip_observation_gae(rewards, values, mask, gamma=0.95, lam=lam,
                                     segment_ids=ids,
                                     implementation=implementation, block_t=128)
  want = advantages.skip_observation_gae(rewards, values, mask, gamma=0.95,
                                         lam=lam, segment_ids=ids)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-4)
  # Without the segment ids the recursion would run across trajectories.
  unsegmented = advantages.skip_observation_gae(
      rewards, values, mask, gamma=0.95, lam=lam)
  assert np.abs(np.asarray(unsegmented[0]) - np.asarray(want[0])).max() > 0.1


def numpy_seq_mean_per_segment(term_BxT, mask, ids):
  """Mean over trajectories of each one's token mean, in float64."""
  means = [term_BxT[(ids == n) & mask].mean()
           for n in np.unique(ids[ids > 0]) if ((ids == n) & mask).any()]
  return np.mean(means)


def test_dis_reference_packed_is_the_mean_over_trajectories():
  logp, mu, adv, mask = dis_inputs(8, batch=6, length=300)
  ids = packed_segments(np.random.default_rng(8), 6, 300)
  mask = mask & (ids > 0)
  loss, _ = losses.dis_policy_loss(
      logp, mu, adv, mask, eps_low=0.3, eps_high=5.0,
      aggregation='seq_mean_token_mean', segment_ids=ids)
  ratio = np.exp(np.asarray(logp, np.float64) - np.asarray(mu, np.float64))
  keep = (ratio > 0.7) & (ratio < 6.0)
  term = np.where(keep, -ratio * np.asarray(adv) * np.asarray(logp), 0.0)
  np.testing.assert_allclose(loss, numpy_seq_mean_per_segment(term, mask, ids),
                             rtol=1e-5)


@pytest.mark.parametrize('implementation', IMPLEMENTATIONS)
@pytest.mark.parametrize('dtype', list(DTYPES))
@pytest.mark.parametrize('aggregation', list(losses.AGGREGATIONS))
def test_dis_packed_matches_reference(implementation, dtype, aggregation):
  dt, tol = DTYPES[dtype]
  logp, mu, adv, mask = dis_inputs(9, batch=10, length=300, dtype=dt)
  ids = packed_segments(np.random.default_rng(9), 10, 300)
  mask = mask & (ids > 0)

  def run(fn, **kw):
    return jax.value_and_grad(
        lambda lp: fn(lp, mu, adv, mask, eps_low=0.3, eps_high=5.0,
                      aggregation=aggregation, segment_ids=ids, **kw),
        has_aux=True)(logp)

  (loss, metrics), grad = run(kernels.dis_policy_loss,
                              implementation=implementation, block_b=32,
                              block_t=128)
  (want_loss, want_metrics), want_grad = run(losses.dis_policy_loss)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-7)
  chex.assert_trees_all_close(metrics, want_metrics, rtol=1e-5)
  assert grad.dtype == logp.dtype
  np.testing.assert_allclose(np.asarray(grad, np.float32),
                             np.asarray(want_grad, np.float32),
                             rtol=tol, atol=tol * np.abs(want_grad).max())


def test_packed_kernels_per_shard_match_one_call():
  """On a mesh the kernels run per batch shard; the sequence mean's weights
  are global, so the shards' sums add up to the one-call loss."""
  mesh = sharding.make_mesh({'data': 2, 'fsdp': 1, 'tensor': 1},
                            jax.devices()[:2])
  logp, mu, adv, mask = dis_inputs(10, batch=64, length=128)
  ids = packed_segments(np.random.default_rng(10), 64, 128)
  mask = mask & (ids > 0)
  dis = lambda lp, **kw: kernels.dis_policy_loss(
      lp, mu, adv, mask, eps_low=0.3, eps_high=5.0,
      aggregation='seq_mean_token_mean', segment_ids=ids,
      implementation='pallas', **kw)[0]
  chex.assert_trees_all_close(
      jax.value_and_grad(lambda lp: dis(lp, mesh=mesh))(logp),
      jax.value_and_grad(dis)(logp), rtol=1e-5, atol=1e-7)
  rewards, values = logp, mu
  gae = lambda **kw: kernels.skip_observation_gae(
      rewards, values, mask, gamma=1.0, lam=jnp.where(mask, 0.9, 0.0),
      segment_ids=ids, implementation='pallas', **kw)
  chex.assert_trees_all_close(gae(mesh=mesh), gae(), rtol=1e-6)
