"""Moving policy weights from the learner to rollout servers.

Two transports (`TRANSPORTS`, chosen by `config.rollout.weight_transport`),
both started by a call to the admin gRPC service, authenticated by a shared
secret:

- `stream` (the default): the learner copies its parameters to the host in
  the servers' dtype and streams them in size-bounded, checksummed buckets
  (`weight_stream`) straight into each server's device arrays; no file on
  either side. The admin call authenticates the push and carries the
  manifest and the verdict; the bytes go over a TCP connection it hands out
  a one-time token for (`weight_socket`). On a multi-host learner every
  process sends the shards it holds, and a server commits the version once
  all parts arrived.
  With `rollout.weight_delta = 'sparse'` a server that acknowledged the
  last version gets only the elements that changed since (`weight_delta`).
- `files`: the learner writes an orbax checkpoint and tells every server
  (`UpdateWeights`) its path; each restores it with its own shardings. For
  servers that share storage with the learner but have no network path to
  it that carries the weights.

Either way a server swaps atomically between decode steps, and a version is
acknowledged only once a server serves it.

The admin service uses JSON messages over gRPC generic handlers: no generated
protobuf code to keep in sync, and nothing the JetStream protocol needs to
know about.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Sequence
from typing import Any

import grpc
import jax
import orbax.checkpoint as ocp
from flax import nnx

from sao_jax import errors
from sao_jax.rollout import host_buffers
from sao_jax.rollout import weight_delta
from sao_jax.rollout import weight_socket
from sao_jax.rollout import weight_stream

SERVICE = 'sao_jax.Admin'
SECRET_ENV = 'SAO_ADMIN_SECRET'
SECRET_HEADER = 'x-sao-admin-secret'

_log = logging.getLogger(__name__)


def _encode(message: dict) -> bytes:
  return json.dumps(message).encode()


def _decode(data: bytes) -> dict:
  """A message: a JSON object (empty bytes: `{}`).

  Raises:
    ValueError: with a short reason, for bytes that are not a JSON object.
  """
  if not data:
    return {}
  try:
    message = json.loads(data.decode())
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError('the message is not JSON') from e
  if not isinstance(message, dict):
    raise ValueError(f'the message is a JSON {type(message).__name__}, not an'
                     ' object')
  return message


def method(name: str) -> str:
  return f'/{SERVICE}/{name}'


def read_secret(secret_file: str | None = None) -> str:
  """The admin secret from a file or the `SAO_ADMIN_SECRET` variable.

  Surrounding whitespace is dropped, from either source: a secret written by
  `echo` or pasted with its newline is the same secret.

  Raises:
    errors.UserError: when neither is set (the admin service never runs
      open), the file cannot be read, or the secret is shorter than 16
      characters.
  """
  if secret_file:
    try:
      with open(secret_file) as f:
        secret = f.read().strip()
    except OSError as e:
      raise errors.UserError(f'cannot read the admin secret file'
                             f' {secret_file}: {e.strerror or e}') from e
    where = f'the admin secret file {secret_file}'
  else:
    secret = os.environ.get(SECRET_ENV, '').strip()
    where = f'${SECRET_ENV}'
  if not secret:
    raise errors.UserError(
        f'no admin secret: set ${SECRET_ENV} or'
        ' config.rollout.admin_secret_file (at least 16 characters; the'
        ' servers and the learner share it)')
  if len(secret) < 16:
    raise errors.UserError(
        f'the admin secret in {where} has {len(secret)} characters; it needs'
        ' at least 16: anyone who can reach the port could otherwise replace'
        ' the model')
  return secret


def authorized(context, secret: str) -> bool:
  """Constant-time check of the secret in the call's metadata."""
  sent = dict(context.invocation_metadata() or ()).get(SECRET_HEADER, '')
  if isinstance(sent, str):
    sent = sent.encode()
  return hmac.compare_digest(sent, secret.encode())


# -- checkpoints --------------------------------------------------------------


def save_policy(path: str, model_or_state) -> None:
  """Writes policy parameters as an orbax checkpoint at `path`.

  The directory appears complete or not at all (orbax writes to a temporary
  name and renames), so a server never reads a half-written checkpoint. One
  already at `path` is replaced: a resumed or extended run writes the version
  it starts at again (that of the previous run is not known to be complete,
  nor equal: a SIGKILL may have hit after the push, before the checkpoint).
  """
  state = (nnx.state(model_or_state, nnx.Param)
           if isinstance(model_or_state, nnx.Module) else model_or_state)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.path.abspath(path), nnx.to_pure_dict(state),
                    force=True)
  checkpointer.wait_until_finished()


