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

SERVICE = 'sao_jax.Admin'
SECRET_ENV = 'SAO_ADMIN_SECRET'
SECRET_HEADER = 'x-sao-admin-secret'

_log = logging.getLogger(__name__)


def _encode(message: dict) -> bytes:
  return json.dumps(message).encode()


def _decode(data: bytes) -> dict:
  return json.loads(data.decode()) if data else {}


def method(name: str) -> str:
  return f'/{SERVICE}/{name}'


def read_secret(secret_file: str | None = None) -> str:
  """The admin secret from a file or the `SAO_ADMIN_SECRET` variable.

  Raises:
    ValueError: when neither is set (the admin service never runs open), or
      the secret is shorter than 16 characters.
  """
  if secret_file:
    with open(secret_file) as f:
      secret = f.read().strip()
  else:
    secret = os.environ.get(SECRET_ENV, '')
  if len(secret) < 16:
    raise ValueError(
        f'the admin secret must be set (in ${SECRET_ENV} or a secret file)'
        ' and be at least 16 characters: anyone who can reach the port could'
        ' otherwise replace the model')
  return secret


def authorized(context, secret: str) -> bool:
  """Constant-time check of the secret in the call's metadata."""
  sent = dict(context.invocation_metadata()).get(SECRET_HEADER, '')
  return hmac.compare_digest(sent.encode(), secret.encode())


# -- checkpoints --------------------------------------------------------------


def save_policy(path: str, model_or_state) -> None:
  """Writes policy parameters as an orbax checkpoint at `path` (a new dir).

  The directory appears complete or not at all (orbax writes to a temporary
  name and renames), so a server never reads a half-written checkpoint.
  """
  state = (nnx.state(model_or_state, nnx.Param)
           if isinstance(model_or_state, nnx.Module) else model_or_state)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.path.abspath(path), nnx.to_pure_dict(state))
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
  """Outcome of one weight push to every server."""
  version: int
  seconds: float
  updated: list[str]
  failed: dict[str, str]


class WeightPublisher:
  """Tells rollout servers to load a new policy version."""

  def __init__(self, addresses: Sequence[str], secret: str,
               timeout_s: float = 300.0):
    self.addresses = list(addresses)
    self._secret = secret
    self._timeout_s = timeout_s

  async def _push_one(self, address, path, version):
    async with grpc.aio.insecure_channel(address) as channel:
      call = channel.unary_unary(method('UpdateWeights'),
                                 request_serializer=_encode,
                                 response_deserializer=_decode)
      return await call({'path': os.path.abspath(path), 'version': version},
                        metadata=((SECRET_HEADER, self._secret),),
                        timeout=self._timeout_s)

  async def push(self, path: str, version: int) -> PushResult:
    """Pushes checkpoint `path` as `version` to all servers concurrently.

    A server that fails (dead, refused) is reported, not raised: the others
    keep serving the new version and the client routes around dead ones.
    """
    start = time.perf_counter()
    results = await asyncio.gather(
        *(self._push_one(a, path, version) for a in self.addresses),
        return_exceptions=True)
    updated, failed = [], {}
    for address, result in zip(self.addresses, results):
      if isinstance(result, BaseException):
        failed[address] = (result.code().name if isinstance(result, grpc.RpcError)
                           else repr(result))
      else:
        updated.append(address)
    if failed:
      _log.warning('weight push of version %d failed on %s', version, failed)
    return PushResult(version, time.perf_counter() - start, updated, failed)


async def server_status(address: str, secret: str,
                        timeout_s: float = 10.0) -> dict:
  """The admin `Status` of one server (version, swap timings, engine shape)."""
  async with grpc.aio.insecure_channel(address) as channel:
    call = channel.unary_unary(method('Status'), request_serializer=_encode,
                               response_deserializer=_decode)
    return await call({}, metadata=((SECRET_HEADER, secret),),
                      timeout=timeout_s)
