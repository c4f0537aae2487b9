"""Host buffers that a CPU device can adopt and that fill at memory speed.

Both ends of a streamed weight push copy a version through host memory: the
learner its pieces in the wire dtype, a server each arriving leaf before it
goes to the device. `aligned_empty` makes those buffers; a `Pool` hands
the large ones out again once the arrays made from them are gone.
"""

from __future__ import annotations

import collections
import ctypes
import math
import mmap
import threading
import weakref

import jax
import numpy as np

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
  if _mapped(nbytes, alignment):
    return np.frombuffer(_new_pages(nbytes), dtype).reshape(shape)
  raw = np.empty(nbytes + alignment, np.uint8)
  start = -raw.ctypes.data % alignment
  return raw[start:start + nbytes].view(dtype).reshape(shape)


def _mapped(nbytes: int, alignment: int = 64) -> bool:
  return nbytes >= _MAPPED_BYTES and mmap.PAGESIZE % alignment == 0


def _new_pages(nbytes: int) -> mmap.mmap:
  pages = mmap.mmap(-1, nbytes)
  _populate(ctypes.addressof(ctypes.c_char.from_buffer(pages)), nbytes)
  return pages


class Pool:
  """`aligned_empty` whose large buffers are used again.

  Faulting in fresh pages is most of the cost of a host copy (0.17 s of
  0.33 s for the 0.54 GB of SmolLM2-135M in f32 on a 2-core VM; copying
  into pages already touched: 0.08 s). A buffer returns to the pool when
  the last array viewing it is collected, so nothing still read (a push in
  flight, a version kept for servers that catch up, a delta's base) is
  ever written over; the pool keeps at most `max_bytes` of them, resident.
  A learner that keeps one version on the host holds two while copying
  the next either way, so a pool of one version's bytes raises its memory
  between pushes to that peak but not the peak itself.
  """

  def __init__(self, max_bytes: int = 0):
    self.max_bytes = int(max_bytes)
    self._free: dict[int, list[mmap.mmap]] = collections.defaultdict(list)
    self._held = 0
    self._lock = threading.Lock()
    self.reused = 0  # buffers handed out again (for tests and benchmarks)

  @property
  def held_bytes(self) -> int:
    return self._held

  def empty(self, shape, dtype) -> np.ndarray:
    """As `aligned_empty`, from a returned buffer of the same size if any."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if not _mapped(nbytes):
      return aligned_empty(shape, dtype)
    with self._lock:
      pages = self._free[nbytes].pop() if self._free[nbytes] else None
      if pages is not None:
        self._held -= nbytes
        self.reused += 1
    if pages is None:
      pages = _new_pages(nbytes)
    owner = np.frombuffer(pages, dtype)
    # NumPy points every view (of a view...) at this array, the last one
    # whose base is not an array: once it is collected, nothing reads the
    # pages.
    weakref.finalize(owner, self._give_back, pages, nbytes)
    return owner.reshape(shape)

  def _give_back(self, pages: mmap.mmap, nbytes: int) -> None:
    with self._lock:
      if self._held + nbytes <= self.max_bytes:
        self._free[nbytes].append(pages)
        self._held += nbytes
    # Otherwise the mapping goes with its last reference.


def empty_from(pool: Pool | None):
  """The `empty(shape, dtype)` that makes host buffers: `pool`'s, which reuses
  returned ones, or fresh `aligned_empty` ones when there is no pool."""
  return aligned_empty if pool is None else pool.empty


def settle() -> None:
  """Lets jaxlib drop the host buffers of device arrays already deleted.

  A CPU device array that adopted a host buffer (`may_alias`) lets go of it
  only at jaxlib's next operation, not when the array is deleted (measured
  with jax 0.10.2: a deleted version's pages came back to a `Pool` only
  after the next `device_put` or dispatch, however long one waited). A
  server that has just swapped calls this so that the previous version's
  pages are free for the next push even if it decodes nothing meanwhile.
  """
  jax.block_until_ready(jax.numpy.zeros(()))


try:
  _LIBC = ctypes.CDLL(None, use_errno=True)
  _LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
except (OSError, AttributeError):  # no C library to ask: pages fault lazily
  _LIBC = None


def _populate(address: int, nbytes: int) -> None:
  """Faults in a mapping's pages at once. Through ctypes, which lets go of
  the GIL for the call: `mmap.madvise` holds it, and a server's decode loop
  and event loop stood still for the ~0.25 s that 0.54 GB of pages take."""
  if _LIBC is not None:
    # An older kernel refuses the advice (EINVAL): pages fault on first
    # write instead, as without it.
    _LIBC.madvise(address, nbytes, _MADV_POPULATE_WRITE)