def load_policy(path: str, abstract_state):
  """Restores `save_policy`'s checkpoint into the shapes/shardings given.

  Args:
    path: the checkpoint directory.
    abstract_state: an nnx State of `jax.ShapeDtypeStruct`s with shardings
      (`Engine.abstract_state()`), which says where each array goes.

  Returns:
    The restored nnx State.
  """
  target = nnx.to_pure_dict(abstract_state)
  restored = ocp.StandardCheckpointer().restore(os.path.abspath(path), target)
  state = jax.tree.map(lambda x: x, abstract_state)  # a structural copy
  nnx.replace_by_pure_dict(state, restored)
  return state


# -- transports ---------------------------------------------------------------


class FileTransport:
  """A version is an orbax checkpoint under `weights_dir`; servers load it."""

  parts = 1
  overlaps = False  # the learner waits for the servers' loads

  @classmethod
  def from_config(cls, rollout, *, weights_dir: str, dtype: str, part: int,
                  parts: int) -> 'FileTransport':
    """The transport `rollout.weight_transport = 'files'` names (orbax
    writes a multi-host learner's shards from each process itself)."""
    del rollout, dtype, part, parts
    return cls(weights_dir)

  def __init__(self, weights_dir: str | None = None):
    """`weights_dir`: where `prepare` writes (None: paths are given)."""
    self._weights_dir = weights_dir
    if weights_dir is not None:
      os.makedirs(weights_dir, exist_ok=True)
    self.sent_bytes: dict[str, int] = {}  # a server reads what it needs
    self.version_bytes = 0

  def prepare(self, policy_state, version: int) -> str:
    """Writes `version` (a resume writes the version it starts at again)."""
    if self._weights_dir is None:
      raise ValueError('this FileTransport has no weights_dir to write to')
    path = os.path.join(self._weights_dir, f'v{version}')
    save_policy(path, policy_state)
    return os.path.abspath(path)

  def wait(self, prepared: str) -> None:
    del prepared  # written by `prepare` itself

  def retire(self, version: int) -> None:
    """Deletes the checkpoints of versions before `version`."""
    for old in os.listdir(self._weights_dir):
      if old != f'v{version}':
        shutil.rmtree(os.path.join(self._weights_dir, old),
                      ignore_errors=True)

  async def send(self, publisher: 'WeightPublisher', address: str,
                 path: str, version: int) -> None:
    await publisher.call(address, 'UpdateWeights',
                         {'path': os.path.abspath(path), 'version': version},
                         publisher.push_timeout_s)


