r"""Weight sync benchmark: the `files` and `stream` transports side by side,
against a loopback bound measured in the same run.

  python benchmarks/weight_sync.py            # SmolLM2-135M f32, Llama-3.2-1B-shaped bf16
  python benchmarks/weight_sync.py --quick    # tiny random model (smoke run)

For each model it starts one real rollout server (`python -m sao_jax.serve`,
loopback), keeps it decoding (`--slots` requests in flight all the time),
and pushes new versions of the weights, alternating per repeat:

  * bound: the same bytes (in the served dtype) sent over a raw TCP socket
    to a sink process that counts and drops them, and in buckets of the
    same size over a plain gRPC call to the same sink. What the link, and
    gRPC in Python, allow here with nothing checked or stored;
  * stream: `weight_sync.StreamTransport` (copy to the host in the served
    dtype, checksummed buckets over a TCP connection the admin call hands
    out, the server reads them into place on its device and swaps): its
    bound is the TCP copy;
  * stream_overlapped: the same, with the push started while the copy to
    the host runs (`rollout.weight_send_while_copying`);
  * files: `weight_sync.FileTransport` (orbax checkpoint of the learner's
    parameters, `UpdateWeights`, the server restores and swaps).

Reported per transport, medians over `--repeats`: seconds per push (the
learner's prepare included; a stream's overlaps its send), GB/s of served
weights, the server's decode pause at the swap and its first step under the
new weights (the refresh of rows in flight) next to the step after it, and
the extra resident memory of both processes during a push (peak minus the
level just before it, sampled every 5 ms) next to the size of one copy of
the served weights.

The 1B case is Llama-3.2-1B's shape with random weights: the learner holds
f32 parameters, the server bf16 ones, so `stream` sends bf16 (converted by
the learner) while `files` writes the learner's f32 checkpoint, as the two
transports do in a run. Writes a JSON result and prints markdown rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import numpy as np

from sao_jax import checksums
from sao_jax import process_memory
from sao_jax.models import architectures
from sao_jax.models import pretrained
from sao_jax.models import tiny
from sao_jax.models import transformer
from sao_jax.rollout import client as client_lib
from sao_jax.rollout import launch
from sao_jax.rollout import weight_stream
from sao_jax.rollout import weight_sync

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = 'benchmark-admin-secret'
_GB = 1e9


# -- the bound's sink (a separate process) -------------------------------------


def sink_main(port_file: str) -> None:
  """A gRPC server whose one method counts and drops a stream of bytes, and
  a TCP listener that does the same; their ports go to `port_file`."""

  async def drain(requests, context):
    del context
    total = 0
    async for message in requests:
      total += len(message)
    return total

  def tcp(listener):
    buffer = bytearray(1 << 24)
    while True:
      conn, _ = listener.accept()
      with conn:
        while conn.recv_into(buffer):
          pass

  async def serve():
    server = grpc.aio.server(options=[
        ('grpc.max_receive_message_length', 1 << 30)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        'sink', {'Drain': grpc.stream_unary_rpc_method_handler(
            drain, response_serializer=lambda n: str(n).encode())}),))
    port = server.add_insecure_port('127.0.0.1:0')
    listener = socket.create_server(('127.0.0.1', 0))
    threading.Thread(target=tcp, args=(listener,), daemon=True).start()
    await server.start()
    with open(port_file + '.tmp', 'w') as f:
      json.dump({'grpc': port, 'tcp': listener.getsockname()[1]}, f)
    os.rename(port_file + '.tmp', port_file)
    await server.wait_for_termination()

  asyncio.run(serve())


def start_sink(workdir: str):
  port_file = os.path.join(workdir, 'sink_ports.json')
  process = subprocess.Popen([sys.executable, __file__, '--sink', port_file])
  for _ in range(600):
    if os.path.exists(port_file):
      with open(port_file) as f:
        return process, json.load(f)
    time.sleep(0.1)
  process.kill()
  raise RuntimeError('the sink process did not start')


def raw_chunks(pieces, bucket_bytes):
  """The pieces' bytes cut at `bucket_bytes`, as bytes objects (one copy)."""
  for piece in pieces:
    view = memoryview(piece.data.reshape(-1).view(np.uint8))
    for start in range(0, len(view), bucket_bytes):
      yield bytes(view[start:start + bucket_bytes])


