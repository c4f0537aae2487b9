"""The streamed weight transport's wire format, sender and receiver.

A push of policy version v is one client-streaming admin RPC (`PushWeights`)
per learner process and server. Its first message is a JSON manifest: the
pieces this process sends (a piece is one array, or on a multi-host learner
one shard of it: its leaf path, the global shape, the dtype on the wire and
the shard's index), their byte sizes, and how many processes send parts of v.
Then come buckets: the pieces' bytes concatenated in manifest order and cut
into messages of at most `bucket_bytes`, each prefixed by a fixed header
(bucket number, offset in the stream, length, CRC-32 of the payload).

The receiver (`Staging`, one per version on a server) checks every header
against what it has read so far, writes each piece straight into a host
buffer of its leaf, and hands a leaf to the device as soon as its last byte
arrived (so at most a few leaves sit on the host at once: the server's extra
memory is about one copy of the weights, on the device). Version v is
complete when every leaf of the engine's state is covered by the parts of all
processes; nothing of it is visible before, and a stream that breaks, lies
about a size or fails a checksum discards v whole.

Nothing here knows gRPC: `weight_sync` (the learner's publisher) and
`server` (the admin service) carry these bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import mmap
import struct
from collections.abc import Iterator, Sequence

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from sao_jax import checksums

# Bucket header: bucket number, byte offset in the stream, payload length,
# CRC-32 of the payload.
# bucket number, byte offset, payload bytes, checksum.
_HEADER = struct.Struct('<QQQQ')
HEADER_BYTES = _HEADER.size
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


def _name(key_path) -> str:
  return '/'.join(str(getattr(k, 'key', getattr(k, 'idx', k)))
                  for k in key_path)


def leaf_paths(pure_dict) -> list[tuple[str, object]]:
  """(`'a/b/c'`, leaf) of a nested dict (an nnx pure dict), sorted."""
  flat = jax.tree_util.tree_flatten_with_path(pure_dict)[0]
  return sorted((_name(path), leaf) for path, leaf in flat)


# -- the sender ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Piece:
  """One array or shard on the wire: `data` is the part at `index` (a
  `(start, stop)` per axis) of leaf `path`, whose whole shape is `shape`."""
  path: str
  shape: tuple[int, ...]
  index: tuple[tuple[int, int], ...]
  data: np.ndarray  # C-contiguous, the wire dtype

  def describe(self) -> dict:
    return {'path': self.path, 'shape': list(self.shape),
            'dtype': _dtype_name(self.data.dtype),
            'index': [list(i) for i in self.index],
            'nbytes': int(self.data.nbytes)}


def _dtype_name(dtype) -> str:
  return 'bfloat16' if dtype == ml_dtypes.bfloat16 else np.dtype(dtype).name


def _index(slices: Sequence[slice], shape) -> tuple[tuple[int, int], ...]:
  return tuple((s.start or 0, n if s.stop is None else s.stop)
               for s, n in zip(slices, shape))


def host_pieces(state, dtype: str | None = None) -> list[Piece]:
  """This process's pieces of `state` (a model's parameters, an nnx State or
  a pure dict of arrays),
  copied to the host in `dtype` (None: as they are).

  An array this process holds whole is one piece; otherwise each shard it
  holds whose `replica_id` is 0 (so over all processes every element is sent
  exactly once, and no process gathers what others hold). The copies are the
  learner's own: the training step may donate the arrays they came from.
  """
  if isinstance(state, nnx.Module):
    state = nnx.state(state, nnx.Param)
  if isinstance(state, nnx.State):
    state = nnx.to_pure_dict(state)
  wire = None if dtype in (None, '') else dtype_of(dtype)
  pieces = []
  for path, x in leaf_paths(state):
    shape = tuple(x.shape)
    converted = False
    if (wire is not None and isinstance(x, jax.Array) and x.dtype != wire):
      # Converted where it lives (each device its own shards): XLA's convert
      # is several times NumPy's f32 -> bf16 cast on the host (prepare of a
      # 1B model: 4.4 s with the host cast), and an accelerator then copies
      # half the bytes to the host. The result is ours: no copy after.
      x, converted = _convert(x, wire), True
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      shards = [(tuple((0, n) for n in shape), x)]
    else:
      shards = [(_index(s.index, shape), s.data)
                for s in x.addressable_shards if s.replica_id == 0]
    for index, data in shards:
      host = np.asarray(data)
      if not converted:
        # Into pages faulted in up front (`aligned_empty`): a fresh page
        # faulted on first write made this copy ~3x slower.
        copy = aligned_empty(host.shape,
                             host.dtype if wire is None else wire)
        np.copyto(copy, host, casting='unsafe')
        host = copy
      pieces.append(Piece(path, shape, index, np.ascontiguousarray(host)))
  return pieces


@functools.partial(jax.jit, static_argnums=1)
def _convert(x: jax.Array, dtype: np.dtype) -> jax.Array:
  return x.astype(dtype)


def manifest(pieces: Sequence[Piece], *, version: int, part: int = 0,
             parts: int = 1, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
             bucket_timeout_s: float = 30.0,
             checksum: str = 'sum64') -> bytes:
  """The stream's first message."""
  if checksum not in checksums.CHECKSUMS:
    raise ValueError(f'checksum={checksum!r} is not one of'
                     f' {", ".join(checksums.CHECKSUMS)}')
  return json.dumps({
      'version': int(version), 'part': int(part), 'parts': int(parts),
      'bucket_bytes': int(bucket_bytes),
      'bucket_timeout_s': float(bucket_timeout_s), 'checksum': checksum,
      'total_bytes': int(sum(p.data.nbytes for p in pieces)),
      'pieces': [p.describe() for p in pieces]}).encode()


