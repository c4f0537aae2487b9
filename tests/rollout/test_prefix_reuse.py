"""Keys/values kept across an episode's turns: exact, version-safe, bounded."""

import asyncio

import jax
import numpy as np
import pytest

from sao_jax.models import sampling
from sao_jax.rollout import client as client_lib
from sao_jax.rollout import engine as engine_lib
from sao_jax.rollout import prefix_cache
from sao_jax.rollout import server as server_lib
from sao_jax.rollout import weight_sync
from sao_jax.rollout import wire
import sao_jax.models

# Half the tiny vocabulary stops a reply: turns end after ~2 tokens, by a
# stop token, as an agent's tool calls do.
STOPS = tuple(range(32, 64))
SECRET = 'prefix-reuse-test-secret'


# -- the store ---------------------------------------------------------------

def test_lookup_finds_the_longest_common_prefix_of_its_version():
  cache = prefix_cache.PrefixCache(max_bytes=100)
  assert cache.save(np.array([1, 2, 3, 4]), 'a', version=0, nbytes=10)
  assert cache.save(np.array([1, 2, 9]), 'b', version=0, nbytes=10)
  entry, reuse = cache.lookup(np.array([1, 2, 3, 4, 5, 6]), version=0)
  assert (entry.kv, reuse) == ('a', 4)
  entry, reuse = cache.lookup(np.array([1, 2, 9, 9]), version=0)
  assert (entry.kv, reuse) == ('b', 3)
  # The last prompt token is always computed (its logits start the reply).
  entry, reuse = cache.lookup(np.array([1, 2, 3, 4]), version=0)
  assert (entry.kv, reuse) == ('a', 3)
  assert cache.lookup(np.array([7, 1, 2]), version=0) == (None, 0)


def test_a_newer_version_invalidates_everything_kept():
  cache = prefix_cache.PrefixCache(max_bytes=100)
  cache.save(np.array([1, 2, 3]), 'a', version=3, nbytes=10)
  assert cache.lookup(np.array([1, 2, 3, 4]), version=4) == (None, 0)
  assert len(cache) == 0 and cache.stats.invalidated == 1
  # A row computed by the old weights, finished after the swap: refused.
  assert not cache.save(np.array([1, 2, 3]), 'old', version=3, nbytes=10)


def test_memory_is_bounded_least_recently_used_first():
  cache = prefix_cache.PrefixCache(max_bytes=25)
  cache.save(np.array([1, 1]), 'a', 0, nbytes=10)
  cache.save(np.array([2, 2]), 'b', 0, nbytes=10)
  cache.lookup(np.array([1, 1, 5]), 0)  # 'a' is now the most recent
  cache.save(np.array([3, 3]), 'c', 0, nbytes=10)
  kept = {cache.lookup(np.array([t, t, 5]), 0)[0].kv
          for t in (1, 3)}
  assert kept == {'a', 'c'} and cache.lookup(np.array([2, 2, 5]), 0)[0] is None
  assert cache.stats.evicted == 1 and cache.nbytes == 20
  assert not cache.save(np.array([4]), 'huge', 0, nbytes=26)


def test_a_row_that_extends_a_kept_one_replaces_it():
  cache = prefix_cache.PrefixCache(max_bytes=100)
  cache.save(np.array([1, 2]), 'turn1', 0, nbytes=10)
  cache.save(np.array([1, 2, 3, 4]), 'turn2', 0, nbytes=10)
  assert len(cache) == 1 and cache.nbytes == 10


# -- the engine --------------------------------------------------------------

def make_engine(checkpoint, **overrides):
  model, tok = sao_jax.models.from_pretrained(checkpoint)
  cfg = dict(max_concurrent_decodes=2, max_prefill_length=128,
             max_target_length=256, stop_ids=STOPS,
             sampling=sampling.SamplingParams(temperature=1.0),
             prefix_cache_bytes=64 << 20)
  cfg.update(overrides)
  return engine_lib.Engine(model, tok, engine_lib.EngineConfig(**cfg),
                           version=7), model, tok


