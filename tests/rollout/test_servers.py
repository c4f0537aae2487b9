"""Two real JetStream servers as subprocesses on loopback, end to end.

Checks what the rollout path promises: tokens decode to text, streamed mu_t
equal the learner's recomputation, a weight push mid-stream switches the
version column from the next step on (and both versions' log-probs are right),
a SIGKILLed server loses no request, and the admin service refuses a wrong
secret, a malformed request and a path outside the weights root. A server
started with `--parent_pid` exits when that process dies.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import grpc
import jax
import numpy as np
import pytest

from sao_jax import errors
from sao_jax import xla_flags
from sao_jax.envs import base
from sao_jax.models import sampling
from sao_jax.rollout import client as client_lib
from sao_jax.rollout import episodes
from sao_jax.rollout import launch
from sao_jax.rollout import queue as queue_lib
from sao_jax.rollout import server as server_lib
from sao_jax.rollout import weight_sync
from sao_jax.rollout import workers
import sao_jax.models

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
  argv = launch.server_argv('configs/default.py:x', 2, 3,
                            ['--config.seed=5', '--host=::1'])
  assert argv[1:] == ['-m', 'sao_jax.serve', '--config=configs/default.py:x',
                      '--port=0', '--server_index=2', '--restart=3',
                      '--config.seed=5', '--host=::1']
  assert launch.server_argv('c.py', 0)[-2:] == ['--server_index=0',
                                                '--restart=0']


def test_server_argv_names_the_weights_root_and_the_parent():
  argv = launch.server_argv('c.py', 0, weights_root='w', parent_pid=42)
  assert f'--weights_root={os.path.abspath("w")}' in argv
  assert '--parent_pid=42' in argv


def test_read_secret_strips_whitespace(monkeypatch, tmp_path):
  secret = 'sixteen-chars-ok'
  monkeypatch.setenv(weight_sync.SECRET_ENV, f'  {secret}\n')
  assert weight_sync.read_secret() == secret
  (tmp_path / 'secret').write_text(f'{secret}\n')
  assert weight_sync.read_secret(str(tmp_path / 'secret')) == secret
  monkeypatch.setenv(weight_sync.SECRET_ENV, 'fifteen-chars!!\n')
  with pytest.raises(errors.UserError, match='has 15 characters'):
    weight_sync.read_secret()
  monkeypatch.setenv(weight_sync.SECRET_ENV, ' \n')
  with pytest.raises(errors.UserError, match='no admin secret'):
    weight_sync.read_secret()
  with pytest.raises(errors.UserError, match='cannot read the admin secret'):
    weight_sync.read_secret(str(tmp_path / 'missing'))


def test_weights_path_stays_under_the_root(tmp_path):
  root = tmp_path / 'run' / 'weights'
  (root / 'v1').mkdir(parents=True)
  (tmp_path / 'run' / 'weightsx').mkdir()
  os.symlink(tmp_path, root / 'escape')
  real = os.path.realpath(root / 'v1')
  assert server_lib.weights_path(str(root), str(root / 'v1')) == real
  assert server_lib.weights_path(str(root), f'{root}/x/../v1') == real
  # Through a symlink to the root, still inside.
  os.symlink(root, tmp_path / 'alias')
  assert server_lib.weights_path(str(tmp_path / 'alias'),
                                 str(root / 'v1')) == real
  for outside in (f'{root}x/v1', f'{root}/../weightsx', f'{root}/../../..',
                  str(root / 'escape' / 'run'), '/etc/passwd'):
    assert server_lib.weights_path(str(root), outside) is None, outside


@pytest.fixture(scope='module')
def weights_root(tmp_path_factory):
  return tmp_path_factory.mktemp('weights')


@pytest.fixture(scope='module')
def servers(tiny_checkpoint_no_eos, tmp_path_factory, weights_root):
  started = launch.start_subprocesses(
      os.path.join(ROOT, 'configs', 'default.py'), count=2, secret=SECRET,
      log_dir=str(tmp_path_factory.mktemp('server_logs')),
      overrides=(f'--config.model.source={tiny_checkpoint_no_eos}',
                 *SERVER_FLAGS),
      env=dict(JAX_PLATFORMS='cpu'), weights_root=str(weights_root))
  yield [(s.process, s.address) for s in started]
  launch.stop(started)
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
                                                         weights_root):
  model, tok = policy
  addresses = [address for _, address in servers]
  prompts = prompts_for(tok, 8)
  perturbed = jax.tree.map(lambda x: x * 1.5,
                           sao_jax.models.pretrained.flat_params(model))
  new_model = sao_jax.models.pretrained.build(model.config, perturbed)
  weight_sync.save_policy(str(weights_root / 'stream_v1'), new_model)

  async def main():
    async with pool_for(addresses, tok) as pool:
      first = await asyncio.gather(*(pool.generate(p, 24) for p in prompts))
      # Every slot streams long requests back to back until the push of
      # version 1 has returned, and the push starts only once one long
      # request has come back, so the servers are demonstrably decoding: the
      # swap then lands inside the requests in flight however slow the
      # machine. (A fixed head start raced the push: on a loaded CI machine
      # every request was still waiting for its prefill when the swap came.)
      pushed, decoding = asyncio.Event(), asyncio.Event()

      async def stream(prompt):
        samples = []
        while not pushed.is_set():
          (sample,) = await pool.generate(prompt, 400)
          samples.append((prompt, sample))
          decoding.set()
        return samples

      tasks = [asyncio.create_task(stream(p)) for p in prompts]
      await decoding.wait()
      push = await weight_sync.WeightPublisher(addresses, SECRET).push(
          str(weights_root / 'stream_v1'), 1)
      pushed.set()
      second = [s for samples in await asyncio.gather(*tasks) for s in samples]
      statuses = [await weight_sync.server_status(a, SECRET) for a in addresses]
      return first, push, second, statuses, dict(pool.counters)

  first, push, second, statuses, counters = asyncio.run(main())
  assert not push.failed and sorted(push.updated) == sorted(addresses)
  assert all(s['version'] == 1 and s['swaps'] == 1 for s in statuses)
  assert counters['completed'] == len(prompts) + len(second)
  for prompt, (sample,) in zip(prompts, first):
    assert tok.decode(sample.tokens).strip()  # decodes to text
    assert set(sample.versions) == {0}
    np.testing.assert_allclose(sample.logprobs,
                               recompute(model, prompt, sample.tokens),
                               atol=1e-4)
  mixed = 0
  for prompt, sample in second:
    versions = np.array(sample.versions)
    assert np.all(np.diff(versions) >= 0)  # 0...0 then 1...1, never back
    old = recompute(model, prompt, sample.tokens)
    new = recompute(new_model, prompt, sample.tokens)
    want = np.where(versions == 0, old, new)
    np.testing.assert_allclose(sample.logprobs, want, atol=1e-4)
    mixed += set(versions) == {0, 1}
  assert mixed > 0, f'none of {len(second)} trajectories spanned the update'


@pytest.mark.slow
def test_admin_refuses_a_wrong_secret(servers, tmp_path):
  address = servers[0][1]
  with pytest.raises(grpc.RpcError) as info:
    asyncio.run(weight_sync.server_status(address, 'not-the-secret-at-all'))
  assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
  push = asyncio.run(weight_sync.WeightPublisher([address], 'wrong-secret-xx')
                     .push(str(tmp_path), 5))
  assert push.failed == {address: 'UNAUTHENTICATED'}


def admin_call(address, name, body: bytes, secret=SECRET):
  """A raw admin call: `body` goes out as is, the reply is decoded."""

  async def call():
    async with grpc.aio.insecure_channel(address) as channel:
      return await channel.unary_unary(
          weight_sync.method(name),
          response_deserializer=weight_sync._decode)(  # pylint: disable=protected-access
              body, metadata=((weight_sync.SECRET_HEADER, secret),),
              timeout=60)

  return asyncio.run(call())


def admin_error(address, name, body: bytes, secret=SECRET):
  with pytest.raises(grpc.RpcError) as info:
    admin_call(address, name, body, secret)
  return info.value.code(), info.value.details()


def update(path, version=7) -> bytes:
  return json.dumps({'path': str(path), 'version': version}).encode()


@pytest.mark.slow
def test_admin_checks_the_secret_then_the_request(servers, weights_root,
                                                  tmp_path):
  address = servers[1][1]  # servers[0] is SIGKILLed by a test below
  # The secret first: a stranger learns nothing about the request format.
  for name in ('UpdateWeights', 'Status'):
    code, _ = admin_error(address, name, b'not json', 'wrong-secret-12345')
    assert code == grpc.StatusCode.UNAUTHENTICATED
  # Then the body, with a short reason and no Python internals.
  for name, body in (('UpdateWeights', b'not json'), ('Status', b'not json'),
                     ('UpdateWeights', b'\xff\xfe'), ('UpdateWeights', b'[]'),
                     ('Status', b'"x"'), ('UpdateWeights', b'{"path": 3}'),
                     ('UpdateWeights', update(weights_root / 'v', True)),
                     ('UpdateWeights', update(weights_root / 'v', -1)),
                     ('UpdateWeights', update(weights_root / 'v', '1'))):
    code, details = admin_error(address, name, body)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, body, details)
    assert 'Error' not in details and 'Traceback' not in details, details
  # Then the path: only under the weights root, however it is spelled.
  os.symlink(tmp_path, weights_root / 'escape')
  (tmp_path / 'outside').mkdir()
  for path in (tmp_path / 'outside',
               f'{weights_root}/../{tmp_path.name}/outside',
               f'{weights_root}/x/../../{weights_root.name}x',
               weights_root / 'escape' / 'outside'):
    code, details = admin_error(address, 'UpdateWeights', update(path))
    assert code == grpc.StatusCode.PERMISSION_DENIED, (path, details)
    assert 'not under the weights root' in details
  # A path inside that holds no checkpoint is a load failure, not a denial.
  code, _ = admin_error(address, 'UpdateWeights',
                        update(weights_root / 'missing'))
  assert code == grpc.StatusCode.FAILED_PRECONDITION
  status = admin_call(address, 'Status', b'')
  assert status['temperature'] == PARAMS.temperature
  assert (status['top_k'], status['top_p']) == (0, 1.0)
  assert status['generate_loop_restarts'] == 0


def pid_exited(pid: int) -> bool:
  """Whether `pid` ended (a zombie too: a container's init may not reap)."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rpartition(')')[2].split()[0] == 'Z'
  except FileNotFoundError:
    return True


