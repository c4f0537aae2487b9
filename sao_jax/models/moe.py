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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sao_jax import sharding

P = jax.sharding.PartitionSpec
_F32 = jnp.float32


class Routing(NamedTuple):
  """What one routed layer did with its tokens (`[B, T, ...]`), or the
  per-layer sums of a whole stack (`Decoder(..., with_routing=True)`).

  Attributes:
    experts: int32 `[..., k]` the experts each token went to (stacked
      `[L, B, T, k]` over layers): what an engine records for replay.
    expert_tokens_E: tokens (real ones, summed over their k slots) sent to
      each expert: the load f of the balancing loss, unnormalised.
    expert_probs_E: the router's probabilities summed over real tokens: its
      P, unnormalised.
    tokens: real tokens routed (per layer, summed over layers in a stack).
    mismatched: recorded (token, slot) pairs whose expert is not among the
      router's own top k (the engine/learner disagreement).
    recorded: recorded (token, slot) pairs compared.
  """
  experts: Any
  expert_tokens_E: Any
  expert_probs_E: Any
  tokens: Any
  mismatched: Any
  recorded: Any


def route(x_Nxd, router_dxE, *, top_k: int, normalise: bool, dtype,
          recorded_Nxk=None, replay: bool = False):
  """`(weights [N, k] in dtype, experts [N, k], probs [N, E] f32, own [N, k])`.

  The softmax is over all E experts, in float32; with `normalise` the k
  chosen probabilities are rescaled to sum to 1 (HF `norm_topk_prob`).
  `own` is the router's top k. With `replay`, a token whose `recorded_Nxk`
  row is set (>= 0; -1 marks a token the engine did not record) goes to
  those experts instead (routing replay): its weights are still this
  router's probabilities of them, so the router keeps its gradient.
  """
  logits_NxE = jnp.matmul(x_Nxd, router_dxE.astype(dtype))
  probs_NxE = jax.nn.softmax(logits_NxE.astype(_F32), axis=-1)
  weights_Nxk, own_Nxk = jax.lax.top_k(probs_NxE, top_k)
  experts_Nxk = own_Nxk
  if replay and recorded_Nxk is not None:
    replayed_N = recorded_Nxk[:, 0] >= 0
    experts_Nxk = jnp.where(replayed_N[:, None],
                            recorded_Nxk.astype(own_Nxk.dtype), own_Nxk)
    weights_Nxk = jnp.take_along_axis(probs_NxE, experts_Nxk, axis=-1)
  if normalise:
    weights_Nxk = weights_Nxk / jnp.sum(weights_Nxk, -1, keepdims=True)
  return weights_Nxk.astype(dtype), experts_Nxk, probs_NxE, own_Nxk


def routing_sums(experts_BxTxk, own_BxTxk, probs_BxTxE, real_BxT,
                 recorded_BxTxk=None) -> Routing:
  """A layer's `Routing`: its loads, probabilities and disagreement summed
  over the real tokens (plain array ops, outside any `shard_map`, so that
  the balancing loss differentiates through `probs` as XLA shards it)."""
  num_experts = probs_BxTxE.shape[-1]
  real = real_BxT.astype(_F32)
  hits_BxTxE = jnp.sum(jax.nn.one_hot(experts_BxTxk, num_experts,
                                      dtype=_F32), axis=-2)
  mismatched = recorded = jnp.zeros((), _F32)
  if recorded_BxTxk is not None:
    compared_BxT = real * (recorded_BxTxk[..., 0] >= 0)
    found_BxTxk = jnp.any(recorded_BxTxk[..., :, None]
                          == own_BxTxk[..., None, :], axis=-1)
    mismatched = jnp.sum(compared_BxT[..., None] * (~found_BxTxk))
    recorded = jnp.sum(compared_BxT) * own_BxTxk.shape[-1]
  return Routing(
      experts=experts_BxTxk,
      expert_tokens_E=jnp.einsum('bte,bt->e', hits_BxTxE, real),
      expert_probs_E=jnp.einsum('bte,bt->e', probs_BxTxE, real),
      tokens=jnp.sum(real), mismatched=mismatched, recorded=recorded)


