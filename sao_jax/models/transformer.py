"""Llama / Qwen2 / Qwen3 decoder in Flax NNX, shared by learner and rollout engine.

Layers are stacked (one parameter array per kind with a leading `layers` axis)
and run with `jax.lax.scan`: compile time does not grow with depth, which is
what makes 8B-class models compile for TPU pods in minutes. The scan can be
unrolled (`ModelConfig.layer_loop`), which is faster for shallow stacks off
TPU; parameters and values are the same either way. Every parameter
carries `logical_axes` metadata (`embed`, `mlp`, `heads`, `kv_heads`, `vocab`,
...) that `sao_jax.sharding` maps to mesh axes by its logical-axis rules.

The same `Decoder.__call__` serves three modes:
  * training / scoring: full sequences, no cache;
  * prefill: full (right-padded) prompts, returning their keys and values;
  * decode: one new token per slot written into a KV cache at each slot's own
    position, attending over the cache.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax import array_checks
from sao_jax import platforms
from sao_jax.kernels.attention import api as attention_api
from sao_jax.kernels.attention import reference as attention_reference
from sao_jax.models import model_config
from sao_jax.models import moe

_F32 = jnp.float32


def _param(rngs, shape, axes, dtype, init=jax.nn.initializers.normal(0.02)):
  return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=axes)


def dense(x, kernel, contract: int = 1, preferred_element_type=None):
  """`x` times `kernel` over x's last `contract` axes, as one 2-D matmul.

  `x [..., *in]` and `kernel [*in, *out]` give `[..., *out]`. The leading
  (batch, time) axes are flattened into one row axis, so that the backward
  pass's weight gradient is a plain `[in, N] x [N, out]` matmul: written as a
  3-D einsum it contracts over both batch and time, which XLA:CPU runs at
  half the speed (docs/design/learner_speed.md). On TPU the reshapes are bitcasts.
  """
  lead, inner = x.shape[:x.ndim - contract], x.shape[x.ndim - contract:]
  if kernel.shape[:contract] != inner:
    raise ValueError(f'dense: x {x.shape} does not contract with kernel'
                     f' {kernel.shape} over {contract} axes')
  size = math.prod(inner)
  y = jnp.matmul(x.reshape(-1, size), kernel.reshape(size, -1),
                 preferred_element_type=preferred_element_type)
  return y.reshape(lead + kernel.shape[contract:])


class RMSNorm(nnx.Module):
  """`x / rms(x) * scale`, the statistics in float32 (as Hugging Face does)."""

  def __init__(self, dim: int, eps: float, param_dtype):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=('norm',))

  def __call__(self, x):
    x32 = x.astype(_F32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True)
                                 + self.eps)
    return normed.astype(x.dtype) * self.scale[...].astype(x.dtype)


def rope_cos_sin(positions_BxT, inv_freq_D2):
  """cos/sin tables `[B, T, D]` for rotate-half RoPE at integer positions."""
  angles_BxTxD2 = positions_BxT.astype(_F32)[..., None] * inv_freq_D2
  angles_BxTxD = jnp.concatenate([angles_BxTxD2, angles_BxTxD2], axis=-1)
  return jnp.cos(angles_BxTxD), jnp.sin(angles_BxTxD)


def apply_rope(x_BxTxNxD, cos_BxTxD, sin_BxTxD):
  """Rotates query/key heads by their positions (Hugging Face rotate-half)."""
  half = x_BxTxNxD.shape[-1] // 2
  rotated = jnp.concatenate([-x_BxTxNxD[..., half:], x_BxTxNxD[..., :half]],
                            axis=-1)
  cos = cos_BxTxD[:, :, None, :].astype(x_BxTxNxD.dtype)
  sin = sin_BxTxD[:, :, None, :].astype(x_BxTxNxD.dtype)
  return x_BxTxNxD * cos + rotated * sin


class Attention(nnx.Module):
  """Grouped-query self-attention with optional q/k/v biases (Qwen2) and
  per-head query/key RMSNorm (Qwen3)."""

  def __init__(self, cfg: model_config.ModelConfig, *, rngs: nnx.Rngs):
    d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pd = cfg.params_dtype
    self.q_proj = _param(rngs, (d, h, dh), ('embed', 'heads', 'head_dim'), pd)
    self.k_proj = _param(rngs, (d, k, dh), ('embed', 'kv_heads', 'head_dim'), pd)
    self.v_proj = _param(rngs, (d, k, dh), ('embed', 'kv_heads', 'head_dim'), pd)
    self.o_proj = _param(rngs, (h, dh, d), ('heads', 'head_dim', 'embed'), pd)
    if cfg.qkv_bias:
      zeros = jax.nn.initializers.zeros
      self.q_bias = _param(rngs, (h, dh), ('heads', 'head_dim'), pd, zeros)
      self.k_bias = _param(rngs, (k, dh), ('kv_heads', 'head_dim'), pd, zeros)
      self.v_bias = _param(rngs, (k, dh), ('kv_heads', 'head_dim'), pd, zeros)
    else:
      self.q_bias = self.k_bias = self.v_bias = None
    if cfg.qk_norm:
      self.q_norm = RMSNorm(dh, cfg.rms_norm_eps, pd)
      self.k_norm = RMSNorm(dh, cfg.rms_norm_eps, pd)
    else:
      self.q_norm = self.k_norm = None
    self.dtype = cfg.compute_dtype
    self.implementation = cfg.attention

  def _project(self, x, kernel, bias, norm=None):
    y = dense(x, kernel[...].astype(self.dtype))
    y = y if bias is None else y + bias[...].astype(self.dtype)
    return y if norm is None else norm(y)  # over each head's D

  def __call__(self, x_BxTxd, cos_BxTxD, sin_BxTxD, mask,
               cache_k=None, cache_v=None, write_index_B=None):
    """Returns `(y_BxTxd, (keys, values))`.

    Without a cache `mask` is the segment ids `[B, T]` of causal
    self-attention (`attention_api.self_attention`) and the keys/values are
    this call's own `[B, T, K, D]` (what a prefill stores); with one, `mask`
    is `[B, T, S]` bool over the cache, the new keys/values are written into
    it at `write_index_B` and the updated `[B, S, K, D]` cache is returned.
    """
    q_BxTxHxD = apply_rope(
        self._project(x_BxTxd, self.q_proj, self.q_bias, self.q_norm),
        cos_BxTxD, sin_BxTxD)
    k_BxTxKxD = apply_rope(
        self._project(x_BxTxd, self.k_proj, self.k_bias, self.k_norm),
        cos_BxTxD, sin_BxTxD)
    v_BxTxKxD = self._project(x_BxTxd, self.v_proj, self.v_bias)
    if cache_k is None:
      keys, values = k_BxTxKxD, v_BxTxKxD
      out_BxTxHxD = attention_api.self_attention(
          q_BxTxHxD, keys, values, mask, self.implementation)
    else:
      write = jax.vmap(lambda c, n, i: jax.lax.dynamic_update_slice(
          c, n.astype(c.dtype), (i, 0, 0)))
      keys = write(cache_k, k_BxTxKxD, write_index_B)
      values = write(cache_v, v_BxTxKxD, write_index_B)
      out_BxTxHxD = attention_reference.dense_attention(
          q_BxTxHxD, keys.astype(self.dtype), values.astype(self.dtype), mask)
    y_BxTxd = dense(out_BxTxHxD, self.o_proj[...].astype(self.dtype), 2)
    return y_BxTxd, (keys, values)


class MLP(nnx.Module):
  """SwiGLU: `down(silu(gate(x)) * up(x))`."""

  def __init__(self, cfg: model_config.ModelConfig, *, rngs: nnx.Rngs):
    d, f, pd = cfg.hidden_size, cfg.intermediate_size, cfg.params_dtype
    self.gate_proj = _param(rngs, (d, f), ('embed', 'mlp'), pd)
    self.up_proj = _param(rngs, (d, f), ('embed', 'mlp'), pd)
    self.down_proj = _param(rngs, (f, d), ('mlp', 'embed'), pd)
    self.dtype = cfg.compute_dtype

  def __call__(self, x_BxTxd):
    gate = dense(x_BxTxd, self.gate_proj[...].astype(self.dtype))
    up = dense(x_BxTxd, self.up_proj[...].astype(self.dtype))
    return dense(jax.nn.silu(gate) * up, self.down_proj[...].astype(self.dtype))


class RoutedMLP(nnx.Module):
  """Top-k routed SwiGLU experts (Qwen3-MoE), `moe.routed_swiglu`."""

  def __init__(self, cfg: model_config.ModelConfig, *, rngs: nnx.Rngs):
    d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    pd = cfg.params_dtype
    self.router = _param(rngs, (d, e), ('embed', 'expert'), pd)
    self.gate_proj = _param(rngs, (e, d, f), ('expert', 'embed', 'mlp'), pd)
    self.up_proj = _param(rngs, (e, d, f), ('expert', 'embed', 'mlp'), pd)
    self.down_proj = _param(rngs, (e, f, d), ('expert', 'mlp', 'embed'), pd)
    self.top_k = cfg.num_experts_per_tok
    self.normalise = cfg.norm_topk_prob
    self.dtype = cfg.compute_dtype

  def __call__(self, x_BxTxd, real_BxT=None, recorded_BxTxk=None,
               replay: bool = False):
    """`(y_BxTxd, moe.Routing)`; `real_BxT` marks the tokens the routing
    sums count (all by default), `recorded_BxTxk` / `replay` as
    `moe.routed_swiglu`."""
    y, experts, probs, own = moe.routed_swiglu(
        x_BxTxd, self.router[...], self.gate_proj[...], self.up_proj[...],
        self.down_proj[...], top_k=self.top_k, normalise=self.normalise,
        dtype=self.dtype, recorded_BxTxk=recorded_BxTxk, replay=replay)
    if real_BxT is None:
      real_BxT = jnp.ones(x_BxTxd.shape[:2], bool)
    return y, moe.routing_sums(experts, own, probs, real_BxT, recorded_BxTxk)


class Block(nnx.Module):
  """Pre-norm residual block: attention, then a SwiGLU MLP (dense or
  routed experts)."""

  def __init__(self, cfg: model_config.ModelConfig, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.params_dtype)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.params_dtype)
    self.mlp = (RoutedMLP(cfg, rngs=rngs) if cfg.num_experts
                else MLP(cfg, rngs=rngs))

  def __call__(self, x, cos, sin, mask, cache_k=None, cache_v=None,
               write_index=None, real=None, recorded=None, replay=False):
    """`(x, (keys, values), moe.Routing or None)`: routing arguments as
    `RoutedMLP`'s (a dense block has none)."""
    h, kv = self.attn(self.attn_norm(x), cos, sin, mask, cache_k, cache_v,
                      write_index)
    x = x + h
    if isinstance(self.mlp, RoutedMLP):
      y, routing = self.mlp(self.mlp_norm(x), real, recorded, replay)
    else:
      y, routing = self.mlp(self.mlp_norm(x)), None
    return x + y, kv, routing


