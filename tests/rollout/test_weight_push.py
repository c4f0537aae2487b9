"""Streamed weight pushes over the real admin gRPC service.

In-process servers: a push mid-decode switches the version column from the
next step on with both versions' mu_t right and no file anywhere; an
unauthenticated push moves nothing; a corrupted bucket and a learner killed
mid-stream each end in a counted failure with the server on its previous
version; the data port closes a connection without a token it issued.
Server subprocesses: one SIGKILLed and one SIGSTOPped mid-stream fail the
push within its deadlines, counted, without holding up the push to a healthy
server.
"""

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest
from flax import nnx

from sao_jax import xla_flags
from sao_jax.models import sampling
from sao_jax.models import tiny
from sao_jax.rollout import client as client_lib
from sao_jax.rollout import engine as engine_lib
from sao_jax.rollout import launch
from sao_jax.rollout import server as server_lib
from sao_jax.rollout import weight_stream
from sao_jax.rollout import weight_sync
import sao_jax.models

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
SECRET = 'weight-push-test-secret'
PARAMS = sampling.SamplingParams(temperature=1.0)
BUCKET = 4096  # the tiny model is ~0.5 MB: a push is ~100 buckets


def serve(checkpoint):
  model, tok = sao_jax.models.from_pretrained(checkpoint)
  engine = engine_lib.Engine(model, tok, engine_lib.EngineConfig(
      max_concurrent_decodes=4, max_prefill_length=64,
      max_target_length=512, stop_ids=(), sampling=PARAMS))
  # No weights root: a file push would be refused, so what arrives came
  # over the stream.
  server = server_lib.RolloutServer(engine, port=0, secret=SECRET)
  return server, f'127.0.0.1:{server.port}', model, tok


def perturbed(model, scale=1.5):
  params = jax.tree.map(lambda x: x * scale,
                        sao_jax.models.pretrained.flat_params(model))
  return sao_jax.models.pretrained.build(model.config, params)


def publisher_for(addresses, transport=None, secret=SECRET, **kwargs):
  transport = transport or weight_sync.StreamTransport(bucket_bytes=BUCKET)
  return weight_sync.WeightPublisher(addresses, secret, transport=transport,
                                     **kwargs)


def recompute(model, prompt, tokens):
  sequence = np.array([prompt + tokens])
  logp = sampling.token_logprobs(model(sequence)[:, :-1], sequence[:, 1:],
                                 PARAMS)
  return np.asarray(logp)[0, len(prompt) - 1:]


@pytest.fixture(scope='module')
def server(tiny_checkpoint_no_eos):
  served = serve(tiny_checkpoint_no_eos)
  yield served
  served[0].stop()


def test_a_streamed_push_mid_decode_switches_versions_exactly(server):
  srv, address, model, tok = server
  new_model = perturbed(model)
  prompts = [tok.encode_chat([{'role': 'user', 'content': f'w{i} w{i + 1}'}])
             for i in range(4)]
  publisher = publisher_for([address])

  async def main():
    async with client_lib.ServerPool([address], stop_ids=(),
                                     max_prompt_length=63,
                                     deadline_s=120) as pool:
      pushed, decoding = asyncio.Event(), asyncio.Event()

      async def stream(prompt, max_new_tokens):
        samples = []
        while not pushed.is_set():
          (sample,) = await pool.generate(prompt, max_new_tokens)
          samples.append((prompt, sample))
          decoding.set()
        return samples

      # Unequal lengths keep the four slots out of step: whenever the swap
      # lands, some row is mid-trajectory (equal ones all end together, and
      # on a slow machine the swap can fall in the gap before the next
      # prefill, so that no trajectory spans it).
      tasks = [asyncio.create_task(stream(p, 150 + 90 * i))
               for i, p in enumerate(prompts)]
      await decoding.wait()
      result = await publisher.push(
          publisher.transport.prepare(new_model, 1), 1)
      pushed.set()
      samples = [s for ss in await asyncio.gather(*tasks) for s in ss]
      return result, samples, await weight_sync.server_status(address,
                                                              SECRET)

  result, samples, status = asyncio.run(main())
  assert result.updated == [address] and not result.failed
  assert status['version'] == 1 and status['pushes_committed'] == 1
  assert status['swap_pauses']['count'] >= 1
  assert status['swap_pauses']['max_s'] < 5.0
  mixed = 0
  for prompt, sample in samples:
    versions = np.array(sample.versions)
    assert np.all(np.diff(versions) >= 0)
    want = np.where(versions == 0, recompute(model, prompt, sample.tokens),
                    recompute(new_model, prompt, sample.tokens))
    np.testing.assert_allclose(sample.logprobs, want, atol=1e-4)
    mixed += set(versions) == {0, 1}
  assert mixed > 0, f'none of {len(samples)} trajectories spanned the push'


