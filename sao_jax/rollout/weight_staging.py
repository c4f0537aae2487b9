"""The receiving end of a streamed weight push: a version being staged.

A server makes one `Staging` per arriving version and feeds it each learner
process's stream (`begin`, then buckets, then `end`). Each bucket is checked
against its header and its checksum and written straight into a host buffer
of its leaf (a sparse piece of a delta is applied onto the served array),
and a leaf goes to the device as soon as its last byte arrived, so the
server's extra memory is about one copy of the weights. Nothing of a version
is visible before `complete`; any failed check raises
`weight_stream.StreamError` and the caller drops the version whole.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Iterator
from concurrent import futures

import jax
import numpy as np
from flax import nnx

from sao_jax import checksums
from sao_jax.rollout import host_buffers
from sao_jax.rollout import weight_delta
from sao_jax.rollout import weight_stream

StreamError = weight_stream.StreamError


@dataclasses.dataclass
class _Leaf:
  shape: tuple[int, ...]
  dtype: np.dtype  # the engine's
  sharding: object
  base: object = None  # the served array (a delta's base), if any
  nbytes_wire: int = 0  # whole-leaf bytes in the wire dtype, once known
  received: int = 0  # bytes of it received so far (over all parts)
  host: np.ndarray | None = None
  device: jax.Array | None = None
  allocation: futures.Future | None = None  # of `host`, made ahead


@dataclasses.dataclass
class _Incoming:
  """One piece of a part's stream, as its manifest announced it."""
  leaf: _Leaf
  index: tuple[tuple[int, int], ...]
  extent: tuple[int, ...]
  wire: np.dtype
  nbytes: int  # on the wire
  count: int | None  # a sparse piece's changed elements

  @property
  def dense_bytes(self) -> int:
    return math.prod(self.extent) * self.wire.itemsize