class Decoder(nnx.Module):
  """Embedding, L stacked blocks, final norm: tokens -> hidden states."""

  def __init__(self, cfg: model_config.ModelConfig, *, rngs: nnx.Rngs):
    self.config = cfg
    self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size),
                        ('vocab', 'embed'), cfg.params_dtype)

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0,
              transform_metadata={nnx.PARTITION_NAME: 'layers',
                                  'logical_axes': 'layers'})
    def make_blocks(rngs):
      return Block(cfg, rngs=rngs)

    self.blocks = make_blocks(rngs)
    self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                              cfg.params_dtype)

  def __call__(self, tokens_BxT, positions_BxT, mask, cache=None,
               write_index_B=None, *, recorded_experts_BxTxR=None,
               replay: bool = False, with_routing: bool = False):
    """Runs the stack; returns `(hidden_BxTxd, (keys, values))`.

    Args:
      tokens_BxT: int token ids.
      positions_BxT: RoPE positions of the tokens.
      mask: without a cache, int segment ids `[B, T]` of causal
        self-attention (`attention_mask`); with one, bool `[B, T, S]`: query
        t may attend cache position s.
      cache: optional `(k, v)`, each `[L, B, S, K, D]`, for decoding.
      write_index_B: where each row's new keys go in the cache.
      recorded_experts_BxTxR: optional int `[B, T, L * k]` (MoE only): the
        experts an engine routed each token to, layer by layer (-1: not
        recorded); compared with the routers' choices, and with `replay`
        used instead of them (`moe.route`).
      replay: routing replay (`model.moe_routing = 'replay'`).
      with_routing: also return the `moe.Routing` of the stack: experts
        `[L, B, T, k]`, the other fields summed over layers (None for a
        dense model).

    Returns:
      The final-normed hidden states and the per-layer keys/values
      `[L, B, T or S, K, D]` (this call's own, or the updated cache); and
      the routing with `with_routing`.
    """
    cfg = self.config
    x = jnp.take(self.embed[...], tokens_BxT, axis=0).astype(cfg.compute_dtype)
    cos, sin = rope_cos_sin(positions_BxT, jnp.asarray(cfg.rope_inv_freq()))
    graphdef, stacked = nnx.split(self.blocks)
    # The tokens the routing sums count: real ones (segment id > 0) of a
    # full sequence, every one of a decode step.
    real_BxT = (jnp.asarray(mask) > 0 if cache is None
                else jnp.ones(tokens_BxT.shape, bool))
    recorded_LxBxTxk = None
    if cfg.num_experts and recorded_experts_BxTxR is not None:
      batch, length = tokens_BxT.shape
      recorded_LxBxTxk = jnp.moveaxis(jnp.asarray(
          recorded_experts_BxTxR, jnp.int32).reshape(
              batch, length, cfg.num_layers, cfg.num_experts_per_tok), 2, 0)

    def layer(x, xs):
      params, cache_k, cache_v, recorded = xs
      block = nnx.merge(graphdef, params)
      x, kv, routing = block(x, cos, sin, mask, cache_k, cache_v,
                             write_index_B, real_BxT, recorded, replay)
      return x, (kv, routing)

    if cfg.remat:
      layer = jax.checkpoint(layer)
    cache_k, cache_v = cache if cache is not None else (None, None)
    unroll = cfg.unroll_layers(platforms.target())
    x, (kv, routing) = jax.lax.scan(
        layer, x, (stacked, cache_k, cache_v, recorded_LxBxTxk),
        unroll=cfg.num_layers if unroll else 1)
    hidden = self.final_norm(x)
    if not with_routing:
      return hidden, kv
    if routing is not None:  # per-layer sums -> the stack's
      routing = routing._replace(**{
          f: jnp.sum(getattr(routing, f), axis=0)
          for f in moe.Routing._fields if f != 'experts'})
    return hidden, kv, routing


