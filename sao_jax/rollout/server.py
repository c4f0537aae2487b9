"""A JetStream gRPC server for our engine, plus the authenticated admin service.

One gRPC server on one port carries JetStream's unchanged `Orchestrator`
service (Decode, HealthCheck) and our `sao_jax.Admin` service (UpdateWeights,
Status). Unlike `jetstream.core.server_lib`, it binds without SO_REUSEPORT (so
a second server on a busy port fails loudly instead of silently sharing it),
listens on loopback unless told otherwise, and stops gracefully.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent import futures

import grpc

from sao_jax.rollout import engine as engine_lib
from sao_jax.rollout import jetstream_compat
from sao_jax.rollout import weight_sync

orchestrator = jetstream_compat.orchestrator
_log = logging.getLogger(__name__)


class PortInUseError(RuntimeError):
  """The requested port could not be bound."""


class RolloutServer:
  """JetStream Orchestrator + Admin services around one `engine.Engine`."""

  def __init__(self, engine: engine_lib.Engine, *, port: int,
               secret: str, host: str = '127.0.0.1',
               threads: int | None = None):
    self.engine = engine
    self._secret = secret
    self._swaps: list[float] = []
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
    self._server = grpc.aio.server(self._executor,
                                   options=[('grpc.so_reuseport', 0)])
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
      return grpc.unary_unary_rpc_method_handler(
          fn, request_deserializer=weight_sync._decode,  # pylint: disable=protected-access
          response_serializer=weight_sync._encode)  # pylint: disable=protected-access

    return grpc.method_handlers_generic_handler(weight_sync.SERVICE, {
        'UpdateWeights': unary(self._update_weights),
        'Status': unary(self._status),
    })

  async def _check(self, context):
    if not weight_sync.authorized(context, self._secret):
      await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          'wrong or missing admin secret')

  async def _update_weights(self, request, context):
    await self._check(context)
    path, version = request.get('path'), request.get('version')
    if not isinstance(path, str) or not isinstance(version, int):
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          'UpdateWeights needs {"path": str, "version": int}')
    start = time.perf_counter()
    loop = asyncio.get_running_loop()
    try:
      state = await loop.run_in_executor(
          None, weight_sync.load_policy, path, self.engine.abstract_state())
    except Exception as e:  # pylint: disable=broad-except
      _log.exception('loading weights from %s failed', path)
      await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f'cannot load {path}: {e}')
    self.engine.weights.swap(state, version)
    seconds = time.perf_counter() - start
    self._swaps.append(seconds)
    _log.info('now serving policy version %d (loaded in %.3f s)', version,
              seconds)
    return {'version': version, 'seconds': seconds}

  async def _status(self, request, context):
    del request
    await self._check(context)
    cfg = self.engine.config
    return {
        'version': self.engine.version,
        'swaps': len(self._swaps),
        'last_swap_seconds': self._swaps[-1] if self._swaps else None,
        'max_concurrent_decodes': cfg.max_concurrent_decodes,
        'samples_per_slot': cfg.samples_per_slot,
        'max_prefill_length': cfg.max_prefill_length,
        'max_target_length': cfg.max_target_length,
        'live': self._driver.live,
    }

  # -- lifecycle --------------------------------------------------------------

  def wait(self) -> None:
    """Blocks until the server stops."""
    self._run(self._server.wait_for_termination())

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
    self._driver.stop()
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._thread.join(timeout=10)
    self._executor.shutdown(wait=False, cancel_futures=True)
