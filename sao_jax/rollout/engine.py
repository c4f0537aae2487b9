"""Our policy behind JetStream 0.2.2's `Engine` contract, with mu_t and versions.

JetStream's orchestrator runs prefill, insert and generate threads around an
Engine and streams each step's tokens to gRPC clients. SAO needs two things the
protocol does not carry: the behaviour log-prob mu_t of every sampled token and
the policy version that sampled it. Both ride as extra columns of
`ResultTokens`, which the orchestrator streams like token ids for token-content
requests: each step emits `[token, float32 bits of mu_t as int32, version]`
(the layout both sides import from `wire`).

Sampling happens at the start of `generate`, from logits kept per slot in the
decode state (prefill leaves the prompt's last logits there; each step then
feeds the sampled token through the model to refresh them). A token's version
is that of the forward pass that produced its logits, so a weight swap between
steps attributes every token correctly; each call reads its `(params, version)`
pair once, so no step mixes two versions. After a swap, the first step
recomputes the KV cache and pending logits of every slot whose cache was
computed by an older version (a full forward over the slot's tokens): the
tokens it samples are exactly pi_new(a_t | s_t), not a hybrid of new weights
over a stale cache, so the learner's recomputation of mu_t matches across the
switch. Weights live in a `WeightsHolder`
the engine reads on every call (the orchestrator captures `params` once per
thread, which would pin the first weights forever), swapped atomically by the
admin service.

Multi-turn episodes send each turn as the whole conversation so far. When a
row finishes (or its slot is reused), its tokens and keys/values go to a
`prefix_cache.PrefixCache` (`EngineConfig.prefix_cache_bytes`), and a
prefill whose prompt extends a kept row under the same policy version runs
the model over the new tokens only, attending to the kept keys/values; a
weight swap invalidates what is kept. With the cache on, `generate` waits
for the step it dispatched to learn which rows it ended (an `[N]` bool), so
that a row is kept before its client can send the next turn, even when the
engine then goes idle: the next step is dispatched a host round trip later
than JetStream would (sub-millisecond against a decode step's
milliseconds); with it off (`prefix_cache_bytes=0`) nothing waits.

A slot that samples a stop token still emits it (the client sees EOS), then
turns invalid on the next step, which is how the orchestrator learns it is
complete: JetStream's own stop-token check would also fire on the log-prob and
version columns, so the tokenizer it sees declares no stop tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax import sharding
from sao_jax.models import decoding
from sao_jax.models import pretrained
from sao_jax.models import sampling
from sao_jax.models import tokenizer as tokenizer_lib
from sao_jax.models import transformer
from sao_jax.rollout import jetstream_compat
from sao_jax.rollout import options
from sao_jax.rollout import prefix_cache
from sao_jax.rollout import weight_stream
from sao_jax.rollout import wire

engine_api = jetstream_compat.engine_api
tokenizer_api = jetstream_compat.tokenizer_api

# JetStream prepends a BOS to every token-content prompt without history; the
# engine's tokenizer reports this sentinel as BOS and prefill strips it, so the
# prompt reaches the model exactly as the client sent it.
BOS_SENTINEL = -1
PREFILL_BUCKETS = options.PREFILL_BUCKETS


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Serving shape.

  Attributes:
    max_concurrent_decodes: decode slots (continuous batching width).
    samples_per_slot: G samples per prompt from one prefill (GRPO groups).
    max_prefill_length: longest prompt, one of JetStream's padding buckets
      (the BOS JetStream adds counts: prompts may be one token shorter).
    max_target_length: KV-cache length per slot: prompt plus generation.
    sampling: the sampling distribution (shared with the learner).
    stop_ids: tokens that end a sample (emitted, then the slot stops).
    seed: sampling PRNG seed (the run's `config.seed`).
    server_index: this server's position among the run's rollout servers,
      folded into the sampling key so that servers draw different streams.
    restart: how many times the run was restarted (from a checkpoint), folded
      in too so that a resumed run does not replay the samples it drew before.
    prefix_cache_bytes: device memory for finished rows' keys/values, reused
      by the prefills of later turns (0: off).
    max_new_tokens: a row stops after this many sampled tokens (0: at a stop
      token or a full cache only). JetStream ends a request at its
      `max_tokens` on the client's side but keeps decoding the row; with the
      prefix cache on, `engine_config` sets this to the most any episode
      asks for, so that a reply cut there is kept before the next turn.
  """
  max_concurrent_decodes: int = 8
  samples_per_slot: int = 1
  max_prefill_length: int = 256
  max_target_length: int = 512
  sampling: sampling.SamplingParams = sampling.SamplingParams()
  stop_ids: tuple[int, ...] = ()
  seed: int = 0
  server_index: int = 0
  restart: int = 0
  prefix_cache_bytes: int = 0
  max_new_tokens: int = 0

  def __post_init__(self):
    if self.max_prefill_length not in PREFILL_BUCKETS:
      raise ValueError(
          f'max_prefill_length={self.max_prefill_length} must be one of'
          f" JetStream's padding buckets {PREFILL_BUCKETS}")
    if self.max_target_length <= self.max_prefill_length:
      raise ValueError(
          f'max_target_length={self.max_target_length} must exceed'
          f' max_prefill_length={self.max_prefill_length}')
    if self.max_concurrent_decodes < 1 or self.samples_per_slot < 1:
      raise ValueError('max_concurrent_decodes and samples_per_slot must be'
                       ' >= 1')
    if self.server_index < 0 or self.restart < 0:
      raise ValueError(f'server_index={self.server_index} and restart='
                       f'{self.restart} must be >= 0')
    if self.max_new_tokens < 0:
      raise ValueError(f'max_new_tokens={self.max_new_tokens} must be >= 0')
    if self.prefix_cache_bytes < 0:
      raise ValueError(f'prefix_cache_bytes={self.prefix_cache_bytes} must be'
                       ' >= 0')


