"""Two real JetStream servers as subprocesses on loopback, end to end.

Checks what the rollout path promises: tokens decode to text, streamed mu_t
equal the learner's recomputation, a weight push mid-stream switches the
version column from the next step on (and both versions' log-probs are right),
a SIGKILLed server loses no request, and the admin service refuses a wrong
secret.
"""

import asyncio
import os
import signal

import grpc
import jax
import numpy as np
import pytest

import sao_jax.models
from sao_jax.models import sampling
from sao_jax.rollout import client as client_lib
from sao_jax.rollout import episodes
from sao_jax.rollout import local_servers
from sao_jax.rollout import queue as queue_lib
from sao_jax.rollout import weight_sync
from sao_jax.rollout import workers
from sao_jax.rollout.environments import base

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECRET = 'integration-test-secret'
PARAMS = sampling.SamplingParams(temperature=1.0)


# The servers sample with the distribution the test recomputes mu_t under,
# whatever the demo's default temperature.
SERVER_FLAGS = (f'--config.rollout.temperature={PARAMS.temperature}',
                '--config.rollout.max_concurrent_decodes=4',
                '--config.rollout.max_prefill_length=64',
                '--config.rollout.max_target_length=512')


def test_server_argv_gives_each_server_its_index_and_the_restart():
  argv = local_servers.server_argv('configs/default.py:x', 2, 3,
                                   ['--config.seed=5', '--host=::1'])
  assert argv[1:] == ['-m', 'sao_jax.serve', '--config=configs/default.py:x',
                      '--port=0', '--server_index=2', '--restart=3',
                      '--config.seed=5', '--host=::1']
  assert local_servers.server_argv('c.py', 0)[-2:] == ['--server_index=0',
                                                       '--restart=0']


@pytest.fixture(scope='module')
def servers(tiny_checkpoint_no_eos, tmp_path_factory):
  started = local_servers.start(
      os.path.join(ROOT, 'configs', 'default.py'), count=2, secret=SECRET,
      log_dir=str(tmp_path_factory.mktemp('server_logs')),
      overrides=(f'--config.model.source={tiny_checkpoint_no_eos}',
                 *SERVER_FLAGS),
      env=dict(JAX_PLATFORMS='cpu'))
  yield [(s.process, s.address) for s in started]
  local_servers.stop(started)
  for server in started:
    assert server.process.returncode in (0, -signal.SIGKILL)


@pytest.fixture(scope='module')
def policy(tiny_checkpoint_no_eos):
  return sao_jax.models.from_pretrained(tiny_checkpoint_no_eos)


def recompute(model, prompt, tokens):
  sequence = np.array([prompt + tokens])
  logp = sampling.token_logprobs(model(sequence)[:, :-1], sequence[:, 1:],
                                 PARAMS)
  return np.asarray(logp)[0, len(prompt) - 1:]


def prompts_for(tok, n):
  return [tok.encode_chat([{'role': 'user', 'content': f'w{i} w{i + 1}'}])
          for i in range(n)]


def pool_for(addresses, tok):
  return client_lib.ServerPool(addresses, stop_ids=tok.stop_ids,
                               max_prompt_length=63, max_in_flight_per_server=4,
                               deadline_s=120)


@pytest.mark.slow
def test_servers_stream_text_logprobs_and_weight_updates(servers, policy,
                                                         tmp_path):
  model, tok = policy
  addresses = [address for _, address in servers]
  prompts = prompts_for(tok, 8)
  perturbed = jax.tree.map(lambda x: x * 1.5,
                           sao_jax.models.pretrained.flat_params(model))
  new_model = sao_jax.models.pretrained.build(model.config, perturbed)
  weight_sync.save_policy(str(tmp_path / 'v1'), new_model)

  async def main():
    async with pool_for(addresses, tok) as pool:
      first = await asyncio.gather(*(pool.generate(p, 24) for p in prompts))
      # Long requests, then a push of version 1 while they stream.
      tasks = [asyncio.create_task(pool.generate(p, 400)) for p in prompts]
      await asyncio.sleep(0.3)
      push = await weight_sync.WeightPublisher(addresses, SECRET).push(
          str(tmp_path / 'v1'), 1)
      second = await asyncio.gather(*tasks)
      statuses = [await weight_sync.server_status(a, SECRET) for a in addresses]
      return first, push, second, statuses, dict(pool.counters)

  first, push, second, statuses, counters = asyncio.run(main())
  assert not push.failed and sorted(push.updated) == sorted(addresses)
  assert all(s['version'] == 1 and s['swaps'] == 1 for s in statuses)
  assert counters['completed'] == 16
  for prompt, (sample,) in zip(prompts, first):
    assert tok.decode(sample.tokens).strip()  # decodes to text
    assert set(sample.versions) == {0}
    np.testing.assert_allclose(sample.logprobs,
                               recompute(model, prompt, sample.tokens),
                               atol=1e-4)
  mixed = 0
  for prompt, (sample,) in zip(prompts, second):
    versions = np.array(sample.versions)
    assert np.all(np.diff(versions) >= 0)  # 0...0 then 1...1, never back
    old = recompute(model, prompt, sample.tokens)
    new = recompute(new_model, prompt, sample.tokens)
    want = np.where(versions == 0, old, new)
    np.testing.assert_allclose(sample.logprobs, want, atol=1e-4)
    mixed += set(versions) == {0, 1}
  assert mixed > 0, 'no trajectory spanned the weight update'