class StreamTransport:
  """A version is this process's pieces on the host, streamed to servers."""

  overlaps = True  # a push runs on during the learner's next step

  @classmethod
  def from_config(cls, rollout, *, weights_dir: str, dtype: str, part: int,
                  parts: int) -> 'StreamTransport':
    """The transport `rollout.weight_transport = 'stream'` names."""
    del weights_dir
    encoder = weight_delta.ENCODERS[rollout.weight_delta](
        rtol=rollout.weight_delta_rtol,
        anchor_every=rollout.weight_delta_anchor_every)
    return cls(dtype=dtype,
               bucket_bytes=int(rollout.weight_bucket_mib * (1 << 20)),
               checksum=rollout.weight_checksum,
               bucket_timeout_s=rollout.weight_bucket_timeout_s, part=part,
               parts=parts, encoder=encoder,
               reuse_host_buffers=rollout.weight_reuse_host_buffers)

  def __init__(self, *, dtype: str = '', bucket_bytes: int =
               weight_stream.DEFAULT_BUCKET_BYTES,
               bucket_timeout_s: float = 30.0, part: int = 0, parts: int = 1,
               checksum: str = 'sum64',
               encoder: weight_delta.Encoder | None = None,
               reuse_host_buffers: bool = False):
    """Sets up the transport.

    Args:
      dtype: the servers' parameter dtype, converted to here ('' as is).
      bucket_bytes: the most one message carries.
      checksum: each bucket's, a name of `checksums.CHECKSUMS`.
      bucket_timeout_s: how long either side waits for one bucket.
      part: this learner process's index; parts: how many send each version.
      encoder: sends a server that acknowledged the last version only what
        changed since (`weight_delta`); None: every version whole.
      reuse_host_buffers: copy each version into the host buffers of one
        no longer held (`host_buffers.Pool`; one more copy kept between
        pushes); False: fresh pages each time.
    """
    self._dtype = dtype
    self._bucket_bytes = bucket_bytes
    self._bucket_timeout_s = bucket_timeout_s
    self._checksum = checksum
    self._encoder = encoder
    self.part, self.parts = part, parts
    # Payload bytes of the last push to each server, and a whole version's.
    self.sent_bytes: dict[str, int] = {}
    self.version_bytes = 0
    # The state id each server committed from this process's last push to
    # it: a delta goes only onto a state this process itself left there.
    self._holds: dict[str, str | None] = {}
    # Host buffers of versions no longer held, for the next copy (or None).
    self.pool = host_buffers.Pool() if reuse_host_buffers else None

  def prepare(self, policy_state, version: int) -> weight_stream.HostCopy:
    """Starts copying this process's pieces to the host; a push may start
    at once and sends each piece as it arrives there."""
    if self._encoder is not None:
      self._encoder.begin(version)
    prepared = weight_stream.HostCopy(policy_state, self._dtype,
                                      self._encoder, self.pool)
    self.version_bytes = prepared.total_bytes
    if self.pool is not None:  # one version's buffers wait for the next
      self.pool.max_bytes = max(self.pool.max_bytes, prepared.total_bytes)
    return prepared

  def wait(self, prepared: weight_stream.HostCopy) -> None:
    """Returns once the copy is complete: from then on the learner may
    donate the arrays it was made from."""
    prepared.pieces()

  def retire(self, version: int) -> None:
    del version  # nothing kept but the current pieces

  def manifest(self, pieces, version: int, *, state_id: str | None = None,
               base_id: str | None = None) -> bytes:
    return weight_stream.manifest(
        pieces, version=version, part=self.part, parts=self.parts,
        bucket_bytes=self._bucket_bytes,
        bucket_timeout_s=self._bucket_timeout_s, checksum=self._checksum,
        state_id=state_id, base_id=base_id)

  def frames(self, pieces, version: int):
    """The buckets of one push (`weight_stream.frames`)."""
    del version
    return weight_stream.frames(pieces, self._bucket_bytes, self._checksum)

  async def _what_to_send(self, publisher: 'WeightPublisher', address: str,
                          prepared: weight_stream.HostCopy, version: int):
    """(manifest, pieces) for `address`: the sparse delta where it
    acknowledged the version it is against, else the whole version
    (`prepared` may also be a list of pieces: sent whole)."""
    if not isinstance(prepared, weight_stream.HostCopy):
      return self.manifest(prepared, version), prepared
    # Both: the publisher forgets what a server acknowledged once it
    # restarted; the id tells this process's states from another run's.
    if (prepared.base is not None
        and publisher.acked.get(address) == prepared.base[1]
        and self._holds.get(address) == prepared.base[0]):
      # Known only once every piece was compared (a delta is small: its
      # transfer is short next to the copy it waits for).
      deltas = await asyncio.get_running_loop().run_in_executor(
          None, prepared.deltas)
      return self.manifest(deltas, version, state_id=prepared.state_id,
                           base_id=prepared.base[0]), deltas
    return self.manifest(prepared, version,
                         state_id=prepared.state_id), prepared

  async def send(self, publisher: 'WeightPublisher', address: str,
                 pieces: weight_stream.HostCopy, version: int) -> None:
    """Streams `version` to `address`.

    The admin call sends the manifest and gets the data connection's token;
    the buckets go over that connection (`weight_socket`); the call's last
    message is the server's verdict. Every socket write has
    `bucket_timeout_s` and the whole call `push_timeout_s`; meanwhile the
    server must answer a health check every `health_timeout_s`, so a hung
    server (e.g. SIGSTOP, while our bytes sit in a socket buffer) fails the
    push within about twice that, not at the push deadline.
    """
    async with grpc.aio.insecure_channel(address) as channel:
      call = channel.stream_stream(method('PushWeights'),
                                   request_serializer=bytes,
                                   response_deserializer=_decode)(
          metadata=((SECRET_HEADER, publisher.secret),),
          timeout=publisher.push_timeout_s)
      conn = []  # the data connection, once open (closed to stop a write)
      stream = asyncio.ensure_future(
          self._stream(publisher, call, address, pieces, version, conn))
      watchdog = asyncio.ensure_future(publisher.watch(address))
      try:
        await asyncio.wait((stream, watchdog),
                           return_when=asyncio.FIRST_COMPLETED)
        if not stream.done():
          call.cancel()
          for c in conn:
            _shut(c)
          watchdog.result()  # raises why the server was given up
        await stream
      finally:
        for task in (stream, watchdog):
          task.cancel()
        call.cancel()
        for c in conn:
          _shut(c)

  async def _stream(self, publisher, call, address, prepared, version,
                    conn) -> None:
    loop = asyncio.get_running_loop()
    header, pieces = await self._what_to_send(publisher, address, prepared,
                                              version)
    self.sent_bytes.pop(address, None)
    self._holds.pop(address, None)  # until this push commits
    await call.write(header)
    offer = await call.read()  # a failed call raises its status here
    if offer is grpc.aio.EOF:
      raise ConnectionError(f'{address} ended the push without a data'
                            ' connection')
    host = address.rsplit(':', 1)[0].strip('[]')
    try:
      token = bytes.fromhex(offer['token'])
      port = int(offer['data_port'])
    except (KeyError, TypeError, ValueError) as e:
      raise ConnectionError(f'{address} offered no data connection:'
                            f' {offer!r}') from e
    try:
      # Connecting, checksumming and writing off the loop (the workers'
      # episodes share it); the kernel copies straight from the pieces.
      sock = await loop.run_in_executor(
          None, weight_socket.connect, host, port, token,
          self._bucket_timeout_s)
      conn.append(sock)
      await loop.run_in_executor(None, weight_socket.send_frames, sock,
                                 self.frames(pieces, version))
    except socket.timeout as e:
      raise asyncio.TimeoutError(
          f'{address} took no weight bytes for {self._bucket_timeout_s:g}'
          ' s') from e
    except OSError:
      # The server ended the push (a failed check closes the connection):
      # its status says why; a dead server's call fails on its own.
      pass
    # All bytes arrived and passed their checks (or the read raises the
    # server's status). The server commits only on our word: a push this
    # side gave up on (its deadline passed while the server was stopped with
    # our bytes in its socket buffer) is never applied behind our back.
    for step in ('received', 'committed'):
      answer = await call.read()
      if answer is grpc.aio.EOF:
        raise ConnectionError(f'{address} ended the push before it'
                              f' {step} it')
      if step == 'received':
        await call.write(_encode({'commit': version}))
    self.sent_bytes[address] = (
        pieces.total_bytes if isinstance(pieces, weight_stream.HostCopy)
        else sum(p.data.nbytes for p in pieces))
    self._holds[address] = (prepared.state_id if isinstance(
        prepared, weight_stream.HostCopy) else None)


