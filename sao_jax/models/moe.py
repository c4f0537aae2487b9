"""Routed SwiGLU experts (Qwen3-MoE): top-k routing and grouped matmuls.

`routed_swiglu` is what `transformer.RoutedMLP` calls. The router's softmax
over E experts picks each token's k experts; the token-expert pairs are
sorted by expert so that each projection is one `jax.lax.ragged_dot` over
all experts' groups, not a loop over experts.

On a mesh (`sharding.mesh_context`) it runs per shard under `jax.shard_map`:
XLA cannot partition the sort over tokens that grouping needs (it would
gather every token of the batch onto every device), so each device routes
its own tokens. Expert parallelism: with an `expert` mesh axis of size ep,
each device holds E/ep experts (their parameters and optimiser state split
ep ways); the tokens of the ep devices of one expert group are all-gathered,
each device applies its own experts to the pairs routed to them, and a
reduce-scatter returns every token's sum to the device that holds it (the
all-gather dispatch; an all-to-all of only the routed pairs moves fewer
bytes and is not built). The experts' hidden width splits over `tensor`
(partial outputs summed there), and their `embed` dimension is gathered
over `fsdp` at the shard_map boundary, as XLA does for a dense layer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from sao_jax import sharding

P = jax.sharding.PartitionSpec
_F32 = jnp.float32


def route(x_Nxd, router_dxE, *, top_k: int, normalise: bool, dtype):
  """(weights `[N, k]` in `dtype`, expert ids `[N, k]`) of each token.

  The softmax is over all E experts, in float32; with `normalise` the k
  chosen probabilities are rescaled to sum to 1 (HF `norm_topk_prob`).
  """
  logits_NxE = jnp.matmul(x_Nxd, router_dxE.astype(dtype))
  probs_NxE = jax.nn.softmax(logits_NxE.astype(_F32), axis=-1)
  weights_Nxk, experts_Nxk = jax.lax.top_k(probs_NxE, top_k)
  if normalise:
    weights_Nxk = weights_Nxk / jnp.sum(weights_Nxk, -1, keepdims=True)
  return weights_Nxk.astype(dtype), experts_Nxk


def _grouped_swiglu(x_Nxd, weights_Nxk, experts_Nxk, gate_ExdxF, up_ExdxF,
                    down_ExFxd, first_expert, dtype):
  """Sum over each token's pairs routed to experts `first_expert ..
  first_expert + E_local - 1` (those held here) of weight x expert(x)."""
  top_k = experts_Nxk.shape[-1]
  local_experts = gate_ExdxF.shape[0]
  flat_P = experts_Nxk.reshape(-1) - first_expert
  held_P = (flat_P >= 0) & (flat_P < local_experts)
  # Pairs for experts held here first, grouped by expert; the others after
  # every group, where `ragged_dot` leaves zeros.
  key_P = jnp.where(held_P, flat_P, local_experts)
  order_P = jnp.argsort(key_P, stable=True)
  group_sizes_E = jnp.bincount(key_P, length=local_experts + 1)[
      :local_experts].astype(jnp.int32)
  token_P = order_P // top_k
  xs_Pxd = x_Nxd[token_P]

  def grouped(lhs, kernel):
    return jax.lax.ragged_dot(lhs, kernel.astype(dtype), group_sizes_E)

  hidden_PxF = jax.nn.silu(grouped(xs_Pxd, gate_ExdxF)) * grouped(xs_Pxd,
                                                                 up_ExdxF)
  out_Pxd = grouped(hidden_PxF, down_ExFxd)
  weight_P = jnp.where(held_P, weights_Nxk.reshape(-1), 0)[order_P]
  return jnp.zeros_like(x_Nxd).at[token_P].add(out_Pxd * weight_P[:, None])


def _routed_tokens(x_BxTxd, router_dxE, gate_ExdxF, up_ExdxF, down_ExFxd, *,
                   top_k, normalise, dtype, expert=None, tensor=None):
  """The routed layer over the tokens here: with `expert`, this device's
  experts among its expert group's gathered tokens; with `tensor`, this
  device's slice of the hidden width (both inside `shard_map` only)."""
  lead, d = x_BxTxd.shape[:-1], x_BxTxd.shape[-1]
  x_Nxd = x_BxTxd.reshape(-1, d)
  weights, experts = route(x_Nxd, router_dxE, top_k=top_k,
                           normalise=normalise, dtype=dtype)
  first = 0
  if expert is not None:  # the expert group's tokens, in device order
    x_Nxd, weights, experts = (
        jax.lax.all_gather(a, expert, tiled=True)
        for a in (x_Nxd, weights, experts))
    first = jax.lax.axis_index(expert) * gate_ExdxF.shape[0]
  y_Nxd = _grouped_swiglu(x_Nxd, weights, experts, gate_ExdxF, up_ExdxF,
                          down_ExFxd, first, dtype)
  if tensor is not None:  # each device summed its slice of the width
    y_Nxd = jax.lax.psum(y_Nxd, tensor)
  if expert is not None:  # every token's sum, back where it lives
    y_Nxd = jax.lax.psum_scatter(y_Nxd, expert, scatter_dimension=0,
                                 tiled=True)
  return y_Nxd.reshape(*lead, d)


def routed_swiglu(x_BxTxd, router_dxE, gate_ExdxF, up_ExdxF, down_ExFxd, *,
                  top_k: int, normalise: bool, dtype):
  """`sum_j w_j * SwiGLU_{e_j}(x)` over each token's k routed experts.

  Args:
    x_BxTxd: the normed hidden states.
    router_dxE: the router's kernel.
    gate_ExdxF, up_ExdxF, down_ExFxd: the experts' SwiGLU kernels.
    top_k: k experts per token; normalise: renormalise their weights.
    dtype: the compute dtype.

  Returns:
    `[B, T, d]` in `dtype`.
  """
  mesh = sharding.current_mesh()
  if mesh is None or mesh.size == 1:
    return _routed_tokens(x_BxTxd, router_dxE, gate_ExdxF, up_ExdxF,
                          down_ExFxd, top_k=top_k, normalise=normalise,
                          dtype=dtype)
  expert_ways = mesh.shape.get(sharding.EXPERT_AXIS, 1)
  tensor_ways = mesh.shape.get('tensor', 1)
  num_experts, _, hidden = gate_ExdxF.shape
  if num_experts % expert_ways:
    raise ValueError(f'{num_experts} experts do not split over'
                     f' mesh.expert={expert_ways}')
  expert = sharding.EXPERT_AXIS if expert_ways > 1 else None
  tensor = 'tensor' if tensor_ways > 1 and hidden % tensor_ways == 0 else None
  sequence = (sharding.SEQUENCE_AXIS
              if mesh.shape.get(sharding.SEQUENCE_AXIS, 1) > 1
              and x_BxTxd.shape[1] % mesh.shape[sharding.SEQUENCE_AXIS] == 0
              else None)
  tokens = P(sharding.BATCH_AXES, sequence, None)
  local = functools.partial(_routed_tokens, top_k=top_k, normalise=normalise,
                            dtype=dtype, expert=expert, tensor=tensor)
  return jax.shard_map(
      local, mesh=mesh,
      in_specs=(tokens, P(), P(expert, None, tensor), P(expert, None, tensor),
                P(expert, tensor, None)),
      out_specs=tokens, check_vma=False)(
          x_BxTxd, router_dxE, gate_ExdxF, up_ExdxF, down_ExFxd)