async def grpc_bound(port: int, pieces, bucket_bytes: int) -> float:
  async with grpc.aio.insecure_channel(f'127.0.0.1:{port}') as channel:
    call = channel.stream_unary('/sink/Drain', request_serializer=bytes,
                                response_deserializer=int)()
    start = time.perf_counter()
    for chunk in raw_chunks(pieces, bucket_bytes):
      await call.write(chunk)
    await call.done_writing()
    await call
    return time.perf_counter() - start


def tcp_bound(port: int, pieces) -> float:
  start = time.perf_counter()
  with socket.create_connection(('127.0.0.1', port)) as conn:
    for piece in pieces:
      conn.sendall(memoryview(piece.data.reshape(-1).view(np.uint8)))
  return time.perf_counter() - start


# -- measuring ------------------------------------------------------------------


class RssSampler:
  """Peak resident memory of this process and the server during a window."""

  def __init__(self, server_pid: int):
    self._pid = server_pid
    self._stop = threading.Event()

  def __enter__(self):
    self.before = (process_memory.usage()[0],
                   process_memory.usage(self._pid)[0])
    self.peak = list(self.before)
    self._stop.clear()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()
    return self

  def _run(self):
    while not self._stop.wait(0.005):
      for i, pid in enumerate(('self', self._pid)):
        self.peak[i] = max(self.peak[i], process_memory.usage(pid)[0])

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()

  @property
  def extra_gb(self):
    return [p - b for p, b in zip(self.peak, self.before)]


async def decode_load(address, prompts, max_tokens, stop: asyncio.Event):
  """Keeps one request per prompt in flight until `stop`; tokens made."""
  async with client_lib.ServerPool([address], stop_ids=(),
                                   max_in_flight_per_server=len(prompts),
                                   deadline_s=3600) as pool:

    async def loop(prompt):
      tokens = 0
      while not stop.is_set():
        (sample,) = await pool.generate(prompt, max_tokens)
        tokens += len(sample.tokens)
      return tokens

    return sum(await asyncio.gather(*(loop(p) for p in prompts)))


# In turn within each repeat; `stream_overlapped` sends while it copies.
TRANSPORTS = ('stream', 'stream_overlapped', 'files')


async def swap_record(address: str, swaps_before: int) -> dict:
  """The server's pause record of the swap after `swaps_before` (waits for
  the step after the first under the new weights)."""
  for _ in range(1200):
    status = await weight_sync.server_status(address, SECRET, 120)
    pauses = status['swap_pauses']
    if (pauses['count'] > swaps_before and pauses['last'] is not None
        and pauses['last']['next_step_s'] is not None):
      return pauses['last']
    await asyncio.sleep(0.05)
  raise RuntimeError('the server measured no swap: was it decoding?')


