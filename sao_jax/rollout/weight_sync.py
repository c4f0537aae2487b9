"""Moving policy weights from the learner to rollout servers.

Out of process, the learner writes the policy parameters as an orbax
checkpoint and tells every server (admin RPC `UpdateWeights`, authenticated by
a shared secret) the path and the new version; each server restores it with
its own shardings and swaps atomically between decode steps. In one process
(Colab, CPU demos) the learner hands the arrays to the engine directly.

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
import time
from collections.abc import Sequence

import grpc
import jax
import orbax.checkpoint as ocp
from flax import nnx

from sao_jax import errors

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


# -- the learner's side -------------------------------------------------------


@dataclasses.dataclass
class PushResult:
  """Outcome of one weight push to the servers it was sent to."""
  version: int
  seconds: float
  updated: list[str]
  failed: dict[str, str]


class SettingsMismatch(ValueError):
  """A server samples differently from what the learner assumes."""


# Sampling settings a server reports in `Status` that must equal the
# learner's: the DIS ratio pi/mu divides by the server's mu_t, so a different
# temperature or truncation shifts every ratio without any error.
SAMPLING_KEYS = ('temperature', 'top_k', 'top_p')


class WeightPublisher:
  """Makes rollout servers serve the learner's current policy version.

  Keeps the current version (its checkpoint path) and, per server, the newest
  version that server acknowledged. A push goes to the servers the caller
  names (the live ones); each gets `health_timeout_s` to answer a health
  check and then `push_timeout_s` to load, so a hung server costs the push at
  most the health timeout and never blocks the others. A server that failed
  is brought up to date later by `catch_up` (the server pool calls it before
  routing traffic to a revived server), which also checks its sampling
  settings. `rollout_version(live)` is the minimum the live servers
  acknowledged: the version the queue may assume new rollouts start from.
  """

  def __init__(self, addresses: Sequence[str], secret: str, *,
               push_timeout_s: float = 300.0, health_timeout_s: float = 5.0,
               sampling: dict | None = None):
    """Sets up the publisher; nothing is sent yet.

    Args:
      addresses: the servers, `host:port`.
      secret: the admin secret.
      push_timeout_s: seconds one server may take to load one version.
      health_timeout_s: seconds a server may take to answer a health check.
      sampling: the learner's sampling settings (`SAMPLING_KEYS`); when given,
        `catch_up` refuses a server that reports different ones.
    """
    self.addresses = list(addresses)
    self._secret = secret
    self._push_timeout_s = push_timeout_s
    self._health_timeout_s = health_timeout_s
    self._sampling = dict(sampling) if sampling is not None else None
    self.current: tuple[str, int] | None = None  # (path, version)
    self.acked: dict[str, int] = {}
    self.counters: dict[str, int] = {'pushes_failed': 0, 'catch_ups': 0,
                                     'catch_ups_failed': 0}
    # A settings mismatch found by `catch_up` (in the pool's monitor); the
    # trainer raises it in its own thread.
    self.mismatch: SettingsMismatch | None = None
    # Each server's prefill counters (`Status['prefix_cache']`), as of the
    # last health check this publisher made.
    self.prefill_counters: dict[str, dict] = {}

  def _record(self, address: str, status) -> None:
    if isinstance(status, dict) and isinstance(status.get('prefix_cache'),
                                               dict):
      self.prefill_counters[address] = status['prefix_cache']

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

  def set_current(self, path: str, version: int) -> None:
    """Records that `path` holds `version`, without sending it anywhere."""
    self.current = (os.path.abspath(path), int(version))

  async def _call(self, address, name, message, timeout):
    async with grpc.aio.insecure_channel(address) as channel:
      call = channel.unary_unary(method(name), request_serializer=_encode,
                                 response_deserializer=_decode)
      return await call(message, metadata=((SECRET_HEADER, self._secret),),
                        timeout=timeout)

  async def _load(self, address: str) -> int:
    """Health check, then `UpdateWeights` of the current version."""
    path, version = self.current
    self._record(address, await self._call(address, 'Status', {},
                                           self._health_timeout_s))
    await self._call(address, 'UpdateWeights',
                     {'path': path, 'version': version}, self._push_timeout_s)
    # Acknowledgements only move forward: a slow load of an older version
    # must not undo a newer one's.
    self.acked[address] = max(version, self.acked.get(address, version))
    return version

  async def push(self, path: str, version: int,
                 addresses: Sequence[str] | None = None) -> PushResult:
    """Makes `version` (at `path`) current and pushes it concurrently.

    Args:
      path: the checkpoint directory (`save_policy`).
      version: its policy version.
      addresses: where to push (the live servers); default all.

    A server that fails (dead, hung, refused) is reported, not raised: the
    others serve the new version, and the caller routes around the failed
    ones until `catch_up` succeeds.
    """
    self.set_current(path, version)
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
      status = await self._call(address, 'Status', {}, self._health_timeout_s)
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
    self.counters['catch_ups'] += 1
    # What it acknowledged before (it restarted since) no longer holds.
    self.acked.pop(address, None)
    try:
      # A push may make a newer version current while this one loads.
      while self.acked.get(address) != self.current[1]:
        await self._load(address)
    except (grpc.RpcError, asyncio.TimeoutError) as e:
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
