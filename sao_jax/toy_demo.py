r"""SAO's update rule end to end on a synthetic multi-turn token task.

  python -m sao_jax.toy_demo --config=configs/default.py --workdir=runs/demo

The interim main job until the trainer of issue 6 lands: it exercises the
algorithm core exactly as the learner will (skip-observation GAE with the
length-adaptive lambda, K critic steps per DIS policy step, behaviour logprobs
from a policy `max_staleness` versions old), with a tabular policy and critic in
place of the transformer and a synthetic environment in place of JetStream.

Each trajectory is `[prompt(2), action(4), observation(2), action(4)]`. At each
action position the policy picks one of V tokens; the outcome reward, placed on
the last action token, is the fraction of actions that equal the target token.
"""

import collections
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
import tqdm
from absl import flags

from sao_jax import advantages
from sao_jax import config_lib
from sao_jax import losses

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

_CONFIG = config_lib.define_config_flag()
_WORKDIR = flags.DEFINE_string('workdir', 'runs/demo', 'where the plot goes')
_STEPS = flags.DEFINE_integer('steps', 150, 'policy steps')

VOCAB = 8
TARGET = 3
# 0 prompt, 1 action, 2 observation.
LAYOUT_T = np.array([0, 0, 1, 1, 1, 1, 2, 2, 1, 1, 1, 1])
ACTION_MASK_T = LAYOUT_T == 1


def rollout(policy_TxV, key, batch):
  """Samples tokens at action positions; returns tokens, mu_t and rewards."""
  logits_BxTxV = jnp.broadcast_to(policy_TxV, (batch,) + policy_TxV.shape)
  tokens_BxT = jax.random.categorical(key, logits_BxTxV)
  logp_BxT = token_logp(policy_TxV, tokens_BxT)
  hits_B = jnp.sum((tokens_BxT == TARGET) & ACTION_MASK_T, axis=1)
  reward_B = hits_B / ACTION_MASK_T.sum()
  last_action = int(np.flatnonzero(ACTION_MASK_T)[-1])
  rewards_BxT = jnp.zeros(tokens_BxT.shape).at[:, last_action].set(reward_B)
  return tokens_BxT, logp_BxT, rewards_BxT


def critic_values(critic_TxH, tokens_BxT):
  """V(s_t) with the state s_t = (position, target hits before t)."""
  hits_BxT = jnp.cumsum((tokens_BxT == TARGET) & ACTION_MASK_T, axis=1)
  hits_before_BxT = hits_BxT - ((tokens_BxT == TARGET) & ACTION_MASK_T)
  positions_T = jnp.arange(tokens_BxT.shape[1])
  return critic_TxH[positions_T[None], hits_before_BxT]


def token_logp(policy_TxV, tokens_BxT):
  logp_TxV = jax.nn.log_softmax(policy_TxV, axis=-1)
  return jnp.take_along_axis(logp_TxV[None], tokens_BxT[..., None], axis=-1)[..., 0]


def make_step(config, actor_opt, critic_opt):
  """One SAO update: K critic steps on MC returns, then one DIS step."""
  adv_cfg, loss_cfg = config.advantage, config.policy_loss
  mask_BxT = jnp.asarray(ACTION_MASK_T)[None]

  @jax.jit
  def step(state, tokens_BxT, mu_BxT, rewards_BxT):
    policy, critic, actor_state, critic_state = state
    mask = jnp.broadcast_to(mask_BxT, tokens_BxT.shape)
    # Critic target: Monte-Carlo return (lambda_critic = critic.lam).
    _, returns_BxT = advantages.skip_observation_gae(
        rewards_BxT, critic_values(critic, tokens_BxT), mask, adv_cfg.gamma,
        config.critic.lam)

    def critic_loss(critic):
      return losses.value_loss(critic_values(critic, tokens_BxT), returns_BxT,
                               mask)

    for _ in range(config.critic.steps_per_policy_step):
      (_, value_metrics), grads = jax.value_and_grad(
          critic_loss, has_aux=True)(critic)
      updates, critic_state = critic_opt.update(grads, critic_state)
      critic = optax.apply_updates(critic, updates)

    values_BxT = critic_values(critic, tokens_BxT)
    lam = (advantages.length_adaptive_lambda(mask.sum(1), adv_cfg.alpha)
           if adv_cfg.adaptive_lambda else adv_cfg.lam)
    adv_BxT, _ = advantages.skip_observation_gae(
        rewards_BxT, values_BxT, mask, adv_cfg.gamma, lam)

    def policy_loss(policy):
      return losses.dis_policy_loss(
          token_logp(policy, tokens_BxT), mu_BxT, adv_BxT, mask,
          loss_cfg.eps_low, loss_cfg.eps_high, loss_cfg.aggregation)

    (_, dis_metrics), grads = jax.value_and_grad(
        policy_loss, has_aux=True)(policy)
    updates, actor_state = actor_opt.update(grads, actor_state)
    policy = optax.apply_updates(policy, updates)
    metrics = dict(dis_metrics, **value_metrics)
    return (policy, critic, actor_state, critic_state), metrics

  return step


def main(argv: Sequence[str]) -> None:
  del argv
  config = _CONFIG.value
  config_lib.validate(config)
  if config.algorithm != 'sao':
    raise config_lib.ConfigError('the toy demo runs algorithm=sao only')
  key = jax.random.key(config.seed)
  policy = jnp.zeros((len(LAYOUT_T), VOCAB))
  critic = jnp.zeros((len(LAYOUT_T), ACTION_MASK_T.sum() + 1))
  # A tabular model learns at rates far above the LLM defaults of the config.
  actor_opt = optax.adam(0.05)
  critic_opt = optax.adam(0.05)
  state = (policy, critic, actor_opt.init(policy), critic_opt.init(critic))
  step = make_step(config, actor_opt, critic_opt)
  # Async rollouts: behaviour policy lags the learner by max_staleness versions.
  history = collections.deque([policy], maxlen=config.rollout.max_staleness + 1)
  log = collections.defaultdict(list)
  bar = tqdm.trange(_STEPS.value, desc='SAO toy demo')
  for _ in bar:
    key, sample_key = jax.random.split(key)
    tokens, mu, rewards = rollout(history[0], sample_key, config.batch_size)
    state, metrics = step(state, tokens, mu, rewards)
    history.append(state[0])
    log['reward'].append(float(rewards.sum(1).mean()))
    for name in ('explained_variance', 'frac_below', 'frac_above'):
      log[name].append(float(metrics[name]))
    bar.set_postfix(reward=f'{log["reward"][-1]:.3f}')
  os.makedirs(_WORKDIR.value, exist_ok=True)
  path = os.path.join(_WORKDIR.value, 'toy_demo.png')
  fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
  axes[0].plot(log['reward'])
  axes[0].set_title('mean reward')
  axes[1].plot(log['explained_variance'])
  axes[1].set_title('critic explained variance')
  axes[2].plot(log['frac_below'], label='below band')
  axes[2].plot(log['frac_above'], label='above band')
  axes[2].set_title('DIS masked fraction')
  axes[2].legend()
  for ax in axes:
    ax.set_xlabel('policy step')
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  print(f'reward {np.mean(log["reward"][:10]):.3f} (first 10 steps) ->'
        f' {np.mean(log["reward"][-10:]):.3f} (last 10); plot: {path}')


if __name__ == '__main__':
  config_lib.run(main)
