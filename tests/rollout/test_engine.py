"""The JetStream engine in process: contract, mu_t, versions, tensor parallel."""

import asyncio
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax import config_lib
from sao_jax import recipe_checks
from sao_jax.models import model_config
from sao_jax.models import sampling
from sao_jax.rollout import engine as engine_lib
from sao_jax.rollout import jetstream_compat
from sao_jax.rollout import weight_sync
from sao_jax.rollout import wire
import sao_jax.models

pb = jetstream_compat.jetstream_pb2
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def make_engine(checkpoint, devices=None, **overrides):
  model, tok = sao_jax.models.from_pretrained(checkpoint)
  cfg = dict(max_concurrent_decodes=4, max_prefill_length=32,
             max_target_length=96, stop_ids=tuple(tok.stop_ids),
             sampling=sampling.SamplingParams(temperature=1.0))
  cfg.update(overrides)
  return (engine_lib.Engine(model, tok, engine_lib.EngineConfig(**cfg),
                            version=7, devices=devices), model, tok)


def drive(engine, scenario):
  """Runs `scenario(llm)` on JetStream's own orchestrator (no gRPC)."""
  orch = jetstream_compat.orchestrator
  driver = orch.Driver(prefill_engines=[engine], generate_engines=[engine],
                       prefill_params=[None], generate_params=[None],
                       interleaved_mode=True, jax_padding=False)
  llm = orch.LLMOrchestrator(driver=driver)
  # The loop outlives the driver: its detokenize thread may still close a
  # finished request's channel (a call into this loop) after the scenario
  # returns, and on a closed loop that raises and SIGKILLs the process.
  loop = asyncio.new_event_loop()
  try:
    return loop.run_until_complete(scenario(llm))
  finally:
    driver.stop()
    loop.close()


def run_requests(engine, prompts, max_tokens, with_records=False):
  """(tokens, logprobs, versions) of each prompt's completion, and with
  `with_records` its routing records `[tokens, R]` (an MoE engine's)."""

  async def one(llm, prompt):
    request = pb.DecodeRequest(
        token_content=pb.DecodeRequest.TokenContent(token_ids=prompt),
        max_tokens=max_tokens)
    steps = []
    async for response in llm.Decode(request):
      for sample in response.stream_content.samples:
        if sample.token_ids:
          steps.append(wire.decode_step(sample.token_ids, engine.routing))
    out = ([t for s in steps for t in s[0]], [l for s in steps for l in s[1]],
           [v for s in steps for v in s[2]])
    if with_records:
      out += (np.concatenate([s[3] for s in steps]),)
    return out

  async def scenario(llm):
    return await asyncio.gather(*(one(llm, p) for p in prompts))

  return drive(engine, scenario)


def recompute(model, prompt, tokens, params):
  sequence = np.array([prompt + tokens])
  logits = model(sequence)
  logp = sampling.token_logprobs(logits[:, :-1], sequence[:, 1:], params)
  return np.asarray(logp)[0, len(prompt) - 1:]


def test_streamed_logprobs_match_learner_recomputation(tiny_checkpoint):
  engine, model, tok = make_engine(
      tiny_checkpoint, sampling=sampling.SamplingParams(0.8, 20, 0.9))
  prompts = [tok.encode_chat([{'role': 'user', 'content': f'w{i} w{i + 3}'}])
             for i in range(6)]  # more requests than the 4 slots
  results = run_requests(engine, prompts, max_tokens=40)
  for prompt, (tokens, logprobs, versions) in zip(prompts, results):
    assert tokens and set(versions) == {7}
    assert len(tokens) <= 40
    # The stop token, if sampled, is streamed and ends the sample.
    if tok.eos_id in tokens:
      assert tokens.index(tok.eos_id) == len(tokens) - 1
    np.testing.assert_allclose(
        logprobs, recompute(model, prompt, tokens, engine.config.sampling),
        atol=1e-4)


