"""The learner's step: sharded like one device, micro-batched like one batch,
NaN-safe, every algorithm, both kernel implementations."""

import os

import chex
import jax
import numpy as np
import pytest

from sao_jax import config_lib
from sao_jax import sharding
from sao_jax import types
from sao_jax.learner import learner as learner_lib
from sao_jax.models import tiny
from sao_jax.rl import advantages
from sao_jax.rl import algorithms
from sao_jax.rollout import batching

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 8


def make_config(algorithm='sao', lr=1e-2, **changes):
  config = config_lib.load_config(
      os.path.join(ROOT, 'configs', 'default.py') + f':algorithm={algorithm}')
  config.batch_size = BATCH
  config.group_size = 4 if config.group_size > 1 else 1
  for role in ('actor', 'critic'):
    config.optim[role].learning_rate = lr
    config.optim[role].warmup_steps = 0
    config.optim[role].schedule = 'constant'  # the references assume it
  for key, value in changes.items():
    node = config
    *parents, leaf = key.split('.')
    for part in parents:
      node = node[part]
    node[leaf] = value
  return config


def fake_batch(seed, nan_reward=False):
  """A batch of `fake_trajectories`, one per row of 32 tokens."""
  return batching.assemble_batch(fake_trajectories(seed, nan_reward), 32, 0)


def fake_trajectories(seed, nan_reward=False):
  """Multi-turn-shaped trajectories: prompt, action, observation, action."""
  rng = np.random.default_rng(seed)
  trajs = []
  for i in range(BATCH):
    length = int(rng.integers(14, 30))
    tokens = rng.integers(3, tiny.VOCAB, length).astype(np.int32)
    mask = np.zeros(length, bool)
    mask[5:] = True
    mask[9:12] = False  # an observation
    logp = np.where(mask, -rng.uniform(0.5, 4.0, length), 0.0)
    reward = float(rng.integers(0, 2))
    if nan_reward and i == 3:
      reward = float('nan')
    trajs.append(types.Trajectory(
        prompt_id=f'p{i // 4}', tokens=tokens, action_mask=mask,
        behavior_logprobs=logp.astype(np.float32),
        versions=np.where(mask, 0, -1).astype(np.int32), reward=reward))
  return trajs


class Owned:
  """A (functional) learner and the state this test owns.

  `run` threads `.state` through the steps; other attributes are the
  learner's, so `owned.train_step(owned.state, ...)` reads like the trainer.
  """

  def __init__(self, learner):
    self.learner = learner
    self.state = learner.init_state()

  def __getattr__(self, name):
    return getattr(self.learner, name)


def make_learner(config, devices, experts=0):
  model, _ = tiny.make(seed=1, experts=experts)
  mesh = learner_lib.mesh_from_config(config, devices)
  return Owned(learner_lib.Learner(config, model, mesh))


@pytest.fixture(scope='module')
def one_device():
  """A compiled one-device SAO learner and a way back to its first state.

  Compiling a learner takes most of a test's time; tests share this one and
  start from a copy of the initial state (steps donate the state they get).
  """
  learner = make_learner(make_config(lr=1e-4, **{'mesh.data': 1}),
                         jax.devices()[:1])
  initial = jax.tree.map(np.asarray, learner.state)

  def fresh():
    learner.state = jax.device_put(initial, learner.state_shardings)
    return learner

  return fresh


def flat(tree):
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in
          jax.tree_util.tree_flatten_with_path(tree)[0]}


def run(learner, seeds, **batch_kwargs):
  metrics = []
  for seed in seeds:
    learner.state, m = learner.train_step(
        learner.state, learner.device_batch(fake_batch(seed, **batch_kwargs)))
    metrics.append(jax.tree.map(np.asarray, m))
  return metrics


def on_mesh(mesh, implementation='xla', microbatches=1):
  """A learner on the first devices of a (data, fsdp, tensor) mesh."""
  data, fsdp, tensor = mesh
  return make_learner(make_config(lr=1e-4, **{
      'mesh.data': data, 'mesh.fsdp': fsdp, 'mesh.tensor': tensor,
      'kernels.implementation': implementation,
      'optim.microbatches': microbatches}), jax.devices()[:data * fsdp * tensor])