def padded(tokens, bucket=128):
  out = np.zeros(bucket, np.int32)
  out[:len(tokens)] = tokens
  return out


def one_turn(engine, state, prompt, slot=0):
  """Prefill, insert, decode to the stop token: the reply's tokens."""
  prefix = engine.prefill(params=None, padded_tokens=padded(prompt),
                          true_length=len(prompt))
  state = engine.insert(prefix, state, slot=slot)
  reply = []
  for _ in range(40):
    state, result = engine.generate(None, state)
    reply.append(int(result.data[slot, wire.TOKEN]))
    if reply[-1] in STOPS:
      return state, reply
  raise AssertionError('no stop token in 40 steps')


def fresh_prefill(engine, prompt):
  state, version = engine.weights.get()
  return engine_lib._prefill(engine._graphdef, state, padded(prompt)[None],
                             np.int32(len(prompt)), np.int32(version),
                             np.bool_(False))


def assert_same_prefix(got, want, length):
  np.testing.assert_allclose(got.logits, want.logits, atol=1e-5)
  for a, b in zip(got.cache, want.cache):
    np.testing.assert_allclose(np.asarray(a)[:, :, :length],
                               np.asarray(b)[:, :, :length], atol=1e-5)
  assert int(got.version) == int(want.version)


def test_a_second_turn_prefills_only_the_observation(tiny_checkpoint):
  engine, _, tok = make_engine(tiny_checkpoint)
  prompt = tok.encode_chat([{'role': 'user', 'content': 'w1 w2 w3'}])
  state, reply = one_turn(engine, engine.init_decode_state(), prompt)
  assert len(engine.prefix_cache) == 1  # kept as the row finished
  second = prompt + reply + [5, 6, 7, 8, 9]
  before = engine.prefix_cache.status()
  got = engine.prefill(params=None, padded_tokens=padded(second),
                       true_length=len(second))
  after = engine.prefix_cache.status()
  assert after['hits'] == before['hits'] + 1
  assert after['prefilled_tokens'] - before['prefilled_tokens'] == 5
  assert after['reused_tokens'] - before['reused_tokens'] == len(
      prompt + reply)
  # Exactly what a prefill of the whole conversation computes.
  assert_same_prefix(got, fresh_prefill(engine, second), len(second))


def test_a_weight_swap_forces_a_full_prefill_under_the_new_weights(
    tiny_checkpoint):
  engine, _, tok = make_engine(tiny_checkpoint)
  prompt = tok.encode_chat([{'role': 'user', 'content': 'w4 w5'}])
  _, reply = one_turn(engine, engine.init_decode_state(), prompt)
  state, _ = engine.weights.get()
  moved = jax.tree.map(lambda x: x * 1.05, state)
  engine.weights.swap(moved, 8)
  second = prompt + reply + [5, 6]
  hits = engine.prefix_cache.stats.hits
  got = engine.prefill(params=None, padded_tokens=padded(second),
                       true_length=len(second))
  assert engine.prefix_cache.stats.hits == hits  # nothing of version 7 used
  assert engine.prefix_cache.stats.invalidated == 1
  assert int(got.version) == 8
  # mu_t of the next reply is pi_8's: the logits of a fresh v8 prefill.
  assert_same_prefix(got, fresh_prefill(engine, second), len(second))


def test_an_off_cache_keeps_nothing(tiny_checkpoint):
  engine, _, tok = make_engine(tiny_checkpoint, prefix_cache_bytes=0)
  prompt = tok.encode_chat([{'role': 'user', 'content': 'w1'}])
  _, reply = one_turn(engine, engine.init_decode_state(), prompt)
  second = prompt + reply + [5, 6]
  engine.prefill(params=None, padded_tokens=padded(second),
                 true_length=len(second))
  status = engine.prefill_status()
  assert status['entries'] == 0 and status['hits'] == 0
  assert status['prefilled_tokens'] == len(prompt) + len(second)


