"""Routing replay: an MoE engine records each generated token's experts, the
record travels in the token stream, and the learner can route by it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax import types
from sao_jax.models import pretrained
from sao_jax.models import sampling
from sao_jax.rl import algorithms
from sao_jax.rollout import batching
from sao_jax.rollout import engine as engine_lib
from sao_jax.rollout import wire

import test_engine  # pylint: disable=wrong-import-order

PARAMS = sampling.SamplingParams(temperature=1.0)


@pytest.mark.parametrize('num_experts', [6, 300])
def test_records_pack_and_unpack(num_experts):
  layout = wire.RoutingLayout.for_model(3, 2, num_experts)
  assert layout.bits_per_id == (8 if num_experts <= 256 else 16)
  ids_LxNx1xk = np.random.default_rng(0).integers(
      0, num_experts, (3, 5, 1, 2)).astype(np.int32)
  columns_NxC = np.asarray(engine_lib._pack_routing(  # pylint: disable=protected-access
      jnp.asarray(ids_LxNx1xk), layout))
  assert columns_NxC.shape == (5, layout.columns) and columns_NxC.dtype == np.int32
  want_NxR = np.moveaxis(ids_LxNx1xk[:, :, 0], 1, 0).reshape(5, 6)
  np.testing.assert_array_equal(layout.unpack(columns_NxC), want_NxR)
  assert wire.RoutingLayout.for_model(3, 2, 0).width == wire.NUM_COLUMNS


def test_a_step_of_the_wrong_width_is_an_error():
  """A dense server's 3-column steps do not parse as an MoE policy's (the
  client turns this into a failed request, `bad_response`)."""
  layout = wire.RoutingLayout.for_model(2, 2, 4)
  assert layout.width == 4
  with pytest.raises(ValueError):
    wire.decode_step([5, 0, 1], layout)


def generate(dtype, prompts, max_tokens=24):
  """`[(prompt, tokens, logprobs, versions, records)]` of a tiny MoE engine
  at version 0 on JetStream's orchestrator."""
  model, tok = pretrained.from_pretrained(pretrained.TINY_RANDOM_MOE,
                                          dtype=dtype, param_dtype=dtype)
  engine = engine_lib.Engine(model, tok, engine_lib.EngineConfig(
      max_concurrent_decodes=4, max_prefill_length=32, max_target_length=96,
      stop_ids=tuple(tok.stop_ids), sampling=PARAMS), version=0)
  assert engine.routing.ids_per_token == 2 * 2  # layers x experts per token

  results = test_engine.run_requests(engine, prompts, max_tokens,
                                     with_records=True)
  return [(prompt,) + result for prompt, result in zip(prompts, results)]


def prompts(count=6):
  _, tok = pretrained.from_pretrained(pretrained.TINY_RANDOM)
  return [tok.encode_chat([{'role': 'user', 'content': f'w{i} w{i + 3}'}])
          for i in range(count)]


def as_batch(results):
  trajs = []
  for n, (prompt, tokens, logprobs, versions, records) in enumerate(results):
    length = len(prompt) + len(tokens)
    mask = np.arange(length) >= len(prompt)
    experts = np.full((length, records.shape[1]), types.NOT_RECORDED,
                      np.int16)
    experts[len(prompt):] = records
    trajs.append(types.Trajectory(
        prompt_id=f'p{n}', tokens=np.asarray(prompt + tokens, np.int32),
        action_mask=mask,
        behavior_logprobs=np.where(mask, np.pad(
            logprobs, (len(prompt), 0)), 0).astype(np.float32),
        versions=np.where(mask, np.pad(versions, (len(prompt), 0)),
                          -1).astype(np.int32),
        reward=1.0, routed_experts=experts))
  return batching.assemble_batch(trajs, 96, 0)


@pytest.fixture(scope='module')
def float32_run():
  return generate('float32', prompts())