def test_prompt_bos_is_not_added(tiny_checkpoint):
  engine, model, tok = make_engine(
      tiny_checkpoint, sampling=sampling.SamplingParams(temperature=0))
  prompt = tok.encode_chat([{'role': 'user', 'content': 'w5 w6'}])
  ((tokens, _, _),) = run_requests(engine, [prompt], max_tokens=8)
  # Greedy continuation of exactly `prompt`, with nothing prepended.
  from sao_jax.models import decoding  # pylint: disable=g-import-not-at-top
  (want,) = decoding.generate(model, [prompt], 8,
                              sampling.SamplingParams(temperature=0),
                              stop_ids=tok.stop_ids)
  assert tokens == want.tokens


def test_too_long_prompt_is_refused_not_truncated(tiny_checkpoint):
  engine, _, _ = make_engine(tiny_checkpoint)
  ((tokens, _, versions),) = run_requests(engine, [[5] * 40], max_tokens=8)
  assert versions == [wire.PROMPT_TOO_LONG] and tokens == [0]


def test_samples_per_slot_gives_groups(tiny_checkpoint):
  engine, model, tok = make_engine(tiny_checkpoint, samples_per_slot=3,
                                   max_concurrent_decodes=2)
  prompt = tok.encode_chat([{'role': 'user', 'content': 'w1'}])

  async def one(llm):
    per = [[], [], []]
    request = pb.DecodeRequest(
        token_content=pb.DecodeRequest.TokenContent(token_ids=prompt),
        max_tokens=12)
    async for response in llm.Decode(request):
      for i, sample in enumerate(response.stream_content.samples):
        if sample.token_ids:
          per[i].append(wire.decode_step(sample.token_ids))
    return per

  per = drive(engine, one)
  sequences = [[t for s in steps for t in s[0]] for steps in per]
  assert all(sequences) and len({tuple(s) for s in sequences}) > 1
  for steps, seq in zip(per, sequences):
    logprobs = [l for s in steps for l in s[1]]
    np.testing.assert_allclose(
        logprobs, recompute(model, prompt, seq, engine.config.sampling),
        atol=1e-4)


def test_tensor_parallel_engine_matches_one_device(tiny_checkpoint):
  greedy = sampling.SamplingParams(temperature=0)
  one, _, tok = make_engine(tiny_checkpoint, devices=jax.devices()[:1],
                            sampling=greedy)
  two, _, _ = make_engine(tiny_checkpoint, devices=jax.devices()[:2],
                          sampling=greedy)
  state, _ = two.weights.get()
  q_proj = state['decoder']['blocks']['attn']['q_proj'][...]
  assert 'tensor' in str(q_proj.sharding.spec)  # really sharded
  prompts = [tok.encode_chat([{'role': 'user', 'content': f'w{i}'}])
             for i in range(3)]
  a = run_requests(one, prompts, max_tokens=16)
  b = run_requests(two, prompts, max_tokens=16)
  for (ta, la, _), (tb, lb, _) in zip(a, b):
    assert ta == tb
    np.testing.assert_allclose(la, lb, atol=1e-5)


def sample_directly(engine, prompt, steps):
  """Tokens of slot 0 after `steps` generate calls (no orchestrator threads)."""
  padded = np.zeros(32, np.int32)
  padded[:len(prompt)] = prompt
  prefix = engine.prefill(params=None, padded_tokens=padded,
                          true_length=len(prompt))
  state = engine.insert(prefix, engine.init_decode_state(), slot=0)
  tokens = []
  for _ in range(steps):
    state, result = engine.generate(None, state)
    tokens.append(int(result.data[0, wire.TOKEN]))
  return tokens


def test_sampling_stream_depends_on_server_index_and_restart(tiny_checkpoint):
  model, tok = sao_jax.models.from_pretrained(tiny_checkpoint)
  prompt = tok.encode_chat([{'role': 'user', 'content': 'w2 w4'}])

  def tokens(**stream):
    # No stop ids: every stream runs the full 16 steps.
    config = engine_lib.EngineConfig(
        max_concurrent_decodes=1, max_prefill_length=32, max_target_length=64,
        sampling=sampling.SamplingParams(temperature=1.0), seed=3, **stream)
    return sample_directly(engine_lib.Engine(model, tok, config), prompt, 16)

  base = tokens()
  # The same (seed, server_index, restart) reproduces the samples exactly.
  assert tokens(server_index=0, restart=0) == base
  other_server = tokens(server_index=1)
  restarted = tokens(restart=1)
  assert other_server != base and restarted != base
  assert other_server != restarted


