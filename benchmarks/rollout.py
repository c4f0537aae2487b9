r"""Rollout benchmark: continuous batching vs one request at a time, weight swaps.

  python benchmarks/rollout.py             # SmolLM2-135M-Instruct, 8 slots
  python benchmarks/rollout.py --quick     # tiny random model (CI)

Starts one real rollout server (`python -m sao_jax.serve`, JetStream with our
engine) on loopback and measures, on the same server and the same prompts:
  * sequential: requests sent one at a time (one slot busy);
  * batched: the same requests with up to `--slots` in flight (continuous
    batching fills every decode slot);
alternating the two `--repeats` times and reporting medians of generated
tokens per second and their ratio. Then it times a weight update of the
served model: writing the orbax checkpoint (learner side) and the server's
load-and-swap (admin RPC), medians over `--swaps` pushes.

Writes a JSON result and prints a markdown summary for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time

from sao_jax.models import pretrained
from sao_jax.rollout import client as client_lib
from sao_jax.rollout import launch
from sao_jax.rollout import weight_sync
import sao_jax.models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = 'benchmark-admin-secret'


async def timed_generation(pool, prompts, max_tokens, concurrency):
  semaphore = asyncio.Semaphore(concurrency)

  async def one(prompt):
    async with semaphore:
      (sample,) = await pool.generate(prompt, max_tokens)
      return len(sample.tokens)

  start = time.perf_counter()
  tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
  return tokens / (time.perf_counter() - start), tokens


async def measure(address, prompts, max_tokens, slots, repeats, stop_ids):
  async with client_lib.ServerPool([address], stop_ids=stop_ids,
                                   max_in_flight_per_server=slots,
                                   deadline_s=1800) as pool:
    # Warm-up: compiles prefill buckets and the decode step.
    await timed_generation(pool, prompts[:slots], max_tokens, slots)
    sequential, batched = [], []
    for _ in range(repeats):
      sequential.append(await timed_generation(pool, prompts[:slots],
                                               max_tokens, 1))
      batched.append(await timed_generation(pool, prompts, max_tokens, slots))
  return sequential, batched


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--quick', action='store_true')
  parser.add_argument('--model', default='smollm2-135m-instruct')
  parser.add_argument('--slots', type=int, default=8)
  parser.add_argument('--requests', type=int, default=32)
  parser.add_argument('--max_tokens', type=int, default=64)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--swaps', type=int, default=3)
  parser.add_argument('--out', default='benchmarks/results/rollout.json')
  args = parser.parse_args()
  workdir = tempfile.mkdtemp(prefix='sao_rollout_bench_')
  source = args.model
  if args.quick:
    source = pretrained.save_tiny(os.path.join(workdir, 'tiny'),
                                  with_stop=False)
    args.requests, args.max_tokens, args.repeats, args.swaps = 8, 16, 1, 1
  model, tok = sao_jax.models.from_pretrained(source)
  questions = [f'What is {a} + {b}? Answer with a number.'
               for a in range(10) for b in range(10)]
  prompts = [tok.encode_chat([{'role': 'user', 'content': q}])
             for q in questions[:args.requests]]
  (server,) = launch.start_subprocesses(
      os.path.join(ROOT, 'configs', 'default.py'), count=1, secret=SECRET,
      log_dir=workdir, weights_root=workdir, overrides=(
          f'--config.model.source={source}',
          f'--config.rollout.max_concurrent_decodes={args.slots}',
          '--config.rollout.temperature=1.0',  # as in BENCHMARKS.md
          '--config.rollout.max_prefill_length=128',
          '--config.rollout.max_target_length=256',
          '--config.rollout.max_sequence_length=256'))
  address = server.address
  try:
    sequential, batched = asyncio.run(measure(
        address, prompts, args.max_tokens, args.slots, args.repeats,
        tok.stop_ids))
    save_s, swap_s, rpc_s = [], [], []
    for version in range(1, args.swaps + 1):
      path = os.path.join(workdir, f'v{version}')
      start = time.perf_counter()
      weight_sync.save_policy(path, model)
      save_s.append(time.perf_counter() - start)
      push = asyncio.run(weight_sync.WeightPublisher([address], SECRET).push(
          path, version))
      status = asyncio.run(weight_sync.server_status(address, SECRET))
      if push.failed:
        raise RuntimeError(f'weight push failed: {push.failed}')
      rpc_s.append(push.seconds)
      swap_s.append(status['last_swap_seconds'])
  finally:
    launch.stop([server])
  seq_tps = statistics.median(r[0] for r in sequential)
  bat_tps = statistics.median(r[0] for r in batched)
  result = {
      'model': args.model if not args.quick else 'tiny-random',
      'slots': args.slots, 'requests': args.requests,
      'max_tokens': args.max_tokens,
      'sequential_tokens_per_s': [r[0] for r in sequential],
      'batched_tokens_per_s': [r[0] for r in batched],
      'median_sequential_tokens_per_s': seq_tps,
      'median_batched_tokens_per_s': bat_tps,
      'speedup': bat_tps / seq_tps,
      'checkpoint_save_s': save_s, 'server_load_and_swap_s': swap_s,
      'push_rpc_s': rpc_s,
      'machine': {'platform': platform.platform(), 'cpus': os.cpu_count(),
                  'command': ' '.join(sys.argv)},
  }
  os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump(result, f, indent=2)
  print(f'| model | slots | sequential tok/s | batched tok/s | speedup |'
        f' checkpoint save s | server load+swap s | push RPC s |\n'
        f'|---|---|---|---|---|---|---|---|\n'
        f'| {result["model"]} | {args.slots} | {seq_tps:.0f} | {bat_tps:.0f} |'
        f' {result["speedup"]:.1f}x | {statistics.median(save_s):.2f} |'
        f' {statistics.median(swap_s):.2f} | {statistics.median(rpc_s):.2f} |')


if __name__ == '__main__':
  main()
