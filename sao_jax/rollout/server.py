"""A JetStream gRPC server for our engine, plus the authenticated admin service.

One gRPC server on one port carries JetStream's unchanged `Orchestrator`
service (Decode, HealthCheck) and our `sao_jax.Admin` service (PushWeights,
UpdateWeights, Status). Unlike `jetstream.core.server_lib`, it binds without SO_REUSEPORT (so
a second server on a busy port fails loudly instead of silently sharing it),
listens on loopback unless told otherwise, and stops gracefully.

The admin service checks the secret before it looks at a request's bytes (an
unauthenticated caller learns nothing but UNAUTHENTICATED), then answers a
malformed request with INVALID_ARGUMENT. `PushWeights` receives a version's
parameters in buckets (`weight_stream`) over a data connection it admits by a
one-time token (`weight_socket`): nothing is read from the call before the
secret is checked, each bucket must arrive within the manifest's
`bucket_timeout_s`, and the version is swapped in only when every parameter
of every learner process's part arrived intact; decoding goes on meanwhile.
`UpdateWeights` loads only checkpoints under the server's `weights_root` (the
learner's `<workdir>/weights`): the secret lets a caller swap the model, not
read any file the server can.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import threading
import time
from concurrent import futures

import grpc
import jax

from sao_jax import process_memory
from sao_jax.rollout import engine as engine_lib
from sao_jax.rollout import host_buffers
from sao_jax.rollout import jetstream_compat
from sao_jax.rollout import weight_socket
from sao_jax.rollout import weight_staging
from sao_jax.rollout import weight_stream
from sao_jax.rollout import weight_sync

orchestrator = jetstream_compat.orchestrator
_log = logging.getLogger(__name__)


# Bounds on the per-bucket deadline a manifest may ask for.
_BUCKET_TIMEOUT_S = (0.1, 600.0)


class PortInUseError(RuntimeError):
  """The requested port could not be bound."""


def _close(conn) -> None:
  try:
    conn.shutdown(socket.SHUT_RDWR)
  except OSError:
    pass
  conn.close()


def weights_path(root: str, path: str) -> str | None:
  """`path` resolved (symlinks, `..`), if it lies in directory `root`.

  Returns:
    The real path to load (so that what was checked is what gets read), or
    None when `path` resolves outside `root`'s real path.
  """
  real_root = os.path.realpath(root)
  real = os.path.realpath(path)
  # commonpath compares whole components: '/a/bc' is not under '/a/b'.
  if os.path.commonpath([real_root, real]) != real_root:
    return None
  return real


@dataclasses.dataclass
class _Arriving:
  """A streamed version being received, and whether it was committed."""
  staging: weight_staging.Staging | None
  done: asyncio.Event
  committed: bool = False


class RolloutServer:
  """JetStream Orchestrator + Admin services around one `engine.Engine`."""

  def __init__(self, engine: engine_lib.Engine, *, port: int,
               secret: str, host: str = '127.0.0.1',
               threads: int | None = None, weights_root: str | None = None,
               data_port: int = 0, reuse_host_buffers: bool = False):
    """Starts serving on `host:port` (0: a free port, see `self.port`).

    Args:
      engine: the engine to serve.
      port: the port.
      secret: the admin secret.
      host: the bind address.
      threads: gRPC worker threads; default twice the decode slots, >= 16.
      weights_root: the directory `UpdateWeights` may load checkpoints from;
        None refuses every `UpdateWeights`.
      data_port: the port streamed pushes send their bytes to, on `host`
        (0: a free one; `self.data_port`).
      reuse_host_buffers: receive a streamed version into the host pages of
        one before it (`host_buffers.Pool`) instead of fresh ones, which
        must be faulted in. Costs one more copy of the weights resident
        between pushes: on a CPU server a version's pages are its device
        arrays, so the spare is the previous version's; on an accelerator,
        a host copy.
    """
    self.engine = engine
    self._secret = secret
    self._weights_root = weights_root
    self._swaps: list[float] = []
    # The streamed version being received (one at a time: a newer one
    # replaces an unfinished older one) and push outcomes.
    self._arriving: _Arriving | None = None
    # Per learner part, the id of the state its last committed push left
    # (the base a delta push must name; none after a checkpoint load).
    self._state_ids: dict[int, str] = {}
    self._push_counts = {'pushes_committed': 0, 'pushes_failed': 0}
    self.staging_pages = (host_buffers.Pool(max_bytes=sum(
        a.size * a.dtype.itemsize for a in jax.tree.leaves(
            engine.abstract_state()))) if reuse_host_buffers else None)
    try:
      self._data = weight_socket.Listener(host, data_port)
    except OSError as e:
      raise PortInUseError(f'cannot bind the weight data port'
                           f' {host}:{data_port}: {e}') from e
    self.data_port = self._data.port
    self._driver = orchestrator.Driver(
        prefill_engines=[engine], generate_engines=[engine],
        prefill_params=[None], generate_params=[None],
        interleaved_mode=True, jax_padding=False)
    workers = threads or max(engine.max_concurrent_decodes * 2, 16)
    self._executor = futures.ThreadPoolExecutor(max_workers=workers)
    self._loop = asyncio.new_event_loop()
    self._loop.set_default_executor(self._executor)
    self._thread = threading.Thread(target=self._loop.run_forever,
                                    name='grpc-loop', daemon=True)
    self._thread.start()
    self._stopped = False
    try:
      self.port = self._run(self._build(host, port))
    except BaseException:
      self._shutdown_driver_and_loop()
      raise

  def _run(self, coroutine):
    return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

  async def _build(self, host: str, port: int) -> int:
    # so_reuseport=0: JetStream's server lets two processes bind one port.
    self._server = grpc.aio.server(
        self._executor,
        options=[('grpc.so_reuseport', 0),
                 # A manifest lists every piece: a sharded 70B policy's
                 # runs to megabytes.
                 ('grpc.max_receive_message_length', 64 << 20)])
    jetstream_compat.jetstream_pb2_grpc.add_OrchestratorServicer_to_server(
        orchestrator.LLMOrchestrator(driver=self._driver), self._server)
    self._server.add_generic_rpc_handlers((self._admin_handler(),))
    try:
      bound = self._server.add_insecure_port(f'{host}:{port}')
    except RuntimeError as e:
      raise PortInUseError(f'cannot bind {host}:{port}: {e}') from e
    if bound == 0:
      raise PortInUseError(f'cannot bind {host}:{port} (in use?)')
    await self._server.start()
    _log.info('rollout server listening on %s:%d', host, bound)
    return bound

  # -- admin ------------------------------------------------------------------

  def _admin_handler(self):
    def unary(fn):
      # No request deserializer: the handler gets the raw bytes and decodes
      # them only after the secret is checked.
      return grpc.unary_unary_rpc_method_handler(
          fn, response_serializer=weight_sync._encode)  # pylint: disable=protected-access

    return grpc.method_handlers_generic_handler(weight_sync.SERVICE, {
        # Bidirectional: the data connection's token goes back mid-call.
        'PushWeights': grpc.stream_stream_rpc_method_handler(
            self._push_weights),
        'UpdateWeights': unary(self._update_weights),
        'Status': unary(self._status),
    })

  async def _admit(self, request: bytes, context) -> dict:
    """The decoded request of an authenticated caller; aborts otherwise."""
    if not weight_sync.authorized(context, self._secret):
      await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          'wrong or missing admin secret')
    try:
      return weight_sync._decode(request)  # pylint: disable=protected-access
    except ValueError as e:
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

  async def _push_weights(self, requests, context):
    """Receives one learner process's part of a version (see module doc).

    The call carries the manifest in, the data connection's port and token
    out, and at the end the verdict; the buckets arrive on the connection
    (`weight_socket`).
    """
    if not weight_sync.authorized(context, self._secret):
      # Before the first message is read: an unauthenticated peer gets
      # nothing stored and no token (gRPC's own window is all it can fill).
      await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          'wrong or missing admin secret')
    start = time.perf_counter()
    loop = asyncio.get_running_loop()
    arriving = token = receiving = conn = None
    try:
      header = weight_stream.parse_manifest(
          await asyncio.wait_for(requests.__anext__(), _BUCKET_TIMEOUT_S[1]))
      arriving = self._arriving_for(header)
      staging = arriving.staging
      stream = staging.begin(header)
      timeout = min(max(header['bucket_timeout_s'], _BUCKET_TIMEOUT_S[0]),
                    _BUCKET_TIMEOUT_S[1])
      token, connected = self._data.expect()
      await context.write(weight_sync._encode(  # pylint: disable=protected-access
          {'data_port': self._data.port, 'token': token.hex()}))
      conn = await asyncio.wait_for(asyncio.wrap_future(connected), timeout)
      # The reads off the loop (Decode streams share it).
      receiving = loop.run_in_executor(None, weight_socket.receive_frames,
                                       conn, staging, stream, timeout)
      await receiving
      # Received and checked; applied only when the learner confirms that
      # it still wants it (it may have given up while we were stalled).
      await context.write(weight_sync._encode(  # pylint: disable=protected-access
          {'received': stream.received}))
      confirm = weight_sync._decode(  # pylint: disable=protected-access
          await asyncio.wait_for(requests.__anext__(), timeout))
      if confirm.get('commit') != staging.version:
        raise weight_stream.StreamError(f'expected the commit of version'
                                        f' {staging.version}, got {confirm}')
      if arriving.done.is_set():
        raise weight_stream.StreamError(f'version {staging.version} was'
                                        ' replaced by a newer push')
      staging.end(stream, header['part'])
      if staging.complete:
        state = await loop.run_in_executor(None, staging.state)
        if arriving.done.is_set():  # replaced while it was assembled
          raise weight_stream.StreamError(f'version {staging.version} was'
                                          ' replaced by a newer push')
        self.engine.weights.swap(state, staging.version)
        self._state_ids = {part: i for part, i in staging.state_ids.items()
                           if i is not None}
        del state
        if self.staging_pages is not None:
          host_buffers.settle()  # the last version's pages, to the pool
        self._finish(arriving, committed=True)
        process_memory.return_free_pages()
        seconds = time.perf_counter() - start
        self._swaps.append(seconds)
        _log.info('now serving policy version %d (streamed %.1f MB in'
                  ' %.3f s)', staging.version, staging.bytes / 1e6, seconds)
      else:
        # Another process's part is still on its way: answer once the
        # version commits or is given up.
        remaining = context.time_remaining()
        await asyncio.wait_for(arriving.done.wait(), remaining)
        if not arriving.committed:
          raise weight_stream.StreamError(
              f'version {staging.version} did not complete:'
              f' {len(staging.missing())} parameters missing')
      await context.write(weight_sync._encode(  # pylint: disable=protected-access
          {'version': staging.version, 'committed': True,
           'bytes': stream.received, 'seconds': time.perf_counter() - start}))
    except StopAsyncIteration:
      self._fail(arriving, 'the call ended before its manifest or commit')
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          'PushWeights: the call ended before its manifest'
                          ' or its commit')
    except asyncio.TimeoutError:
      self._fail(arriving, 'the data connection or the commit did not'
                 ' arrive in time')
      await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                          'PushWeights: the data connection or the commit'
                          ' did not arrive in time')
    except ValueError as e:  # a commit message that is not JSON
      self._fail(arriving, str(e))
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f'PushWeights: {e}')
    except weight_stream.StreamError as e:
      self._fail(arriving, str(e))
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f'PushWeights: {e}')
    except asyncio.CancelledError:
      # The caller went away mid-stream (killed, cancelled).
      self._fail(arriving, 'the caller cancelled the stream')
      raise
    finally:
      if token is not None:
        self._data.forget(token)
      if conn is not None:
        # Unblocks a read still in flight; never two writers on a staging:
        # it is dropped only once that read gave up.
        _close(conn)
      if receiving is not None and not receiving.done():
        await asyncio.wait([receiving])

  def _arriving_for(self, header: dict) -> '_Arriving':
    """The version being received; a push of another version replaces an
    unfinished one (the learner moved on, or restarted)."""
    version = header['version']
    current = self._arriving
    if current is None or current.staging.version != version:
      if current is not None:
        self._fail(current, f'replaced by version {version}')
      self._arriving = _Arriving(
          weight_staging.Staging(self.engine.abstract_state(), version,
                                header['parts'],
                                served=self.engine.weights.get()[0],
                                served_ids=self._state_ids,
                                pool=self.staging_pages),
          asyncio.Event())
    return self._arriving

  def _finish(self, arriving: '_Arriving', committed: bool) -> None:
    if arriving.done.is_set():
      return
    arriving.committed = committed
    arriving.done.set()
    if self._arriving is arriving:
      self._arriving = None
    self._push_counts['pushes_committed' if committed
                      else 'pushes_failed'] += 1

  def _fail(self, arriving: '_Arriving | None', why: str) -> None:
    if arriving is None or arriving.done.is_set():
      return
    _log.warning('weight push of version %d dropped: %s',
                 arriving.staging.version, why)
    self._finish(arriving, committed=False)
    # Its device copies go with it; give their pages back now.
    arriving.staging = None
    process_memory.return_free_pages()

  async def _update_weights(self, request, context):
    request = await self._admit(request, context)
    path, version = request.get('path'), request.get('version')
    # bool is an int to isinstance; a version of True is a caller's bug.
    if (not isinstance(path, str) or not path or isinstance(version, bool)
        or not isinstance(version, int) or version < 0):
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          'UpdateWeights needs {"path": str, "version": int'
                          ' >= 0}')
    if self._weights_root is None:
      await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          'this server was started without --weights_root:'
                          ' it loads no pushed weights')
    real = weights_path(self._weights_root, path)
    if real is None:
      await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f'{path} is not under the weights root'
                          f' {self._weights_root}')
    start = time.perf_counter()
    loop = asyncio.get_running_loop()
    try:
      state = await loop.run_in_executor(
          None, weight_sync.load_policy, real, self.engine.abstract_state())
    except Exception as e:  # pylint: disable=broad-except
      _log.exception('loading weights from %s failed', real)
      await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f'cannot load {path}: {e}')
    self.engine.weights.swap(state, version)
    self._state_ids = {}  # a checkpoint is no delta's base
    del state
    # The restore's staging buffers, freed by orbax's threads, would stay
    # resident in their arenas until the next push.
    process_memory.return_free_pages()
    seconds = time.perf_counter() - start
    self._swaps.append(seconds)
    _log.info('now serving policy version %d (loaded in %.3f s)', version,
              seconds)
    return {'version': version, 'seconds': seconds}

  async def _status(self, request, context):
    await self._admit(request, context)
    cfg = self.engine.config
    return {
        'version': self.engine.version,
        'swaps': len(self._swaps),
        **self._push_counts,
        # Connections to the weight data port without a valid token.
        'data_connections_refused': self._data.refused,
        # Longest gap between two decode steps across a version change,
        # and the serving weights' dtype (what a streamed push sends).
        'swap_pauses': self.engine.swap_pauses(),
        'last_swap_seconds': self._swaps[-1] if self._swaps else None,
        'max_concurrent_decodes': cfg.max_concurrent_decodes,
        'samples_per_slot': cfg.samples_per_slot,
        'max_prefill_length': cfg.max_prefill_length,
        'max_target_length': cfg.max_target_length,
        # The distribution mu_t is drawn from, for the learner to compare
        # with its own (a mismatch skews every importance ratio silently).
        'temperature': cfg.sampling.temperature,
        'top_k': cfg.sampling.top_k,
        'top_p': cfg.sampling.top_p,
        'generate_loop_restarts': jetstream_compat.GENERATE_LOOP_RESTARTS,
        # Prefill work saved by keeping finished rows' keys/values.
        'prefix_cache': self.engine.prefill_status(),
        'live': self._driver.live,
    }

  # -- lifecycle --------------------------------------------------------------

  def stop(self, grace_s: float = 5.0) -> None:
    """Stops accepting calls, lets running ones finish for `grace_s`, exits."""
    if self._stopped:
      return
    self._stopped = True
    try:
      self._run(self._server.stop(grace=grace_s))
    finally:
      self._shutdown_driver_and_loop()

  def _shutdown_driver_and_loop(self):
    self._data.close()
    self._driver.stop()
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._thread.join(timeout=10)
    self._executor.shutdown(wait=False, cancel_futures=True)
