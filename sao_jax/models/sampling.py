"""The sampling distribution: temperature, top-k, top-p, and its log-probs.

The rollout engine samples from it and records the log-prob mu_t of every
sampled token; the learner recomputes log pi_theta(a_t) under the *same*
distribution with `token_logprobs`. DIS (SAO §1.2) compares the two, so both
sides share this one definition.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sao_jax import array_checks

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How tokens are drawn from the logits.

  Attributes:
    temperature: divides the logits; 0 means greedy (argmax).
    top_k: keep only the k most likely tokens; 0 disables it.
    top_p: keep the smallest set of most likely tokens whose probability
      reaches p (nucleus sampling); 1 disables it.
  """
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f'temperature must be >= 0, got {self.temperature}')
    if self.top_k < 0:
      raise ValueError(f'top_k must be >= 0, got {self.top_k}')
    if not 0 < self.top_p <= 1:
      raise ValueError(f'top_p must be in (0, 1], got {self.top_p}')

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def sampling_logprobs(logits, params: SamplingParams):
  """Log-probs `[..., V]` of the distribution tokens are sampled from.

  Truncated tokens (outside top-k / top-p) get -inf and the rest are
  renormalised. Greedy decoding is deterministic, so there is no sampling
  distribution to report; it gets the temperature-1 log-softmax (what a
  policy-gradient learner would use at temperature 1).
  """
  logits = jnp.asarray(logits, _F32)
  if params.greedy:
    return jax.nn.log_softmax(logits, axis=-1)
  logits = logits / params.temperature
  vocab = logits.shape[-1]
  if 0 < params.top_k < vocab:
    kth = jax.lax.top_k(logits, params.top_k)[0][..., -1:]
    logits = jnp.where(logits >= kth, logits, -jnp.inf)
  if params.top_p < 1:
    sorted_desc = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    # Keep a token while the mass before it is still short of p; the most
    # likely token always survives.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept = jnp.where(mass_before < params.top_p, sorted_desc, jnp.inf)
    threshold = jnp.min(kept, axis=-1, keepdims=True)
    logits = jnp.where(logits >= threshold, logits, -jnp.inf)
  return jax.nn.log_softmax(logits, axis=-1)


def sample(key, logits_BxV, params: SamplingParams):
  """Draws one token per row; returns `(tokens_B int32, logprobs_B float32)`.

  The log-prob is that of the drawn token under `sampling_logprobs`: the
  behaviour log-prob mu_t the learner's DIS ratio is taken against.
  """
  array_checks.require_rank('sample', 'logits', logits_BxV, '[B, V]')
  logp_BxV = sampling_logprobs(logits_BxV, params)
  if params.greedy:
    tokens_B = jnp.argmax(logits_BxV, axis=-1)
  else:
    tokens_B = jax.random.categorical(key, logp_BxV, axis=-1)
  tokens_B = tokens_B.astype(jnp.int32)
  logprobs_B = jnp.take_along_axis(logp_BxV, tokens_B[:, None], axis=-1)[:, 0]
  return tokens_B, logprobs_B


def token_logprobs(logits_BxTxV, targets_BxT, params: SamplingParams):
  """`log p(target_t)` under the sampling distribution of `logits_t`: `[B, T]`.

  The learner-side recomputation of what `sample` recorded. The caller aligns
  targets with the logits that predicted them (`targets[:, t] = tokens[:, t+1]`).
  """
  array_checks.require_rank('token_logprobs', 'logits', logits_BxTxV,
                            '[B, T, V]')
  array_checks.require_shape('token_logprobs', 'targets', targets_BxT,
                             logits_BxTxV.shape[:2], '[B, T]')
  logp_BxTxV = sampling_logprobs(logits_BxTxV, params)
  return jnp.take_along_axis(
      logp_BxTxV, jnp.asarray(targets_BxT, jnp.int32)[..., None], axis=-1)[..., 0]


def chunked_token_logprobs(head_fn, hidden_BxTxd, targets_BxT,
                           params: SamplingParams, chunk_size: int = 0,
                           with_entropy: bool = False):
  """`log p(target_t)` `[B, T]` from hidden states, C positions at a time.

  `head_fn` maps hidden states `[B, C, d]` to logits `[B, C, V]` (the policy's
  LM head). With `0 < chunk_size < T` the sequence is cut into chunks of
  `chunk_size` positions: each chunk's logits are made, reduced to per-token
  values and dropped, and the backward pass recomputes them chunk by chunk
  (`jax.checkpoint`) instead of keeping `[B, T, V]` residuals. At SmolLM2's
  vocabulary (49k) the whole logits of a 16 x 160 batch are 0.5 GB in
  float32, and the softmax and its gradient each as much again. Values are
  those of `token_logprobs` (the chunks only regroup the work).

  Returns:
    `(logp_BxT, entropy_BxT or None)`: the entropy of the sampling
    distribution at each position when `with_entropy`.
  """
  array_checks.require_rank('chunked_token_logprobs', 'hidden', hidden_BxTxd,
                            '[B, T, d]')
  array_checks.require_shape('chunked_token_logprobs', 'targets', targets_BxT,
                             hidden_BxTxd.shape[:2], '[B, T]')

  targets_BxT = jnp.asarray(targets_BxT, jnp.int32)
  untruncated = params.top_k == 0 and params.top_p == 1

  def one_chunk(h_BxCxd, targets_BxC):
    logits_BxCxV = head_fn(h_BxCxd)
    if untruncated and not with_entropy:
      # log p = z_target - logsumexp(z): no [B, C, V] log-softmax is written,
      # and its gradient (softmax - one-hot) fuses (30% faster on CPU).
      z_BxCxV = logits_BxCxV.astype(_F32) / (params.temperature or 1.0)
      target_BxC = jnp.take_along_axis(z_BxCxV, targets_BxC[..., None],
                                       axis=-1)[..., 0]
      return target_BxC - jax.nn.logsumexp(z_BxCxV, axis=-1), None
    if not with_entropy:
      return token_logprobs(logits_BxCxV, targets_BxC, params), None
    logp_BxCxV = sampling_logprobs(logits_BxCxV, params)
    logp_BxC = jnp.take_along_axis(logp_BxCxV, targets_BxC[..., None],
                                   axis=-1)[..., 0]
    probs = jnp.exp(logp_BxCxV)
    # Tokens truncated by top-k / top-p have p = 0 and log p = -inf: zero the
    # log first (0 * -inf would be NaN in the value and in the gradient).
    finite_logp = jnp.where(probs > 0, logp_BxCxV, 0.0)
    return logp_BxC, -jnp.sum(probs * finite_logp, axis=-1)

  rows, length = hidden_BxTxd.shape[:2]
  if chunk_size <= 0 or chunk_size >= length:
    return one_chunk(hidden_BxTxd, targets_BxT)
  chunks = -(-length // chunk_size)
  pad = chunks * chunk_size - length
  # [B, T, ...] -> [N, B, C, ...]: lax.map runs over the leading axis.
  split = lambda x: jnp.swapaxes(jnp.pad(
      x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)).reshape(
          (rows, chunks, chunk_size) + x.shape[2:]), 0, 1)
  merge = lambda x_NxBxC: jnp.swapaxes(x_NxBxC, 0, 1).reshape(
      rows, chunks * chunk_size)[:, :length]
  logp_NxBxC, entropy_NxBxC = jax.lax.map(
      jax.checkpoint(lambda xs: one_chunk(*xs)),
      (split(hidden_BxTxd), split(targets_BxT)))
  return merge(logp_NxBxC), (None if entropy_NxBxC is None
                             else merge(entropy_NxBxC))
