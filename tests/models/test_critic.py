"""The critic: built from the policy, zero head, frozen attention."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sao_jax.models import critic
from sao_jax.models import model_config
from sao_jax.models import transformer

CFG = model_config.ModelConfig('qwen2', 50, 32, 48, 2, 4, 2, 8, qkv_bias=True)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 50, (2, 7)))


def flat(model):
  return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in
          jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(
              nnx.state(model, nnx.Param)))[0]}


def train_steps(model, frozen_attention, steps=3):
  wrt = critic.trainable_filter(frozen_attention)
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=wrt)

  def loss_fn(m):
    return jnp.mean((m(TOKENS) - jnp.arange(7.0)) ** 2)

  @nnx.jit
  def step(model, optimizer):
    grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, wrt))(model)
    optimizer.update(model, grads)

  for _ in range(steps):
    step(model, optimizer)


def test_critic_starts_from_the_policy_with_zero_values():
  policy = transformer.init_causal_lm(CFG, seed=1)
  value_model = critic.from_policy(policy)
  np.testing.assert_array_equal(value_model(TOKENS), np.zeros((2, 7)))
  chex.assert_trees_all_equal(flat(value_model.decoder), flat(policy.decoder))
  # A copy, not a shared buffer: training the critic leaves the policy alone.
  before = flat(policy)
  train_steps(value_model, frozen_attention=False)
  chex.assert_trees_all_equal(flat(policy), before)


@pytest.mark.parametrize('frozen', [True, False])
def test_frozen_attention_leaves_attention_bit_identical(frozen):
  value_model = critic.from_policy(transformer.init_causal_lm(CFG, seed=2))
  before = flat(value_model)
  train_steps(value_model, frozen_attention=frozen)
  after = flat(value_model)
  changed = {name for name in after
             if not np.array_equal(after[name], before[name])}
  attention = {n for n in after if "['attn']" in n}
  assert len(attention) == 7  # q, k, v, o and the three Qwen2 biases
  mlp_and_head = {n for n in after if "['mlp']" in n or 'value_' in n}
  assert mlp_and_head <= changed
  if frozen:
    # Only the MLP projections and the head train (SAO §1.3).
    assert changed == mlp_and_head
  else:
    assert attention <= changed
