"""Advantage estimators against numpy brute force and hand-worked cases."""

import collections

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

from sao_jax.rl import advantages

_GAE = jax.jit(lambda rewards, values, mask, gamma, lam:
               advantages.skip_observation_gae(rewards, values, mask,
                                               gamma=gamma, lam=lam))


def gae_brute_force(rewards, values, mask, gamma, lam):
  """The explicit double sum: A_t = sum_j (gamma lam)^j delta_{k_j}.

  k_0 = t, k_1, k_2, ... are the action tokens of the row from t on, and
  delta_k = r_k + gamma V[next action after k] - V[k] (0 past the last one).
  """
  batch, _ = rewards.shape
  lam = np.broadcast_to(np.asarray(lam, np.float64), (batch,))
  adv = np.zeros(rewards.shape)
  ret = np.zeros(rewards.shape)
  for b in range(batch):
    idx = np.flatnonzero(mask[b])
    for i, t in enumerate(idx):
      total = 0.0
      for j in range(i, len(idx)):
        k = idx[j]
        next_value = values[b, idx[j + 1]] if j + 1 < len(idx) else 0.0
        delta = rewards[b, k] + gamma * next_value - values[b, k]
        total += (gamma * lam[b]) ** (j - i) * delta
      adv[b, t] = total
      ret[b, t] = total + values[b, t]
  return adv, ret


def random_batch(rng, batch, length, p_action=0.6):
  rewards = rng.normal(size=(batch, length)).astype(np.float32)
  values = rng.normal(size=(batch, length)).astype(np.float32)
  mask = rng.random((batch, length)) < p_action
  return rewards, values, mask


@pytest.mark.parametrize('gamma', [1.0, 0.9])
@pytest.mark.parametrize('per_row_lam', [False, True])
def test_gae_matches_double_sum(gamma, per_row_lam):
  rng = np.random.default_rng(0)
  rewards, values, mask = random_batch(rng, 5, 17)
  mask[1] = False  # an all-observation row
  mask[2, :6] = False  # an observation run at the start
  mask[3, -5:] = False  # padding at the end
  lam = rng.uniform(0, 1, size=5).astype(np.float32) if per_row_lam else 0.8
  adv, ret = _GAE(rewards, values, mask, gamma, lam)
  want_adv, want_ret = gae_brute_force(rewards, values, mask, gamma, lam)
  np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-5)


def test_gae_hand_worked_multi_turn_trajectory():
  # Tokens: [prompt, a0, a1, obs, obs, a2, a3, pad]; gamma = 1, lam = 0.5.
  # V = [9, 1, 2, 9, 9, 3, 4, 9] (9 marks positions that must be ignored);
  # reward 1 on the last action a3 (and a stray 5 at the pad, ignored).
  #   a3: delta = 1 + 0 - 4 = -3;            A = -3
  #   a2: delta = 0 + V[a3] - 3 = 1;         A = 1 + 0.5 * -3 = -0.5
  #   a1: delta = 0 + V[a2] - 2 = 1 (skips the observation);
  #                                          A = 1 + 0.5 * -0.5 = 0.75
  #   a0: delta = 0 + V[a1] - 1 = 1;         A = 1 + 0.5 * 0.75 = 1.375
  # Returns A + V: a0 2.375, a1 2.75, a2 2.5, a3 1.
  mask = np.array([[0, 1, 1, 0, 0, 1, 1, 0]], bool)
  values = np.array([[9, 1, 2, 9, 9, 3, 4, 9]], np.float32)
  rewards = np.array([[0, 0, 0, 0, 0, 0, 1, 5]], np.float32)
  adv, ret = _GAE(rewards, values, mask, 1.0, 0.5)
  np.testing.assert_allclose(adv[0], [0, 1.375, 0.75, 0, 0, -0.5, -3, 0])
  np.testing.assert_allclose(ret[0], [0, 2.375, 2.75, 0, 0, 2.5, 1, 0])


