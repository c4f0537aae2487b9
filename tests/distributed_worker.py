"""One process of the two-process `jax.distributed` test (run as a script).

  python tests/distributed_worker.py PROCESS_ID NUM_PROCESSES PORT OUT.json

Trains the tiny model for two steps on fixed batches over a (data=2, fsdp=2)
mesh of all processes' CPU devices (2 per process). Each process feeds its
own rows of the global batch, as each host's rollout workers do on a pod.
Process 0 writes the losses and the gathered parameters' checksums.
"""

import json
import os
import sys

process_id, num_processes, port, out = (int(sys.argv[1]), int(sys.argv[2]),
                                        int(sys.argv[3]), sys.argv[4])
devices_per_process = 4 // num_processes
# The scheduler flag: see tests/conftest.py (concurrent collectives deadlock
# XLA:CPU's blocking rendezvous). The parent's other flags (conftest's compile
# options) come first; it removed its own device count.
os.environ['XLA_FLAGS'] = ' '.join([
    os.environ.get('XLA_FLAGS', ''),
    f'--xla_force_host_platform_device_count={devices_per_process}',
    '--xla_cpu_enable_concurrency_optimized_scheduler=false']).strip()
os.environ['JAX_PLATFORMS'] = 'cpu'

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

if num_processes > 1:
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top,wrong-import-position
import test_learner  # pylint: disable=g-import-not-at-top,wrong-import-position

from sao_jax import distributed  # pylint: disable=g-import-not-at-top,wrong-import-position
from sao_jax.learner import learner as learner_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from sao_jax.models import tiny  # pylint: disable=g-import-not-at-top,wrong-import-position


def main():
  config = test_learner.make_config(lr=1e-4, **{
      'mesh.data': 2, 'mesh.fsdp': 2, 'mesh.tensor': 1,
      'distributed.enabled': num_processes > 1,
      'distributed.coordinator_address': f'127.0.0.1:{port}',
      'distributed.num_processes': num_processes,
      'distributed.process_id': process_id})
  distributed.initialize(config.distributed)
  assert jax.device_count() == 4 and jax.process_count() == num_processes
  model, _ = tiny.make(seed=1)
  learner = learner_lib.Learner(config, model,
                                learner_lib.mesh_from_config(config))
  state = learner.init_state()
  rows = test_learner.BATCH // num_processes
  losses = []
  for seed in (0, 1):
    full = test_learner.fake_batch(seed)
    mine = jax.tree.map(lambda x: x[process_id * rows:(process_id + 1) * rows],
                        full)
    # A process assembles its own trajectories, numbered from 1
    # (`Learner.device_batch` moves them past the other processes'); this
    # slice of the whole batch carries the whole batch's numbers.
    ids = mine.segment_ids_BxT
    mine = mine.replace(segment_ids_BxT=np.where(
        ids > 0, ids - process_id * rows, 0).astype(np.int32))
    state, metrics = learner.train_step(state, learner.device_batch(mine))
    # Metrics are replicated: every process holds the whole value.
    losses.append({k: float(v.addressable_data(0))
                   for k, v in metrics.items()
                   if k in ('policy/loss', 'critic/loss')})
  gathered = multihost_utils.process_allgather(state.policy,
                                               tiled=True)
  checksums = {jax.tree_util.keystr(k): float(np.abs(np.asarray(v)).sum())
               for k, v in jax.tree_util.tree_flatten_with_path(gathered)[0]}
  if process_id == 0:
    with open(out, 'w') as f:
      json.dump({'losses': losses, 'checksums': checksums}, f)


if __name__ == '__main__':
  main()