def assert_same_parameters(one, many, parts=('policy', 'critic')):
  # atol: 1% of an Adam step (lr 1e-4), the most that f32 reduction-order
  # noise in a near-zero gradient element can move a parameter through Adam.
  for part in parts:
    chex.assert_trees_all_close(
        flat(getattr(many.state, part)), flat(getattr(one.state, part)),
        rtol=1e-5, atol=1e-6, custom_message=part)


def assert_same_steps(one, many, rtol, extra=()):
  """Two steps of each learner: the same losses, norms and parameters."""
  m_one, m_many = run(one, [0, 1]), run(many, [0, 1])
  for a, b in zip(m_one, m_many):
    for key in ('policy/loss', 'critic/loss', 'policy/grad_norm') + extra:
      np.testing.assert_allclose(b[key], a[key], rtol=rtol, atol=1e-6,
                                 err_msg=key)
  assert_same_parameters(one, many)


@pytest.mark.slow
@pytest.mark.parametrize('mesh', [(8, 1, 1), (2, 4, 1), (2, 2, 2)])
def test_sharded_step_equals_one_device(mesh, one_device):
  _, fsdp, tensor = mesh
  # Adam turns reduction-order noise in near-zero gradients into full-size
  # steps; a small learning rate keeps the comparison at f32 noise level.
  one, many = one_device(), on_mesh(mesh)
  spec = str(many.state.policy['decoder']['blocks']['attn']['q_proj'][
      ...].sharding.spec)
  assert ('tensor' in spec) == (tensor > 1) and ('fsdp' in spec) == (fsdp > 1)
  assert_same_steps(one, many, rtol=2e-5)


@pytest.mark.slow
def test_expert_parallel_step_equals_one_device():
  """A tiny Qwen3-MoE (4 experts, 2 per token; the critic an MoE too) with
  its experts split 4 ways over `expert` and the rest over 2-way FSDP: two
  SAO steps equal the one-device ones, policy and critic."""
  one = make_learner(make_config(lr=1e-4, **{'mesh.data': 1}),
                     jax.devices()[:1], experts=4)
  many = make_learner(make_config(lr=1e-4, **{
      'mesh.data': 1, 'mesh.fsdp': 2, 'mesh.expert': 4}), jax.devices()[:8],
                      experts=4)
  mlp = many.state.policy['decoder']['blocks']['mlp']
  assert str(mlp['gate_proj'][...].sharding.spec).count('expert') == 1
  assert 'gate_proj' in many.state.critic['decoder']['blocks']['mlp']
  assert_same_steps(one, many, rtol=1e-5)


@pytest.mark.parametrize('implementation', ['xla', 'pallas'])
def test_a_sequence_split_step_equals_one_device(implementation, one_device):
  """Each row's 32 tokens over a 4-way `sequence` axis (and rows over
  2-way FSDP): the step is the unsharded one, kernels included."""
  one = one_device()
  many = make_learner(make_config(lr=1e-4, **{
      'mesh.data': 1, 'mesh.fsdp': 2, 'mesh.sequence': 4, 'mesh.tensor': 1,
      'kernels.implementation': implementation}), jax.devices()[:8])
  assert tuple(many.batch_sharding.spec) == (sharding.BATCH_AXES, 'sequence')
  assert_same_steps(one, many, rtol=2e-5, extra=('advantage/abs_mean',))


def test_microbatches_accumulate_to_the_full_batch(one_device):
  full = one_device()
  split = make_learner(make_config(lr=1e-4, **{'mesh.data': 1,
                                               'optim.microbatches': 4}),
                       jax.devices()[:1])
  (m_full,), (m_split,) = run(full, [0]), run(split, [0])
  # Micro-batch metrics are token-weighted (the micro-batches of 2 rows hold
  # different numbers of action tokens) and extremes are extremes: they equal
  # the full batch's.
  for key in ('policy/loss', 'policy/ratio_mean', 'policy/ratio_min',
              'policy/ratio_max', 'policy/frac_below', 'policy/frac_above',
              'policy/kl_k3', 'policy/num_tokens', 'critic/loss',
              'critic/explained_variance', 'critic/last_update/loss'):
    np.testing.assert_allclose(m_split[key], m_full[key], rtol=1e-5,
                               atol=1e-7, err_msg=key)
  # atol: 1% of an Adam step (lr 1e-4), the most that f32 summation-order
  # noise in a near-zero gradient can move a parameter through Adam.
  chex.assert_trees_all_close(flat(split.state.policy),
                              flat(full.state.policy), rtol=1e-5, atol=1e-6)


