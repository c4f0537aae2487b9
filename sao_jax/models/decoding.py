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
from jax.experimental import multihost_utils

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
                                 transformer.attention_mask(input_mask_BxP))
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
                positions_B, with_routing: bool = False):
  """Feeds one token per slot at its position; returns `(logits_BxV, cache)`
  (and, `with_routing`, the fed tokens' `moe.Routing` or None: the experts
  an MoE policy sent them to, `[L, B, 1, k]`).

  Slot b attends to cache positions `<= positions_B[b]`, so padding a prefill
  left beyond a prompt (and stale entries of a reused slot) is never read:
  position p is always written before it is attended to. Positions must be
  below the cache length (the caller stops a slot before it fills up).
  """
  cache_len = cache.k.shape[2]
  mask_Bx1xS = (jnp.arange(cache_len)[None] <= positions_B[:, None])[:, None]
  hidden, (k, v), *routing = model.decoder(
      tokens_B[:, None], positions_B[:, None], mask_Bx1xS,
      cache=(cache.k, cache.v), write_index_B=positions_B,
      with_routing=with_routing)
  return (model.logits(hidden)[:, 0], KVCache(k, v), *routing)


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


@functools.partial(jax.jit, static_argnums=(1, 2))
def _extend_cache(prefix: KVCache, extra: int, dtype) -> KVCache:
  """The prompts' keys/values followed by room for `extra` positions."""
  pad = ((0, 0), (0, 0), (0, extra), (0, 0), (0, 0))
  return KVCache(*(jnp.pad(c.astype(dtype), pad) for c in prefix))


def generate(model: transformer.CausalLM, prompts: Sequence[Sequence[int]],
             max_new_tokens: int, params: sampling.SamplingParams = (
                 sampling.SamplingParams()),
             key=None, stop_ids: Sequence[int] = (), pad_id: int = 0,
             bucket: int = 16,
             row_sharding: jax.sharding.NamedSharding | None = None
             ) -> list[Generation]:
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
    row_sharding: with several processes, the sharding of a batch axis over
      all processes' devices (the learner's `row_sharding`): `prompts` are
      then this process's rows of one global batch, decoded on every host's
      devices at once. A collective: every process calls it, with any number
      of prompts (none too); the hosts agree on the rows and the prompt
      length, and decode until every host's rows have stopped.

  Returns:
    One `Generation` per prompt.
  """
  if any(len(p) == 0 for p in prompts) or not (prompts or row_sharding):
    raise ValueError('generate: every prompt needs at least one token')
  key = jax.random.key(0) if key is None else key
  graphdef, state = nnx.split(model)
  hosts = _HostRows(row_sharding) if row_sharding is not None else None
  lengths = np.array([len(p) for p in prompts], np.int32)
  longest = int(lengths.max()) if len(prompts) else 1
  rows = len(prompts)
  if hosts is not None:
    rows, longest = hosts.agree(rows, longest)
  padded_len = int(-(-longest // bucket) * bucket)
  tokens = np.full((rows, padded_len), pad_id, np.int32)
  for row, prompt in enumerate(prompts):
    tokens[row, :len(prompt)] = prompt
  # Rows past this host's prompts repeat its last prompt (or one pad token):
  # no longer prompt, and under greedy decoding no more decode steps.
  filler = list(prompts[-1]) if prompts else [pad_id]
  tokens[len(prompts):, :len(filler)] = filler
  lengths = np.concatenate(
      [lengths, np.full(rows - len(prompts), len(filler), np.int32)])
  if hosts is not None:
    tokens, lengths = hosts.place(tokens), hosts.place(lengths)

  key, sub = jax.random.split(key)
  prefix, next_B, logp_B = _prefill_and_sample(graphdef, state, tokens,
                                               lengths, sub, params)
  cache = _extend_cache(prefix, max_new_tokens,
                        jnp.dtype(model.config.compute_dtype))
  stops = set(int(s) for s in stop_ids)
  outputs = [Generation([], [], False) for _ in prompts]
  positions_B = jnp.asarray(lengths) if hosts is None else lengths
  read = np.asarray if hosts is None else hosts.local
  for step in range(max_new_tokens):
    next_host, logp_host = read(next_B), read(logp_B)
    for row, out in enumerate(outputs):
      if not out.stopped and len(out.tokens) < max_new_tokens:
        out.tokens.append(int(next_host[row]))
        out.logprobs.append(float(logp_host[row]))
        out.stopped = int(next_host[row]) in stops
    done = all(o.stopped for o in outputs)
    if hosts is not None:
      done = hosts.all(done)
    if step == max_new_tokens - 1 or done:
      break
    key, sub = jax.random.split(key)
    cache, next_B, logp_B = _decode_and_sample(
        graphdef, state, cache, next_B, positions_B, params, sub)
    positions_B = positions_B + 1
  return outputs


class _HostRows:
  """This process's rows of a batch sharded over every process's devices."""

  def __init__(self, row_sharding: jax.sharding.NamedSharding):
    self.rows = row_sharding
    first = row_sharding.spec[0] if len(row_sharding.spec) else None
    self.matrix = jax.sharding.NamedSharding(
        row_sharding.mesh, jax.sharding.PartitionSpec(first, None))
    axes = (first,) if isinstance(first, str) else tuple(first or ())
    # Row blocks of the batch axis on each process: its rows come in
    # multiples of these.
    blocks = int(np.prod([row_sharding.mesh.shape[a] for a in axes]))
    self.multiple = max(blocks // jax.process_count(), 1)

  def agree(self, rows: int, longest: int) -> tuple[int, int]:
    """The rows per process and the prompt length every host uses."""
    every = multihost_utils.process_allgather(
        np.asarray([rows, longest], np.int64)).reshape(-1, 2)
    rows = max(int(every[:, 0].max()), 1)
    return -(-rows // self.multiple) * self.multiple, int(every[:, 1].max())

  def place(self, local: np.ndarray) -> jax.Array:
    sharding = self.rows if local.ndim == 1 else self.matrix
    shape = (local.shape[0] * jax.process_count(),) + local.shape[1:]
    return jax.make_array_from_process_local_data(sharding, local, shape)

  @staticmethod
  def local(x: jax.Array) -> np.ndarray:
    """This process's rows of `x`, in order (replicas read once)."""
    shards = {s.index[0].start or 0: s for s in x.addressable_shards}
    return np.concatenate([np.asarray(shards[start].data)
                           for start in sorted(shards)])

  @staticmethod
  def all(flag: bool) -> bool:
    every = multihost_utils.process_allgather(np.asarray(flag, np.int32))
    return bool(np.all(every))