def test_a_reply_cut_at_max_new_tokens_is_kept_for_the_next_turn(
    tiny_checkpoint):
  """No stop ids: the row ends at the engine's max_new_tokens, the count the
  client asked for, and is kept right then."""
  engine, _, tok = make_engine(tiny_checkpoint, stop_ids=(), max_new_tokens=5)
  prompt = tok.encode_chat([{'role': 'user', 'content': 'w1 w2'}])
  state = engine.insert(
      engine.prefill(params=None, padded_tokens=padded(prompt),
                     true_length=len(prompt)),
      engine.init_decode_state(), slot=0)
  reply = []
  for _ in range(5):
    state, result = engine.generate(None, state)
    reply.append(int(result.data[0, wire.TOKEN]))
  assert len(engine.prefix_cache) == 1  # kept at the 5th token
  second = prompt + reply + [5, 6]
  engine.prefill(params=None, padded_tokens=padded(second),
                 true_length=len(second))
  assert engine.prefix_cache.stats.reused_tokens == len(prompt) + 5
  _, result = engine.generate(None, state)
  assert int(result.data[0, wire.NUM_COLUMNS]) == 0  # the row stopped


def recompute(model, sequence, start, params):
  logits = model(np.array([sequence]))
  logp = sampling.token_logprobs(logits[:, :-1], np.array([sequence])[:, 1:],
                                 params)
  return np.asarray(logp)[0, start - 1:]


@pytest.mark.slow
def test_an_eight_turn_episode_on_a_server_prefills_new_tokens_only(
    tiny_checkpoint):
  """A real gRPC server and client: each turn after the first prefills the
  observation only, and every streamed mu_t is the learner's log-prob of
  the whole conversation."""
  engine, model, tok = make_engine(tiny_checkpoint)
  server = server_lib.RolloutServer(engine, port=0, secret=SECRET)
  observation = [5, 6, 7, 8, 9, 10]
  prompt = tok.encode_chat([{'role': 'user', 'content': 'w1 w2 w3 w4'}])

  async def episode():
    async with client_lib.ServerPool([f'127.0.0.1:{server.port}'],
                                     stop_ids=STOPS, max_prompt_length=127,
                                     deadline_s=120) as pool:
      tokens, turns = list(prompt), []
      for _ in range(8):
        (sample,) = await pool.generate(tokens, 40)
        assert sample.finish_reason == 'stop'
        turns.append((len(tokens), sample))
        tokens += sample.tokens + observation
      address = f'127.0.0.1:{server.port}'
      status = await weight_sync.server_status(address, SECRET)
      # The trainer's view: the publisher's health check reads the same.
      publisher = weight_sync.WeightPublisher([address], SECRET)
      assert await publisher.catch_up(address)
      return tokens, turns, status['prefix_cache'], publisher.prefill_metrics()

  try:
    tokens, turns, status, metrics = asyncio.run(episode())
  finally:
    server.stop()
  assert status['lookups'] == 8 and status['hits'] == 7
  assert status['prefilled_tokens'] == len(prompt) + 7 * len(observation)
  generated = sum(len(s.tokens) for _, s in turns)
  assert status['generated_tokens'] == generated
  np.testing.assert_allclose(status['prefilled_tokens_per_generated_token'],
                             status['prefilled_tokens'] / generated)
  assert metrics['prefilled_tokens'] == status['prefilled_tokens']
  np.testing.assert_allclose(
      metrics['prefilled_tokens_per_generated_token'],
      status['prefilled_tokens_per_generated_token'])
  for start, sample in turns:
    sequence = tokens[:start + len(sample.tokens)]
    np.testing.assert_allclose(
        sample.logprobs, recompute(model, sequence, start,
                                   engine.config.sampling), atol=1e-4)