def _shut(sock) -> None:
  try:
    sock.shutdown(socket.SHUT_RDWR)
  except OSError:
    pass
  sock.close()


# By `config.rollout.weight_transport`; each builds itself `from_config`.
TRANSPORTS = {'stream': StreamTransport, 'files': FileTransport}


# -- the learner's side -------------------------------------------------------


@dataclasses.dataclass
class PushResult:
  """Outcome of one weight push to the servers it was sent to."""
  version: int
  seconds: float
  updated: list[str]
  failed: dict[str, str]


class ServerUnresponsive(RuntimeError):
  """A server stopped answering while a push to it was in flight."""


class SettingsMismatch(ValueError):
  """A server samples differently from what the learner assumes."""


# Sampling settings a server reports in `Status` that must equal the
# learner's: the DIS ratio pi/mu divides by the server's mu_t, so a different
# temperature or truncation shifts every ratio without any error.
SAMPLING_KEYS = ('temperature', 'top_k', 'top_p')


class WeightPublisher:
  """Makes rollout servers serve the learner's current policy version.

  Keeps the current version (what its transport prepared: a checkpoint path
  or the host pieces) and, per server, the newest version that server
  acknowledged. A push goes to the servers the caller names (the live ones);
  each gets `health_timeout_s` to answer a health check and then
  `push_timeout_s` to load, so a hung server costs the push at most those
  and never blocks the others. A server that failed is brought up to date
  later by `catch_up` (the server pool calls it before routing traffic to a
  revived server), which also checks its sampling settings.
  `rollout_version(live)` is the minimum the live servers acknowledged: the
  version the queue may assume new rollouts start from.
  """

  def __init__(self, addresses: Sequence[str], secret: str, *,
               transport=None, push_timeout_s: float = 300.0, health_timeout_s: float = 5.0,
               sampling: dict | None = None):
    """Sets up the publisher; nothing is sent yet.

    Args:
      addresses: the servers, `host:port`.
      secret: the admin secret.
      transport: one of `TRANSPORTS`' values (default: files at the paths
        `push` is given).
      push_timeout_s: seconds one server may take to receive one version.
      health_timeout_s: seconds a server may take to answer a health check.
      sampling: the learner's sampling settings (`SAMPLING_KEYS`); when given,
        `catch_up` refuses a server that reports different ones.
    """
    self.addresses = list(addresses)
    self.secret = secret
    self.transport = FileTransport() if transport is None else transport
    self.push_timeout_s = push_timeout_s
    self._health_timeout_s = health_timeout_s
    self._sampling = dict(sampling) if sampling is not None else None
    self.current: tuple[Any, int] | None = None  # (prepared, version)
    self.acked: dict[str, int] = {}
    self.counters: dict[str, int] = {'pushes_failed': 0, 'catch_ups': 0,
                                     'catch_ups_failed': 0}
    # A settings mismatch found by `catch_up` (in the pool's monitor); the
    # trainer raises it in its own thread.
    self.mismatch: SettingsMismatch | None = None
    # Each server's prefill counters (`Status['prefix_cache']`) and decode
    # pauses at swaps (`Status['swap_pauses']`), as of the last health
    # check this publisher made.
    self.prefill_counters: dict[str, dict] = {}
    self.swap_pauses: dict[str, dict] = {}

  def _record(self, address: str, status) -> None:
    if not isinstance(status, dict):
      return
    if isinstance(status.get('prefix_cache'), dict):
      self.prefill_counters[address] = status['prefix_cache']
    if isinstance(status.get('swap_pauses'), dict):
      self.swap_pauses[address] = status['swap_pauses']

  def prefill_metrics(self) -> dict[str, float]:
    """Prefill work over the servers: tokens prefilled, tokens whose keys
    and values a kept row supplied, and prefilled per generated token."""
    totals = {k: sum(float(c.get(k) or 0) for c in
                     self.prefill_counters.values())
              for k in ('prefilled_tokens', 'reused_tokens',
                        'generated_tokens')}
    if not self.prefill_counters:
      return {}
    return {'prefilled_tokens': totals['prefilled_tokens'],
            'prefix_reused_tokens': totals['reused_tokens'],
            'prefilled_tokens_per_generated_token': (
                totals['prefilled_tokens'] / totals['generated_tokens']
                if totals['generated_tokens'] else 0.0)}

  def pause_metrics(self) -> dict[str, float]:
    """The largest decode pause at a swap over the servers (seconds)."""
    pauses = [p['max_s'] for p in self.swap_pauses.values()
              if isinstance(p.get('max_s'), (int, float))]
    return {'server_swap_pause_max_seconds': max(pauses)} if pauses else {}

  def set_current(self, prepared, version: int) -> None:
    """Records what the transport prepared for `version`, without sending
    it anywhere."""
    self.current = (prepared, int(version))

  async def watch(self, address: str) -> None:
    """Returns only by raising: when `address` misses a health check (one
    every `health_timeout_s`, each given as long). Run beside a long call to
    the same server."""
    while True:
      await asyncio.sleep(self._health_timeout_s)
      try:
        await self.call(address, 'Status', {}, self._health_timeout_s)
      except grpc.RpcError as e:
        raise ServerUnresponsive(
            f'{address} missed a health check during the push:'
            f' {_describe(e)}') from e

  async def call(self, address, name, message, timeout):
    """One unary admin call (JSON in, JSON out) with the secret."""
    async with grpc.aio.insecure_channel(address) as channel:
      call = channel.unary_unary(method(name), request_serializer=_encode,
                                 response_deserializer=_decode)
      return await call(message, metadata=((SECRET_HEADER, self.secret),),
                        timeout=timeout)

  async def _load(self, address: str) -> int:
    """Health check, then the transport's send of the current version."""
    prepared, version = self.current
    self._record(address, await self.call(address, 'Status', {},
                                          self._health_timeout_s))
    await self.transport.send(self, address, prepared, version)
    # Acknowledgements only move forward: a slow load of an older version
    # must not undo a newer one's.
    self.acked[address] = max(version, self.acked.get(address, version))
    return version

  async def push(self, prepared, version: int,
                 addresses: Sequence[str] | None = None) -> PushResult:
    """Makes `version` current and pushes it concurrently.

    Args:
      prepared: what `transport.prepare` made of the version.
      version: its policy version.
      addresses: where to push (the live servers); default all.

    A server that fails (dead, hung, refused) is reported, not raised: the
    others serve the new version, and the caller routes around the failed
    ones until `catch_up` succeeds.
    """
    self.set_current(prepared, version)
    targets = self.addresses if addresses is None else list(addresses)
    start = time.perf_counter()
    results = await asyncio.gather(*(self._load(a) for a in targets),
                                   return_exceptions=True)
    updated, failed = [], {}
    for address, result in zip(targets, results):
      if isinstance(result, BaseException):
        failed[address] = _describe(result)
      else:
        updated.append(address)
    self.counters['pushes_failed'] += len(failed)
    if failed:
      _log.warning('weight push of version %d failed on %s', version, failed)
    return PushResult(version, time.perf_counter() - start, updated, failed)

  async def catch_up(self, address: str) -> bool:
    """Readies a server for traffic: same sampling, current weights.

    Returns:
      True once `address` serves the current version (loaded now if it was
      behind, e.g. restarted with the model source's weights); False if it
      could not (retried at the next call) or samples differently (recorded
      in `mismatch` for the trainer to raise).
    """
    try:
      status = await self.call(address, 'Status', {}, self._health_timeout_s)
    except grpc.RpcError:
      return False
    self._record(address, status)
    if self._sampling is not None:
      theirs = {k: status.get(k) for k in SAMPLING_KEYS}
      if any(_differs(theirs[k], self._sampling[k]) for k in SAMPLING_KEYS):
        self.mismatch = SettingsMismatch(
            f'rollout server {address} samples with'
            f' {_settings(theirs)} but the learner assumes'
            f' {_settings(self._sampling)}: every importance ratio would be'
            ' off; start the servers with the same config.rollout settings')
        return False
    if self.current is None or status.get('version') == self.current[1]:
      if self.current is not None:
        self.acked[address] = self.current[1]
      return True
    if self.transport.parts > 1:
      # Every learner process holds a part of the weights: a lone process
      # cannot send them; the next push (to every server) brings it up.
      return False
    self.counters['catch_ups'] += 1
    # What it acknowledged before (it restarted since) no longer holds.
    self.acked.pop(address, None)
    try:
      # A push may make a newer version current while this one loads.
      while self.acked.get(address) != self.current[1]:
        await self._load(address)
    except (grpc.RpcError, asyncio.TimeoutError, OSError,
            ServerUnresponsive) as e:
      self.counters['catch_ups_failed'] += 1
      _log.warning('bringing rollout server %s to version %d failed: %s',
                   address, self.current[1], _describe(e))
      return False
    _log.info('rollout server %s caught up to version %d', address,
              self.current[1])
    return True

  def rollout_version(self, live: Sequence[str]) -> int | None:
    """The minimum version the `live` servers acknowledged (None: none)."""
    versions = [self.acked[a] for a in live if a in self.acked]
    return min(versions) if versions else None


def _describe(error: BaseException) -> str:
  if isinstance(error, grpc.RpcError):
    return error.code().name
  return repr(error)


def _differs(theirs, ours) -> bool:
  try:
    return abs(float(theirs) - float(ours)) > 1e-6
  except (TypeError, ValueError):
    return True


def _settings(values: dict) -> str:
  return ', '.join(f'{k}={values.get(k)}' for k in SAMPLING_KEYS)


async def server_status(address: str, secret: str,
                        timeout_s: float = 10.0) -> dict:
  """The admin `Status` of one server (version, swap timings, engine shape)."""
  async with grpc.aio.insecure_channel(address) as channel:
    call = channel.unary_unary(method('Status'), request_serializer=_encode,
                               response_deserializer=_decode)
    return await call({}, metadata=((SECRET_HEADER, secret),),
                      timeout=timeout_s)