class WeightsHolder:
  """The engine's current `(params state, version)`, swapped atomically."""

  def __init__(self, state, version: int):
    self._lock = threading.Lock()
    self._current = (state, int(version))

  def get(self):
    with self._lock:
      return self._current

  def swap(self, state, version: int) -> None:
    with self._lock:
      self._current = (state, int(version))

  @property
  def version(self) -> int:
    return self.get()[1]


class Prefix(NamedTuple):
  """A prefilled prompt, ready to insert into a slot."""
  tokens: jax.Array  # [1, P] int32, the prompt (right-padded)
  cache: decoding.KVCache  # [L, 1, P, K, D]
  logits: jax.Array  # [1, V] at the prompt's last token
  length: jax.Array  # int32 scalar, real prompt tokens
  version: jax.Array  # int32 scalar, weights version of the prefill
  too_long: jax.Array  # bool scalar


class DecodeState(NamedTuple):
  """All slots' decoding state (N = slots x samples per slot rows)."""
  tokens: jax.Array  # [N, S] int32: each row's sequence so far
  cache: decoding.KVCache  # [L, N, S, K, D]
  logits: jax.Array  # [N, V] float32: the next token's logits
  logits_version: jax.Array  # [N] int32: version that computed them
  positions: jax.Array  # [N] int32: where the next token is written
  generated: jax.Array  # [N] int32: tokens emitted so far
  active: jax.Array  # [N] bool: the slot still samples
  too_long: jax.Array  # [N] bool: report wire.PROMPT_TOO_LONG once
  key: jax.Array  # PRNG key


class _TokenIds(tokenizer_api.Tokenizer):
  """What the orchestrator sees of the tokenizer (token-in/token-out only)."""

  def __init__(self, tok: tokenizer_lib.Tokenizer):
    self._tok = tok

  def encode(self, s, **kwargs):
    raise NotImplementedError('sao_jax servers take token_content requests')

  def decode(self, token_ids, **kwargs):
    return self._tok.decode(list(token_ids))

  @property
  def pad_id(self):
    return self._tok.pad_id if self._tok.pad_id is not None else 0

  @property
  def eos_id(self):
    return self._tok.eos_id

  @property
  def bos_id(self):
    return BOS_SENTINEL

  @property
  def stop_tokens(self):
    return set()  # stops travel as invalid steps; see the module docstring


