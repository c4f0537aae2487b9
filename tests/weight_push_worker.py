"""One learner process of the two-process streamed-push test (run as a script).

  python tests/weight_push_worker.py PROCESS_ID PORT SERVER_ADDRESS OUT.json

Two processes joined by `jax.distributed` (2 CPU devices each) hold the tiny
model's policy as the learner shards it over a (data=1, fsdp=4) mesh, so
each process holds half of every sharded parameter and the replicated ones
are sent by whoever holds replica 0. Each streams only its own shards to the
one server (`parts=2`); the server commits the version when both parts
arrived. Each process writes what it sent to OUT.json.<PROCESS_ID>.
"""

import asyncio
import json
import os
import sys

process_id, port, address, out = (int(sys.argv[1]), int(sys.argv[2]),
                                  sys.argv[3], sys.argv[4])
# As in distributed_worker.py: the parent's flags first, 2 devices here.
os.environ['XLA_FLAGS'] = ' '.join([
    os.environ.get('XLA_FLAGS', ''),
    '--xla_force_host_platform_device_count=2',
    '--xla_cpu_enable_concurrency_optimized_scheduler=false']).strip()
os.environ['JAX_PLATFORMS'] = 'cpu'

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

jax.config.update('jax_cpu_collectives_implementation', 'gloo')

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_learner  # pylint: disable=g-import-not-at-top,wrong-import-position

from sao_jax import distributed  # pylint: disable=g-import-not-at-top,wrong-import-position
from sao_jax.learner import learner as learner_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from sao_jax.models import tiny  # pylint: disable=g-import-not-at-top,wrong-import-position
from sao_jax.rollout import weight_sync  # pylint: disable=g-import-not-at-top,wrong-import-position

SECRET = 'weight-push-test-secret'


def main():
  config = test_learner.make_config(**{
      'mesh.data': 1, 'mesh.fsdp': 4, 'mesh.tensor': 1,
      'distributed.enabled': True,
      'distributed.coordinator_address': f'127.0.0.1:{port}',
      'distributed.num_processes': 2,
      'distributed.process_id': process_id})
  distributed.initialize(config.distributed)
  assert jax.device_count() == 4 and jax.process_count() == 2
  model, _ = tiny.make(seed=1)
  learner = learner_lib.Learner(config, model,
                                learner_lib.mesh_from_config(config))
  policy = learner.init_state().policy
  transport = weight_sync.StreamTransport(
      bucket_bytes=4096, part=jax.process_index(), parts=jax.process_count())
  pieces = transport.prepare(policy, 1)
  publisher = weight_sync.WeightPublisher([address], SECRET,
                                          transport=transport,
                                          push_timeout_s=120)
  publisher.set_current(pieces, 1)
  result = asyncio.run(publisher.push(pieces, 1))
  with open(f'{out}.{process_id}', 'w') as f:
    json.dump({'updated': result.updated, 'failed': result.failed,
               'bytes': sum(p.data.nbytes for p in pieces),
               'pieces': [[p.path, p.index == tuple((0, n) for n in p.shape)]
                          for p in pieces]}, f)


if __name__ == '__main__':
  main()
