"""`self_attention`: causal attention over segments, by implementation, on a mesh.

The one entry the model calls for a full sequence (training, scoring,
prefill). Implementations are registered by name:

  dense      `reference.dense_self_attention`, the definition: scores
             `[B, K, G*T, T]` in memory, quadratic in T
  blockwise  `reference.blockwise_attention`: online softmax in tiles, its
             own VJP; memory linear in T, on any backend
  splash     `pallas_tpu.splash_self_attention`: JAX's splash attention
             Mosaic kernel (interpret mode off TPU); on a mesh it runs per
             shard under `jax.shard_map` (XLA cannot partition it)
  cudnn      `jax.nn.dot_product_attention(implementation='cudnn')`, the
             fused flash kernel of NVIDIA GPUs: causal, rows of ONE
             segment each (it takes lengths, not segment ids), so only for
             unpacked batches (`batching.pack_sequences='off'`; the config
             checks); bf16 on the GPU
  auto       splash on TPU; elsewhere blockwise once T exceeds one tile
             (`reference.DEFAULT_BLOCK`), dense below (where the scores are
             small and one matmul is fastest)

Decoding one token over a KV cache is linear in the cache already and stays
with `reference.dense_attention` (the model calls it directly).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from sao_jax import platforms
from sao_jax import sharding
from sao_jax.kernels.attention import pallas_tpu
from sao_jax.kernels.attention import reference

P = jax.sharding.PartitionSpec

def _splash(q, k, v, segment_ids):
  # XLA cannot partition a Mosaic custom call: on a mesh of more than one
  # device (`sharding.mesh_context`) the kernel runs per shard.
  interpret = platforms.target() != 'tpu'
  mesh = sharding.current_mesh()
  if mesh is None or mesh.size == 1:
    return pallas_tpu.splash_self_attention(q, k, v, segment_ids, interpret)
  # Rows over the batch axes; heads over `tensor` where both head counts
  # divide (else replicated there, as XLA would leave them).
  tensor = mesh.shape.get('tensor', 1)
  heads = ('tensor' if tensor > 1 and q.shape[2] % tensor == 0
           and k.shape[2] % tensor == 0 else None)
  tokens = P(sharding.BATCH_AXES, None, heads, None)
  return jax.shard_map(
      lambda q, k, v, s: pallas_tpu.splash_self_attention(q, k, v, s,
                                                          interpret),
      mesh=mesh, in_specs=(tokens, tokens, tokens, P(sharding.BATCH_AXES, None)),
      out_specs=tokens, check_vma=False)(q, k, v, segment_ids)


def _cudnn(q, k, v, segment_ids):
  """cuDNN's fused attention over right-padded one-segment rows.

  Each row's real tokens are those with a nonzero id (one trajectory from
  position 0); off GPU, XLA's implementation of the same call runs (tests).
  """
  lengths_B = jnp.sum(segment_ids > 0, axis=1).astype(jnp.int32)
  implementation = 'cudnn' if platforms.target() == 'gpu' else 'xla'
  return jax.nn.dot_product_attention(
      q, k, v, is_causal=True, query_seq_lengths=lengths_B,
      key_value_seq_lengths=lengths_B, implementation=implementation)


IMPLEMENTATIONS: dict[str, Callable] = {
    'dense': reference.dense_self_attention,
    'blockwise': reference.blockwise_attention,
    'splash': _splash,
    'cudnn': _cudnn,
}
# Implementations that cannot tell two segments of a packed row apart.
ONE_SEGMENT_ONLY = frozenset({'cudnn'})
CHOICES = ('auto',) + tuple(IMPLEMENTATIONS)


def resolve(implementation: str, length: int) -> str:
  """The implementation 'auto' (or a name) stands for at sequence `length`."""
  if implementation not in CHOICES:
    raise ValueError(f'attention={implementation!r} is not one of {CHOICES}')
  if implementation != 'auto':
    return implementation
  if platforms.target() == 'tpu':
    return 'splash'
  return 'blockwise' if length > reference.DEFAULT_BLOCK else 'dense'


def self_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT,
                   implementation: str = 'auto'):
  """Causal attention of each query over its own segment's keys up to it.

  Args:
    q_BxTxHxD: queries (RoPE applied), H heads.
    k_BxTxKxD, v_BxTxKxD: K key/value heads (H % K == 0).
    segment_ids_BxT: int, the row's segments (1, 2, ... for packed
      trajectories, 1 for an unpacked row's tokens); 0 at padding, which no
      query attends.
    implementation: a name of `CHOICES`.

  Returns:
    `[B, T, H, D]` in the queries' dtype; rows of padding queries are
    unspecified (finite).
  """
  name = resolve(implementation, q_BxTxHxD.shape[1])
  return IMPLEMENTATIONS[name](q_BxTxHxD, k_BxTxKxD, v_BxTxKxD,
                               segment_ids_BxT)