class Engine(engine_api.Engine):
  """A `transformer.CausalLM` served through JetStream, tensor parallel."""

  def __init__(self, model: transformer.CausalLM,
               tok: tokenizer_lib.Tokenizer, config: EngineConfig,
               version: int = 0, devices=None,
               rules=sharding.DEFAULT_RULES):
    """Places the model on `devices` (default: all local ones) tensor-parallel.

    Args:
      model: the policy.
      tok: its tokenizer (for JetStream's detokenizer and pad/eos ids).
      config: serving shape and sampling.
      version: policy version of the initial weights.
      devices: devices of this engine; the model is sharded over all of them
        along the `tensor` mesh axis by the learner's logical-axis rules.
      rules: logical-axis rules (`sao_jax.sharding.DEFAULT_RULES`).
    """
    self.config = config
    self.model_config = model.config
    # An MoE policy's steps carry each token's experts (routing replay).
    self.routing = wire.RoutingLayout.for_config(model.config)
    self._tok = tok
    devices = jax.local_devices() if devices is None else devices
    self._mesh = sharding.make_mesh(dict(data=1, fsdp=1, tensor=len(devices)),
                                    devices)
    self._rules = rules
    self._graphdef, state = nnx.split(model)
    self._shardings = sharding.state_shardings(state, self._mesh, rules)
    self.weights = WeightsHolder(self._place(state), version)
    self._pad_id = _TokenIds(tok).pad_id
    self._stop_ids = tuple(int(s) for s in config.stop_ids)
    self.prefix_cache = prefix_cache.PrefixCache(config.prefix_cache_bytes)
    # Rows (generate-thread bookkeeping) whose content is not kept yet.
    self._unsaved: set[int] = set()
    self._emitted: list = []  # per-step device counts, folded lazily
    self._emitted_total = 0
    self._emitted_lock = threading.Lock()
    # The last step's output and version, and what was measured at the
    # last 64 version changes (`swap_pauses`).
    self._last_step: tuple[jax.Array, int] | None = None
    self._pauses: list[dict] = []
    self._time_next_step = False

  # -- weights -----------------------------------------------------------

  def _place(self, state):
    return jax.device_put(state, self._shardings)

  def abstract_state(self):
    """The parameter state's shapes, dtypes and shardings (for restores)."""
    state, _ = self.weights.get()
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        state)

  @property
  def version(self) -> int:
    return self.weights.version

  # -- the Engine contract ----------------------------------------------------

  def load_params(self, *args, **kwargs):
    del args, kwargs
    return None  # weights are read from self.weights on every call

  def prefill(self, *, params, existing_prefix=None, padded_tokens,
              true_length: int) -> Prefix:
    del params
    if existing_prefix is not None:
      raise ValueError('sao_jax engines do not continue prefixes')
    tokens = np.asarray(padded_tokens)
    bucket = tokens.shape[-1]
    # JetStream truncates an over-long prompt to the bucket and still reports
    # its full length: refuse it rather than generate from a cut prompt.
    too_long = true_length > bucket
    start = 1 if tokens[0] == BOS_SENTINEL else 0
    real = tokens[start:min(true_length, bucket)]
    padded = np.full((1, bucket), self._pad_id, np.int32)
    padded[0, :len(real)] = real
    state, version = self.weights.get()
    length = np.int32(max(len(real), 1))
    if self.prefix_cache.enabled and not too_long and len(real) > 1:
      entry, reuse = self.prefix_cache.lookup(real, version)
      if entry is not None:
        count = len(real) - reuse
        suffix = np.full((1, _bucket(count, bucket)), self._pad_id, np.int32)
        suffix[0, :count] = real[reuse:]
        self.prefix_cache.count_prefill(count, reuse)
        return _prefill_reusing(self._graphdef, state, entry.kv, padded,
                                suffix, np.int32(reuse), np.int32(count),
                                length, np.int32(version), np.bool_(False))
    self.prefix_cache.count_prefill(len(real), 0)
    # On several chips a Mosaic attention kernel runs per shard (heads over
    # `tensor`); the context is read when a call traces.
    with sharding.mesh_context(self._mesh):
      return _prefill(self._graphdef, state, padded, length,
                      np.int32(version), np.bool_(too_long))

  def insert(self, prefix: Prefix, decode_state: DecodeState,
             slot: int) -> DecodeState:
    g = self.config.samples_per_slot
    rows = range(slot * g, (slot + 1) * g)
    if self.prefix_cache.enabled:
      # The slot's last occupant, before its rows are overwritten.
      self._save_rows(decode_state, [r for r in rows if r in self._unsaved])
    decode_state = _insert(g, prefix, decode_state, np.int32(slot))
    if self.prefix_cache.enabled and not bool(np.asarray(prefix.too_long)):
      self._unsaved.update(rows)
    return decode_state

  def _save_rows(self, ds: DecodeState, rows) -> None:
    """Keeps rows' tokens and keys/values in the prefix cache (before `ds`
    is donated: called on the generate thread, which owns it)."""
    if not rows:
      return
    positions = np.asarray(ds.positions)
    versions = np.asarray(ds.logits_version)
    tokens = np.asarray(ds.tokens)
    for row in rows:
      self._unsaved.discard(row)
      length = int(positions[row])
      if length < 1:
        continue
      kv = _take_row(_bucket(length, self.config.max_target_length),
                     ds.cache, np.int32(row))
      self.prefix_cache.save(tokens[row, :length], kv, int(versions[row]),
                             kv.k.nbytes + kv.v.nbytes)

  def generate(self, params, decode_state: DecodeState):
    del params
    state, version = self.weights.get()
    swapped = self._last_step is not None and self._last_step[1] != version
    timed = swapped or self._time_next_step
    if timed:
      # At a version change: the pause (the last step under the old weights
      # done to the first under the new dispatched), that first step (it
      # refreshes the rows in flight) and, as its yardstick, the step after
      # it. Only these steps are waited for; the others stay asynchronous.
      self._last_step[0].block_until_ready()
      previous_done = time.perf_counter()
    with sharding.mesh_context(self._mesh):  # the refresh's prefill
      decode_state, data, inactive_N, emitted = _generate(
          self._graphdef, self.config.sampling, self._stop_ids,
          self.config.max_target_length, self.config.max_new_tokens, state,
          np.int32(version), decode_state)
    if timed:
      dispatched = time.perf_counter()
      data.block_until_ready()
      seconds = time.perf_counter() - previous_done
      if swapped:
        self._pauses = (self._pauses + [{
            'pause_s': dispatched - previous_done, 'first_step_s': seconds,
            'next_step_s': None}])[-64:]
      else:
        self._pauses[-1]['next_step_s'] = seconds
      self._time_next_step = swapped
    self._last_step = (data, version)
    self._count_emitted(emitted)
    if self.prefix_cache.enabled and self._unsaved:
      # Rows this step ended, kept before the client can send its next turn
      # (waits for the step: see the module docstring).
      inactive = np.asarray(inactive_N)
      self._save_rows(decode_state, [row for row in self._unsaved
                                     if inactive[row]])
    rows = data.shape[0]
    return decode_state, engine_api.ResultTokens(
        data=data,
        tokens_idx=(0, self.routing.width),
        valid_idx=(self.routing.width, 2 * self.routing.width),
        length_idx=(2 * self.routing.width, 2 * self.routing.width + 1),
        samples_per_slot=rows // self.config.max_concurrent_decodes)

  def _count_emitted(self, emitted) -> None:
    with self._emitted_lock:
      self._emitted.append(emitted)
      if len(self._emitted) > 64:  # long done: reading them never waits
        self._emitted_total += int(sum(np.asarray(e)
                                       for e in self._emitted[:32]))
        del self._emitted[:32]

  def generated_tokens(self) -> int:
    """Tokens sampled since the engine started (every row of every step
    that has finished: the admin service's `Status` asks from the server's
    event loop, which must never wait for a decode step)."""
    with self._emitted_lock:
      ready = 0
      while ready < len(self._emitted) and self._emitted[ready].is_ready():
        ready += 1
      self._emitted_total += int(sum(np.asarray(e)
                                     for e in self._emitted[:ready]))
      del self._emitted[:ready]
      return self._emitted_total

  def swap_pauses(self) -> dict:
    """Decoding at the last 64 weight swaps (seconds): how many were
    measured; the pause (the last step under the old weights done to the
    first under the new dispatched: the swap itself), its last and largest;
    and the first step under the new weights (its refresh of the rows in
    flight included) next to the step after it, medians."""
    pauses = [dict(p) for p in self._pauses]
    gaps = [p['pause_s'] for p in pauses]
    firsts = [p['first_step_s'] for p in pauses]
    nexts = [p['next_step_s'] for p in pauses if p['next_step_s'] is not None]
    return {'count': len(pauses), 'last_s': gaps[-1] if gaps else None,
            'max_s': max(gaps) if gaps else None,
            'first_step_median_s': float(np.median(firsts)) if firsts else None,
            'next_step_median_s': float(np.median(nexts)) if nexts else None,
            'last': pauses[-1] if pauses else None}

  def prefill_status(self) -> dict:
    """The prefix cache's counters and the prefill work per sampled token."""
    status = self.prefix_cache.status()
    generated = self.generated_tokens()
    status['generated_tokens'] = generated
    status['prefilled_tokens_per_generated_token'] = (
        status['prefilled_tokens'] / generated if generated else None)
    return status

  def init_decode_state(self, *args, **kwargs) -> DecodeState:
    del args, kwargs
    # A fresh decode state (also after a generate loop restart) holds no
    # row worth keeping.
    self._unsaved.clear()
    cfg = self.config
    rows = cfg.max_concurrent_decodes * cfg.samples_per_slot
    return DecodeState(
        tokens=jnp.zeros((rows, cfg.max_target_length), jnp.int32),
        cache=decoding.init_cache(self.model_config, rows,
                                  cfg.max_target_length),
        logits=jnp.zeros((rows, self.model_config.vocab_size), jnp.float32),
        logits_version=jnp.zeros((rows,), jnp.int32),
        positions=jnp.zeros((rows,), jnp.int32),
        generated=jnp.zeros((rows,), jnp.int32),
        active=jnp.zeros((rows,), bool),
        too_long=jnp.zeros((rows,), bool),
        key=sampling_key(cfg))

  def get_prefix_destination_sharding(self):
    return None  # interleaved mode: prefixes never move between engines

  def get_tokenizer(self):
    return jetstream_compat.engine_api.tokenizer_pb2.TokenizerParameters(
        path='sao_jax')

  def build_tokenizer(self, metadata) -> tokenizer_api.Tokenizer:
    del metadata
    return _TokenIds(self._tok)

  @property
  def max_concurrent_decodes(self) -> int:
    return self.config.max_concurrent_decodes

  @property
  def samples_per_slot(self) -> int:
    return self.config.samples_per_slot

  @property
  def max_prefill_length(self) -> int:
    return self.config.max_prefill_length

  @property
  def mesh(self):
    return self._mesh

  @property
  def colocated_cpus(self):
    return None


@functools.partial(jax.jit, static_argnums=(0,))
def _prefill(graphdef, state, tokens_1xP, length, version, too_long) -> Prefix:
  model = nnx.merge(graphdef, state)
  logits_1xV, cache = decoding.prefill(model, tokens_1xP, length[None])
  return Prefix(tokens_1xP, cache, logits_1xV, length, version, too_long)


def _bucket(length: int, cap: int) -> int:
  """The smallest padding bucket holding `length` tokens, at most `cap`."""
  return min(next((b for b in PREFILL_BUCKETS if b >= length),
                  PREFILL_BUCKETS[-1]), cap)


# A reused prefill runs its new tokens this many at a time: the scores of a
# chunk over the kept cache are `[H, chunk, P]`, not `[H, T, P]`.
_EXTEND_CHUNK = 256


@functools.partial(jax.jit, static_argnums=(0,))
def _prefill_reusing(graphdef, state, kept: decoding.KVCache, tokens_1xP,
                     suffix_1xQ, start, count, length, version,
                     too_long) -> Prefix:
  """A prefill whose first `start` positions come from a kept row.

  Runs the model over the `count` new tokens (`suffix_1xQ`, right-padded) at
  positions `start, start + 1, ...`, attending to the kept keys/values
  below `start` and causally among themselves: what `_prefill` computes for
  the whole prompt, with the prefix's work skipped. The cache it returns
  has the prompt's bucket length P, as `_prefill`'s does.
  """
  model = nnx.merge(graphdef, state)
  prompt_len, suffix_len = tokens_1xP.shape[1], suffix_1xQ.shape[1]
  # Room for the whole padded suffix past any start < P: a write that ran
  # past the end would be clamped (shifted) by dynamic_update_slice.
  width = prompt_len + suffix_len
  layers, _, kept_len, heads, dim = kept.k.shape

  def work(c):
    c = c[:, :, :min(kept_len, width)]
    return jnp.zeros((layers, 1, width, heads, dim), c.dtype).at[
        :, :, :c.shape[2]].set(c)

  chunk = min(_EXTEND_CHUNK, suffix_len)  # both powers of 2: it divides

  def one_chunk(cache, i):
    first = start + i * chunk
    tokens_1xC = jax.lax.dynamic_slice_in_dim(suffix_1xQ, i * chunk, chunk, 1)
    positions_1xC = (first + jnp.arange(chunk))[None]
    mask_1xCxW = (jnp.arange(width)[None, None]
                  <= positions_1xC[:, :, None])
    hidden_1xCxd, cache = model.decoder(tokens_1xC, positions_1xC,
                                        mask_1xCxW, cache=cache,
                                        write_index_B=first[None])
    return cache, hidden_1xCxd[0]

  (k, v), hidden_NxCxd = jax.lax.scan(one_chunk, (work(kept.k), work(kept.v)),
                                      jnp.arange(suffix_len // chunk))
  last_d = hidden_NxCxd.reshape(suffix_len, -1)[count - 1]
  logits_1xV = model.logits(last_d[None, None])[:, 0]
  cache = decoding.KVCache(k[:, :, :prompt_len], v[:, :, :prompt_len])
  return Prefix(tokens_1xP, cache, logits_1xV, length, version, too_long)


@functools.partial(jax.jit, static_argnums=(0,))
def _take_row(length: int, cache: decoding.KVCache, row) -> decoding.KVCache:
  """Row `row`'s keys/values at positions `[0, length)`: `[L, 1, length, K,
  D]`, a copy (the decode state's buffers are donated every step)."""
  def take(c):
    return jax.lax.dynamic_slice(
        c, (0, row, 0, 0, 0), (c.shape[0], 1, length) + c.shape[3:])
  return decoding.KVCache(take(cache.k), take(cache.v))


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _insert(samples_per_slot, prefix: Prefix, ds: DecodeState,
            slot) -> DecodeState:
  """Writes a prefix into the `samples_per_slot` rows of `slot`."""
  first = slot * samples_per_slot
  cache = ds.cache
  for g in range(samples_per_slot):
    cache = decoding.insert(cache, prefix.cache, first + g)
  rows = jnp.arange(ds.active.shape[0])
  mine = (rows >= first) & (rows < first + samples_per_slot)
  prompt_len = prefix.tokens.shape[1]
  prompt_NxS = jnp.zeros_like(ds.tokens).at[:, :prompt_len].set(prefix.tokens)
  return DecodeState(
      tokens=jnp.where(mine[:, None], prompt_NxS, ds.tokens),
      cache=cache,
      logits=jnp.where(mine[:, None], prefix.logits, ds.logits),
      logits_version=jnp.where(mine, prefix.version, ds.logits_version),
      positions=jnp.where(mine, prefix.length, ds.positions),
      generated=jnp.where(mine, 0, ds.generated),
      active=jnp.where(mine, ~prefix.too_long, ds.active),
      too_long=jnp.where(mine, prefix.too_long, ds.too_long),
      key=ds.key)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(7,))
def _generate(graphdef, params, stop_ids, cache_len, max_new, state, version,
              ds: DecodeState):
  """One step for every slot: sample, emit, and feed the token back."""
  model = nnx.merge(graphdef, state)
  stale_N = ds.active & (ds.logits_version != version)
  ds = jax.lax.cond(jnp.any(stale_N),
                    functools.partial(_refresh, model, version, stale_N),
                    lambda d: d, ds)
  key, sub = jax.random.split(ds.key)
  tokens_N, logp_N = sampling.sample(sub, ds.logits, params)
  emit_N = ds.active
  stop_N = jnp.isin(tokens_N, jnp.asarray(stop_ids, jnp.int32)) if stop_ids \
      else jnp.zeros_like(emit_N)
  # Feed the token at its position; a slot whose cache is full stops after it.
  write_N = jnp.minimum(ds.positions, cache_len - 1)
  layout = wire.RoutingLayout.for_config(model.config)
  logits_NxV, cache, routing = decoding.decode_step(
      model, ds.cache, tokens_N, write_N, with_routing=True)
  full_N = ds.positions + 1 >= cache_len
  if max_new:
    full_N = full_N | (ds.generated + 1 >= max_new)
  rows_N = jnp.arange(tokens_N.shape[0])
  new = DecodeState(
      tokens=ds.tokens.at[rows_N, write_N].set(
          jnp.where(emit_N, tokens_N, ds.tokens[rows_N, write_N])),
      cache=cache,
      logits=jnp.where(emit_N[:, None], logits_NxV, ds.logits),
      logits_version=jnp.where(emit_N, version, ds.logits_version),
      positions=ds.positions + emit_N,
      generated=ds.generated + emit_N,
      active=emit_N & ~stop_N & ~full_N,
      too_long=jnp.zeros_like(ds.too_long),
      key=key)
  # A too-long prompt answers once with a marker step, then stops.
  marker_N = ds.too_long
  columns = [None] * wire.NUM_COLUMNS
  columns[wire.TOKEN] = jnp.where(marker_N, 0, tokens_N)
  columns[wire.LOGPROB_BITS] = jax.lax.bitcast_convert_type(
      jnp.where(marker_N, 0.0, logp_N).astype(jnp.float32), jnp.int32)
  columns[wire.VERSION] = jnp.where(marker_N, wire.PROMPT_TOO_LONG,
                                    ds.logits_version)
  if layout.ids_per_token:  # the experts the fed-back token went to
    records_NxC = _pack_routing(routing.experts, layout)
    columns += [records_NxC[:, c] for c in range(layout.columns)]
  valid = (emit_N | marker_N).astype(jnp.int32)
  # ResultTokens: the wire columns, a validity flag per column, the length.
  data = jnp.stack(columns + [valid] * layout.width
                   + [new.generated + marker_N], axis=1)
  # For the prefix cache: which rows this step left done, and the number of
  # tokens it sampled.
  return new, data, ~new.active, jnp.sum(emit_N.astype(jnp.int32))


def _pack_routing(experts_LxNx1xk, layout: wire.RoutingLayout):
  """int32 `[N, columns]`: each row's `[L * k]` expert ids, layer by layer,
  packed `layout.ids_per_column` to a column (`wire.RoutingLayout.unpack`)."""
  layers, rows, _, top_k = experts_LxNx1xk.shape
  ids_NxR = jnp.moveaxis(experts_LxNx1xk[:, :, 0], 1, 0).reshape(
      rows, layers * top_k).astype(jnp.uint32)
  per = layout.ids_per_column
  ids_NxCxJ = jnp.pad(ids_NxR, ((0, 0), (0, layout.columns * per
                                         - layers * top_k))).reshape(
                                             rows, layout.columns, per)
  shifts_J = jnp.arange(per, dtype=jnp.uint32) * layout.bits_per_id
  words_NxC = jnp.sum(ids_NxCxJ << shifts_J, axis=-1, dtype=jnp.uint32)
  return jax.lax.bitcast_convert_type(words_NxC, jnp.int32)


def sampling_key(config: EngineConfig) -> jax.Array:
  """The engine's initial PRNG key: the seed, then server index and restart."""
  key = jax.random.fold_in(jax.random.key(config.seed), config.server_index)
  return jax.random.fold_in(key, config.restart)


def engine_config(config, tok: tokenizer_lib.Tokenizer, server_index: int = 0,
                  restart: int = 0) -> EngineConfig:
  """The serving shape and sampling of a sao_jax config.

  `server_index` and `restart` pick this server's sampling stream; see
  `EngineConfig`.
  """
  r = config.rollout
  return EngineConfig(
      max_concurrent_decodes=r.max_concurrent_decodes,
      samples_per_slot=config.group_size if r.group_in_one_request else 1,
      max_prefill_length=r.max_prefill_length,
      max_target_length=r.max_target_length,
      sampling=sampling.SamplingParams(r.temperature, r.top_k, r.top_p),
      stop_ids=tuple(tok.stop_ids),
      seed=config.seed,
      server_index=server_index,
      restart=restart,
      prefix_cache_bytes=int(r.get('prefix_cache_gib', 0.0) * 2**30),
      max_new_tokens=(r.max_new_tokens if r.get('prefix_cache_gib', 0.0)
                      else 0))


def serving_dtype(config) -> str:
  """The dtype a server computes in: `rollout.dtype`, or the learner's
  `model.dtype` when that is '' (set them apart to measure what a bf16
  engine does to mu against an f32 learner, or the reverse)."""
  return config.rollout.get('dtype', '') or config.model.dtype


def build_engine(config, version: int = 0, model=None, tok=None,
                 devices=None, server_index: int = 0,
                 restart: int = 0) -> Engine:
  """An engine for `config.model.source` (or the given model and tokenizer).

  `server_index` and `restart` pick its sampling stream (`EngineConfig`).
  """
  if model is None:
    model, tok = pretrained.from_pretrained(
        config.model.source, dtype=serving_dtype(config),
        param_dtype=weight_stream.serving_param_dtype(config),
        layer_loop=config.model.layer_loop,
        logits_dtype=config.model.get('logits_dtype', ''),
        attention=config.model.get('attention', 'auto'))
  return Engine(model, tok,
                engine_config(config, tok, server_index=server_index,
                              restart=restart),
                version=version, devices=devices)


def _refresh(model, version, stale_N, ds: DecodeState) -> DecodeState:
  """Recomputes the cache and pending logits of `stale_N` rows (new weights).

  A full forward over each row's tokens [0, position) with the current
  weights: what a fresh prefill of the sequence so far would produce.
  """
  rows, length = ds.tokens.shape
  positions_NxS = jnp.broadcast_to(jnp.arange(length), (rows, length))
  valid_NxS = positions_NxS < ds.positions[:, None]
  hidden, (k, v) = model.decoder(ds.tokens, positions_NxS,
                                 transformer.attention_mask(valid_NxS))
  last_Nxd = hidden[jnp.arange(rows), jnp.maximum(ds.positions - 1, 0)]
  logits_NxV = model.logits(last_Nxd[:, None])[:, 0]
  pick = stale_N[None, :, None, None, None]
  return ds._replace(
      cache=decoding.KVCache(jnp.where(pick, k.astype(ds.cache.k.dtype),
                                       ds.cache.k),
                             jnp.where(pick, v.astype(ds.cache.v.dtype),
                                       ds.cache.v)),
      logits=jnp.where(stale_N[:, None], logits_NxV, ds.logits),
      logits_version=jnp.where(stale_N, version, ds.logits_version))