@pytest.mark.slow
def test_catch_up_loads_the_current_version_and_checks_sampling(
    servers, policy, weights_root):
  model, _ = policy
  address = servers[0][1]
  version = asyncio.run(weight_sync.server_status(address, SECRET))[
      'version'] + 3
  weight_sync.save_policy(str(weights_root / 'catch_up'), model)
  sampling_settings = {'temperature': PARAMS.temperature, 'top_k': 0,
                       'top_p': 1.0}
  publisher = weight_sync.WeightPublisher([address], SECRET,
                                          sampling=sampling_settings)
  publisher.set_current(str(weights_root / 'catch_up'), version)
  publisher.acked[address] = version  # from before a restart: stale
  assert asyncio.run(publisher.catch_up(address))
  status = asyncio.run(weight_sync.server_status(address, SECRET))
  assert status['version'] == version
  assert publisher.rollout_version([address]) == version
  assert publisher.counters['catch_ups'] == 1
  # Already current: accepted without a load.
  assert asyncio.run(publisher.catch_up(address))
  assert publisher.counters['catch_ups'] == 1
  assert asyncio.run(weight_sync.server_status(address, SECRET))[
      'swaps'] == status['swaps']
  # A learner that assumes another temperature refuses the server.
  other = weight_sync.WeightPublisher(
      [address], SECRET, sampling=dict(sampling_settings, temperature=0.5))
  assert not asyncio.run(other.catch_up(address))
  assert f'temperature={PARAMS.temperature}' in str(other.mismatch)
  assert 'temperature=0.5' in str(other.mismatch)