def load_balancing_loss(routing: Routing):
  """The Switch-style auxiliary loss `E * sum_e f_e * P_e` over all layers'
  tokens pooled (as HF's `load_balancing_loss_func`): f_e the share of
  token slots sent to e, P_e the mean router probability of e."""
  num_experts = routing.expert_probs_E.shape[-1]
  count = jnp.maximum(routing.tokens, 1.0)  # layers x real tokens
  return num_experts * jnp.sum((routing.expert_tokens_E / count)
                               * (routing.expert_probs_E / count))


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


def _routed_tokens(x_BxTxd, router_dxE, gate_ExdxF, up_ExdxF, down_ExFxd,
                   recorded_BxTxk, *, top_k, normalise, replay, dtype,
                   expert=None, tensor=None):
  """The routed layer over the tokens here: with `expert`, this device's
  experts among its expert group's gathered tokens; with `tensor`, this
  device's slice of the hidden width (both inside `shard_map` only).

  Returns `(y [B, T, d], experts [B, T, k], probs [B, T, E], own [B, T, k])`
  of these tokens (`route`).
  """
  lead, d = x_BxTxd.shape[:-1], x_BxTxd.shape[-1]
  x_Nxd = x_BxTxd.reshape(-1, d)
  recorded_Nxk = (None if recorded_BxTxk is None
                  else recorded_BxTxk.reshape(-1, top_k))
  weights, experts, probs_NxE, own = route(
      x_Nxd, router_dxE, top_k=top_k, normalise=normalise, dtype=dtype,
      recorded_Nxk=recorded_Nxk, replay=replay)
  routed = (experts.reshape(*lead, top_k), probs_NxE.reshape(*lead, -1),
            own.reshape(*lead, top_k))
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
  return (y_Nxd.reshape(*lead, d),) + routed


def routed_swiglu(x_BxTxd, router_dxE, gate_ExdxF, up_ExdxF, down_ExFxd, *,
                  top_k: int, normalise: bool, dtype, recorded_BxTxk=None,
                  replay: bool = False):
  """`sum_j w_j * SwiGLU_{e_j}(x)` over each token's k routed experts.

  Args:
    x_BxTxd: the normed hidden states.
    router_dxE: the router's kernel.
    gate_ExdxF, up_ExdxF, down_ExFxd: the experts' SwiGLU kernels.
    top_k: k experts per token; normalise: renormalise their weights.
    dtype: the compute dtype.
    recorded_BxTxk: optional int experts an engine routed each token to
      (-1: not recorded): compared with this router's choice, and used
      instead of it with `replay` (`route`).
    replay: route recorded tokens to their recorded experts.

  Returns:
    `(y [B, T, d] in dtype, experts [B, T, k], probs [B, T, E] float32,
    own [B, T, k])`: the experts used, the router's probabilities and its
    own top k.
  """
  mesh = sharding.current_mesh()
  options = dict(top_k=top_k, normalise=normalise, replay=replay, dtype=dtype)
  if mesh is None or mesh.size == 1:
    return _routed_tokens(x_BxTxd, router_dxE, gate_ExdxF, up_ExdxF,
                          down_ExFxd, recorded_BxTxk, **options)
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
  local = functools.partial(_routed_tokens, expert=expert, tensor=tensor,
                            **options)
  return jax.shard_map(
      local, mesh=mesh,
      in_specs=(tokens, P(), P(expert, None, tensor), P(expert, None, tensor),
                P(expert, tensor, None),
                None if recorded_BxTxk is None else tokens),
      out_specs=(tokens,) * 4, check_vma=False)(
          x_BxTxd, router_dxE, gate_ExdxF, up_ExdxF, down_ExFxd,
          recorded_BxTxk)
