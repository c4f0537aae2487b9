"""Host buffers that a CPU device can adopt and that fill at memory speed.

Both ends of a streamed weight push copy a version through host memory: the
learner its pieces in the wire dtype, a server each arriving leaf before it
goes to the device. `aligned_empty` makes those buffers.
"""

from __future__ import annotations

import ctypes
import math
import mmap

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
  if nbytes >= _MAPPED_BYTES and mmap.PAGESIZE % alignment == 0:
    pages = mmap.mmap(-1, nbytes)
    array = np.frombuffer(pages, dtype).reshape(shape)
    _populate(array.ctypes.data, nbytes)
    return array
  raw = np.empty(nbytes + alignment, np.uint8)
  start = -raw.ctypes.data % alignment
  return raw[start:start + nbytes].view(dtype).reshape(shape)


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
