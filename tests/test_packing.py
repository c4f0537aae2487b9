"""Sequence packing: trajectories as segments of fixed-shape rows.

A packed batch must train exactly like the same trajectories one per row:
the same advantages, returns, losses and gradients (to float rounding),
because attention, positions, GAE and the per-trajectory loss mean all stay
inside a segment. Also: the bin packing itself, and its errors.
"""

import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax import config_lib
from sao_jax import recipe_checks
from sao_jax import types
from sao_jax.learner import learner as learner_lib
from sao_jax.models import critic as critic_lib
from sao_jax.models import sampling
from sao_jax.models import tiny
from sao_jax.rl import algorithms
from sao_jax.rollout import batching

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM, LENGTH, ROWS = 8, 32, 4


def make_config(algorithm='sao', **changes):
  config = config_lib.load_config(
      os.path.join(ROOT, 'configs', 'tiny.py') + f':algorithm={algorithm}')
  config.batch_size = NUM
  config.mesh.data = 1
  for key, value in changes.items():
    config_lib.set_from_text(config, key, str(value))
  return config


def trajectories(seed=0, num=NUM, lengths=(5, 20)):
  """Multi-turn-shaped: prompt, action, observation, action; varied lengths."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(num):
    length = int(rng.integers(*lengths))
    mask = np.zeros(length, bool)
    mask[2:] = True
    mask[3 + length // 3:4 + length // 2] = False  # an observation
    tokens = rng.integers(3, tiny.VOCAB, length).astype(np.int32)
    logp = np.where(mask, -rng.uniform(3.5, 4.8, length), 0.0)
    out.append(types.Trajectory(
        prompt_id=f'p{i // 4}', tokens=tokens, action_mask=mask,
        behavior_logprobs=logp.astype(np.float32),
        versions=np.where(mask, 0, -1).astype(np.int32),
        reward=float(rng.integers(0, 2)) + 0.25 * i))
  return out


def both_layouts(trajs, rows=ROWS):
  unpacked = batching.assemble_batch(trajs, LENGTH, 0)
  packed = batching.assemble_batch(trajs, LENGTH, 0, packed_rows=rows)
  slots = np.arange(len(trajs), dtype=np.int32) % 3
  assert packed.tokens_BxT.shape == (rows, LENGTH)  # it packed, no fallback
  return (unpacked.replace(slot_ids_N=slots), packed.replace(slot_ids_N=slots))


def by_trajectory(batch, x_BxT):
  """Each trajectory's tokens of `x`, in order (whatever the layout)."""
  ids = np.asarray(batch.segment_ids_BxT)
  x = np.asarray(x_BxT)
  return [x[ids == n + 1] for n in range(len(batch.reward_N))]


def models():
  policy, _ = tiny.make(seed=3)
  critic = critic_lib.from_policy(policy)
  # A random head, so that the critic's gradient reaches its backbone.
  critic.value_head[...] = jax.random.normal(
      jax.random.key(0), critic.value_head[...].shape) * 0.3
  return nnx.split(policy), nnx.split(critic)


def step_quantities(config, batch):
  """A learner step's quantities of one batch, computed directly."""
  (policy_def, policy_params), (critic_def, critic_params) = models()
  params = sampling.SamplingParams(1.0, 0, 1.0)
  estimator = algorithms.resolve(config).estimator

  @jax.jit
  def compute(policy_params, critic_params, batch):
    critic = nnx.merge(critic_def, critic_params)
    values = algorithms.critic_values(critic, batch)
    adv, _ = estimator.advantages(config, batch, values,
                                  estimator.init_state(config), None)
    _, returns = algorithms.gae(config, batch, values, config.critic.lam)
    prox = algorithms.policy_logprobs(nnx.merge(policy_def, policy_params),
                                      batch, params)[0]

    def policy_loss(p):
      logp, _, _ = algorithms.policy_logprobs(nnx.merge(policy_def, p), batch,
                                           params)
      return algorithms.policy_loss(config, logp, batch, adv,
                                    jax.lax.stop_gradient(prox))[0]

    def critic_loss(c):
      v = algorithms.critic_values(nnx.merge(critic_def, c), batch)
      return algorithms.value_loss(config, v, returns, batch, values)[0]

    policy_out = jax.value_and_grad(policy_loss)(policy_params)
    critic_out = jax.value_and_grad(critic_loss)(critic_params)
    return adv, returns, values, policy_out, critic_out

  return compute(policy_params, critic_params, batch)


CASES = [
    ('sao', 'xla', {}),
    ('sao', 'pallas', {'policy_loss.aggregation': 'seq_mean_token_mean'}),
    ('sao', 'xla', {'advantage.skip_observations': False,
                    'policy_loss.aggregation': 'seq_mean_token_mean'}),
    ('grpo_dis', 'xla', {}),
    ('running_mean', 'xla', {'policy_loss.aggregation':
                             'seq_mean_token_mean'}),
    ('ppo', 'xla', {'policy_loss.aggregation': 'seq_mean_token_mean'}),
]