def test_gae_ignores_nan_outside_actions():
  mask = np.array([[1, 0, 1, 0]], bool)
  values = np.array([[0.5, np.nan, 0.25, np.inf]], np.float32)
  rewards = np.array([[0.0, np.nan, 1.0, np.nan]], np.float32)
  adv, ret = _GAE(rewards, values, mask, 1.0, 1.0)
  np.testing.assert_allclose(adv[0], [0.5, 0, 0.75, 0])
  np.testing.assert_allclose(ret[0], [1, 0, 1, 0])



def plain_gae(rewards, values, gamma, lam):
  """Textbook GAE over one contiguous token sequence (no mask): the backward
  recursion A_t = r_t + gamma V_{t+1} - V_t + gamma lam A_{t+1}."""
  adv = np.zeros(len(rewards))
  next_value = next_adv = 0.0
  for t in reversed(range(len(rewards))):
    adv[t] = rewards[t] + gamma * next_value - values[t] + (
        gamma * lam * next_adv)
    next_value, next_adv = values[t], adv[t]
  return adv, adv + np.asarray(values, np.float64)


def test_response_mask_runs_from_first_action_over_real_tokens():
  input_mask = np.array([[1, 1, 1, 1, 1, 1, 1, 0],
                         [1, 1, 1, 1, 1, 1, 0, 0],
                         [1, 1, 1, 0, 0, 0, 0, 0]], bool)
  action_mask = np.array([[0, 1, 1, 0, 0, 1, 1, 0],  # prompt, a, obs, a, pad
                          [0, 0, 1, 0, 1, 0, 0, 0],  # ends with an observation
                          [0, 0, 0, 0, 0, 0, 0, 0]], bool)  # no action at all
  got = advantages.response_mask(input_mask, action_mask)
  np.testing.assert_array_equal(got, [[0, 1, 1, 1, 1, 1, 1, 0],
                                      [0, 0, 1, 1, 1, 1, 0, 0],
                                      [0, 0, 0, 0, 0, 0, 0, 0]])
  with pytest.raises(ValueError, match=r'action_mask has shape \(3, 7\)'):
    advantages.response_mask(input_mask, action_mask[:, :7])


def test_naive_gae_hand_worked_runs_through_observations():
  # The trajectory of the skip-observation example above, with real values on
  # the observations: [prompt, a0, a1, o, o, a2, a3, pad], gamma = 1,
  # lam = 0.5, V = [9, 1, 2, 5, 6, 3, 4, 9], reward 1 on a3. Naive GAE runs
  # over the response (positions 1..6):
  #   a3: delta = 1 + 0 - 4 = -3;          A = -3
  #   a2: delta = 0 + V[a3] - 3 = 1;       A = 1 + 0.5 * -3 = -0.5
  #   o:  delta = 0 + V[a2] - 6 = -3;      A = -3 + 0.5 * -0.5 = -3.25
  #   o:  delta = 0 + 6 - 5 = 1;           A = 1 + 0.5 * -3.25 = -0.625
  #   a1: delta = 0 + V[o] - 2 = 3;        A = 3 + 0.5 * -0.625 = 2.6875
  #   a0: delta = 0 + V[a1] - 1 = 1;       A = 1 + 0.5 * 2.6875 = 2.34375
  # Skip-observation GAE gives a1 0.75 and a0 1.375 instead: a1 bootstraps
  # from V[a2] = 3, not V[o] = 5, and the tail reaches a0 through two fewer
  # factors gamma * lam. After the last observation (a2, a3) both agree.
  input_mask = np.array([[1, 1, 1, 1, 1, 1, 1, 0]], bool)
  action_mask = np.array([[0, 1, 1, 0, 0, 1, 1, 0]], bool)
  values = np.array([[9, 1, 2, 5, 6, 3, 4, 9]], np.float32)
  rewards = np.array([[0, 0, 0, 0, 0, 0, 1, 5]], np.float32)
  naive_mask = advantages.response_mask(input_mask, action_mask)
  adv, ret = _GAE(rewards, values, naive_mask, 1.0, 0.5)
  np.testing.assert_allclose(
      adv[0], [0, 2.34375, 2.6875, -0.625, -3.25, -0.5, -3, 0])
  np.testing.assert_allclose(
      ret[0], [0, 3.34375, 4.6875, 4.375, 2.75, 2.5, 1, 0])
  skip, _ = _GAE(rewards, values, action_mask, 1.0, 0.5)
  np.testing.assert_allclose(skip[0], [0, 1.375, 0.75, 0, 0, -0.5, -3, 0])