@pytest.mark.slow
def test_admin_refuses_a_wrong_secret(servers, tmp_path):
  address = servers[0][1]
  with pytest.raises(grpc.RpcError) as info:
    asyncio.run(weight_sync.server_status(address, 'not-the-secret-at-all'))
  assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
  push = asyncio.run(weight_sync.WeightPublisher([address], 'wrong-secret-xx')
                     .push(str(tmp_path), 5))
  assert push.failed == {address: 'UNAUTHENTICATED'}


class TwoTurnEnv(base.Environment):
  """Turn 0 gets an observation back; turn 1 ends with reward 1 or 0."""

  name = 'two_turn'
  max_turns = 2

  def task(self, split, index):
    return base.Task(id=f'{split}/{index}', question=f'w{index % 50} w9')

  def prompt_messages(self, task):
    return [{'role': 'user', 'content': task.question}]

  def step(self, task, turn, action_text):
    if turn == 0:
      return base.StepResult(done=False, observation='w7 w8 <|s|> w1')
    return base.StepResult(done=True, reward=float('w3' in action_text),
                           info={'correct': 'w3' in action_text})


@pytest.mark.slow
def test_workers_fill_the_queue_and_survive_a_sigkilled_server(servers,
                                                                policy,
                                                                tmp_path):
  model, tok = policy
  (victim, victim_address), (_, survivor_address) = servers
  batch_size, max_staleness, steps = 8, 1, 4
  queue = queue_lib.RolloutQueue(batch_size, max_staleness, tok.vocab_size,
                                 max_length=256)
  chat = episodes.ChatFormat(tok)
  env = TwoTurnEnv()
  counter = iter(range(10**6))

  def next_task():
    index = next(counter)
    return index, env.task('train', index)

  runner = workers.RolloutRunner(
      addresses=[victim_address, survivor_address], env=env,
      next_task=next_task, queue=queue, tok=tok,
      limits=episodes.EpisodeLimits(max_new_tokens=24,
                                    max_sequence_length=256,
                                    max_prompt_length=63),
      num_workers=12,
      pool_options=dict(stop_ids=tok.stop_ids, max_prompt_length=63,
                        deadline_s=120))
  publisher = weight_sync.WeightPublisher([victim_address, survivor_address],
                                          SECRET)
  weight_sync.save_policy(str(tmp_path / 'weights'), model)
  # An earlier test may have pushed other weights: serve `model` again.
  start = asyncio.run(weight_sync.server_status(survivor_address,
                                                SECRET))['version'] + 1
  assert not asyncio.run(publisher.push(str(tmp_path / 'weights'),
                                        start)).failed
  queue.set_learner_version(start)
  queue.set_rollout_version(start)
  runner.start()
  batches = []
  try:
    for step in range(steps):
      batches.append(queue.get_batch_blocking(timeout=120))
      if step == 0:
        os.kill(victim.pid, signal.SIGKILL)  # requests are in flight now
      queue.set_learner_version(start + step + 1)
      runner.call(publisher.push(str(tmp_path / 'weights'), start + step + 1))
      queue.set_rollout_version(start + step + 1)
  finally:
    runner.stop()
  stats, queue_stats = runner.stats(), queue.stats()
  assert victim.wait(timeout=10) == -signal.SIGKILL
  # Nothing lost: every episode that started finished (retried elsewhere).
  assert not [k for k in stats if k.startswith('workers/failed')], stats
  assert stats['client/server_marked_dead'] == 1
  assert stats['client/retried'] >= 1
  assert stats['client/live_servers'] == 1
  assert queue_stats['consumed'] == steps * batch_size
  assert queue_stats['rejected'] == 0 and queue_stats['dropped_stale'] == 0
  assert queue_stats['max_consumed_staleness'] <= max_staleness
  for step, batch in enumerate(batches):
    assert len(batch) == batch_size
    for traj in batch:
      assert traj.info['turns'] == 2
      assert start + step - traj.oldest_version <= max_staleness
      # Prompt, action, observation, action; mu_t matches a recomputation
      # over the whole sequence at every action token.
      runs = np.flatnonzero(np.diff(traj.action_mask.astype(int)) != 0)
      assert len(runs) == 3
      logp = np.asarray(sampling.token_logprobs(
          model(traj.tokens[None])[:, :-1], traj.tokens[None, 1:], PARAMS))[0]
      actions = np.flatnonzero(traj.action_mask)
      np.testing.assert_allclose(traj.behavior_logprobs[actions],
                                 logp[actions - 1], atol=1e-4)
      # Between the two actions: exactly the observation turn the chat
      # template writes around the environment's text.
      first_action = traj.tokens[runs[0] + 1:runs[1] + 1]
      observation = traj.tokens[runs[1] + 1:runs[2] + 1]
      assert observation.tolist() == chat.observation_tokens(
          first_action, 'w7 w8 <|s|> w1')