# ~25-35 s each on a shared 2-core machine (two compiles of losses and
# gradients of the tiny model).
@pytest.mark.slow
@pytest.mark.parametrize('algorithm,implementation,changes', CASES)
def test_packed_batch_trains_like_one_trajectory_per_row(algorithm,
                                                         implementation,
                                                         changes):
  config = make_config(algorithm, **{'kernels.implementation': implementation,
                                     **changes})
  recipe_checks.validate(config, num_devices=1)
  unpacked, packed = both_layouts(trajectories(1))
  got = step_quantities(config, packed)
  want = step_quantities(config, unpacked)
  # Values where they are read: a segment's first token gets the previous
  # segment's output (`critic_values`), a prompt token nothing reads.
  got_values = np.where(packed.action_mask_BxT, got[2], 0.0)
  want_values = np.where(unpacked.action_mask_BxT, want[2], 0.0)
  for name, g, w in zip(('advantages', 'returns', 'values'),
                        (got[0], got[1], got_values),
                        (want[0], want[1], want_values)):
    chex.assert_trees_all_close(by_trajectory(packed, g),
                                by_trajectory(unpacked, w), rtol=1e-5,
                                atol=1e-5, custom_message=name)
  assert np.abs(np.asarray(want[0])).max() > 0  # advantages not all 0
  (policy_loss, policy_grad), (critic_loss, critic_grad) = got[3:]
  (want_policy_loss, want_policy_grad), (want_critic_loss,
                                         want_critic_grad) = want[3:]
  chex.assert_trees_all_close((policy_loss, critic_loss),
                              (want_policy_loss, want_critic_loss),
                              rtol=1e-5, atol=1e-7)
  chex.assert_trees_all_close(policy_grad, want_policy_grad, rtol=1e-5,
                              atol=1e-6)
  chex.assert_trees_all_close(critic_grad, want_critic_grad, rtol=1e-5,
                              atol=1e-6)


@pytest.mark.slow  # ~30 s here, most of it the first compile
def test_attention_never_crosses_a_segment():
  """A trajectory packed after another gets the logits and values it gets
  alone in a row."""
  first, second = trajectories(2, num=2, lengths=(10, 16))
  alone = batching.assemble_batch([second], LENGTH, 0)
  packed = batching.assemble_batch([first, second], LENGTH, 0, packed_rows=1)
  assert packed.tokens_BxT.shape[0] == 1
  (policy_def, policy_params), (critic_def, critic_params) = models()
  policy = nnx.merge(policy_def, policy_params)
  critic = nnx.merge(critic_def, critic_params)

  def outputs(batch, segment):
    args = (batch.tokens_BxT, batch.positions_BxT, batch.input_mask_BxT,
            batch.segment_ids_BxT)
    where = np.asarray(batch.segment_ids_BxT) == segment  # `second`'s tokens
    return np.asarray(policy(*args))[where], np.asarray(critic(*args))[where]

  chex.assert_trees_all_close(outputs(packed, 2), outputs(alone, 1),
                              rtol=1e-5, atol=1e-5)
  # Without the segment mask, `second` would attend to `first`.
  leaky = np.asarray(policy(packed.tokens_BxT, packed.positions_BxT,
                            packed.input_mask_BxT))
  assert np.abs(leaky[np.asarray(packed.segment_ids_BxT) == 2]
                - outputs(alone, 1)[0]).max() > 1e-3


@pytest.mark.slow  # two compiles of the learner step
def test_learner_step_is_the_same_packed_and_micro_batched():
  """Through the jitted learner (2 micro-batches of rows): the same
  advantages and gradients (their norms) as one trajectory per row. (The
  loss metrics are means of each micro-batch's own loss, whose trajectories
  differ between the layouts.)"""
  config = make_config('sao', **{'optim.microbatches': 2,
                                 'critic.steps_per_policy_step': 1})
  recipe_checks.validate(config, num_devices=1)
  model, _ = tiny.make(seed=1)
  mesh = learner_lib.mesh_from_config(config, jax.devices()[:1])
  learner = learner_lib.Learner(config, model, mesh)
  initial = jax.tree.map(np.asarray, learner.init_state())
  metrics = []
  for batch in both_layouts(trajectories(3)):
    state = jax.device_put(initial, learner.state_shardings)
    _, m = learner.train_step(state, learner.device_batch(batch))
    metrics.append({k: np.asarray(m[k]) for k in (
        'policy/grad_norm', 'critic/grad_norm', 'advantage/mean',
        'advantage/abs_mean', 'policy/num_tokens', 'critic/num_tokens')})
  chex.assert_trees_all_close(metrics[1], metrics[0], rtol=1e-5, atol=1e-6)


# -- the packer ----------------------------------------------------------------


