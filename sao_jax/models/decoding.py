"""KV-cache decoding: prefill, insert into a slot, one-token decode steps.

This is the model side of the JetStream engine contract: a right-padded prompt
is prefilled once, its keys/values are inserted into one slot of a batched
cache, and every decode step advances all slots by one token, each at its own
position. `generate` strings the pieces together for evaluation and tests.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax import array_checks
from sao_jax.models import model_config
from sao_jax.models import sampling
from sao_jax.models import transformer


class KVCache(NamedTuple):
  """Keys and values of every layer: each `[L, B, S, K, D]`."""
  k: jax.Array
  v: jax.Array


def init_cache(cfg: model_config.ModelConfig, batch: int, max_len: int,
               dtype=None) -> KVCache:
  """An empty cache of `batch` slots holding `max_len` positions each."""
  shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
  dtype = dtype or cfg.compute_dtype
  return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def prefill(model: transformer.CausalLM, tokens_BxP, lengths_B):
  """Runs right-padded prompts of true lengths `lengths_B`.

  Returns:
    `(logits_BxV, prefix)`: float32 logits at each prompt's last real token
    (they predict the first generated token) and the prompts' keys/values as
    a `KVCache` of length P (positions past a prompt's length are padding).
  """
  array_checks.require_rank('prefill', 'tokens', tokens_BxP, '[B, P]')
  batch, length = tokens_BxP.shape
  input_mask_BxP = jnp.arange(length)[None] < jnp.asarray(lengths_B)[:, None]
  positions_BxP = jnp.broadcast_to(jnp.arange(length), (batch, length))
  hidden, (k, v) = model.decoder(tokens_BxP, positions_BxP,
                                 transformer.causal_mask(input_mask_BxP))
  last_Bxd = hidden[jnp.arange(batch), jnp.asarray(lengths_B) - 1]
  logits_BxV = model.logits(last_Bxd[:, None])[:, 0]
  return logits_BxV, KVCache(k, v)


def insert(cache: KVCache, prefix: KVCache, slot) -> KVCache:
  """Writes a one-prompt prefix (`[L, 1, P, K, D]`) into rows [0, P) of `slot`."""
  def write(dst, src):
    return jax.lax.dynamic_update_slice(dst, src.astype(dst.dtype),
                                        (0, slot, 0, 0, 0))
  return KVCache(write(cache.k, prefix.k), write(cache.v, prefix.v))


def decode_step(model: transformer.CausalLM, cache: KVCache, tokens_B,
                positions_B):
  """Feeds one token per slot at its position; returns `(logits_BxV, cache)`.

  Slot b attends to cache positions `<= positions_B[b]`, so padding a prefill
  left beyond a prompt (and stale entries of a reused slot) is never read:
  position p is always written before it is attended to. Positions must be
  below the cache length (the caller stops a slot before it fills up).
  """
  cache_len = cache.k.shape[2]
  mask_Bx1xS = (jnp.arange(cache_len)[None] <= positions_B[:, None])[:, None]
  hidden, (k, v) = model.decoder(tokens_B[:, None], positions_B[:, None],
                                 mask_Bx1xS, cache=(cache.k, cache.v),
                                 write_index_B=positions_B)
  return model.logits(hidden)[:, 0], KVCache(k, v)


@dataclasses.dataclass
class Generation:
  """One generated continuation: tokens, their behaviour log-probs mu_t."""
  tokens: list[int]
  logprobs: list[float]
  stopped: bool  # ended on a stop token (included in `tokens`)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _prefill_and_sample(graphdef, state, tokens_BxP, lengths_B, key, params):
  model = nnx.merge(graphdef, state)
  logits_BxV, prefix = prefill(model, tokens_BxP, lengths_B)
  tokens_B, logprobs_B = sampling.sample(key, logits_BxV, params)
  return prefix, tokens_B, logprobs_B


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(2,))
def _decode_and_sample(graphdef, state, cache, tokens_B, positions_B, params,
                       key):
  model = nnx.merge(graphdef, state)
  logits_BxV, cache = decode_step(model, cache, tokens_B, positions_B)
  next_B, logprobs_B = sampling.sample(key, logits_BxV, params)
  return cache, next_B, logprobs_B


def generate(model: transformer.CausalLM, prompts: Sequence[Sequence[int]],
             max_new_tokens: int, params: sampling.SamplingParams = (
                 sampling.SamplingParams()),
             key=None, stop_ids: Sequence[int] = (), pad_id: int = 0,
             bucket: int = 16) -> list[Generation]:
  """Generates continuations of a batch of prompts (evaluation and tests).

  All prompts are prefilled together (right-padded to a multiple of
  `bucket`, which bounds recompilation), then decoded in lock-step until every
  row has hit a stop token or `max_new_tokens`.

  Args:
    model: the policy.
    prompts: token id lists.
    max_new_tokens: generation budget per prompt.
    params: sampling settings.
    key: PRNG key (unused for greedy); defaults to key 0.
    stop_ids: tokens that end a row (kept in its output).
    pad_id: token used for padding.
    bucket: prompt lengths are padded up to a multiple of this.

  Returns:
    One `Generation` per prompt.
  """
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError('generate: every prompt needs at least one token')
  key = jax.random.key(0) if key is None else key
  graphdef, state = nnx.split(model)
  batch = len(prompts)
  lengths = np.array([len(p) for p in prompts], np.int32)
  padded_len = int(-(-lengths.max() // bucket) * bucket)
  tokens = np.full((batch, padded_len), pad_id, np.int32)
  for row, prompt in enumerate(prompts):
    tokens[row, :len(prompt)] = prompt

  key, sub = jax.random.split(key)
  prefix, next_B, logp_B = _prefill_and_sample(graphdef, state, tokens,
                                               lengths, sub, params)
  cache = init_cache(model.config, batch, padded_len + max_new_tokens)
  cache = KVCache(*(jax.lax.dynamic_update_slice(c, p.astype(c.dtype),
                                                 (0, 0, 0, 0, 0))
                    for c, p in zip(cache, prefix)))
  stops = set(int(s) for s in stop_ids)
  outputs = [Generation([], [], False) for _ in prompts]
  positions_B = jnp.asarray(lengths)
  for step in range(max_new_tokens):
    next_host, logp_host = np.asarray(next_B), np.asarray(logp_B)
    for row, out in enumerate(outputs):
      if not out.stopped and len(out.tokens) < max_new_tokens:
        out.tokens.append(int(next_host[row]))
        out.logprobs.append(float(logp_host[row]))
        out.stopped = int(next_host[row]) in stops
    if step == max_new_tokens - 1 or all(o.stopped for o in outputs):
      break
    key, sub = jax.random.split(key)
    cache, next_B, logp_B = _decode_and_sample(
        graphdef, state, cache, next_B, positions_B, params, sub)
    positions_B = positions_B + 1
  return outputs