@pytest.mark.parametrize('gamma', [1.0, 0.9])
def test_naive_gae_is_plain_gae_over_the_response_tokens(gamma):
  rng = np.random.default_rng(3)
  batch, length = 6, 30
  input_mask = np.zeros((batch, length), bool)
  action_mask = np.zeros((batch, length), bool)
  for b in range(batch):
    # prompt, then alternating action and observation runs, then padding.
    real = int(rng.integers(12, length + 1))
    input_mask[b, :real] = True
    t, acting = int(rng.integers(1, 5)), True
    while t < real:
      run = int(rng.integers(1, 5))
      action_mask[b, t:min(t + run, real)] = acting
      t, acting = t + run, not acting
  rewards, values, _ = random_batch(rng, batch, length)
  lam = rng.uniform(0, 1, size=batch).astype(np.float32)
  response = advantages.response_mask(input_mask, action_mask)
  adv, ret = _GAE(rewards, values, response, gamma, lam)
  skip, _ = _GAE(rewards, values, action_mask, gamma, lam)
  for b in range(batch):
    first = np.flatnonzero(action_mask[b])[0]
    span = slice(first, int(input_mask[b].sum()))
    want_adv, want_ret = plain_gae(rewards[b, span], values[b, span], gamma,
                                   lam[b])
    np.testing.assert_allclose(adv[b, span], want_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret[b, span], want_ret, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(adv)[b, ~response[b]], 0.0)
  # Only rows with an observation between actions tell the two apart.
  assert not np.allclose(np.asarray(adv)[action_mask],
                         np.asarray(skip)[action_mask])

_LENGTH = 24  # Fixed padded length: one compilation for all property examples.


def _padded(rewards, values, mask):
  pad = _LENGTH - len(mask)
  return (np.pad(rewards, (0, pad))[None].astype(np.float32),
          np.pad(values, (0, pad))[None].astype(np.float32),
          np.pad(mask, (0, pad))[None])


_floats = st.floats(-3, 3, allow_nan=False, width=32)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
    actions=st.lists(st.tuples(_floats, _floats), min_size=1, max_size=8),
    gaps=st.lists(st.integers(0, 2), min_size=8, max_size=8),
    gamma=st.floats(0.5, 1.0), lam=st.floats(0.0, 1.0))
def test_gae_unchanged_by_inserted_observations(actions, gaps, gamma, lam):
  rewards = np.array([a[0] for a in actions])
  values = np.array([a[1] for a in actions])
  base = _GAE(*_padded(rewards, values, np.ones(len(actions), bool)), gamma, lam)

  # The same actions with gaps[i] observation tokens before action i; the
  # observations carry junk rewards and values that must not matter.
  r_obs, v_obs, m_obs = [], [], []
  for i, (r, v) in enumerate(actions):
    r_obs += [7.0] * gaps[i] + [r]
    v_obs += [-7.0] * gaps[i] + [v]
    m_obs += [False] * gaps[i] + [True]
  spread = _GAE(*_padded(np.array(r_obs), np.array(v_obs), np.array(m_obs)),
                gamma, lam)
  is_action = np.pad(np.array(m_obs), (0, _LENGTH - len(m_obs)))
  for got, want in zip(spread, base):
    np.testing.assert_allclose(np.asarray(got)[0, is_action],
                               np.asarray(want)[0, :len(actions)],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got)[0, ~is_action], 0.0)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
    rewards=st.lists(_floats, min_size=_LENGTH, max_size=_LENGTH),
    values=st.lists(_floats, min_size=_LENGTH, max_size=_LENGTH),
    mask=st.lists(st.booleans(), min_size=_LENGTH, max_size=_LENGTH))