def test_engine_records_the_experts_each_token_went_to(float32_run):
  model, _ = pretrained.from_pretrained(pretrained.TINY_RANDOM_MOE)
  for prompt, tokens, _, versions, records in float32_run:
    assert set(versions) == {0} and records.shape == (len(tokens), 4)
    sequence = jnp.asarray([prompt + tokens])
    _, routing = model.hidden_states(sequence, with_routing=True)
    # The full forward pass's experts of the generated tokens, [n, L * k].
    want = np.moveaxis(np.asarray(routing.experts)[:, 0, len(prompt):], 0,
                       1).reshape(len(tokens), -1)
    np.testing.assert_array_equal(np.sort(records.reshape(-1, 2, 2), -1),
                                  np.sort(want.reshape(-1, 2, 2), -1))


def test_replayed_logprobs_at_version_0_equal_the_engines(float32_run):
  model, _ = pretrained.from_pretrained(pretrained.TINY_RANDOM_MOE)
  batch = jax.tree.map(jnp.asarray, as_batch(float32_run))
  logp, _, routing = algorithms.policy_logprobs(model, batch, PARAMS,
                                                replay=True)
  mask = np.asarray(batch.action_mask_BxT)
  diff = np.abs(np.asarray(logp) - np.asarray(batch.behavior_logprobs_BxT))
  assert diff[mask].max() < 2e-5
  # The records are the routers' own choices (same weights, f32).
  assert float(routing.recorded) == mask.sum() * 4
  assert float(routing.mismatched) == 0


def test_learn_disagrees_with_a_bfloat16_engine_and_replay_agrees():
  """A bf16 engine's routing against an f32 learner's: `learn` disagrees
  on some recorded picks; `replay` routes those tokens the engine's way,
  and its log-probs are closer to mu on the tokens whose routing differs."""
  results = generate('bfloat16', prompts(8), max_tokens=32)
  model, _ = pretrained.from_pretrained(pretrained.TINY_RANDOM_MOE)
  batch = jax.tree.map(jnp.asarray, as_batch(results))
  mask = np.asarray(batch.action_mask_BxT)
  mu = np.asarray(batch.behavior_logprobs_BxT)
  config = _config()
  learned, _, routing = algorithms.policy_logprobs(model, batch, PARAMS)
  _, metrics = algorithms.routing_terms(config, routing)
  assert 0 < float(metrics['routing_disagreement']) < 0.5
  replayed, _, _ = algorithms.policy_logprobs(model, batch, PARAMS,
                                              replay=True)
  err_learn = np.abs(np.asarray(learned) - mu)[mask]
  err_replay = np.abs(np.asarray(replayed) - mu)[mask]
  assert err_replay.mean() < err_learn.mean()


def _config(**changes):
  import test_learner  # pylint: disable=g-import-not-at-top
  return test_learner.make_config(**changes)


def test_a_learner_step_replays_and_reports_routing(float32_run):
  """The learner's own passes at version 0 with `replay`: its log pi_old
  equals mu (parity), and the step reports the routing metrics and adds
  the balancing loss."""
  import test_learner  # pylint: disable=g-import-not-at-top
  config = _config(lr=1e-4, **{'mesh.data': 1, 'model.moe_routing': 'replay',
                               'model.router_aux_loss_coef': 0.01,
                               'rollout.temperature': PARAMS.temperature})
  config.batch_size = len(float32_run)
  learner = test_learner.make_learner(config, jax.devices()[:1], experts=4)
  # The learner's policy is tiny.make(seed=1, experts=4); the engine's
  # records came from seed 0's: put seed 0's weights in.
  model, _ = pretrained.from_pretrained(pretrained.TINY_RANDOM_MOE)
  from flax import nnx  # pylint: disable=g-import-not-at-top
  learner.state = learner.state._replace(policy=jax.device_put(
      nnx.state(model, nnx.Param), learner.state_shardings.policy))
  batch = learner.device_batch(as_batch(float32_run))
  assert batch.routed_experts_BxTxR.shape[-1] == 4
  _, metrics = learner.train_step(learner.state, batch)
  assert float(metrics['parity/mean_abs_diff']) < 2e-6
  assert float(metrics['policy/routing_disagreement']) == 0
  assert 0.9 < float(metrics['policy/router_aux_loss']) < 4
