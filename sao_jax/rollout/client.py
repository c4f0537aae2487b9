"""asyncio client for a pool of rollout servers: routing, bounds, retries.

JetStream never refuses load (requests pile up in its prefill queue), so the
client bounds the requests in flight per server and sends each new one to the
least-loaded live server. A server that fails a call with UNAVAILABLE (killed,
restarting, unreachable), misses a periodic health check, or is reported sick
by its owner (`mark_unhealthy`: a failed weight push, a dead process) is
marked dead and routed around; the request is re-sent from scratch to a live
one (up to `max_retries` times). A background monitor brings a dead server
back once its health check answers and the owner's `before_revive` hook (the
trainer's: make it serve the current weights) says it may take traffic. Every
outcome is counted.

Requests are token-in/token-out (`token_content`): the client sends prompt ids
and reads, per step, `[token, mu_t bits, version]` (see `wire`). It checks
prompt lengths itself because JetStream truncates over-long prompts silently.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import grpc
import numpy as np
# The protobuf messages alone import no JAX (unlike the rest of JetStream,
# which goes through `jetstream_compat`).
from jetstream.core.proto import jetstream_pb2 as pb

from sao_jax.rollout import wire

_log = logging.getLogger(__name__)

# Codes after which the same request may succeed on another server.
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN,
              grpc.StatusCode.INTERNAL)


class RequestFailed(Exception):
  """A request that did not complete; `reason` is a counter name."""

  def __init__(self, reason: str, message: str = ''):
    super().__init__(f'{reason}: {message}' if message else reason)
    self.reason = reason


@dataclasses.dataclass
class Sample:
  """One generated continuation and what the engine recorded for it."""
  tokens: list[int]
  logprobs: list[float]  # behaviour log-probs mu_t
  versions: list[int]  # policy version per token
  finish_reason: str  # 'stop' (ended on a stop token) or 'length'
  server: str = ''
  # int16 [tokens, R]: an MoE engine's experts per token (wire.RoutingLayout)
  experts: np.ndarray | None = None


class _Server:
  """Client-side state of one server."""

  def __init__(self, address: str, max_in_flight: int):
    self.address = address
    self.max_in_flight = max_in_flight
    self.in_flight = 0
    # Generator idleness as this client sees it: time with no request of
    # ours in flight on the server (a server one learner owns is then idle).
    self.idle_since = time.monotonic()
    self.idle_seconds = 0.0
    self.live = True
    # Set while the server is marked dead: its requests in flight stop
    # waiting (a hung server would hold them, and their admission slots,
    # until the request deadline) and go to another server.
    self.dead = asyncio.Event()
    self.channel = None
    self.decode = None
    self.health = None

  def connect(self):
    self.channel = grpc.aio.insecure_channel(self.address)
    self.decode = self.channel.unary_stream(
        '/jetstream_proto.Orchestrator/Decode',
        request_serializer=pb.DecodeRequest.SerializeToString,
        response_deserializer=pb.DecodeResponse.FromString)
    self.health = self.channel.unary_unary(
        '/jetstream_proto.Orchestrator/HealthCheck',
        request_serializer=pb.HealthCheckRequest.SerializeToString,
        response_deserializer=pb.HealthCheckResponse.FromString)


class _MarkedDead(Exception):
  """The server of a request in flight was marked dead meanwhile."""


class ServerPool:
  """Least-loaded routing over rollout servers, with bounds and retries.

  Create and use it inside one asyncio event loop.
  """

  def __init__(self, addresses: Sequence[str], *, max_in_flight_per_server=16,
               deadline_s=300.0, max_retries=3, stop_ids=(),
               max_prompt_length: int | None = None, probe_interval_s=1.0,
               health_timeout_s=5.0,
               before_revive: Callable[[str], Awaitable[bool]] | None = None,
               start_dead: bool = False,
               routing: wire.RoutingLayout = wire.RoutingLayout()):
    """Sets up the pool (connections open in `__aenter__`).

    Args:
      addresses: the servers, `host:port`.
      max_in_flight_per_server: requests in flight on one server at most.
      deadline_s: seconds one request may take, retries included.
      max_retries: re-sends after a retryable failure.
      stop_ids: token ids that end a generation ('stop' finish reason).
      max_prompt_length: longer prompts are refused here (JetStream would
        truncate them silently).
      probe_interval_s: how often every server's health is checked.
      health_timeout_s: a live server whose health check takes longer is
        marked dead (a hung or overloaded process).
      before_revive: awaited with the address of a dead server whose health
        check answers again; it returns whether the server may take traffic
        (the trainer's hook brings it to the current weights first).
      routing: how the servers' MoE routing records travel (the policy's
        `wire.RoutingLayout`; the default: a dense policy, none).
      start_dead: every server starts dead, so the first traffic waits for
        `before_revive` (servers that may serve stale weights).
    """
    if not addresses:
      raise ValueError('ServerPool needs at least one server address')
    self._servers = [_Server(a, max_in_flight_per_server) for a in addresses]
    for server in self._servers:
      server.live = not start_dead
    self._deadline_s = deadline_s
    self._max_retries = max_retries
    self._stop_ids = set(int(s) for s in stop_ids)
    self._routing = routing
    self._max_prompt_length = max_prompt_length
    self._probe_interval_s = probe_interval_s
    self._health_timeout_s = health_timeout_s
    self._before_revive = before_revive
    self._changed = None  # asyncio.Condition, created in the loop
    self._probe_task = None
    self.counters = collections.Counter()
    self._opened_at = time.monotonic()

  async def __aenter__(self):
    self._changed = asyncio.Condition()
    self._opened_at = time.monotonic()
    for server in self._servers:
      server.connect()
      server.idle_since, server.idle_seconds = self._opened_at, 0.0
    self._probe_task = asyncio.create_task(self._monitor())
    return self

  async def __aexit__(self, *exc):
    await self.close()

  async def close(self):
    if self._probe_task:
      self._probe_task.cancel()
      await asyncio.gather(self._probe_task, return_exceptions=True)
    for server in self._servers:
      if server.channel is not None:
        await server.channel.close()

  @property
  def live_servers(self) -> list[str]:
    return [s.address for s in self._servers if s.live]

  def in_flight(self) -> dict[str, int]:
    return {s.address: s.in_flight for s in self._servers}

  def generator_idle_fraction(self) -> float:
    """Share of server-time since the pool opened with nothing in flight.

    Averaged over the servers; a server idles while none of this pool's
    requests is on it (waiting for the learner's weights, for admission, or
    for an environment's tool call). Dead servers count from when they went
    quiet, so route-around does not flatter the figure.
    """
    now = time.monotonic()
    elapsed = now - self._opened_at
    if elapsed <= 0:
      return 0.0
    idle = sum(s.idle_seconds + (now - s.idle_since if s.in_flight == 0
                                 else 0.0) for s in self._servers)
    return idle / (elapsed * len(self._servers))

  async def _acquire(self, deadline: float) -> _Server:
    """The least-loaded live server with room; waits while all are busy."""
    async with self._changed:
      while True:
        ready = [s for s in self._servers
                 if s.live and s.in_flight < s.max_in_flight]
        if ready:
          server = min(ready, key=lambda s: s.in_flight)
          if server.in_flight == 0:
            server.idle_seconds += time.monotonic() - server.idle_since
          server.in_flight += 1
          return server
        remaining = deadline - time.monotonic()
        if remaining <= 0:
          raise RequestFailed('deadline_exceeded', 'no server had room')
        try:
          await asyncio.wait_for(self._changed.wait(), timeout=remaining)
        except asyncio.TimeoutError:
          pass

  async def _release(self, server: _Server, dead: bool = False):
    async with self._changed:
      server.in_flight -= 1
      if server.in_flight == 0:
        server.idle_since = time.monotonic()
      if dead:
        self._mark_dead(server, 'unavailable')
      self._changed.notify_all()

  def _mark_dead(self, server: _Server, why: str) -> None:
    if server.live:
      server.live = False
      server.dead.set()
      self.counters['server_marked_dead'] += 1
      self.counters[f'server_marked_dead/{why}'] += 1
      _log.warning('rollout server %s: %s; routing around it', server.address,
                   why)

  async def mark_unhealthy(self, address: str, why: str) -> None:
    """Routes around `address` until it answers and may be revived."""
    async with self._changed:
      for server in self._servers:
        if server.address == address:
          self._mark_dead(server, why)
      self._changed.notify_all()

  async def _monitor(self):
    """Health-checks every server each `probe_interval_s`: a live one that
    does not answer in time is marked dead; a dead one that answers is
    revived once `before_revive` agrees. A hook that fails is retried at the
    next probe."""
    # Servers that start dead are probed at once: they hold up all traffic.
    if all(s.live for s in self._servers):
      await asyncio.sleep(self._probe_interval_s)
    while True:
      await asyncio.gather(*(self._probe(s) for s in self._servers))
      await asyncio.sleep(self._probe_interval_s)

  async def _probe(self, server: _Server) -> None:
    try:
      response = await server.health(pb.HealthCheckRequest(),
                                     timeout=self._health_timeout_s)
      healthy = response.is_live
    except grpc.RpcError:
      healthy = False
    if not healthy:
      if server.live:
        async with self._changed:
          self._mark_dead(server, 'failed_health_check')
      return
    if server.live:
      return
    if self._before_revive is not None:
      try:
        if not await self._before_revive(server.address):
          return
      except Exception:  # pylint: disable=broad-except
        # A hook failure must not end the monitor; retry next probe.
        self.counters['revive_hook_errors'] += 1
        _log.exception('reviving rollout server %s failed', server.address)
        return
    async with self._changed:
      if not server.live:
        server.live = True
        server.dead = asyncio.Event()
        self.counters['server_revived'] += 1
        _log.info('rollout server %s is back', server.address)
      self._changed.notify_all()

  async def generate(self, prompt: Sequence[int], max_tokens: int
                     ) -> list[Sample]:
    """Generates from `prompt`: one Sample per sample of the server's slots.

    Raises:
      RequestFailed: with reason 'prompt_too_long', 'deadline_exceeded',
        'retries_exhausted' or the gRPC status name.
    """
    self.counters['requests'] += 1
    if max_tokens < 1:
      raise ValueError(f'max_tokens must be >= 1, got {max_tokens}')
    if self._max_prompt_length and len(prompt) > self._max_prompt_length:
      self.counters['prompt_too_long'] += 1
      raise RequestFailed('prompt_too_long',
                          f'{len(prompt)} > {self._max_prompt_length} tokens')
    deadline = time.monotonic() + self._deadline_s
    attempt = 0
    while True:
      server = await self._acquire(deadline)
      dead = False
      try:
        samples = await self._decode(server, prompt, max_tokens, deadline)
        self.counters['completed'] += 1
        self.counters['tokens'] += sum(len(s.tokens) for s in samples)
        return samples
      except _MarkedDead as e:
        attempt += 1
        self.counters['retried'] += 1
        self.counters['abandoned_on_sick_server'] += 1
        if attempt > self._max_retries:
          self.counters['retries_exhausted'] += 1
          raise RequestFailed('retries_exhausted', str(e)) from e
      except grpc.aio.AioRpcError as e:
        code = e.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
          self.counters['deadline_exceeded'] += 1
          raise RequestFailed('deadline_exceeded', server.address) from e
        if code not in _RETRYABLE:
          self.counters[f'failed_{code.name.lower()}'] += 1
          raise RequestFailed(code.name.lower(), e.details() or '') from e
        dead = True
        attempt += 1
        self.counters['retried'] += 1
        if attempt > self._max_retries:
          self.counters['retries_exhausted'] += 1
          raise RequestFailed('retries_exhausted', e.details() or '') from e
      finally:
        await self._release(server, dead=dead)

  async def _decode(self, server: _Server, prompt, max_tokens, deadline
                    ) -> list[Sample]:
    request = pb.DecodeRequest(
        token_content=pb.DecodeRequest.TokenContent(token_ids=list(prompt)),
        max_tokens=max_tokens)
    call = server.decode(request, timeout=max(deadline - time.monotonic(),
                                              0.001))
    reader = asyncio.ensure_future(self._read(server, call))
    dead = asyncio.ensure_future(server.dead.wait())
    try:
      done, _ = await asyncio.wait({reader, dead},
                                   return_when=asyncio.FIRST_COMPLETED)
    finally:
      dead.cancel()
      if not reader.done():
        reader.cancel()
        call.cancel()
    if reader not in done:
      raise _MarkedDead(f'{server.address} was marked dead')
    return reader.result()

  async def _read(self, server: _Server, call) -> list[Sample]:
    per_sample: list[list[tuple]] = []
    async for response in call:
      for i, sample in enumerate(response.stream_content.samples):
        while len(per_sample) <= i:
          per_sample.append([])
        if sample.token_ids:
          try:
            per_sample[i].append(wire.decode_step(sample.token_ids,
                                                  self._routing))
          except ValueError as e:
            # A dense server for an MoE policy (or the reverse): its steps
            # have another width. A failed request, not a dead worker.
            self.counters['bad_response'] += 1
            raise RequestFailed(
                'bad_response', f'{server.address}: a step of'
                f' {len(sample.token_ids)} ids, not a multiple of'
                f' {self._routing.width} (routing {self._routing})') from e
    results = []
    for steps in per_sample:
      tokens, logprobs, versions, experts = [], [], [], []
      for t, lp, v, e in steps:
        tokens += t
        logprobs += lp
        versions += v
        experts.append(e)
      if versions and versions[0] == wire.PROMPT_TOO_LONG:
        self.counters['prompt_too_long'] += 1
        raise RequestFailed('prompt_too_long', 'the server refused it')
      stopped = bool(tokens) and tokens[-1] in self._stop_ids
      records = (np.concatenate(experts) if self._routing.ids_per_token
                 and experts else None)
      results.append(Sample(tokens, logprobs, versions,
                            'stop' if stopped else 'length', server.address,
                            records))
    if not results or not any(r.tokens for r in results):
      self.counters['empty_response'] += 1
      raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None,
                                 details='empty response')
    return results
