"""Sparse weight deltas for the streamed transport (`rollout.weight_delta`).

A policy step moves most parameters by less than the served dtype resolves:
in bf16 (8 significant bits) an Adam step of lr 1e-6 leaves most elements'
bits as they were. A delta push sends, per piece, only the elements whose
wire bits changed (or, with `rtol > 0`, that moved by more than `rtol` of
their magnitude) as flat indices and values, against the version the server
acknowledged; a piece where that would not be smaller goes whole.

Both sides must agree on the base bit for bit, so the learner keeps what
the servers hold, R_v (per piece, in the wire dtype), not the learner's own
weights: with `rtol = 0` R_v is the new weights themselves; with `rtol > 0`
an element keeps its served value until it moved by more than the
tolerance (so what a server holds is never further than `rtol` from the
learner's, relatively), and every `anchor_every`-th version is sent whole
and exact. Each R_v has an id (this process's nonce and the version); a
delta names the id of its base and a server applies it only onto that state
(`weight_staging.Staging`), so a server that restarted, missed a version or
loaded a checkpoint refuses the delta and gets the next version whole.

The cost: the learner holds one more host copy of its part (R_{v-1}, until
R_v replaces it), and encoding compares every element once per version.
"""

from __future__ import annotations

import secrets

import numpy as np

# The flat index of a changed element within its piece.
_SMALL_INDEX = np.dtype('<u4')
_LARGE_INDEX = np.dtype('<u8')


def index_dtype(elements: int) -> np.dtype:
  """The index dtype of a sparse piece of `elements` elements."""
  return _SMALL_INDEX if elements <= 1 << 32 else _LARGE_INDEX


def sparse_nbytes(count: int, elements: int, dtype: np.dtype) -> int:
  """Bytes on the wire of `count` changed elements (indices, then values)."""
  return count * (index_dtype(elements).itemsize + np.dtype(dtype).itemsize)


def split(payload_u8: np.ndarray, count: int, elements: int, dtype):
  """(indices, values) of a sparse piece's bytes."""
  index = index_dtype(elements)
  cut = count * index.itemsize
  return (payload_u8[:cut].view(index), payload_u8[cut:].view(dtype))


def apply(base: np.ndarray, payload_u8: np.ndarray, count: int) -> np.ndarray:
  """A new array: `base` with a sparse piece's values at its indices.

  Raises:
    ValueError: an index outside the piece.
  """
  indices, values = split(payload_u8, count, base.size, base.dtype)
  if count and int(indices.max()) >= base.size:
    raise ValueError(f'a sparse index {int(indices.max())} is outside the'
                     f' piece of {base.size} elements')
  out = np.array(base, order='C', copy=True)
  out.reshape(-1)[indices] = values
  return out


class Encoder:
  """One learner process's side of delta pushes: the served state R_v.

  `encode(key, new)` is called for each of a version's pieces in turn,
  between `begin(version)` calls; it returns the piece as the servers will
  hold it (R_v) and, when smaller, its sparse form against R_{v-1}.
  """

  def __init__(self, *, rtol: float = 0.0, anchor_every: int = 0):
    """`rtol`: relative tolerance (0: any changed bit is sent);
    `anchor_every`: send every n-th version whole and exact (0: only the
    first; with `rtol > 0` it bounds how long an error below the tolerance
    may persist)."""
    if rtol < 0 or anchor_every < 0:
      raise ValueError(f'rtol={rtol} and anchor_every={anchor_every} must be'
                       ' >= 0')
    self.rtol = float(rtol)
    self.anchor_every = int(anchor_every)
    self._nonce = secrets.token_hex(8)
    self._served: dict = {}  # key -> R_{v-1} piece data
    self._next: dict = {}  # key -> R_v, as encoded so far
    self.base_id: str | None = None  # id of R_{v-1}
    self.base_version: int | None = None
    self.state_id: str | None = None  # id of R_v
    self.version: int | None = None
    self.anchor = True

  def begin(self, version: int) -> None:
    """Starts encoding `version`: what the last one encoded becomes the
    base."""
    if self.state_id is not None:
      self._served, self._next = self._next, {}
      self.base_id, self.base_version = self.state_id, self.version
    self.anchor = (self.base_id is None or (
        self.anchor_every > 0 and version % self.anchor_every == 0))
    self.version = int(version)
    self.state_id = f'{self._nonce}:{int(version)}'

  def encode(self, key, new: np.ndarray):
    """(R_v data, sparse (indices+values bytes, count) or None) of one
    piece; `new` is the learner's piece in the wire dtype (may be reused
    as R_v's data)."""
    base = None if self.anchor else self._served.get(key)
    if base is None or base.shape != new.shape or base.dtype != new.dtype:
      self._next[key] = new
      return new, None
    if self.rtol == 0:
      bits = np.dtype(f'u{new.dtype.itemsize}')
      changed = new.reshape(-1).view(bits) != base.reshape(-1).view(bits)
    else:
      moved = np.abs(new.astype(np.float32) - base.astype(np.float32))
      # NaN compares False: a NaN appears as changed, and is sent.
      changed = ~(moved <= self.rtol * np.abs(base.astype(np.float32)))
      changed = changed.reshape(-1)
    count = int(np.count_nonzero(changed))
    if sparse_nbytes(count, new.size, new.dtype) >= new.nbytes:
      # Counted first: the indices of a piece that goes whole anyway would
      # be 8 bytes per element (an f32 Adam step changes nearly all).
      self._next[key] = new
      return new, None
    indices = np.flatnonzero(changed).astype(index_dtype(new.size))
    served = new
    if self.rtol > 0:
      # What the servers will hold: the base, moved where the change shows.
      served = np.array(base, copy=True)
      served.reshape(-1)[indices] = new.reshape(-1)[indices]
    values = served.reshape(-1)[indices]
    payload = np.empty(sparse_nbytes(count, new.size, new.dtype), np.uint8)
    payload[:indices.nbytes] = indices.view(np.uint8)
    payload[indices.nbytes:] = values.view(np.uint8)
    self._next[key] = served
    return served, (payload, count)


def _off(**unused) -> None:
  del unused  # every version whole


# By `config.rollout.weight_delta`: an encoder for the transport, or None.
ENCODERS = {'off': _off, 'sparse': Encoder}
