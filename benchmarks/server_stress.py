r"""Stress test of one rollout server: bursty load, cancellations, liveness.

  python benchmarks/server_stress.py                   # 20 minutes (issue 13)
  python benchmarks/server_stress.py --quick           # 10 seconds (CI)
  python benchmarks/server_stress.py --duration_s=300  # any length

Starts one real rollout server (`python -m sao_jax.serve` with configs/tiny.py:
the tiny random model, 8 decode slots) and drives it with an asyncio client
for `--duration_s` seconds. The load is what tripped JetStream 0.2.2's
free-slot race (its generate thread asserting that some slot is busy just
after the last busy slot freed, which stopped the server):
  * phases of 0.5-4 s, each with a new random concurrency between
    `--min_concurrency` and `--max_concurrency`, started all at once;
  * after a phase, often (`--drain_fraction`) no new request until every
    request in flight has ended, then a short pause: the server's busy slots
    drain to zero many times;
  * random prompts (random lengths up to the prefill limit) and random
    `max_tokens` (up to the KV-cache length);
  * a share of the requests (`--cancel_fraction`) cancelled mid-stream after
    a random delay (scaled by recent request latencies, so most land while
    tokens stream).
Every `--check_every_s` seconds it checks that the server process is alive
and that its HealthCheck answers; at the end it reads the admin Status.

Writes a JSON summary (and prints it) and exits non-zero if the server
stopped, a health check failed, or a request failed for any reason other than
its cancellation. The server's log stays in a temporary directory; on failure
its tail is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import random
import re
import secrets
import statistics
import sys
import tempfile
import time

import grpc

from sao_jax import config_lib
from sao_jax.rollout import client as client_lib
from sao_jax.rollout import jetstream_compat
from sao_jax.rollout import launch
from sao_jax.rollout import weight_sync
import sao_jax.models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pb = jetstream_compat.jetstream_pb2

# The server's log line when jetstream_compat restarts a generate loop after
# the free-slot race (counted from the log too, should Status not report it).
_RESTART_LINE = re.compile(r'a known race\); restarting its loop')
# First token id of the tiny model's words (after <unk> and the chat markers).
_FIRST_WORD = 3


class Stress:
  """The stress client's state: counters, recent latencies, the stop flag."""

  def __init__(self, pool, server, args, limits, rng):
    self.pool = pool
    self.server = server
    self.args = args
    self.max_prompt, self.max_target, self.vocab = limits
    self.rng = rng
    self.counts = collections.Counter()
    self.failed = collections.Counter()
    self.errors = []  # the first few unexpected failures, for the log
    self.latencies = collections.deque(maxlen=64)
    self.stopped = False  # the server died: stop sending
    self.exit_code = None

  def _random_request(self):
    length = self.rng.randint(1, self.max_prompt)
    prompt = [self.rng.randrange(_FIRST_WORD, self.vocab)
              for _ in range(length)]
    # Within the KV cache: the engine stops a sample at max_target_length.
    return prompt, self.rng.randint(1, self.max_target - length)

  async def one_request(self):
    prompt, max_tokens = self._random_request()
    cancel = self.rng.random() < self.args.cancel_fraction
    # A delay below a typical request's latency cancels most requests while
    # their tokens stream (some before their prefill, a few after the end).
    typical = (statistics.median(self.latencies) if self.latencies else 0.2)
    delay = self.rng.uniform(0.0, 1.2 * typical)
    self.counts['requests'] += 1
    start = time.monotonic()
    task = asyncio.create_task(self.pool.generate(prompt, max_tokens))
    try:
      if cancel:
        done, _ = await asyncio.wait({task}, timeout=delay)
        if not done:
          task.cancel()
          try:
            await task
          except asyncio.CancelledError:
            self.counts['cancelled'] += 1
            return
      samples = await task
    except client_lib.RequestFailed as e:
      self._record_failure(e.reason, str(e))
      return
    except Exception as e:  # pylint: disable=broad-except
      self._record_failure(type(e).__name__, repr(e))
      return
    self.latencies.append(time.monotonic() - start)
    self.counts['completed'] += 1
    self.counts['tokens'] += sum(len(s.tokens) for s in samples)

  def _record_failure(self, reason, message):
    self.failed[reason] += 1
    if len(self.errors) < 10:
      self.errors.append(message)

  async def run(self, duration_s):
    """Bursty phases of random concurrency for `duration_s` seconds."""
    args, rng = self.args, self.rng
    end = time.monotonic() + duration_s
    in_flight = set()
    while time.monotonic() < end and not self.stopped:
      level = rng.randint(args.min_concurrency, args.max_concurrency)
      phase_end = min(time.monotonic() + rng.uniform(*args.phase_s), end)
      self.counts['phases'] += 1
      while not self.stopped:
        remaining = phase_end - time.monotonic()
        if remaining <= 0:
          break
        while len(in_flight) < level:
          in_flight.add(asyncio.create_task(self.one_request()))
        _, in_flight = await asyncio.wait(
            in_flight, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
      if in_flight and rng.random() < args.drain_fraction:
        await asyncio.wait(in_flight)
        in_flight = set()
        self.counts['drains'] += 1
        # Lets the server's slots empty too (a cancelled stream keeps its
        # slot until its max_tokens run out).
        await asyncio.sleep(rng.uniform(0.0, args.max_pause_s))
    if in_flight:
      await asyncio.wait(in_flight)

  async def watch(self, address):
    """Checks the process and its HealthCheck every `check_every_s`."""
    async with grpc.aio.insecure_channel(address) as channel:
      health = channel.unary_unary(
          '/jetstream_proto.Orchestrator/HealthCheck',
          request_serializer=pb.HealthCheckRequest.SerializeToString,
          response_deserializer=pb.HealthCheckResponse.FromString)
      while True:
        await asyncio.sleep(self.args.check_every_s)
        self.counts['health_checks'] += 1
        if not self.server.alive():
          self.exit_code = self.server.process.returncode
          self.stopped = True
          self.failed['server_stopped'] += 1
          return
        try:
          response = await health(pb.HealthCheckRequest(),
                                  timeout=self.args.health_timeout_s)
          live = response.is_live
        except grpc.RpcError as e:
          live = False
          self.errors.append(f'HealthCheck: {e.code().name}')
        if not live:
          self.counts['health_check_failures'] += 1


async def stress(server, secret, args, limits, stop_ids):
  """Runs the stress client; returns its summary (before the server stops)."""
  stats = None
  async with client_lib.ServerPool(
      [server.address], stop_ids=stop_ids,
      max_in_flight_per_server=args.max_concurrency,
      deadline_s=args.deadline_s,
      # One server: a failed call is a finding, not something to retry.
      max_retries=0, max_prompt_length=limits[0]) as pool:
    stats = Stress(pool, server, args, limits, random.Random(args.seed))
    # Warm-up, not counted: compiles the prefill buckets and decode step.
    for length in (1, limits[0]):
      await pool.generate([_FIRST_WORD] * length, 4)
    watcher = asyncio.create_task(stats.watch(server.address))
    start = time.monotonic()
    await stats.run(args.duration_s)
    elapsed = time.monotonic() - start
    watcher.cancel()
  status = None
  if server.alive():
    try:
      status = await weight_sync.server_status(server.address, secret)
    except grpc.RpcError as e:
      stats.errors.append(f'Status: {e.code().name}')
  return stats, elapsed, status


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--quick', action='store_true',
                      help='a 10 s run (CI)')
  parser.add_argument('--duration_s', type=float, default=1200.0)
  parser.add_argument('--config', default=os.path.join(ROOT, 'configs',
                                                       'tiny.py'))
  parser.add_argument('--min_concurrency', type=int, default=2)
  parser.add_argument('--max_concurrency', type=int, default=8)
  parser.add_argument('--phase_s', type=float, nargs=2, default=(0.5, 4.0),
                      help='range of a phase length, seconds')
  parser.add_argument('--drain_fraction', type=float, default=0.5)
  parser.add_argument('--max_pause_s', type=float, default=1.0)
  parser.add_argument('--cancel_fraction', type=float, default=0.25)
  parser.add_argument('--check_every_s', type=float, default=3.0)
  parser.add_argument('--health_timeout_s', type=float, default=30.0)
  parser.add_argument('--deadline_s', type=float, default=300.0)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--out', default='benchmarks/results/server_stress.json')
  args = parser.parse_args()
  if args.quick:
    args.duration_s = 10.0
  workdir = tempfile.mkdtemp(prefix='sao_server_stress_')
  # The trainer's way: the exact config in a file the server loads.
  config = config_lib.load_config(args.config)
  config_path = os.path.join(workdir, 'server_config.py')
  config_lib.write_config_file(config, config_path)
  r = config.rollout
  secret = secrets.token_hex(16)
  _, tok = sao_jax.models.from_pretrained(config.model.source)
  limits = (r.max_prefill_length - 1, r.max_target_length, tok.vocab_size)
  (server,) = launch.start_subprocesses(config_path, count=1, secret=secret,
                                        log_dir=workdir)
  try:
    stats, elapsed, status = asyncio.run(stress(server, secret, args, limits,
                                                tok.stop_ids))
    alive = server.alive()
    exit_code = None if alive else server.process.returncode
  finally:
    launch.stop([server])
  with open(server.log_path) as f:
    log = f.read()
  counts = stats.counts
  failed = dict(stats.failed)
  result = {
      'duration_s': args.duration_s, 'elapsed_s': round(elapsed, 1),
      'model': config.model.source,
      'slots': r.max_concurrent_decodes,
      'concurrency': [args.min_concurrency, args.max_concurrency],
      'cancel_fraction': args.cancel_fraction, 'seed': args.seed,
      'requests': counts['requests'], 'completed': counts['completed'],
      'cancelled': counts['cancelled'], 'failed': failed,
      'failed_total': sum(failed.values()),
      'tokens': counts['tokens'],
      'tokens_per_s': round(counts['tokens'] / elapsed, 1),
      'phases': counts['phases'], 'drains': counts['drains'],
      'health_checks': counts['health_checks'],
      'health_check_failures': counts['health_check_failures'],
      'server_alive_at_end': alive, 'server_exit_code': exit_code,
      # Reported by the server once it counts them; the log has them anyway.
      'generate_loop_restarts': (status or {}).get('generate_loop_restarts'),
      'generate_loop_restarts_logged': len(_RESTART_LINE.findall(log)),
      'server_status': status, 'errors': stats.errors,
      'server_log': server.log_path,
      'machine': {'platform': platform.platform(), 'cpus': os.cpu_count(),
                  'command': ' '.join(sys.argv)},
  }
  ok = (alive and not failed and not result['health_check_failures']
        and counts['completed'] > 0)
  result['ok'] = ok
  os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump(result, f, indent=2)
  print(json.dumps(result, indent=2))
  if not ok:
    print(f'server stress FAILED; end of {server.log_path}:\n{log[-6000:]}',
          file=sys.stderr)
    sys.exit(1)


if __name__ == '__main__':
  main()