def test_an_unauthenticated_push_moves_nothing(server):
  srv, address, model, _ = server
  before = asyncio.run(weight_sync.server_status(address, SECRET))
  intruder = publisher_for([address], secret='not-the-secret-at-all')
  prepared = intruder.transport.prepare(perturbed(model, 0.0), 9)
  # Straight to the stream (the publisher's health check would already be
  # refused): the first message is never read. (A write racing the abort
  # can reach the sender as INTERNAL instead.)
  with pytest.raises(Exception, match='UNAUTHENTICATED|INTERNAL'):
    asyncio.run(intruder.transport.send(intruder, address, prepared, 9))
  after = asyncio.run(weight_sync.server_status(address, SECRET))
  assert after['version'] == before['version']
  assert (after['pushes_committed'], after['pushes_failed']) == (
      before['pushes_committed'], before['pushes_failed'])


def test_the_data_port_admits_only_a_token_it_handed_out(server):
  srv, address, model, _ = server
  before = asyncio.run(weight_sync.server_status(address, SECRET))
  # A stranger's connection: a made-up token, then bytes that would be a
  # bucket. Closed after the token, nothing stored, counted.
  with socket.create_connection(('127.0.0.1', srv.data_port)) as conn:
    conn.sendall(os.urandom(32) + b'x' * 100_000)
    conn.settimeout(10)
    try:
      assert conn.recv(1) == b''  # the server closed it
    except ConnectionResetError:
      pass
  after = asyncio.run(weight_sync.server_status(address, SECRET))
  assert (after['data_connections_refused']
          == before['data_connections_refused'] + 1)
  assert after['version'] == before['version']
  assert (after['pushes_committed'], after['pushes_failed']) == (
      before['pushes_committed'], before['pushes_failed'])
  # A real push still goes through, its token used once.
  version = before['version'] + 1
  publisher = publisher_for([address])
  result = asyncio.run(publisher.push(publisher.transport.prepare(model,
                                                                  version),
                                      version))
  assert result.updated == [address]
  final = asyncio.run(weight_sync.server_status(address, SECRET))
  assert final['data_connections_refused'] == after['data_connections_refused']


class Corrupting(weight_sync.StreamTransport):
  """Flips one payload byte of bucket 3 (after its checksum was taken)."""

  def frames(self, pieces, version):
    for i, (header, parts) in enumerate(super().frames(pieces, version)):
      if i == 3:
        last = bytearray(parts[-1])
        last[-1] ^= 1
        parts = [*parts[:-1], memoryview(last)]
      yield header, parts


def test_a_corrupted_bucket_is_a_counted_failure(server):
  srv, address, model, _ = server
  before = asyncio.run(weight_sync.server_status(address, SECRET))
  publisher = publisher_for([address], Corrupting(bucket_bytes=BUCKET))
  version = before['version'] + 1
  result = asyncio.run(publisher.push(
      publisher.transport.prepare(perturbed(model, 0.5), version), version))
  assert result.failed == {address: 'INVALID_ARGUMENT'}
  assert publisher.counters['pushes_failed'] == 1
  assert publisher.rollout_version([address]) is None  # nothing acked
  after = asyncio.run(weight_sync.server_status(address, SECRET))
  assert after['version'] == before['version']
  assert after['pushes_failed'] == before['pushes_failed'] + 1
  # The next, intact push goes through.
  good = publisher_for([address])
  result = asyncio.run(good.push(good.transport.prepare(model, version),
                                 version))
  assert result.updated == [address]
  assert asyncio.run(weight_sync.server_status(address,
                                               SECRET))['version'] == version


