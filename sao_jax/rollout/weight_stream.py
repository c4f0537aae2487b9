"""The streamed weight transport's wire format and its sending end.

A push of policy version v is one client-streaming admin RPC (`PushWeights`)
per learner process and server. Its first message is a JSON manifest: the
pieces this process sends (a piece is one array, or on a multi-host learner
one shard of it: its leaf path, the global shape, the dtype on the wire and
the shard's index), their byte sizes, and how many processes send parts of v.
Then come buckets: the pieces' bytes concatenated in manifest order and cut
into messages of at most `bucket_bytes`, each prefixed by a fixed header
(bucket number, offset in the stream, length, checksum of the payload). A
sparse piece (`weight_delta`: its manifest entry has a `count`) carries the
flat indices and values of the elements that changed since the state the
manifest's `base_id` names.

`HostCopy` copies a version's pieces to the host, `manifest` and `frames`
make the messages; the receiving end is `weight_staging`.
Nothing here knows gRPC: `weight_sync` (the learner's publisher) and
`server` (the admin service) carry these bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import struct
import threading
from collections.abc import Iterable, Iterator, Sequence

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from sao_jax import checksums
from sao_jax.rollout import host_buffers

# Bucket header: bucket number, byte offset in the stream, payload length,
# checksum of the payload (`checksums.CHECKSUMS`).
HEADER = struct.Struct('<QQQQ')
HEADER_BYTES = HEADER.size
DEFAULT_BUCKET_BYTES = 16 << 20


class StreamError(ValueError):
  """A push that cannot be applied; the message says why (one line)."""


def dtype_of(name: str) -> np.dtype:
  """A numpy dtype by name, bfloat16 included."""
  if name == 'bfloat16':
    return np.dtype(ml_dtypes.bfloat16)
  try:
    return np.dtype(name)
  except TypeError as e:
    raise StreamError(f'unknown dtype {name!r}') from e


def serving_param_dtype(config) -> str:
  """The dtype a server keeps its weights in, and so the wire's:
  `rollout.param_dtype`, or the learner's `model.param_dtype` when that is
  ''. Pushed weights are converted to it by the learner (streamed) or on
  load (orbax restores into the engine's dtypes)."""
  return config.rollout.param_dtype or config.model.param_dtype


def leaf_name(key_path) -> str:
  return '/'.join(str(getattr(k, 'key', getattr(k, 'idx', k)))
                  for k in key_path)


def leaf_paths(pure_dict) -> list[tuple[str, object]]:
  """(`'a/b/c'`, leaf) of a nested dict (an nnx pure dict), sorted."""
  flat = jax.tree_util.tree_flatten_with_path(pure_dict)[0]
  return sorted((leaf_name(path), leaf) for path, leaf in flat)


# -- the sender ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Piece:
  """One array or shard on the wire: `data` is the part at `index` (a
  `(start, stop)` per axis) of leaf `path`, whose whole shape is `shape`."""
  path: str
  shape: tuple[int, ...]
  index: tuple[tuple[int, int], ...]
  data: np.ndarray  # C-contiguous, the wire dtype
  # A sparse piece (`weight_delta`): `data` is the bytes of `count` flat
  # indices and then their values, in `value_dtype`.
  count: int | None = None
  value_dtype: object = None

  def describe(self) -> dict:
    described = {'path': self.path, 'shape': list(self.shape),
                 'dtype': _dtype_name(self.data.dtype
                                      if self.count is None
                                      else self.value_dtype),
                 'index': [list(i) for i in self.index],
                 'nbytes': int(self.data.nbytes)}
    if self.count is not None:
      described['count'] = int(self.count)
    return described


def _dtype_name(dtype) -> str:
  return 'bfloat16' if dtype == ml_dtypes.bfloat16 else np.dtype(dtype).name


def _index(slices: Sequence[slice], shape) -> tuple[tuple[int, int], ...]:
  return tuple((s.start or 0, n if s.stop is None else s.stop)
               for s, n in zip(slices, shape))


def host_pieces(state, dtype: str | None = None) -> list[Piece]:
  """This process's pieces of `state` (a model's parameters, an nnx State or
  a pure dict of arrays), copied to the host in `dtype` (None: as they are);
  `HostCopy(state, dtype).pieces()`."""
  return HostCopy(state, dtype).pieces()


def pure_state(state):
  """A pure dict of arrays, of a module's parameters or an nnx State."""
  if isinstance(state, nnx.Module):
    state = nnx.state(state, nnx.Param)
  if isinstance(state, nnx.State):
    state = nnx.to_pure_dict(state)
  return state


def _shards(x, shape) -> list[tuple[tuple[tuple[int, int], ...], object]]:
  """(index, data) of what this process sends of `x`: all of an array it
  holds whole, else each shard it holds whose `replica_id` is 0 (so over all
  processes every element is sent exactly once, and no process gathers what
  others hold)."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return [(tuple((0, n) for n in shape), x)]
  return [(_index(s.index, shape), s.data)
          for s in x.addressable_shards if s.replica_id == 0]


class HostCopy:
  """This process's pieces of one version, copied to the host in the wire
  dtype by a background thread, in manifest order.

  The layout (every piece's path, shape, index, dtype and size) is known at
  once from the arrays' metadata, so a stream can send its manifest and its
  first buckets while later pieces are still being copied: a push takes
  about the longer of the copy and the transfer, not their sum. The copies
  are the learner's own: once `pieces()` returned, the training step may
  donate the arrays they came from.
  """

  def __init__(self, state, dtype: str | None = None, encoder=None,
               pool: host_buffers.Pool | None = None):
    """`encoder`: a `weight_delta.Encoder` that `begin` readied for this
    version: the pieces are then what the servers will hold, and `deltas()`
    their sparse forms against the last version. `pool`: where the host
    buffers come from (those of versions no longer held), else fresh."""
    state = pure_state(state)
    self._empty = host_buffers.empty_from(pool)
    self._encoder = encoder
    self._deltas: list[Piece] = []
    # The base a delta of this version applies to, and this version's id.
    self.base = None if encoder is None or encoder.anchor else (
        encoder.base_id, encoder.base_version)
    self.state_id = None if encoder is None else encoder.state_id
    self._wire = None if dtype in (None, '') else dtype_of(dtype)
    self._leaves = leaf_paths(state)
    self.layout: list[dict] = []
    for path, x in self._leaves:
      shape = tuple(x.shape)
      wire = np.dtype(x.dtype) if self._wire is None else self._wire
      for index, _ in _shards(x, shape):
        extent = [b - a for a, b in index]
        self.layout.append({'path': path, 'shape': list(shape),
                            'dtype': _dtype_name(wire),
                            'index': [list(i) for i in index],
                            'nbytes': math.prod(extent) * wire.itemsize})
    self.total_bytes = sum(d['nbytes'] for d in self.layout)
    self._done: list[Piece] = []
    self._error: BaseException | None = None
    self._ready = threading.Condition()
    threading.Thread(target=self._copy, daemon=True,
                     name='weight-host-copy').start()

  def _copy(self) -> None:
    try:
      for path, x in self._leaves:
        for piece in _host_leaf(path, x, self._wire, self._empty):
          described = self.layout[len(self._done)]
          if piece.describe() != described:
            raise StreamError(f'piece {path} came out as {piece.describe()},'
                              f' not the announced {described}')
          delta = piece
          if self._encoder is not None:
            served, sparse = self._encoder.encode((path, piece.index),
                                                  piece.data)
            piece = dataclasses.replace(piece, data=served)
            delta = piece if sparse is None else Piece(
                path, piece.shape, piece.index, sparse[0], count=sparse[1],
                value_dtype=served.dtype)
          with self._ready:
            self._done.append(piece)
            self._deltas.append(delta)
            self._ready.notify_all()
    except BaseException as e:  # pylint: disable=broad-except
      with self._ready:
        self._error = e
        self._ready.notify_all()
    finally:
      self._leaves = None  # the learner's arrays are no longer needed

  def _piece(self, i: int) -> Piece:
    with self._ready:
      while len(self._done) <= i and self._error is None:
        self._ready.wait()
      if len(self._done) <= i:
        raise StreamError(f'copying the weights to the host failed:'
                          f' {self._error}') from self._error
      return self._done[i]

  def __iter__(self) -> Iterator[Piece]:
    """The pieces in order, each as soon as it is on the host."""
    for i in range(len(self.layout)):
      yield self._piece(i)

  def __len__(self) -> int:
    return len(self.layout)

  def pieces(self) -> list[Piece]:
    """All pieces, once all are copied (raises what the copy raised)."""
    return list(self)

  def deltas(self) -> list[Piece]:
    """Each piece, or its sparse form against `base` where that is
    smaller, once all are copied (only with an encoder)."""
    if self._encoder is None:
      raise ValueError('a HostCopy without an encoder has no deltas')
    self.pieces()
    return list(self._deltas)


def _host_leaf(path: str, x, wire: np.dtype | None,
               empty=host_buffers.aligned_empty) -> list[Piece]:
  """One leaf's pieces on the host, in the wire dtype (copies into buffers
  from `empty`)."""
  shape = tuple(x.shape)
  converted = False
  if wire is not None and isinstance(x, jax.Array) and x.dtype != wire:
    # Converted where it lives (each device its own shards): XLA's convert
    # is several times NumPy's f32 -> bf16 cast on the host (prepare of a
    # 1B model: 4.4 s with the host cast), and an accelerator then copies
    # half the bytes to the host. The result is ours: no copy after.
    x, converted = _convert(x, wire), True
  pieces = []
  for index, data in _shards(x, shape):
    host = np.asarray(data)
    if not converted:
      # Into pages faulted in up front (`host_buffers.aligned_empty`): a
      # fresh page faulted on first write made this copy ~3x slower.
      copy = empty(host.shape, host.dtype if wire is None else wire)
      np.copyto(copy, host, casting='unsafe')
      host = copy
    pieces.append(Piece(path, shape, index, np.ascontiguousarray(host)))
  return pieces


@functools.partial(jax.jit, static_argnums=1)
def _convert(x: jax.Array, dtype: np.dtype) -> jax.Array:
  return x.astype(dtype)


def manifest(pieces: 'Sequence[Piece] | HostCopy', *, version: int,
             part: int = 0,
             parts: int = 1, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
             bucket_timeout_s: float = 30.0,
             checksum: str = 'sum64', state_id: str | None = None,
             base_id: str | None = None) -> bytes:
  """The stream's first message (a `HostCopy` need not have finished).

  `state_id`: names the state this part leaves on the server (delta pushes
  name it as their base); `base_id`: the state sparse pieces apply to.
  """
  layout = (pieces.layout if isinstance(pieces, HostCopy)
            else [p.describe() for p in pieces])
  if checksum not in checksums.CHECKSUMS:
    raise ValueError(f'checksum={checksum!r} is not one of'
                     f' {", ".join(checksums.CHECKSUMS)}')
  return json.dumps({
      'version': int(version), 'part': int(part), 'parts': int(parts),
      'bucket_bytes': int(bucket_bytes),
      'bucket_timeout_s': float(bucket_timeout_s), 'checksum': checksum,
      'total_bytes': int(sum(d['nbytes'] for d in layout)),
      'state_id': state_id, 'base_id': base_id,
      'pieces': layout}).encode()


def frames(pieces: 'Iterable[Piece]', bucket_bytes: int,
           checksum: str = 'sum64'
           ) -> Iterator[tuple[bytes, list[memoryview]]]:
  """The pieces' bytes cut into buckets of <= `bucket_bytes`: each its
  header and its payload, for one `sendmsg`.

  A bucket inside one piece is a view of it; one that spans pieces is
  joined into one buffer (a memcpy, with the GIL held) so that its checksum
  (`checksums.CHECKSUMS[checksum]`) is one call. Each call that releases the GIL must take it
  back, and in a process whose other threads run Python (the learner's
  episode workers) that costs up to the interpreter's switch interval: a
  few such calls per bucket, not one per piece (docs/design/weight_sync.md).
  """
  if bucket_bytes < 1:
    raise ValueError(f'bucket_bytes={bucket_bytes} must be >= 1')
  check = checksums.CHECKSUMS[checksum]
  offset = number = 0
  parts: list[memoryview] = []
  size = 0

  def flush():
    nonlocal offset, number, parts, size
    payload = parts[0] if len(parts) == 1 else memoryview(b''.join(parts))
    frame = (HEADER.pack(number, offset, size, check(payload)),
             [payload])
    offset += size
    number += 1
    parts, size = [], 0
    return frame

  for piece in pieces:
    view = memoryview(piece.data.reshape(-1).view(np.uint8))
    while len(view):
      take = min(len(view), bucket_bytes - size)
      parts.append(view[:take])
      size += take
      view = view[take:]
      if size == bucket_bytes:
        yield flush()
  if size:
    yield flush()


def buckets(pieces: Sequence[Piece], bucket_bytes: int,
            checksum: str = 'sum64') -> Iterator[bytes]:
  """`frames` as single messages: header and payload joined."""
  for header, parts in frames(pieces, bucket_bytes, checksum):
    yield header + b''.join(parts)


# -- the receiver -------------------------------------------------------------

_INTS = ('version', 'part', 'parts', 'bucket_bytes', 'total_bytes')


def parse_manifest(message: bytes) -> dict:
  """A stream's manifest, its fields' types checked.

  Raises:
    StreamError: for anything but a manifest `manifest()` could write.
  """
  try:
    header = json.loads(bytes(message).decode())
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise StreamError('the first message is not a JSON manifest') from e
  if not isinstance(header, dict):
    raise StreamError('the manifest is not a JSON object')
  for key in _INTS:
    value = header.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise StreamError(f'manifest field {key!r} must be an int >= 0, got'
                        f' {value!r}')
  if header['parts'] < 1 or header['bucket_bytes'] < 1:
    raise StreamError('a manifest needs parts >= 1 and bucket_bytes >= 1')
  if header.get('checksum') not in checksums.CHECKSUMS:
    raise StreamError(f'manifest field checksum must be one of'
                      f' {", ".join(checksums.CHECKSUMS)}, got'
                      f' {header.get("checksum")!r}')
  timeout = header.get('bucket_timeout_s')
  if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
    raise StreamError('manifest field bucket_timeout_s must be a number')
  for key in ('state_id', 'base_id'):
    if not isinstance(header.setdefault(key, None), (str, type(None))):
      raise StreamError(f'manifest field {key} must be a string or null')
  pieces = header.get('pieces')
  if not isinstance(pieces, list) or not all(
      isinstance(p, dict) and isinstance(p.get('path'), str)
      and isinstance(p.get('dtype'), str)
      and isinstance(p.get('nbytes'), int)
      and isinstance(p.get('shape'), list)
      and isinstance(p.get('index'), list)
      and all(isinstance(n, int) for n in p['shape'])
      and all(isinstance(i, list) and len(i) == 2
              and all(isinstance(n, int) for n in i) for i in p['index'])
      and (p.get('count') is None or (
          isinstance(p['count'], int) and not isinstance(p['count'], bool)
          and p['count'] >= 0))
      for p in pieces):
    raise StreamError('manifest field pieces must list {path, shape, dtype,'
                      ' index, nbytes[, count]} objects')
  return header