def test_packer_loses_no_trajectory_and_every_row_fits():
  trajs = trajectories(4, num=16, lengths=(3, 30))
  batch = batching.assemble_batch(trajs, LENGTH, 0, packed_rows=10)
  ids = np.asarray(batch.segment_ids_BxT)
  assert ids.shape == (10, LENGTH)
  for n, traj in enumerate(trajs):
    rows = np.unique(np.nonzero(ids == n + 1)[0])
    assert len(rows) == 1  # whole, in one row
    where = ids == n + 1
    np.testing.assert_array_equal(batch.tokens_BxT[where], traj.tokens)
    np.testing.assert_array_equal(batch.action_mask_BxT[where],
                                  traj.action_mask)
    np.testing.assert_array_equal(batch.positions_BxT[where],
                                  np.arange(traj.length))
    np.testing.assert_allclose(batch.rewards_BxT[where].sum(), traj.reward)
  np.testing.assert_array_equal(batch.input_mask_BxT, ids > 0)
  np.testing.assert_array_equal(batch.num_action_tokens_N,
                                [t.num_action_tokens for t in trajs])
  total = sum(t.length for t in trajs)
  np.testing.assert_allclose(batching.padding_fraction(batch),
                             1 - total / (10 * LENGTH))
  unpacked = batching.assemble_batch(trajs, LENGTH, 0)
  np.testing.assert_allclose(batching.padding_fraction(unpacked),
                             1 - total / (16 * LENGTH))
  for row in ids:  # segments back to back from 0, padding only at the end
    real = row[row > 0]
    assert (row[:len(real)] > 0).all() and (row[len(real):] == 0).all()


def test_first_fit_decreasing():
  # 6 -> row 0, 5 -> row 1, 4 -> row 0 (full), 3 and 2 -> row 1.
  assert batching.first_fit_decreasing([5, 3, 4, 2, 6], 10, 2) == [[2, 4],
                                                                   [0, 1, 3]]
  assert batching.first_fit_decreasing([6, 6, 6], 10, 2) is None
  assert batching.first_fit_decreasing([10], 10, 1) == [[0]]


def test_a_batch_too_long_for_its_rows_takes_one_row_each():
  """Never drops a trajectory: the rare overflow gets N rows (one more
  compile of the step), still packed."""
  trajs = trajectories(5, num=4, lengths=(20, 30))
  batch = batching.assemble_batch(trajs, LENGTH, 0, packed_rows=2)
  assert batch.tokens_BxT.shape == (4, LENGTH)
  assert sorted(np.unique(batch.segment_ids_BxT[batch.segment_ids_BxT > 0])
                ) == [1, 2, 3, 4]


def test_bad_packing_input_is_a_clear_error():
  trajs = trajectories(6, num=2)
  with pytest.raises(ValueError, match=r'packed_rows=3 must be in \[0, 2\]'):
    batching.assemble_batch(trajs, LENGTH, 0, packed_rows=3)
  long = trajectories(7, num=1, lengths=(LENGTH + 1, LENGTH + 2))
  with pytest.raises(ValueError, match=r'trajectory 2 \(.*, 33 tokens\):'
                     r' more than max_length 32'):
    batching.assemble_batch(trajs + long, LENGTH, 0, packed_rows=2)


# -- the config ----------------------------------------------------------------


def test_auto_packs_multi_turn_tasks_only():
  config = make_config()
  assert config.batching.pack_sequences == 'auto'
  assert not batching.packs(config)  # word_target, one turn
  config.task.word_target.turns = 3
  assert batching.packs(config)
  one_device = {'data': 1, 'fsdp': 1, 'tensor': 1}
  assert batching.packed_rows(config, one_device) == 3  # 3/8 of 8
  config.optim.microbatches = 2  # rows: a multiple of 2 from each shard
  assert batching.packed_rows(config, one_device) == 4
  assert batching.packed_rows(config, {'data': 8, 'fsdp': 1,
                                         'tensor': 1}) == 8  # at most N
  config.batching.packed_rows = 6
  assert batching.packed_rows(config, one_device) == 6
  config.task.word_target.turns = 1
  config.batching.pack_sequences = 'on'
  assert batching.packs(config)
  default = config_lib.load_config(os.path.join(ROOT, 'configs', 'default.py'))
  assert not batching.packs(default)  # the demo's single-turn chain sums
  default.task.name = 'calculator'
  assert batching.packs(default)


@pytest.mark.parametrize('changes,message', [
    ({'batching.pack_sequences': 'yes'},
     r"config.batching.pack_sequences='yes' is not one of"),
    ({'batching.pack_sequences': 'on', 'batching.packed_rows': 9},
     r'packed_rows=9 must be <= config.batch_size=8'),
    ({'batching.pack_sequences': 'on', 'batching.packed_rows': 3,
      'optim.microbatches': 2},
     r'packed_rows=3 must split into .* \(a multiple of 2\)'),
    ({'batching.pack_sequences': 'on', 'distributed.enabled': True},
     r'packs batches on one process only'),
])
def test_bad_packing_config_is_a_config_error(changes, message):
  config = make_config(**changes)
  with pytest.raises(config_lib.ConfigError, match=message):
    recipe_checks.validate(config, num_devices=1)