KILLED_LEARNER = textwrap.dedent('''
    import asyncio, sys, numpy as np
    from sao_jax.rollout import weight_stream, weight_sync

    class Stalling(weight_sync.StreamTransport):
      def frames(self, pieces, version):
        for i, frame in enumerate(super().frames(pieces, version)):
          if i == 2:
            print('sent', flush=True)
            import time; time.sleep(600)
          yield frame

    pieces = [weight_stream.Piece(path, shape, tuple((0, n) for n in shape),
                                  np.zeros(shape, dtype))
              for path, shape, dtype in eval(sys.argv[3])]
    transport = Stalling(bucket_bytes=4096, bucket_timeout_s=600)
    publisher = weight_sync.WeightPublisher([sys.argv[1]], sys.argv[2],
                                            transport=transport)
    asyncio.run(transport.send(publisher, sys.argv[1], pieces, 50))
''')


def test_a_learner_killed_mid_stream_leaves_the_served_version(server, caplog):
  srv, address, model, _ = server
  before = asyncio.run(weight_sync.server_status(address, SECRET))
  shapes = [(p.path, p.shape, p.data.dtype.name)
            for p in weight_stream.host_pieces(model)]
  learner = subprocess.Popen(
      [sys.executable, '-c', KILLED_LEARNER, address, SECRET, repr(shapes)],
      cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu'),
      stdout=subprocess.PIPE, text=True)
  try:
    assert learner.stdout.readline().strip() == 'sent'
    learner.kill()
    learner.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
      after = asyncio.run(weight_sync.server_status(address, SECRET))
      if after['pushes_failed'] > before['pushes_failed']:
        break
      time.sleep(0.2)
  finally:
    learner.kill()
  assert after['pushes_failed'] == before['pushes_failed'] + 1
  assert after['version'] == before['version']  # never half-applied
  # The kill ended it (the connection or the call, whichever the server
  # noticed first), not a refused manifest.
  assert re.search('closed after|caller cancelled', caplog.text), caplog.text


@pytest.fixture(scope='module')
def subprocess_servers(tiny_checkpoint_no_eos, tmp_path_factory):
  started = launch.start_subprocesses(
      os.path.join(ROOT, 'configs', 'default.py'), count=3, secret=SECRET,
      log_dir=str(tmp_path_factory.mktemp('server_logs')),
      overrides=(f'--config.model.source={tiny_checkpoint_no_eos}',
                 '--config.rollout.max_concurrent_decodes=2',
                 '--config.rollout.max_prefill_length=64',
                 '--config.rollout.max_target_length=128'),
      env=dict(JAX_PLATFORMS='cpu'))
  yield started
  for s in started:
    try:
      os.kill(s.process.pid, signal.SIGCONT)
    except ProcessLookupError:
      pass
  launch.stop(started)


class Signalling(weight_sync.StreamTransport):
  """Sends `signals[address]` to that server's process after bucket 2."""

  def __init__(self, signals, **kwargs):
    super().__init__(**kwargs)
    self.signals = signals

  async def send(self, publisher, address, pieces, version):
    self._address = address
    return await super().send(publisher, address, pieces, version)

  def frames(self, pieces, version):
    address = self._address
    for i, frame in enumerate(super().frames(pieces, version)):
      if i == 2 and address in self.signals:
        pid, sig = self.signals[address]
        os.kill(pid, sig)
      yield frame


