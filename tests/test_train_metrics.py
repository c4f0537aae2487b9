"""Host bookkeeping: the pretraining stop, the memory of the run's phases,
what a batch says about its rollouts."""

import math
import os
import subprocess
import sys

import numpy as np

from sao_jax import process_memory
from sao_jax import types
from sao_jax.logs import train_metrics


def test_plateau_stops_after_patience_and_ignores_nan():
  plateau = train_metrics.Plateau(patience=2, min_delta=0.01)
  assert not plateau.update(0.10)
  assert not plateau.update(0.30)  # a gain: the count restarts
  assert not plateau.update(0.305)  # below min_delta: 1
  assert not plateau.update(float('nan'))  # undefined: not counted
  assert not plateau.update(float('nan'))
  assert plateau.update(0.29)  # 2 without a gain: stop
  assert plateau.best == 0.30


def test_memory_phases_see_an_allocation_and_keep_the_peak():
  phases = train_metrics.MemoryPhases()
  phases.mark('before')
  block = np.ones(300 * 2**20 // 8)  # 300 MB, touched
  phases.mark('allocated')
  del block
  phases.mark('freed')
  m = phases.metrics()
  grown = m['memory/allocated_rss_gb'] - m['memory/before_rss_gb']
  assert 0.25 < grown < 0.4
  # The peak never falls, and it covers the allocation after it is freed
  # (to the kernel's lag in syncing per-thread counters: a few pages).
  slack = 4 / 1024
  assert m['memory/freed_peak_rss_gb'] >= m['memory/allocated_rss_gb'] - slack
  assert m['memory/peak_rss_gb'] >= m['memory/freed_peak_rss_gb'] - slack
  assert set(phases.metrics()) == {'memory/peak_rss_gb'}  # marks consumed


def test_process_memory_of_another_and_of_no_process():
  rss, peak = process_memory.usage(os.getpid())
  assert 0 < rss <= peak
  assert all(math.isnan(v) for v in process_memory.usage(2**22 + 17))


_FREED_IN_A_THREAD = r'''
import threading
import numpy as np
from sao_jax import process_memory
from sao_jax import types
process_memory.release_freed_arrays()  # as the trainer starts
kept = []
def work():
  # 400 MB of 200 KB arrays from a worker thread's arena, as XLA's threads
  # allocate; one in 50 stays alive, so no heap has a free top to trim.
  blocks = [np.ones(200_000 // 8) for _ in range(2000)]
  kept.extend(blocks[49::50])
thread = threading.Thread(target=work)
thread.start()
thread.join()
before = process_memory.usage()[0]
assert process_memory.return_free_pages()
print(before, process_memory.usage()[0])
'''


def test_return_free_pages_releases_what_threads_freed():
  out = subprocess.run([sys.executable, '-c', _FREED_IN_A_THREAD],
                       capture_output=True, text=True, check=True).stdout
  before, after = map(float, out.split())
  # The freed 392 MB were still resident; after the trim they are not.
  assert before - after > 0.3


def trajectory(action_versions, prompt_len=2):
  n = len(action_versions)
  versions = np.full(prompt_len + n, types.NO_VERSION, np.int32)
  versions[prompt_len:] = action_versions
  return types.Trajectory(
      prompt_id='p', tokens=np.arange(prompt_len + n, dtype=np.int32),
      action_mask=versions != types.NO_VERSION,
      behavior_logprobs=np.where(versions != types.NO_VERSION, -0.5,
                                 0.0).astype(np.float32),
      versions=versions, reward=1.0)


def test_token_staleness_counts_every_action_token_of_the_batch():
  """Trained at version 5 (learner version 6): one trajectory sampled at 4,
  4, 5 (a weight update mid-reply), one at 1 x 17. Token staleness: 1, 1, 0
  and seventeen 4s; trajectory staleness (oldest token): 1 and 4."""
  metrics = train_metrics.batch_metrics(
      [trajectory([4, 4, 5]), trajectory([1] * 17)], version=6)
  token_staleness = np.array([1, 1, 0] + [4] * 17)
  assert metrics['rollout/token_staleness_mean'] == token_staleness.mean()
  assert metrics['rollout/token_staleness_p95'] == 4.0
  assert metrics['rollout/staleness_mean'] == 2.5
  assert metrics['rollout/staleness_max'] == 4.0
  few = train_metrics.batch_metrics([trajectory([4, 4, 5])], version=6)
  # numpy's linear interpolation: p95 of (0, 1, 1) is 1.
  assert few['rollout/token_staleness_p95'] == 1.0