class _Part:
  """Reading one process's stream: where the next bytes go.

  The staging buffers of the pieces ahead of the reader are allocated (and
  their pages faulted in) by a helper thread, up to `lookahead` bytes ahead:
  faulting in 0.54 GB of fresh pages takes ~0.25 s here, which then runs
  beside the socket reads instead of between them. `finished(leaf)` is
  called for each leaf once its last byte arrived.
  """

  def __init__(self, header: dict, leaves: dict[str, _Leaf],
               lock: threading.Lock, finished, empty):
    self.total = header['total_bytes']
    self.bucket_bytes = header['bucket_bytes']
    self.checksum = checksums.CHECKSUMS[header['checksum']]
    self.received = 0
    self.next_bucket = 0
    self.pieces: list[_Incoming] = []
    for p in header['pieces']:
      leaf = leaves[p['path']]
      shape = tuple(p['shape'])
      index = tuple(tuple(i) for i in p['index'])
      wire = weight_stream.dtype_of(p['dtype'])
      extent = tuple(stop - start for start, stop in index)
      if (shape != leaf.shape or len(index) != len(shape)
          or any(not 0 <= a < b <= n for (a, b), n in zip(index, shape))):
        raise StreamError(f'piece {p["path"]}: shape {list(shape)} index'
                          f' {p["index"]} does not fit the served shape'
                          f' {list(leaf.shape)}')
      count = p.get('count')
      if count is None:
        expected = math.prod(extent) * wire.itemsize
      else:
        if leaf.base is None or wire != leaf.dtype:
          raise StreamError(f'piece {p["path"]}: a sparse piece needs the'
                            f' served {leaf.dtype.name} as its base')
        if count > math.prod(extent):
          raise StreamError(f'piece {p["path"]}: {count} changed elements'
                            f' of {math.prod(extent)}')
        expected = weight_delta.sparse_nbytes(count, math.prod(extent), wire)
      if p['nbytes'] != expected:
        raise StreamError(f'piece {p["path"]}: {p["nbytes"]} bytes for'
                          f' {list(extent)} {wire.name}'
                          + ('' if count is None else f' ({count} changed)'))
      self.pieces.append(_Incoming(leaf, index, extent, wire, p['nbytes'],
                                   count))
    if sum(p.nbytes for p in self.pieces) != self.total:
      raise StreamError('total_bytes is not the sum of the pieces')
    self._starts = np.cumsum([0] + [p.nbytes for p in self.pieces])
    self._lock = lock  # the staging's: leaves are shared by all parts
    self._finished = finished
    self._empty = empty  # makes a leaf's host buffer
    self._allocator = futures.ThreadPoolExecutor(
        1, thread_name_prefix='weight-staging-pages')
    self._lookahead = 4 * self.bucket_bytes
    self._ahead = 0  # pieces whose leaf's buffer was asked for
    self._piece = 0  # piece being read, and bytes of it read
    self._done_in_piece = 0
    self._scratch: np.ndarray | None = None
    self._bucket: bytearray | None = None

  def bucket_buffer(self, n: int) -> memoryview:
    """A reused buffer for one bucket's `n` payload bytes, for a bucket
    that spans pieces: read and checked whole, then copied into place."""
    if self._bucket is None or len(self._bucket) < n:
      self._bucket = bytearray(max(n, min(self.bucket_bytes, self.total)))
    return memoryview(self._bucket)[:n]

  def _allocate_ahead(self) -> None:
    at = self._starts[self._piece] + self._done_in_piece
    while self._ahead < len(self.pieces) and (
        self._ahead <= self._piece
        or self._starts[self._ahead] - at < self._lookahead):
      piece = self.pieces[self._ahead]
      with self._lock:
        if piece.leaf.allocation is None:
          piece.leaf.allocation = self._allocator.submit(
              self._empty, piece.leaf.shape, piece.wire)
      self._ahead += 1

  def _host(self, piece: _Incoming) -> np.ndarray:
    leaf = piece.leaf
    if leaf.host is None:
      leaf.host = leaf.allocation.result()
      leaf.nbytes_wire = leaf.host.nbytes
    if leaf.host.dtype != piece.wire:
      raise StreamError('pieces of one leaf in different dtypes')
    return leaf.host

  def region(self, n: int) -> memoryview:
    """A writable view of where the stream's next bytes go: the next `n`,
    or fewer where the piece being read ends sooner."""
    self._skip_empty()
    if self._piece == len(self.pieces):
      raise StreamError('more bytes than the manifest announced')
    self._allocate_ahead()
    piece = self.pieces[self._piece]
    host = self._host(piece)
    if self._scratch is None:
      self._scratch = (np.empty(piece.nbytes, np.uint8)
                       if piece.count is not None
                       else host if piece.extent == piece.leaf.shape
                       else np.empty(piece.extent, piece.wire))
    flat = self._scratch.reshape(-1).view(np.uint8)
    take = min(n, piece.nbytes - self._done_in_piece)
    return memoryview(flat[self._done_in_piece:self._done_in_piece + take])

  def advance(self, n: int) -> None:
    """The view `region` gave (`n` bytes) is filled."""
    self._done_in_piece += n
    if self._done_in_piece < self.pieces[self._piece].nbytes:
      return
    self._complete()
    self._skip_empty()

  def _skip_empty(self) -> None:
    # A sparse piece of a leaf that did not change has no bytes to wait for.
    while (self._piece < len(self.pieces)
           and self.pieces[self._piece].nbytes == 0):
      self._allocate_ahead()
      self._complete()

  def _complete(self) -> None:
    piece = self.pieces[self._piece]
    leaf = piece.leaf
    host = self._host(piece)
    part = tuple(slice(a, b) for a, b in piece.index)
    if piece.count is not None:
      scratch = (np.empty(0, np.uint8) if self._scratch is None
                 else self._scratch)
      try:
        dense = weight_delta.apply(np.asarray(leaf.base[part]), scratch,
                                   piece.count)
      except ValueError as e:
        raise StreamError(f'a sparse piece of a {list(leaf.shape)}'
                          f' leaf: {e}') from e
      host[part] = dense
    elif piece.extent != leaf.shape:
      host[part] = self._scratch
    self._scratch = None
    self._piece += 1
    self._done_in_piece = 0
    with self._lock:
      leaf.received += piece.dense_bytes
      received, whole = leaf.received, leaf.nbytes_wire
    if received > whole:
      raise StreamError('a leaf received more bytes than it holds'
                        ' (overlapping shards)')
    if received == whole:
      self._finished(leaf)
    if self._piece == len(self.pieces):
      self._allocator.shutdown(wait=False)

  def finish(self) -> None:
    """After the last bucket: completes trailing pieces without bytes."""
    self._skip_empty()

  def regions(self, n: int) -> Iterator[memoryview]:
    """Writable views of where the stream's next `n` bytes go, in order;
    fill each before asking for the next (`region`, `advance`)."""
    while n:
      view = self.region(n)
      yield view
      self.advance(len(view))
      n -= len(view)


