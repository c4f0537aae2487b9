"""The critic V_phi: the policy's backbone with a scalar value head (SAO §1.3).

The critic starts from the policy's checkpoint (a copy of its decoder, not a
shared reference) with a zero head, so its first values are 0 and value
pretraining fits the head and MLPs to the initial policy's returns. In the
frozen-attention mode only the MLP projections and the head train: the paper
found the critic's gradient norms blow up in attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax import array_checks
from sao_jax.models import model_config
from sao_jax.models import transformer


class ValueModel(nnx.Module):
  """V_phi(s_t): float32 values `[B, T]`, one per token position."""

  def __init__(self, cfg: model_config.ModelConfig, *, rngs: nnx.Rngs):
    self.config = cfg
    self.decoder = transformer.Decoder(cfg, rngs=rngs)
    self.value_head = nnx.Param(jnp.zeros((cfg.hidden_size,), jnp.float32),
                                logical_axes=('embed',))
    self.value_bias = nnx.Param(jnp.zeros((), jnp.float32), logical_axes=())

  def __call__(self, tokens, positions=None, input_mask=None,
               segment_ids=None):
    """Values of the states at each token: V(s_t) reads tokens [0, t] (of
    its own segment, with `segment_ids` of packed rows)."""
    array_checks.require_rank('ValueModel', 'tokens', tokens, '[B, T]')
    if input_mask is None:
      input_mask = jnp.ones(tokens.shape, bool)
    if positions is None:
      positions = transformer.default_positions(tokens, input_mask)
    hidden, _ = self.decoder(
        tokens, positions, transformer.attention_mask(input_mask, segment_ids))
    values = transformer.dense(hidden.astype(jnp.float32),
                               self.value_head[...][:, None])[..., 0]
    return values + self.value_bias[...]


def from_policy(policy: transformer.CausalLM) -> ValueModel:
  """A critic whose backbone is a copy of the policy's, with a zero head."""
  critic = nnx.eval_shape(lambda: ValueModel(policy.config, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(critic)
  # Copies: the learner donates critic buffers to its jitted step, which must
  # never free the policy's.
  state['decoder'] = jax.tree.map(jnp.copy, nnx.state(policy.decoder))
  state['value_head'] = nnx.Param(
      jnp.zeros((policy.config.hidden_size,), jnp.float32),
      logical_axes=('embed',))
  state['value_bias'] = nnx.Param(jnp.zeros((), jnp.float32), logical_axes=())
  return nnx.merge(graphdef, state)


# Parameters a frozen-attention critic trains: MLP projections and the head.
_TRAINED_WHEN_FROZEN = ('mlp', 'value_head', 'value_bias')


def trainable_filter(frozen_attention: bool):
  """The nnx filter of critic parameters the optimizer may change.

  With `frozen_attention`, only the MLP projections and the value head train
  (SAO §1.3): attention, norms and embeddings keep their pretrained values.
  Use it as `nnx.Optimizer(critic, tx, wrt=...)` and as the `nnx.DiffState`
  of the gradient, so frozen parameters get neither updates nor gradients.
  """
  if not frozen_attention:
    return nnx.Param
  return nnx.All(nnx.Param,
                 nnx.Any(*(nnx.PathContains(k) for k in _TRAINED_WHEN_FROZEN)))