@pytest.mark.slow
def test_a_killed_and_a_hung_server_fail_the_push_within_its_deadlines(
    subprocess_servers, policy_model):
  killed, hung, healthy = subprocess_servers
  signals = {killed.address: (killed.process.pid, signal.SIGKILL),
             hung.address: (hung.process.pid, signal.SIGSTOP)}
  addresses = [s.address for s in subprocess_servers]

  async def push_each():
    # Each server its own transport (`Signalling` keeps the address it
    # sends to), all three concurrently on one loop.
    async def one(address):
      own = Signalling(signals, bucket_bytes=BUCKET, bucket_timeout_s=3.0)
      pub = publisher_for([address], own, push_timeout_s=6.0)
      pub.set_current(own.prepare(policy_model, 1), 1)
      start = time.monotonic()
      result = await pub.push(pub.current[0], 1)
      return address, result, time.monotonic() - start

    return await asyncio.gather(*(one(a) for a in addresses))

  outcomes = {a: (r, s) for a, r, s in asyncio.run(push_each())}
  assert outcomes[healthy.address][0].updated == [healthy.address]
  for address in (killed.address, hung.address):
    result, seconds = outcomes[address]
    assert address in result.failed, result
    assert seconds < 6.0 + 3.0, (address, seconds)  # no hang past deadlines
  assert outcomes[healthy.address][1] < 6.0
  os.kill(hung.process.pid, signal.SIGCONT)
  # The resumed server finds its stream cancelled (or its bucket deadline
  # passed) only once it runs again: its count may lag the SIGCONT.
  deadline = time.monotonic() + 30
  while True:
    status = asyncio.run(weight_sync.server_status(hung.address, SECRET))
    if status['pushes_failed'] or time.monotonic() > deadline:
      break
    time.sleep(0.2)
  assert status['version'] == 0  # the broken push was never applied
  assert status['pushes_failed'] == 1
  assert killed.process.wait(timeout=10) == -signal.SIGKILL


@pytest.fixture(scope='module')
def policy_model(tiny_checkpoint_no_eos):
  return perturbed(sao_jax.models.from_pretrained(tiny_checkpoint_no_eos)[0])


@pytest.mark.slow
def test_two_learner_processes_each_stream_only_their_shards(
    tiny_checkpoint_no_eos, tmp_path):
  # The server holds the tiny model of seed 0; the learner processes hold
  # seed 1's, sharded over fsdp=4 across them (tests/weight_push_worker.py).
  srv, address, _, _ = serve(tiny_checkpoint_no_eos)
  try:
    with socket.socket() as s:
      s.bind(('127.0.0.1', 0))
      port = s.getsockname()[1]
    out = str(tmp_path / 'sent.json')
    env = xla_flags.child_environment(dict(os.environ, PYTHONPATH=ROOT))
    workers = [subprocess.Popen(
        [sys.executable, os.path.join(ROOT, 'tests', 'weight_push_worker.py'),
         str(i), str(port), address, out], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = [w.communicate(timeout=300)[0] for w in workers]
    for w, output in zip(workers, outputs):
      assert w.returncode == 0, output[-4000:]
    sent = []
    for i in range(2):
      with open(f'{out}.{i}') as f:
        sent.append(json.load(f))
    status = asyncio.run(weight_sync.server_status(address, SECRET))
    served, version = srv.engine.weights.get()
  finally:
    srv.stop()
  assert all(s['updated'] == [address] and not s['failed'] for s in sent)
  assert version == 1 and status['pushes_committed'] == 1
  want = sao_jax.models.pretrained.flat_params(tiny.make(seed=1)[0])
  total = sum(x.nbytes for x in want.values())
  # Every byte once over both processes, and neither sent the whole model:
  # no process gathered what the other holds.
  assert sent[0]['bytes'] + sent[1]['bytes'] == total
  assert 0 < sent[0]['bytes'] < total and 0 < sent[1]['bytes'] < total
  # ... and each sent halves of sharded parameters.
  assert all(any(not whole for _, whole in s['pieces']) for s in sent)
  got = {tuple(str(k) for k in path): np.asarray(var[...])
         for path, var in nnx.to_flat_state(served)}
  assert set(got) == set(want)
  for path, array in want.items():
    np.testing.assert_array_equal(got[path], array, err_msg=str(path))