async def run_case(args, name, learner_state, served_dtype, server, workdir,
                   prompts, sink_ports, served_bytes):
  """All pushes of one model; returns per-transport lists of measurements."""
  bucket_bytes = int(args.bucket_mib * (1 << 20))
  address = server.address
  stream = weight_sync.StreamTransport(dtype=served_dtype,
                                       bucket_bytes=bucket_bytes,
                                       checksum=args.checksum,
                                       reuse_host_buffers=not
                                       args.fresh_host_buffers)
  files = weight_sync.FileTransport(os.path.join(workdir, f'weights_{name}'))
  publishers = {
      'stream': weight_sync.WeightPublisher([address], SECRET,
                                            transport=stream,
                                            push_timeout_s=3600),
      'stream_overlapped': weight_sync.WeightPublisher(
          [address], SECRET, transport=stream, push_timeout_s=3600),
      'files': weight_sync.WeightPublisher([address], SECRET,
                                           transport=files,
                                           push_timeout_s=3600)}
  results = {k: [] for k in ('bound_grpc', 'bound_tcp') + TRANSPORTS}
  stop = asyncio.Event()
  load = asyncio.create_task(decode_load(address, prompts, args.max_tokens,
                                         stop))
  await asyncio.sleep(args.warmup_s)  # decode steps compiled and running
  loop = asyncio.get_running_loop()
  version = 0
  for _ in range(args.repeats):
    pieces = stream.prepare(learner_state, 0).pieces()  # on the host
    results['bound_grpc'].append(
        {'seconds': await grpc_bound(sink_ports['grpc'], pieces,
                                     bucket_bytes)})
    results['bound_tcp'].append({'seconds': await loop.run_in_executor(
        None, tcp_bound, sink_ports['tcp'], pieces)})
    del pieces
    for transport in TRANSPORTS:
      version += 1
      publisher = publishers[transport]
      swaps = (await weight_sync.server_status(address, SECRET, 120)
               )['swap_pauses']['count']
      with RssSampler(server.process.pid) as rss:
        # As `RolloutSystem.push_weights` does it: `prepare_s` is the wait
        # for the copy to the host (what the learner waits for); overlapped,
        # the push starts at once and sends each piece once it is there
        # (`rollout.weight_send_while_copying`).
        start = time.perf_counter()
        # Off the loop: the files transport writes its checkpoint here.
        prepared = await loop.run_in_executor(
            None, publisher.transport.prepare, learner_state, version)
        publisher.set_current(prepared, version)
        if transport == 'stream_overlapped':
          pushing = asyncio.ensure_future(publisher.push(prepared, version))
        await loop.run_in_executor(None, publisher.transport.wait, prepared)
        prepared_at = time.perf_counter()
        if transport != 'stream_overlapped':
          pushing = asyncio.ensure_future(publisher.push(prepared, version))
        push = await pushing
        end = time.perf_counter()
        del prepared
        publisher.current = None
      if push.failed:
        raise RuntimeError(f'{transport} push failed: {push.failed}')
      files.retire(version)
      # An idle server (`--slots 0`) has no decode step to pause.
      record = (await swap_record(address, swaps) if prompts else {})
      results[transport].append({
          'seconds': end - start, 'prepare_s': prepared_at - start,
          'send_s': end - prepared_at,
          'learner_extra_gb': rss.extra_gb[0],
          'server_extra_gb': rss.extra_gb[1], **record})
      pause = (f', pause {record["pause_s"] * 1e3:.1f} ms' if record
               else '')
      print(f'{name} {transport} v{version}: {end - start:.2f} s'
            f' (prepare {prepared_at - start:.2f}){pause}, server +'
            f'{rss.extra_gb[1]:.2f} GB', flush=True)
  stop.set()
  tokens = await load
  summary = {'served_bytes': served_bytes, 'decoded_tokens': tokens}
  for key, runs in results.items():
    seconds = statistics.median(r['seconds'] for r in runs)
    row = {'runs': runs, 'median_s': seconds,
           'gb_per_s': served_bytes / _GB / seconds}
    for field in ('prepare_s', 'send_s', 'pause_s', 'first_step_s',
                  'next_step_s', 'learner_extra_gb', 'server_extra_gb'):
      if runs and field in runs[0]:
        row[f'median_{field}'] = statistics.median(r[field] for r in runs)
    summary[key] = row
  # The stream's bytes go over a TCP connection (the gRPC call carries only
  # the manifest, the token and the verdict): its bound is the TCP copy.
  summary['stream_of_bound'] = (summary['stream']['gb_per_s']
                                / summary['bound_tcp']['gb_per_s'])
  summary['stream_of_grpc_bound'] = (summary['stream']['gb_per_s']
                                     / summary['bound_grpc']['gb_per_s'])
  summary['stream_over_files'] = (summary['stream']['gb_per_s']
                                  / summary['files']['gb_per_s'])
  for key in ('of_bound', 'over_files'):
    other = 'bound_tcp' if key == 'of_bound' else 'files'
    summary[f'stream_overlapped_{key}'] = (
        summary['stream_overlapped']['gb_per_s'] / summary[other]['gb_per_s'])
  return summary