def test_nan_reward_skips_the_update_and_is_counted(one_device):
  learner = one_device()
  before_policy = flat(learner.state.policy)
  before_critic = flat(learner.state.critic)
  (metrics,) = run(learner, [0], nan_reward=True)
  assert metrics['policy/nonfinite_skips'] == 1
  assert metrics['critic/nonfinite_skips'] == 2  # K = 2 critic updates
  assert metrics['policy/nonfinite_skips_total'] == 1
  # The loss's inputs are still reported: they do not read the reward.
  for key in ('policy/ratio_min', 'policy/ratio_max', 'policy/num_tokens'):
    assert np.isfinite(metrics[key]), key
  chex.assert_trees_all_equal(flat(learner.state.policy), before_policy)
  chex.assert_trees_all_equal(flat(learner.state.critic), before_critic)
  # The next, healthy batch trains normally: no skip this step, one in all.
  (metrics,) = run(learner, [1])
  assert metrics['policy/nonfinite_skips'] == 0
  assert metrics['policy/nonfinite_skips_total'] == 1
  assert np.isfinite(metrics['policy/loss'])
  changed = [k for k, v in flat(learner.state.policy).items()
             if not np.array_equal(v, before_policy[k])]
  assert changed


def test_a_gradient_whose_norm_overflows_is_skipped_and_counted(one_device):
  """A reward of 1e30 (finite in float32) gives finite gradient elements
  whose global norm overflows: clipping would turn them into a silent zero
  update. It is a counted skip, like a NaN."""
  learner = one_device()
  before = flat(learner.state.policy)
  batch = fake_batch(0)
  batch = batch.replace(reward_N=batch.reward_N * 0 + 1e30,
                        rewards_BxT=np.where(batch.rewards_BxT != 0, 1e30,
                                             batch.rewards_BxT))
  learner.state, metrics = learner.train_step(learner.state,
                                              learner.device_batch(batch))
  assert not np.isfinite(float(metrics['policy/grad_norm']))
  assert int(metrics['policy/nonfinite_skips']) == 1
  assert int(metrics['critic/nonfinite_skips']) >= 1
  for key in ('policy/ratio_min', 'policy/ratio_max', 'policy/num_tokens'):
    assert np.isfinite(float(metrics[key])), key
  chex.assert_trees_all_equal(flat(learner.state.policy), before)


@pytest.mark.parametrize('algorithm', [
    a for a in algorithms.ALGORITHMS if a != 'sao'])  # sao: every other test
def test_every_algorithm_trains(algorithm):
  learner = make_learner(make_config(algorithm, **{'mesh.data': 1}),
                         jax.devices()[:1])
  before = flat(learner.state.policy)
  metrics = run(learner, [0, 1])
  assert int(learner.state.step) == 2
  for m in metrics:
    assert np.isfinite(m['policy/loss']) and m['policy/nonfinite_skips'] == 0
  after = flat(learner.state.policy)
  assert any(not np.array_equal(after[k], before[k]) for k in before)
  assert ('critic/loss' in metrics[0]) == algorithms.ALGORITHMS[
      algorithm].critic


def test_frozen_attention_critic_keeps_attention_in_the_learner(one_device):
  learner = one_device()
  frozen_before = flat(learner.state.critic_frozen)
  assert any("'attn'" in k for k in frozen_before)
  assert not any("'attn'" in k for k in flat(learner.state.critic))
  run(learner, [0, 1])
  chex.assert_trees_all_equal(flat(learner.state.critic_frozen), frozen_before)