@pytest.mark.slow
def test_server_exits_when_its_parent_is_killed(tmp_path):
  # The parent: a small process that starts the server (whose ready line
  # reaches us through the shared stdout) and then just waits.
  parent_code = textwrap.dedent(f'''
      import os, subprocess, sys, time
      subprocess.Popen([sys.executable, '-m', 'sao_jax.serve',
                        '--config=configs/tiny.py', '--port=0',
                        f'--parent_pid={{os.getpid()}}'],
                       stderr=open({str(tmp_path / 'server.log')!r}, 'w'))
      time.sleep(600)
  ''')
  # One CPU device, not the test session's eight.
  env = xla_flags.child_environment(dict(
      os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT,
      **{weight_sync.SECRET_ENV: SECRET}))
  parent = subprocess.Popen([sys.executable, '-c', parent_code], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, text=True)
  server_pid = None
  try:
    line = parent.stdout.readline()
    assert line, (tmp_path / 'server.log').read_text()[-3000:]
    ready = json.loads(line)
    server_pid = ready['pid']
    address = f'127.0.0.1:{ready["port"]}'
    # Started without --weights_root: no push is loaded.
    code, details = admin_error(address, 'UpdateWeights',
                                update(tmp_path / 'v1'))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert '--weights_root' in details
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 30
    while not pid_exited(server_pid) and time.monotonic() < deadline:
      time.sleep(0.2)
    assert pid_exited(server_pid), 'the server outlived its parent'
    log = (tmp_path / 'server.log').read_text()
    assert 'is gone: stopping' in log, log[-3000:]
  finally:
    if parent.poll() is None:
      parent.kill()
      parent.wait()
    parent.stdout.close()
    if server_pid is not None and not pid_exited(server_pid):
      os.kill(server_pid, signal.SIGKILL)


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
                                                                weights_root):
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
  weight_sync.save_policy(str(weights_root / 'workers'), model)
  # An earlier test may have pushed other weights: serve `model` again.
  start = asyncio.run(weight_sync.server_status(survivor_address,
                                                SECRET))['version'] + 1
  assert not asyncio.run(publisher.push(str(weights_root / 'workers'),
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
      runner.call(publisher.push(str(weights_root / 'workers'),
                                 start + step + 1))
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
