"""`skip_observation_gae` with a choice of implementation."""

from __future__ import annotations

import jax.numpy as jnp

from sao_jax.kernels import dispatch
from sao_jax.kernels.gae import pallas_tpu
from sao_jax.kernels.gae import reference
from sao_jax.rl import advantages


def skip_observation_gae(rewards, values, action_mask, gamma, lam,
                         implementation: str = 'auto',
                         block_b: int | None = None,
                         block_t: int | None = None,
                         interpret: bool | None = None):
  """Skip-observation GAE (SAO §1.4); see `sao_jax.rl.advantages` for the math.

  Args:
    rewards, values: float `[B, T]` (f32 or bf16).
    action_mask: bool or 0/1 `[B, T]`.
    gamma: scalar discount.
    lam: scalar or float32 `[B]` lambda.
    implementation: 'auto' (Pallas on TPU, XLA elsewhere), 'xla', or
      'pallas' (interpret mode off TPU).
    block_b, block_t: Pallas block sizes (multiples of 128).
    interpret: force Pallas interpret mode on (or off, to compile the Mosaic
      kernel for a TPU target from a CPU host); default: on off TPU.

  Returns:
    `(advantages, returns)`, float32 `[B, T]`, zero off the action tokens.
    Advantages are targets, not differentiated through: the Pallas kernel has
    no VJP.
  """
  name, interpret_off_tpu = dispatch.resolve(implementation)
  interpret = interpret_off_tpu if interpret is None else interpret
  if name == 'xla':
    return reference.skip_observation_gae(rewards, values, action_mask, gamma,
                                          lam)
  mask, gamma, lam_B = advantages.check_gae_inputs(
      'skip_observation_gae', rewards, values, action_mask, gamma, lam)
  dtype = jnp.result_type(rewards, values)
  return pallas_tpu.skip_observation_gae(
      jnp.asarray(rewards, dtype), jnp.asarray(values, dtype),
      mask.astype(jnp.int8), gamma, lam_B, block_b=block_b, block_t=block_t,
      interpret=interpret)