def test_kernel_implementation_switch_gives_identical_results(one_device):
  results = {}
  for implementation in ('xla', 'pallas'):
    learner = one_device() if implementation == 'xla' else make_learner(
        make_config(lr=1e-4, **{'mesh.data': 1,
                                'kernels.implementation': implementation}),
        jax.devices()[:1])
    results[implementation] = (run(learner, [0])[0], flat(learner.state.policy))
  (m_xla, p_xla), (m_pallas, p_pallas) = results['xla'], results['pallas']
  np.testing.assert_allclose(m_pallas['policy/loss'], m_xla['policy/loss'],
                             rtol=1e-5)
  chex.assert_trees_all_close(p_pallas, p_xla, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize('microbatches', [1, 2])
def test_pallas_kernels_run_per_shard_on_a_mesh(microbatches, one_device):
  """Mosaic kernels cannot be partitioned by XLA: on a mesh they run under
  shard_map per batch shard (interpret mode here) and their partial sums are
  combined; micro-batches take rows from every shard. All of it must equal
  the one-device XLA step."""
  one, many = one_device(), on_mesh((2, 2, 2), 'pallas', microbatches)
  m_one, m_many = run(one, [0, 1]), run(many, [0, 1])
  # Micro-batch metrics are token-weighted: the same with either split.
  for a, b in zip(m_one, m_many):
    for key in ('policy/loss', 'critic/loss', 'policy/num_tokens',
                'policy/ratio_mean', 'policy/ratio_min', 'policy/ratio_max',
                'policy/frac_below', 'policy/frac_above', 'policy/kl_k3',
                'advantage/abs_mean'):
      np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=1e-6,
                                 err_msg=key)
  assert_same_parameters(one, many, parts=('policy',))


@pytest.mark.parametrize('implementation', ['xla', 'pallas'])
def test_skip_observations_switch_selects_the_gae_mask(implementation):
  batch = fake_batch(0)
  rng = np.random.default_rng(0)
  values = rng.normal(size=batch.rewards_BxT.shape).astype(np.float32)
  returns = rng.normal(size=batch.rewards_BxT.shape).astype(np.float32)
  actions = batch.action_mask_BxT
  # Real tokens from the first action on: the prompt (0..4) and padding drop
  # out, the observation (9..11) stays in.
  response = batch.input_mask_BxT & (np.cumsum(actions, axis=1) > 0)
  assert response[:, 9:12].all() and not response[:, :5].any()

  config = make_config(**{'kernels.implementation': implementation})
  assert config.advantage.skip_observations  # the default is SAO's
  lam = algorithms.policy_lambda(config, batch)
  np.testing.assert_array_equal(algorithms.gae_mask(config, batch), actions)
  got = algorithms.gae(config, batch, values, lam)
  want = advantages.skip_observation_gae(batch.rewards_BxT, values, actions,
                                         gamma=1.0, lam=lam)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)

  naive = make_config(**{'kernels.implementation': implementation,
                         'advantage.skip_observations': False})
  # The length-adaptive lambda still counts action tokens only.
  np.testing.assert_array_equal(algorithms.policy_lambda(naive, batch), lam)
  np.testing.assert_array_equal(algorithms.gae_mask(naive, batch), response)
  got = algorithms.gae(naive, batch, values, lam)
  want = advantages.skip_observation_gae(batch.rewards_BxT, values, response,
                                         gamma=1.0, lam=lam)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  assert np.abs(np.asarray(got[0])[:, 9:12]).sum() > 0  # observations count
  # The critic regresses on the tokens GAE ran over.
  for cfg, mask in ((config, actions), (naive, response)):
    loss, metrics = algorithms.value_loss(cfg, values, returns, batch)
    np.testing.assert_allclose(
        loss, 0.5 * np.mean((values - returns)[mask] ** 2), rtol=1e-5)
    assert metrics['num_tokens'] == mask.sum()


def test_naive_gae_trains_policy_on_actions_critic_on_response(one_device):
  sao = one_device()
  naive = make_learner(make_config(lr=1e-4, **{
      'mesh.data': 1, 'advantage.skip_observations': False}),
                       jax.devices()[:1])
  batch = fake_batch(0)
  actions = batch.action_mask_BxT
  response = batch.input_mask_BxT & (np.cumsum(actions, axis=1) > 0)
  (m_sao,), (m_naive,) = run(sao, [0]), run(naive, [0])
  for m in (m_sao, m_naive):
    assert np.isfinite(m['policy/loss']) and m['policy/nonfinite_skips'] == 0
    assert m['policy/num_tokens'] == actions.sum()
  assert m_sao['critic/num_tokens'] == actions.sum()
  assert m_naive['critic/num_tokens'] == response.sum() > actions.sum()
  assert m_naive['advantage/abs_mean'] != pytest.approx(
      m_sao['advantage/abs_mean'])


