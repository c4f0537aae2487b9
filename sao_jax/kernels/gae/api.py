"""`skip_observation_gae` (SAO §1.4): choice of implementation, on a mesh.

The one entry the learner calls: it picks the XLA reference
(`reference.skip_observation_gae`, the definition) or the Pallas TPU kernel
(`pallas_tpu`), and with a mesh of more than one device runs the kernel once
per batch shard under `jax.shard_map` (XLA cannot partition a Mosaic kernel).
GAE is a recursion along T within a row, so the shards' results are simply
the global result's rows: split over `sharding.BATCH_AXES`, replicated over
the tensor axis. The XLA reference is partitioned by XLA itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sao_jax import sharding
from sao_jax.kernels import dispatch
from sao_jax.kernels.gae import pallas_tpu
from sao_jax.kernels.gae import reference

_F32 = jnp.float32
P = jax.sharding.PartitionSpec


def skip_observation_gae(rewards, values, action_mask, gamma, lam,
                         implementation: str = 'auto',
                         block_b: int | None = None,
                         block_t: int | None = None,
                         interpret: bool | None = None, *, mesh=None):
  """Skip-observation GAE (SAO §1.4); see `reference.skip_observation_gae`.

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
    mesh: the learner's mesh; with more than one device a Pallas kernel runs
      per batch shard. None: one call.

  Returns:
    `(advantages, returns)`, float32 `[B, T]`, zero off the action tokens.
    Advantages are targets, not differentiated through: the Pallas kernel has
    no VJP.
  """
  name, interpret_off_tpu = dispatch.resolve(implementation)
  if name == 'xla':
    return reference.skip_observation_gae(rewards, values, action_mask, gamma,
                                          lam)
  interpret = interpret_off_tpu if interpret is None else interpret
  if mesh is None or mesh.size == 1:
    return _pallas(rewards, values, action_mask, gamma, lam, block_b, block_t,
                   interpret)
  lam_B = jnp.broadcast_to(jnp.asarray(lam, _F32), jnp.shape(rewards)[:1])
  rows, token_spec = P(sharding.BATCH_AXES), P(sharding.BATCH_AXES, None)

  def local(rewards, values, mask, lam_local):
    return _pallas(rewards, values, mask, gamma, lam_local, block_b, block_t,
                   interpret)

  return jax.shard_map(local, mesh=mesh,
                       in_specs=(token_spec, token_spec, token_spec, rows),
                       out_specs=(token_spec, token_spec), check_vma=False)(
                           rewards, values, action_mask, lam_B)


def _pallas(rewards, values, action_mask, gamma, lam, block_b, block_t,
            interpret):
  """The Pallas kernel on one device's arrays, arguments checked."""
  mask, gamma, lam_B = reference.check_gae_inputs(
      'skip_observation_gae', rewards, values, action_mask, gamma, lam)
  dtype = jnp.result_type(rewards, values)
  return pallas_tpu.skip_observation_gae(
      jnp.asarray(rewards, dtype), jnp.asarray(values, dtype),
      mask.astype(jnp.int8), gamma, lam_B, block_b=block_b, block_t=block_t,
      interpret=interpret)