def frames(pieces: Sequence[Piece], bucket_bytes: int,
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
    frame = (_HEADER.pack(number, offset, size, check(payload)),
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
      for p in pieces):
    raise StreamError('manifest field pieces must list {path, shape, dtype,'
                      ' index, nbytes} objects')
  return header


@dataclasses.dataclass
class _Leaf:
  shape: tuple[int, ...]
  dtype: np.dtype  # the engine's
  sharding: object
  nbytes_wire: int = 0  # whole-leaf bytes in the wire dtype, once known
  received: int = 0  # bytes of it received so far (over all parts)
  host: np.ndarray | None = None
  device: jax.Array | None = None


class _Part:
  """Reading one process's stream: where the next bytes go."""

  def __init__(self, header: dict, leaves: dict[str, _Leaf]):
    self.total = header['total_bytes']
    self.bucket_bytes = header['bucket_bytes']
    self.checksum = checksums.CHECKSUMS[header['checksum']]
    self.received = 0
    self.next_bucket = 0
    self.pieces = []
    for p in header['pieces']:
      leaf = leaves[p['path']]
      shape = tuple(p['shape'])
      index = tuple(tuple(i) for i in p['index'])
      wire = dtype_of(p['dtype'])
      extent = tuple(stop - start for start, stop in index)
      if (shape != leaf.shape or len(index) != len(shape)
          or any(not 0 <= a < b <= n for (a, b), n in zip(index, shape))):
        raise StreamError(f'piece {p["path"]}: shape {list(shape)} index'
                          f' {p["index"]} does not fit the served shape'
                          f' {list(leaf.shape)}')
      if p['nbytes'] != math.prod(extent) * wire.itemsize:
        raise StreamError(f'piece {p["path"]}: {p["nbytes"]} bytes for'
                          f' {list(extent)} {wire.name}')
      self.pieces.append((leaf, index, extent, wire, p['nbytes']))
    if sum(p[4] for p in self.pieces) != self.total:
      raise StreamError('total_bytes is not the sum of the pieces')
    self._piece = 0  # piece being read, and bytes of it read
    self._done_in_piece = 0
    self._scratch: np.ndarray | None = None
    self._bucket: bytearray | None = None

  def bucket_buffer(self, n: int) -> memoryview:
    """A reused buffer for one bucket's `n` payload bytes: a bucket is read
    and checked whole, then copied into place."""
    if self._bucket is None or len(self._bucket) < n:
      self._bucket = bytearray(max(n, min(self.bucket_bytes, self.total)))
    return memoryview(self._bucket)[:n]

  def regions(self, n: int, finished) -> Iterator[memoryview]:
    """Writable views of where the stream's next `n` bytes go, in order;
    fill each before asking for the next. `finished(leaf)` is called for a
    leaf whose last byte was in a filled view."""
    while n:
      if self._piece == len(self.pieces):
        raise StreamError('more bytes than the manifest announced')
      leaf, index, extent, wire, nbytes = self.pieces[self._piece]
      if leaf.host is None:
        leaf.host = aligned_empty(leaf.shape, wire)
        leaf.nbytes_wire = leaf.host.nbytes
      if leaf.host.dtype != wire:
        raise StreamError('pieces of one leaf in different dtypes')
      whole = extent == leaf.shape
      if self._scratch is None:
        self._scratch = (leaf.host if whole else np.empty(extent, wire))
      flat = self._scratch.reshape(-1).view(np.uint8)
      take = min(n, nbytes - self._done_in_piece)
      yield memoryview(flat[self._done_in_piece:self._done_in_piece + take])
      self._done_in_piece += take
      n -= take
      if self._done_in_piece == nbytes:
        if not whole:
          leaf.host[tuple(slice(a, b) for a, b in index)] = self._scratch
        self._scratch = None
        self._piece += 1
        self._done_in_piece = 0
        leaf.received += nbytes
        if leaf.received > leaf.nbytes_wire:
          raise StreamError('a leaf received more bytes than it holds'
                            ' (overlapping shards)')
        if leaf.received == leaf.nbytes_wire:
          finished(leaf)


# Linux >= 5.14 (not among Python 3.11's mmap constants).
_MADV_POPULATE_WRITE = getattr(mmap, 'MADV_POPULATE_WRITE', 23)
# Leaves at least this large get pages of their own (below, the heap's).
_MAPPED_BYTES = 1 << 20


def aligned_empty(shape, dtype, alignment: int = 64) -> np.ndarray:
  """An uninitialised array whose data starts on an `alignment`-byte
  boundary: a CPU device can then take it as its buffer without a copy
  (`device_put(..., may_alias=True)`), so a received leaf is not held
  twice.

  A large one is an anonymous mapping whose pages are faulted in with one
  `madvise(MADV_POPULATE_WRITE)`: the first write to a fresh page costs a
  page fault each (the server returns its freed pages to the system after
  a swap, so every push writes fresh pages), and one at a time they made
  copying a bucket into place take 1.0-1.5 s of a 1.6 s push of 0.54 GB
  on a 2-core VM; faulted in bulk they cost ~0.2 s
  (docs/design/weight_sync.md).
  """
  dtype = np.dtype(dtype)
  nbytes = math.prod(shape) * dtype.itemsize
  if nbytes >= _MAPPED_BYTES and mmap.PAGESIZE % alignment == 0:
    pages = mmap.mmap(-1, nbytes)
    try:
      pages.madvise(_MADV_POPULATE_WRITE)
    except OSError:  # an older kernel: pages fault in on first write
      pass
    return np.frombuffer(pages, dtype).reshape(shape)
  raw = np.empty(nbytes + alignment, np.uint8)
  start = -raw.ctypes.data % alignment
  return raw[start:start + nbytes].view(dtype).reshape(shape)


class Staging:
  """Version v arriving on a server, from `parts` learner processes.

  Feed each process's stream through `begin` / `bucket` / `end`; when every
  part ended and every leaf arrived, `state()` is the complete new state.
  """

  def __init__(self, abstract_state, version: int, parts: int):
    """`abstract_state`: the engine's (`Engine.abstract_state()`)."""
    self.version = version
    self.parts = parts
    self._abstract = abstract_state
    self._leaves = {path: _Leaf(tuple(a.shape), np.dtype(a.dtype), a.sharding)
                    for path, a in leaf_paths(nnx.to_pure_dict(
                        abstract_state))}
    self._streams: dict[int, _Part] = {}
    self.ended: set[int] = set()
    self.bytes = 0

  def begin(self, header: dict) -> _Part:
    """Checks a part's manifest against the served state."""
    part = header['part']
    if header['parts'] != self.parts:
      raise StreamError(f'part {part} says {header["parts"]} parts, another'
                        f' said {self.parts}')
    if not 0 <= part < self.parts or part in self._streams:
      raise StreamError(f'part {part} of {self.parts} is not expected')
    unknown = sorted({p['path'] for p in header['pieces']}
                     - set(self._leaves))
    if unknown:
      raise StreamError(f'{len(unknown)} pieces name no served parameter,'
                        f' e.g. {unknown[0]}')
    stream = _Part(header, self._leaves)
    self._streams[part] = stream
    return stream

  def bucket(self, stream: _Part, message: bytes) -> None:
    """Checks one whole bucket (header and payload) and stores its bytes."""
    if len(message) < HEADER_BYTES:
      raise StreamError('a bucket shorter than its header')
    payload = memoryview(message)[HEADER_BYTES:]

    def copy(view):
      nonlocal payload
      view[:] = payload[:len(view)]
      payload = payload[len(view):]

    self.read_bucket(stream, message[:HEADER_BYTES], copy,
                     available=len(payload))

  def read_bucket(self, stream: _Part, header: bytes, fill, *,
                  available: int | None = None) -> None:
    """Checks a bucket's header, has `fill(view)` read its payload (a
    socket's `recv_into`), checks its checksum and stores it.

    `available`: the payload's length where it is known up front (a whole
    message); its header must agree.
    """
    number, offset, size, checksum = _HEADER.unpack(header)
    if number != stream.next_bucket or offset != stream.received:
      raise StreamError(f'bucket {number} at offset {offset}; expected'
                        f' bucket {stream.next_bucket} at {stream.received}')
    if ((available is not None and size != available)
        or size > stream.bucket_bytes
        or stream.received + size > stream.total):
      raise StreamError(f'bucket {number}: {available} bytes, header says'
                        f' {size} (bucket size {stream.bucket_bytes},'
                        f' {stream.total - stream.received} left)')
    # Read whole, checked, then copied into place: one read and one checksum
    # call per bucket (each takes the GIL back once; see `frames`), and a
    # corrupted bucket never reaches the staging buffers.
    payload = stream.bucket_buffer(size)
    fill(payload)
    if stream.checksum(payload) != checksum:
      raise StreamError(f'bucket {number}: checksum mismatch')
    at = 0
    for view in stream.regions(size, self._to_device):
      view[:] = payload[at:at + len(view)]
      at += len(view)
    stream.received += size
    stream.next_bucket += 1
    self.bytes += size

  def _to_device(self, leaf: _Leaf) -> None:
    host = leaf.host if leaf.host.dtype == leaf.dtype else leaf.host.astype(
        leaf.dtype)
    # may_alias: on a CPU device the aligned host buffer becomes the
    # device's (no second copy); an accelerator copies it to its memory.
    leaf.device = jax.device_put(host, leaf.sharding, may_alias=True)
    leaf.host = None

  def end(self, stream: _Part, part: int) -> None:
    """A part's stream ended; it must have sent all it announced."""
    if stream.received != stream.total:
      raise StreamError(f'the stream ended after {stream.received} of'
                        f' {stream.total} bytes')
    self.ended.add(part)

  @property
  def complete(self) -> bool:
    return (len(self.ended) == self.parts
            and all(l.device is not None for l in self._leaves.values()))

  def missing(self) -> list[str]:
    return [p for p, l in self._leaves.items() if l.device is None]

  def state(self):
    """The new nnx State (only when `complete`)."""
    if not self.complete:
      raise StreamError(f'version {self.version} is incomplete:'
                        f' {len(self.missing())} parameters missing')
    pure = nnx.to_pure_dict(self._abstract)
    by_path = {p: l.device for p, l in self._leaves.items()}
    filled = jax.tree_util.tree_map_with_path(
        lambda path, _: by_path[_name(path)], pure)
    state = jax.tree.map(lambda x: x, self._abstract)  # a structural copy
    nnx.replace_by_pure_dict(state, filled)
    return state
