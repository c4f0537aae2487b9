"""Causal self-attention over segments on TPU: JAX's splash attention kernel.

`jax.experimental.pallas.ops.tpu.splash_attention` is the block-sparse flash
attention MaxText and Tunix run: a causal mask's tiles above the diagonal
are skipped from a block map built at trace time, segment ids mask within
tiles. This module only adapts it to the model's layout (definition:
`reference.dense_self_attention`) and picks its backward:

  * grouped-query heads as the kernel's MQA form, vmapped over batch rows
    and key/value heads: `[G, T, D]` queries over one `[T, D]` key/value
    head, so K/V are never repeated G times;
  * T padded to a multiple of 128 (the kernel's lane tile) as id-0 padding;
  * queries scaled by `D^-1/2` (the kernel leaves scaling to the caller);
  * the fused dq/dk/dv backward kernel up to `MAX_FUSED_BLOCKS` key blocks,
    the separate dk/dv and dq kernels beyond: the fused one writes a dq
    partial per key block (`[T / block, G, T, D]`, then summed), quadratic
    in T (16 GiB per layer for Llama-3.2-1B at 32k tokens); the separate dq
    kernel recomputes the scores once more and keeps memory linear.

The kernel only requires that no query row is fully masked; with ids
compared for equality a padding query (id 0) attends the padding keys up to
itself, so none is. Real queries never see id 0, as in the definition.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from sao_jax.kernels.attention import reference

LANE = 128
_BLOCKS = (512, 256, 128)
# The fused backward's dq partials cost this many times dq at most.
MAX_FUSED_BLOCKS = 8


def _block(length: int) -> int:
  return next(b for b in _BLOCKS if length % b == 0)


def fused_backward(length: int) -> bool:
  """Whether `length` (padded) tokens take the fused backward kernel."""
  return length // _block(length) <= MAX_FUSED_BLOCKS


@functools.lru_cache(maxsize=64)
def _kernel(groups: int, length: int, interpret: bool, fused: bool):
  """The splash MQA kernel for G query heads over causal `length` tokens."""
  b = _block(length)
  dq_blocks = {} if fused else dict(block_q_dq=b, block_kv_dq=b)
  sizes = splash.BlockSizes(
      block_q=b, block_kv=b, block_kv_compute=b,
      block_q_dkv=b, block_kv_dkv=b, block_kv_dkv_compute=b,
      use_fused_bwd_kernel=fused, **dq_blocks)
  mask = splash.MultiHeadMask(
      [splash.CausalMask((length, length)) for _ in range(groups)])
  return splash.make_splash_mqa_single_device(mask, block_sizes=sizes,
                                              interpret=interpret)


def splash_self_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT,
                          interpret: bool = False,
                          fused: bool | None = None):
  """Causal attention over segments, `[B, T, H, D]` out (see module doc).

  `fused`: the backward kernel (None: `fused_backward` of the length).
  """
  t, h, d = q_BxTxHxD.shape[1:]
  groups = h // k_BxTxKxD.shape[2]
  scaled = (q_BxTxHxD * (d ** -0.5)).astype(q_BxTxHxD.dtype)
  q_BxKxGxTxD, k_BxKxTxD, v_BxKxTxD, seg_BxT = reference.tiled_layout(
      scaled, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT, LANE)
  length = seg_BxT.shape[1]
  kernel = _kernel(groups, length, interpret,
                   fused_backward(length) if fused is None else fused)

  def one_row(q_KxGxTxD, k_KxTxD, v_KxTxD, seg_T):
    ids = splash.SegmentIds(q=seg_T, kv=seg_T)
    return jax.vmap(lambda q, k, v: kernel(q, k, v, segment_ids=ids))(
        q_KxGxTxD, k_KxTxD, v_KxTxD)

  out = jax.vmap(one_row)(q_BxKxGxTxD, k_BxKxTxD, v_BxKxTxD, seg_BxT)
  return reference.ungroup(out[:, :, :, :t])