def test_forward_passes_go_a_micro_batch_at_a_time():
  # PPO with a value clip (so the returns need a value pass of their own),
  # decoupled old log-probs (a proximal pass), a reference KL (a reference
  # pass) and post-update values (a second value pass): every whole-batch
  # forward pass runs in micro-batches and must give the full batch's numbers.
  changes = {'mesh.data': 1, 'policy_loss.old_logprobs': 'decoupled',
             'policy_loss.ref_kl_coef': 0.1,
             'advantage.values_from': 'post_update', 'critic.value_clip': 0.5}
  full = make_learner(make_config('ppo', lr=1e-4, **changes),
                      jax.devices()[:1])
  # 2: the preset's 4 mini-batches of 2 rows take 1 row per micro-batch.
  split = make_learner(make_config('ppo', lr=1e-4, **changes,
                                   **{'optim.microbatches': 2}),
                       jax.devices()[:1])
  m_full, m_split = run(full, [0, 1]), run(split, [0, 1])
  for a, b in zip(m_full, m_split):
    # Not critic/value_clip_frac: it counts tokens where the clipped loss is
    # the larger (verl's), which f32 noise in a tiny update can flip.
    for key in ('policy/loss', 'policy/ref_kl', 'critic/loss',
                'critic/last_update/loss', 'advantage/abs_mean',
                'parity/pearson'):
      np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-7,
                                 err_msg=key)
  chex.assert_trees_all_close(flat(split.state.policy),
                              flat(full.state.policy), rtol=1e-5, atol=1e-6)


def test_map_microbatches_keeps_the_row_order():
  data_BxT = np.arange(24.0).reshape(8, 3)
  out = learner_lib.map_microbatches(lambda x: {'twice': 2 * x,
                                                'row_sum': x.sum(1)},
                                     data_BxT, 4)
  np.testing.assert_array_equal(out['twice'], 2 * data_BxT)
  np.testing.assert_array_equal(out['row_sum'], data_BxT.sum(1))


def advantages_from(learner, state, batch, config):
  """Mean |A| of skip-observation GAE with the critic of `state`."""
  values = algorithms.critic_values(learner.critic_model(state), batch)
  adv, _ = algorithms.gae(config, batch, values,
                          algorithms.policy_lambda(config, batch))
  return float(np.sum(np.abs(np.asarray(adv))) / batch.action_mask_BxT.sum())


@pytest.mark.parametrize('order, microbatches', [
    ('pre_update', 1), ('pre_update', 2), ('post_update', 1)])
def test_advantages_use_the_critic_from_before_its_updates(order,
                                                           microbatches):
  # pre_update values come from the first critic update's own forward pass
  # (re-assembled from its micro-batches): they must equal a separate pass.
  config = make_config(lr=1e-2, **{'mesh.data': 1,
                                    'advantage.values_from': order,
                                    'optim.microbatches': microbatches})
  learner = make_learner(config, jax.devices()[:1])
  batch = fake_batch(0)
  before = jax.tree.map(np.array, learner.state)
  learner.state, metrics = learner.train_step(learner.state,
                                              learner.device_batch(batch))
  pre = advantages_from(learner, before, batch, config)
  post = advantages_from(learner, learner.state, batch, config)
  assert abs(pre - post) > 1e-3  # the K critic updates moved the values
  want = pre if order == 'pre_update' else post
  np.testing.assert_allclose(metrics['advantage/abs_mean'], want, rtol=1e-5)


def test_reference_kl_is_against_the_frozen_initial_policy():
  config = make_config('grpo', lr=1e-2, **{
      'mesh.data': 1, 'optim.policy_minibatches': 1,
      'policy_loss.ref_kl_coef': 0.1})
  learner = make_learner(config, jax.devices()[:1])
  initial = flat(learner.state.policy)
  chex.assert_trees_all_equal(flat(learner.state.ref_policy), initial)
  first, second = run(learner, [0, 1])
  # One step from the initial weights: pi = pi_ref, the penalty is 0.
  np.testing.assert_allclose(first['policy/ref_kl'], 0.0, atol=1e-7)
  assert second['policy/ref_kl'] > 0
  chex.assert_trees_all_equal(flat(learner.state.ref_policy), initial)
  assert make_learner(make_config('grpo', **{'mesh.data': 1}),
                      jax.devices()[:1]).state.ref_policy is None