def test_gae_lambda_one_returns_are_future_reward_sums(rewards, values, mask):
  rewards, values, mask = (np.array(rewards, np.float32),
                           np.array(values, np.float32), np.array(mask))
  _, ret = _GAE(rewards[None], values[None], mask[None], 1.0, 1.0)
  action_rewards = np.where(mask, rewards, 0.0)
  future_sums = np.cumsum(action_rewards[::-1])[::-1]
  np.testing.assert_allclose(ret[0], np.where(mask, future_sums, 0.0),
                             rtol=1e-4, atol=1e-4)


def test_gae_shape_errors_name_the_shapes():
  r = np.zeros((2, 5), np.float32)
  with pytest.raises(ValueError, match=r'values has shape \(2, 4\).*\(2, 5\)'):
    advantages.skip_observation_gae(r, np.zeros((2, 4), np.float32),
                                    np.ones((2, 5)), gamma=1.0, lam=1.0)
  with pytest.raises(ValueError, match=r'lam has shape \(3,\)'):
    advantages.skip_observation_gae(r, r, np.ones((2, 5)), gamma=1.0,
                                    lam=np.ones(3, np.float32))
  with pytest.raises(ValueError, match=r'rewards has shape \(5,\).*rank 2'):
    advantages.skip_observation_gae(
        r[0], r, np.ones((2, 5)), gamma=1.0, lam=1.0)


def test_length_adaptive_lambda_values():
  lam = advantages.length_adaptive_lambda(
      np.array([0, 1, 2, 10, 1000]), alpha=1.5)
  np.testing.assert_allclose(
      lam, [0.0, 1 - 1 / 1.5, 1 - 1 / 3.0, 1 - 1 / 15.0, 1 - 1 / 1500.0],
      rtol=1e-6)
  # alpha * l < 1 would give a negative lambda: clipped to 0.
  np.testing.assert_allclose(
      advantages.length_adaptive_lambda(np.array([1, 3]), alpha=0.5),
      [0.0, 1 / 3],
      rtol=1e-6)
  with pytest.raises(ValueError, match='alpha must be positive'):
    advantages.length_adaptive_lambda(np.array([1]), alpha=0.0)


