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

import chex
import jax
import jax.numpy as jnp

from sao_jax import sharding
from sao_jax.kernels import dispatch
from sao_jax.kernels.gae import pallas_tpu
from sao_jax.kernels.gae import reference

_F32 = jnp.float32
P = jax.sharding.PartitionSpec


def skip_observation_gae(rewards: chex.Array, values: chex.Array,
                         action_mask: chex.Array, *, gamma: float,
                         lam: float | chex.Array,
                         segment_ids=None,
                         implementation: str = 'auto',
                         block_b: int | None = None,
                         block_t: int | None = None,
                         interpret: bool | None = None, mesh=None):
  """Skip-observation GAE (SAO §1.4); see `reference.skip_observation_gae`.

  Args:
    rewards, values: float `[B, T]` (f32 or bf16).
    action_mask: bool or 0/1 `[B, T]`.
    gamma: scalar discount.
    lam: scalar, float32 `[B]` or `[B, T]` lambda.
    segment_ids: int `[B, T]`, the trajectories of packed rows (the
      recursion restarts at each); None: one per row.
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
    return reference.skip_observation_gae(rewards, values, action_mask,
                                          gamma=gamma, lam=lam,
                                          segment_ids=segment_ids)
  interpret = interpret_off_tpu if interpret is None else interpret
  where = 'skip_observation_gae'
  mask, gamma, lam = reference.check_gae_inputs(where, rewards, values,
                                                action_mask, gamma, lam)
  # One int8 input carries both the action mask and the segment ends (bit
  # 1): packing costs the kernel no extra read.
  code_i8 = mask.astype(jnp.int8)
  if segment_ids is not None:
    ends = reference.segment_ends(where, segment_ids, mask.shape)
    code_i8 = code_i8 + 2 * ends.astype(jnp.int8)
  if mesh is None or mesh.size == 1:
    return _pallas(rewards, values, code_i8, gamma, lam, block_b, block_t,
                   interpret)
  rows, token_spec = P(sharding.BATCH_AXES), P(sharding.BATCH_AXES, None)

  def local(rewards, values, code, lam_local):
    return _pallas(rewards, values, code, gamma, lam_local, block_b, block_t,
                   interpret)

  return jax.shard_map(
      local, mesh=mesh,
      in_specs=(token_spec, token_spec, token_spec,
                token_spec if lam.ndim == 2 else rows),
      out_specs=(token_spec, token_spec), check_vma=False)(
          rewards, values, code_i8, lam)


def _pallas(rewards, values, code_i8, gamma, lam, block_b, block_t,
            interpret):
  """The Pallas kernel on one device's (checked) arrays."""
  dtype = jnp.result_type(rewards, values)
  return pallas_tpu.skip_observation_gae(
      jnp.asarray(rewards, dtype), jnp.asarray(values, dtype), code_i8,
      gamma, lam, block_b=block_b, block_t=block_t, interpret=interpret)