def default_positions(tokens_BxT, input_mask_BxT=None):
  """Positions counting real tokens only (left or right padding both work)."""
  if input_mask_BxT is None:
    return jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1]), tokens_BxT.shape)
  return jnp.maximum(jnp.cumsum(input_mask_BxT.astype(jnp.int32), axis=1) - 1, 0)


def attention_mask(input_mask_BxT, segment_ids_BxT=None):
  """The segment ids `[B, T]` the decoder's self-attention takes.

  A packed row holds several trajectories back to back (segment ids 1, 2,
  ...; 0 on padding): attention never crosses from one into another, so
  each one's outputs are what they would be alone in a row (with positions
  counted from 0 in each segment). An unpacked row is one segment, its real
  tokens 1 and its padding 0 (left or right).
  """
  if segment_ids_BxT is None:
    return jnp.asarray(input_mask_BxT).astype(jnp.int32)
  return jnp.asarray(segment_ids_BxT).astype(jnp.int32)


class CausalLM(nnx.Module):
  """The policy pi_theta: decoder plus LM head (tied or untied)."""

  def __init__(self, cfg: model_config.ModelConfig, *, rngs: nnx.Rngs):
    self.config = cfg
    self.decoder = Decoder(cfg, rngs=rngs)
    self.lm_head = None if cfg.tie_embeddings else _param(
        rngs, (cfg.hidden_size, cfg.vocab_size), ('embed', 'vocab'),
        cfg.params_dtype)

  def __call__(self, tokens, positions=None, input_mask=None,
               segment_ids=None):
    """Logits float32 `[B, T, V]` for int tokens `[B, T]`.

    Args:
      tokens: int `[B, T]`.
      positions: optional int `[B, T]` RoPE positions; by default counted over
        the real tokens of `input_mask`.
      input_mask: optional bool `[B, T]`, False at padding (left or right).
      segment_ids: optional int `[B, T]` of packed rows (`attention_mask`;
        0 at padding): replaces `input_mask` in the attention mask.
    """
    return self.logits(self.hidden_states(tokens, positions, input_mask,
                                          segment_ids))

  def hidden_states(self, tokens, positions=None, input_mask=None,
                    segment_ids=None, *, recorded_experts_BxTxR=None,
                    replay: bool = False, with_routing: bool = False):
    """The final-normed hidden states `[B, T, d]` the LM head reads.

    For a caller that applies the head itself (`sampling.chunked_token_logprobs`
    never holds the whole `[B, T, V]` logits). Arguments as `__call__`; the
    routing ones as `Decoder.__call__`'s (with `with_routing`, returns
    `(hidden, moe.Routing or None)`).
    """
    array_checks.require_rank('CausalLM', 'tokens', tokens, '[B, T]')
    if input_mask is None:
      input_mask = jnp.ones(tokens.shape, bool)
    if positions is None:
      positions = default_positions(tokens, input_mask)
    out = self.decoder(tokens, positions,
                       attention_mask(input_mask, segment_ids),
                       recorded_experts_BxTxR=recorded_experts_BxTxR,
                       replay=replay, with_routing=with_routing)
    return (out[0], out[2]) if with_routing else out[0]

  def logits(self, hidden_BxTxd):
    """LM head on final hidden states, float32 logits (operands in
    `ModelConfig.head_dtype`)."""
    dtype = self.config.head_dtype
    if self.lm_head is None:
      kernel = self.decoder.embed[...].astype(dtype).T
    else:
      kernel = self.lm_head[...].astype(dtype)
    return dense(hidden_BxTxd.astype(dtype), kernel,
                 preferred_element_type=_F32)


def init_causal_lm(cfg: model_config.ModelConfig, seed: int = 0) -> CausalLM:
  """A randomly initialised policy (normal(0.02) weights, unit norms)."""
  return CausalLM(cfg, rngs=nnx.Rngs(seed))