def test_grpo_advantages_match_numpy():
  rng = np.random.default_rng(1)
  rewards = rng.integers(0, 2, size=(4, 8)).astype(np.float32)
  rewards[0] = 1.0  # a solved group: zero advantage, not NaN
  got = jax.jit(advantages.grpo_advantages)(rewards)
  mean = rewards.mean(1, keepdims=True)
  # verl's torch.std: Bessel's correction (ddof 1).
  want = (rewards - mean) / (rewards.std(1, ddof=1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got[0], 0.0)
  # ddof matters: with G = 8 the population std is sqrt(7/8) of it.
  population = advantages.grpo_advantages(rewards, ddof=0)
  np.testing.assert_allclose(
      population, (rewards - mean) / (rewards.std(1, keepdims=True) + 1e-6),
      rtol=1e-5, atol=1e-6)
  assert np.abs(np.asarray(population) - np.asarray(got)).max() > 0.05
  dr = advantages.grpo_advantages(rewards, std_normalize=False)
  np.testing.assert_allclose(dr, rewards - mean, atol=1e-6)
  np.testing.assert_array_equal(advantages.grpo_advantages(rewards[:, :1]), 0.0)


def test_running_mean_matches_deque_simulation():
  rng = np.random.default_rng(2)
  num_slots, window, global_window = 3, 4, 6
  state = advantages.running_mean_init(num_slots, window, global_window)
  step = jax.jit(advantages.running_mean_advantages)
  history = collections.defaultdict(lambda: collections.deque(maxlen=window))
  every = collections.deque(maxlen=global_window)
  for _ in range(6):
    rewards = rng.normal(size=5).astype(np.float32)
    slots = rng.integers(0, num_slots, size=5)
    got, state = step(state, rewards, slots)
    fallback = np.mean(every) if every else 0.0
    want = [r - (np.mean(history[s]) if history[s] else fallback)
            for r, s in zip(rewards, slots)]
    for r, s in zip(rewards, slots):
      history[s].append(r)
      every.append(r)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_running_mean_unseen_question_uses_the_global_mean():
  state = advantages.running_mean_init(4, 2, 3)
  adv, state = advantages.running_mean_advantages(
      state, np.array([1., 0.]), np.array([0, 1]))
  np.testing.assert_allclose(adv, [1, 0])  # nothing recorded: baseline 0
  # Question 2 is new: the mean of every reward so far (0.5); question 0
  # has its own window (1.0).
  adv, state = advantages.running_mean_advantages(
      state, np.array([1., 1.]), np.array([2, 0]))
  np.testing.assert_allclose(adv, [0.5, 0.0])


def test_running_mean_global_window():
  state = advantages.running_mean_init(1, 1, 3)
  adv, state = advantages.running_mean_advantages(state, np.array([1., 2.]))
  np.testing.assert_allclose(adv, [1, 2])  # empty history: baseline 0
  adv, state = advantages.running_mean_advantages(state, np.array([3., 4.]))
  np.testing.assert_allclose(adv, [1.5, 2.5])  # baseline mean(1, 2)
  adv, state = advantages.running_mean_advantages(state, np.array([0.]))
  np.testing.assert_allclose(adv, [-3.0])  # last 3 of 1..4: mean(2, 3, 4)
  # A batch longer than the window keeps its last 3 rewards.
  _, state = advantages.running_mean_advantages(state,
                                                np.arange(5, dtype=float))
  adv, _ = advantages.running_mean_advantages(state, np.array([0.]))
  np.testing.assert_allclose(adv, [-3.0])  # mean(2, 3, 4)


def test_broadcast_and_normalize():
  mask = np.array([[1, 1, 0], [0, 1, 1]], bool)
  adv = advantages.broadcast_to_actions(np.array([2.0, -1.0]), mask)
  np.testing.assert_array_equal(adv, [[2, 2, 0], [0, -1, -1]])
  norm = advantages.normalize_advantages(adv, mask)
  on = np.array([2, 2, -1, -1.0])
  # verl's masked_whiten: unbiased variance, rsqrt(var + 1e-8).
  want = (on - on.mean()) / np.sqrt(on.var(ddof=1) + 1e-8)
  np.testing.assert_allclose(np.asarray(norm)[mask], want, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(norm)[~mask], 0.0)
  # Random values: the same formula, independent of the mask's layout.
  rng = np.random.default_rng(5)
  values = rng.normal(size=(3, 7)).astype(np.float32) * 3 + 1
  mask = rng.random((3, 7)) < 0.6
  got = np.asarray(advantages.normalize_advantages(values, mask))
  on = values[mask].astype(np.float64)
  np.testing.assert_allclose(
      got[mask], (on - on.mean()) / np.sqrt(on.var(ddof=1) + 1e-8), rtol=1e-5)
  # One action token: centred (0), not NaN.
  one = np.zeros((1, 3), bool)
  one[0, 1] = True
  np.testing.assert_array_equal(
      advantages.normalize_advantages(values[:1, :3], one), 0.0)