class Staging:
  """Version v arriving on a server, from `parts` learner processes.

  Feed each process's stream through `begin` / `bucket` / `end`; when every
  part ended and every leaf arrived, `state()` is the complete new state.
  """

  def __init__(self, abstract_state, version: int, parts: int, *,
               served=None, served_ids: dict[int, str] | None = None,
               pool: host_buffers.Pool | None = None):
    """Sets up the staging.

    Args:
      abstract_state: the engine's (`Engine.abstract_state()`).
      version: the version arriving; parts: from how many processes.
      served: the state served now (an nnx State): the base sparse pieces
        apply to.
      served_ids: per learner part, the id of the state it left (the
        `state_id` of the push that made `served`); a part's sparse pieces
        are taken only where its manifest's `base_id` names it.
      pool: where the leaves' host buffers come from (None: fresh pages).
    """
    self.version = version
    self.parts = parts
    self._abstract = abstract_state
    self._leaves = {path: _Leaf(tuple(a.shape), np.dtype(a.dtype), a.sharding)
                    for path, a in weight_stream.leaf_paths(nnx.to_pure_dict(
                        abstract_state))}
    if served is not None:
      for path, x in weight_stream.leaf_paths(weight_stream.pure_state(served)):
        if path in self._leaves:
          self._leaves[path].base = x
    self._served_ids = dict(served_ids or {})
    self._empty = host_buffers.empty_from(pool)
    self.state_ids: dict[int, str | None] = {}  # what each part leaves
    self._streams: dict[int, _Part] = {}
    self._lock = threading.Lock()
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
    if any(p.get('count') is not None for p in header['pieces']):
      held = self._served_ids.get(part)
      if header['base_id'] is None or header['base_id'] != held:
        raise StreamError(f'part {part} is a delta against state'
                          f' {header["base_id"]!r}, but this server holds'
                          f' {held!r} (it restarted, missed a version or'
                          ' loaded a checkpoint): the next push sends it'
                          ' whole')
    stream = _Part(header, self._leaves, self._lock, self._to_device,
                   self._empty)
    self._streams[part] = stream
    self.state_ids[part] = header['state_id']
    return stream

  def bucket(self, stream: _Part, message: bytes) -> None:
    """Checks one whole bucket (header and payload) and stores its bytes."""
    if len(message) < weight_stream.HEADER_BYTES:
      raise StreamError('a bucket shorter than its header')
    payload = memoryview(message)[weight_stream.HEADER_BYTES:]

    def copy(view):
      nonlocal payload
      view[:] = payload[:len(view)]
      payload = payload[len(view):]

    self.read_bucket(stream, message[:weight_stream.HEADER_BYTES], copy,
                     available=len(payload))

  def read_bucket(self, stream: _Part, header: bytes, fill, *,
                  available: int | None = None) -> None:
    """Checks a bucket's header, has `fill(view)` read its payload (a
    socket's `recv_into`), checks its checksum and stores it.

    `available`: the payload's length where it is known up front (a whole
    message); its header must agree.
    """
    number, offset, size, checksum = weight_stream.HEADER.unpack(header)
    if number != stream.next_bucket or offset != stream.received:
      raise StreamError(f'bucket {number} at offset {offset}; expected'
                        f' bucket {stream.next_bucket} at {stream.received}')
    if ((available is not None and size != available)
        or size > stream.bucket_bytes
        or stream.received + size > stream.total):
      raise StreamError(f'bucket {number}: {available} bytes, header says'
                        f' {size} (bucket size {stream.bucket_bytes},'
                        f' {stream.total - stream.received} left)')
    # A bucket inside one piece is read straight into its staging buffer
    # and checked there (a bad one fails the whole version, which is then
    # dropped unseen); one that spans pieces is read whole into a reused
    # buffer, checked, and copied into place. Either way one read and one
    # checksum call per bucket (each takes the GIL back once; see `frames`).
    view = stream.region(size)
    if len(view) == size:
      fill(view)
      if stream.checksum(view) != checksum:
        raise StreamError(f'bucket {number}: checksum mismatch')
      stream.advance(size)
    else:
      payload = stream.bucket_buffer(size)
      fill(payload)
      if stream.checksum(payload) != checksum:
        raise StreamError(f'bucket {number}: checksum mismatch')
      at = 0
      for view in stream.regions(size):
        view[:] = payload[at:at + len(view)]
        at += len(view)
    stream.received += size
    stream.next_bucket += 1
    self.bytes += size
    if stream.received == stream.total:
      stream.finish()  # pieces after the last byte that had none

  def _to_device(self, leaf: _Leaf) -> None:
    host = leaf.host if leaf.host.dtype == leaf.dtype else leaf.host.astype(
        leaf.dtype)
    # may_alias: on a CPU device the aligned host buffer becomes the
    # device's (no second copy); an accelerator copies it to its memory.
    leaf.device = jax.device_put(host, leaf.sharding, may_alias=True)
    leaf.host = None

  def end(self, stream: _Part, part: int) -> None:
    """A part's stream ended; it must have sent all it announced."""
    stream.finish()
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
    """The new nnx State (only when `complete`), handed over: the staging
    keeps none of its arrays, nor the served base.

    Each `_Part` points back at its staging, so whatever a staging holds
    lives until Python's cycle collector runs: the previous version (the
    base) would stay resident after the swap, and the pages of a version
    no longer served would not return to the server's pool.
    """
    if not self.complete:
      raise StreamError(f'version {self.version} is incomplete:'
                        f' {len(self.missing())} parameters missing')
    pure = nnx.to_pure_dict(self._abstract)
    by_path = {p: l.device for p, l in self._leaves.items()}
    filled = jax.tree_util.tree_map_with_path(
        lambda path, _: by_path[weight_stream.leaf_name(path)], pure)
    state = jax.tree.map(lambda x: x, self._abstract)  # a structural copy
    nnx.replace_by_pure_dict(state, filled)
    # Every part ended (`complete`), so no reader still writes a leaf.
    for leaf in self._leaves.values():
      leaf.device = leaf.base = leaf.allocation = None
    self._streams.clear()
    return state
