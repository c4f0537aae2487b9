"""`dis_policy_loss` with a choice of implementation."""

from __future__ import annotations

import jax.numpy as jnp

from sao_jax.kernels.dis_loss import pallas_tpu
from sao_jax.kernels.dis_loss import reference
from sao_jax.kernels import dispatch
from sao_jax.rl import losses


def dis_policy_loss(logp, behavior_logp, advantages, mask, eps_low, eps_high,
                    aggregation='token_mean', implementation: str = 'auto',
                    block_b: int | None = None, block_t: int | None = None,
                    interpret: bool | None = None):
  """The DIS loss of SAO §1.2; see `sao_jax.rl.losses.dis_policy_loss`.

  Same arguments and results as the reference, plus:

  Args:
    implementation: 'auto' (Pallas on TPU, XLA elsewhere), 'xla', or
      'pallas' (interpret mode off TPU).
    block_b, block_t: Pallas block sizes (block_b a multiple of 32,
      block_t of 128).
    interpret: force Pallas interpret mode on (or off, to compile the Mosaic
      kernel for a TPU target from a CPU host); default: on off TPU.
  """
  name, interpret_off_tpu = dispatch.resolve(implementation)
  interpret = interpret_off_tpu if interpret is None else interpret
  if name == 'xla':
    return reference.dis_policy_loss(logp, behavior_logp, advantages, mask,
                                     eps_low, eps_high, aggregation)
  if aggregation not in losses.AGGREGATIONS:
    raise ValueError(f'dis_policy_loss: unknown aggregation {aggregation!r};'
                     f' expected one of {losses.AGGREGATIONS}')
  mask_BxT, (logp, behavior_logp, advantages) = losses.check_token_inputs(
      'dis_policy_loss', mask, logp=logp, behavior_logp=behavior_logp,
      advantages=advantages)
  return pallas_tpu.dis_policy_loss(
      logp, behavior_logp, advantages, mask_BxT.astype(jnp.int8),
      jnp.asarray(eps_low, jnp.float32), jnp.asarray(eps_high, jnp.float32),
      aggregation, block_b, block_t, interpret)