def test_engine_config_errors():
  with pytest.raises(ValueError, match='padding buckets'):
    engine_lib.EngineConfig(max_prefill_length=100)
  with pytest.raises(ValueError, match='must exceed'):
    engine_lib.EngineConfig(max_prefill_length=64, max_target_length=64)
  with pytest.raises(ValueError, match='must be >= 0'):
    engine_lib.EngineConfig(server_index=-1)


def sampling_config(tiny_checkpoint, **rollout):
  """configs/tiny.py on the test checkpoint, sampling at temperature 1, with
  `rollout` overrides; validated."""
  config = config_lib.load_config(os.path.join(ROOT, 'configs', 'tiny.py'))
  config.model.source = tiny_checkpoint
  config.rollout.temperature = 1.0
  for key, value in rollout.items():
    config.rollout[key] = value
  recipe_checks.validate(config)
  return config


def test_rollout_dtype_sets_the_servers_compute_apart_from_the_learners(
    tiny_checkpoint):
  """`rollout.dtype = 'bfloat16'` with an f32 learner: the engine keeps f32
  weights, computes in bf16, and mu_t is a bf16 recomputation's log-prob."""
  config = sampling_config(tiny_checkpoint, dtype='bfloat16')
  engine = engine_lib.build_engine(config, version=0)
  assert engine.model_config.dtype == 'bfloat16'
  assert {x.dtype for x in jax.tree.leaves(engine.abstract_state())} == {
      jnp.dtype(jnp.float32)}
  _, tok = sao_jax.models.from_pretrained(tiny_checkpoint)
  prompt = tok.encode_chat([{'role': 'user', 'content': 'w2 w5'}])
  [(tokens, logprobs, _)] = run_requests(engine, [prompt], max_tokens=24)
  params = engine.config.sampling
  f32, _ = sao_jax.models.from_pretrained(tiny_checkpoint)
  bf16, _ = sao_jax.models.from_pretrained(tiny_checkpoint, dtype='bfloat16',
                                           param_dtype='float32')
  np.testing.assert_allclose(logprobs, recompute(bf16, prompt, tokens, params),
                             atol=2e-2)
  assert np.max(np.abs(np.array(logprobs) -
                       recompute(f32, prompt, tokens, params))) > 1e-4


def test_bfloat16_server_weights_sample_from_the_rounded_policy(
    tiny_checkpoint, tmp_path):
  """`rollout.param_dtype = 'bfloat16'`: the engine keeps bf16 weights, a
  pushed f32 checkpoint is rounded on load, and mu_t is the log-prob of the
  rounded weights (computed in f32): equal to a recomputation with rounded
  weights, off the f32 policy's by the rounding only."""
  config = sampling_config(tiny_checkpoint, param_dtype='bfloat16')
  engine = engine_lib.build_engine(config, version=7)
  dtypes = {x.dtype for x in jax.tree.leaves(engine.abstract_state())}
  assert dtypes == {jnp.dtype(jnp.bfloat16)}
  # A push from an f32 learner: the checkpoint is f32, the engine bf16.
  model, tok = sao_jax.models.from_pretrained(tiny_checkpoint)
  weight_sync.save_policy(str(tmp_path / 'push'), model)
  loaded = weight_sync.load_policy(str(tmp_path / 'push'),
                                   engine.abstract_state())
  assert {x.dtype for x in jax.tree.leaves(loaded)} == dtypes
  engine.weights.swap(loaded, 7)
  prompt = tok.encode_chat([{'role': 'user', 'content': 'w1 w4'}])
  [(tokens, logprobs, _)] = run_requests(engine, [prompt], max_tokens=24)
  params = engine.config.sampling
  exact = recompute(model, prompt, tokens, params)
  rounded = jax.tree.map(
      lambda x: x.astype(jnp.bfloat16).astype(jnp.float32),
      nnx.state(model, nnx.Param))
  nnx.update(model, rounded)
  np.testing.assert_allclose(logprobs, recompute(model, prompt, tokens, params),
                             atol=1e-4)
  assert 0 < np.max(np.abs(np.array(logprobs) - exact)) < 0.1