def random_1b(directory: str):
  """A Llama-3.2-1B-shaped checkpoint with random weights (bf16 on disk)."""
  cfg = architectures.get('llama3.2-1b', dtype='bfloat16',
                          param_dtype='bfloat16')
  model = transformer.init_causal_lm(cfg, seed=0)
  _, tok = tiny.make(vocab=cfg.vocab_size, with_stop=False)
  pretrained.export_pretrained(model, tok, directory)
  return directory


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--sink', help=argparse.SUPPRESS)
  parser.add_argument('--quick', action='store_true')
  parser.add_argument('--models', default='135m,1b')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--slots', type=int, default=4,
                      help='requests kept in flight; 0: an idle server')
  parser.add_argument('--max_tokens', type=int, default=96)
  parser.add_argument('--bucket_mib', type=float, default=16.0)
  parser.add_argument('--checksum', default='sum64',
                      choices=tuple(checksums.CHECKSUMS))
  parser.add_argument('--warmup_s', type=float, default=20.0)
  parser.add_argument('--fresh_host_buffers', action='store_true',
                      help='copy every version into fresh pages (the'
                      ' default config) instead of reused ones')
  parser.add_argument('--out', default='benchmarks/results/weight_sync.json')
  args = parser.parse_args()
  if args.sink:
    sink_main(args.sink)
    return
  workdir = tempfile.mkdtemp(prefix='sao_weight_sync_bench_')
  cases = {'135m': ('smollm2-135m-instruct', 'float32', 'float32'),
           '1b': (None, 'float32', 'bfloat16')}
  names = args.models.split(',')
  if args.quick:
    cases = {'tiny': (pretrained.save_tiny(os.path.join(workdir, 'tiny'),
                                with_stop=False), 'float32', 'float32')}
    names, args.repeats, args.warmup_s = ['tiny'], 1, 5.0
  sink, sink_ports = start_sink(workdir)
  out = {'machine': {'platform': platform.platform(), 'cpus': os.cpu_count(),
                     'command': ' '.join(sys.argv),
                     'date': time.strftime('%Y-%m-%d')},
         'bucket_mib': args.bucket_mib, 'checksum': args.checksum,
         'slots': args.slots,
         'reuse_host_buffers': not args.fresh_host_buffers, 'models': {}}
  try:
    for name in names:
      source, learner_dtype, served_dtype = cases[name]
      if source is None:
        source = random_1b(os.path.join(workdir, 'random_1b'))
      model, tok = pretrained.from_pretrained(source, dtype=learner_dtype,
                                              param_dtype=learner_dtype)
      state = model  # the transports take the module's parameters
      served_bytes = sum(
          p.data.nbytes for p in weight_stream.host_pieces(state,
                                                           served_dtype))
      prompts = [tok.encode_chat([{'role': 'user',
                                   'content': f'Count from {i} upwards.'}])
                 for i in range(args.slots)]
      (server,) = launch.start_subprocesses(
          os.path.join(ROOT, 'configs', 'default.py'), count=1,
          secret=SECRET, log_dir=workdir, weights_root=workdir, overrides=(
              f'--config.model.source={source}',
              f'--config.rollout.param_dtype={served_dtype}',
              f'--config.rollout.dtype={served_dtype}',
              '--config.rollout.max_concurrent_decodes='
              f'{max(args.slots, 1)}',
              '--config.rollout.temperature=1.0',
              '--config.rollout.max_prefill_length=128',
              '--config.rollout.max_target_length=256',
              '--config.rollout.max_sequence_length=256',
              f'--config.rollout.max_new_tokens={args.max_tokens}',
              '--config.rollout.weight_reuse_host_buffers='
              f'{not args.fresh_host_buffers}'))
      try:
        summary = asyncio.run(run_case(args, name, state, served_dtype,
                                       server, workdir, prompts, sink_ports,
                                       served_bytes))
        summary['learner_peak_rss_gb'] = process_memory.usage()[1]
        summary['server_peak_rss_gb'] = process_memory.usage(
            server.process.pid)[1]
        summary['learner_dtype'] = learner_dtype
        summary['served_dtype'] = served_dtype
      finally:
        launch.stop([server])
      out['models'][name] = summary
      del model, state, tok
  finally:
    sink.kill()
    shutil.rmtree(workdir, ignore_errors=True)
  os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump(out, f, indent=2)
  print('| model | served GB | transport | s/push | GB/s | of TCP bound |'
        ' pause ms | first / next step s | learner +GB | server +GB |')
  print('|---|---|---|---|---|---|---|---|---|---|')
  for name, s in out['models'].items():
    bound = s['bound_tcp']['gb_per_s']
    for key in ('bound_tcp', 'bound_grpc') + TRANSPORTS:
      row = s[key]
      extra = (f' {row["median_pause_s"] * 1e3:.1f} |'
               f' {row["median_first_step_s"]:.2f} /'
               f' {row["median_next_step_s"]:.2f} |'
               f' {row["median_learner_extra_gb"]:.2f} |'
               f' {row["median_server_extra_gb"]:.2f} |'
               if 'median_pause_s' in row else ' | | | |')
      print(f'| {name} | {s["served_bytes"] / _GB:.2f} | {key} |'
            f' {row["median_s"]:.2f} | {row["gb_per_s"]:.2f} |'
            f' {row["gb_per_s"] / bound:.0%} |{extra}')


if __name__ == '__main__':
  main()