def test_critic_optimizer_restarts_after_value_pretraining(one_device):
  learner = one_device()
  fresh = flat(learner.state.critic_opt)
  learner.state, _ = learner.critic_step(learner.state,
                                         learner.device_batch(fake_batch(0)))
  trained = flat(learner.state.critic)
  assert any(not np.array_equal(v, fresh[k])
             for k, v in flat(learner.state.critic_opt).items())
  learner.state = learner.reset_critic_optimizer(learner.state)
  # Moments and step counts as new (RL's warm-up starts at 0), the critic's
  # pretrained weights kept.
  chex.assert_trees_all_equal(flat(learner.state.critic_opt), fresh)
  chex.assert_trees_all_equal(flat(learner.state.critic), trained)


def test_k_critic_updates_are_k_critic_steps(one_device):
  # SAO's K = 2 critic updates per policy update, run inside one train step
  # (one loop body), leave the critic where K separate critic steps on the
  # same batch do: the returns are Monte-Carlo, so no update sees another's
  # values.
  learner = one_device()
  assert learner.config.critic.steps_per_policy_step == 2
  batch = learner.device_batch(fake_batch(0))
  learner.state, _ = learner.train_step(learner.state, batch)
  in_step = flat(learner.state.critic)
  learner = one_device()
  for _ in range(2):
    learner.state, _ = learner.critic_step(learner.state, batch)
  stepwise = flat(learner.state.critic)
  assert set(in_step) == set(stepwise)
  for key, value in in_step.items():
    np.testing.assert_allclose(value, stepwise[key], rtol=1e-5, atol=1e-6,
                               err_msg=key)


def test_a_train_step_compiled_ahead_is_not_compiled_again():
  """The trainer compiles the step before the first batch: that executable,
  not a second compile, must run the step."""
  from jax._src import monitoring  # pylint: disable=g-import-not-at-top
  learner = make_learner(make_config(**{'mesh.data': 1}), jax.devices()[:1])
  batch = fake_batch(0)
  rows, length = batch.tokens_BxT.shape
  learner.compile_train_step(len(batch.reward_N), length, rows)
  compiles = []

  def count(event, duration, **kwargs):
    del duration, kwargs
    if event == '/jax/compilation_cache/compile_time_saved_sec' or (
        'backend_compile' in event):
      compiles.append(event)

  monitoring.register_event_duration_secs_listener(count)
  try:
    learner.state, m = learner.train_step(learner.state,
                                          learner.device_batch(batch))
    jax.block_until_ready(m)
  finally:
    monitoring.unregister_event_duration_listener(count)
  assert compiles == []
  assert np.isfinite(np.asarray(m['policy/loss']))


# PPO's three old-policy modes; GRPO recomputes as PPO's first does.
@pytest.mark.parametrize('algorithm,old_logprobs', [
    ('ppo', 'recompute'), ('ppo', 'decoupled'), ('ppo', 'behavior')])
def test_top_p_sampling_trains_every_old_policy_mode(algorithm, old_logprobs):
  # Under top_p = 0.5 most of the fake batch's random tokens lie outside the
  # tiny model's nucleus: log-prob -inf under the learner. Before they left
  # the mask, every step of the recompute and decoupled modes was skipped.
  config = make_config(algorithm, lr=1e-3, **{
      'mesh.data': 1, 'rollout.top_p': 0.5,
      'policy_loss.old_logprobs': old_logprobs,
      'policy_loss.ref_kl_coef': 0.1})
  learner = make_learner(config, jax.devices()[:1])
  before = flat(learner.state.policy)
  metrics = run(learner, [0, 1, 2])
  for m in metrics:
    assert m['policy/nonfinite_skips'] == 0
    assert np.isfinite(m['policy/loss']) and np.isfinite(m['policy/ref_kl'])
    assert m['policy/nonfinite_tokens'] > 0
  after = flat(learner.state.policy)
  assert any(not np.array_equal(after[k], before[k]) for k in before)
  # The policy moved off the sampling policy: the ratio left 1.
  assert max(abs(m['policy/ratio_max'] - 1) for m in metrics) > 1e-4
