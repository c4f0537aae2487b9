"""The server's store of finished sequences' KV caches, for multi-turn reuse.

Turn k + 1 of an agent episode is turn k's prompt, its sampled reply and the
observation the environment appended. Prefilling it whole makes an episode
of n turns prefill O(n T) tokens; with the keys/values of turn k's finished
row kept here, the engine prefills only the tokens after the longest prefix
it already holds (`Engine.prefill`).

Entries are keyed by their token sequences and matched by longest common
prefix (a reply cut by the client's `max_tokens` may run on in the engine
for a few steps, so the stored row can be longer than what the client saw:
the common prefix is still exact, since a position's keys and values depend
only on the tokens up to it). An entry also records the policy version that
computed its keys and values; a lookup matches only entries of the version
it serves, and entries of other versions are dropped as soon as a lookup or
a save sees a newer one, so a weight swap invalidates everything kept and
mu_t stays the sampling distribution of the version a token reports. Memory
is bounded (`max_bytes` of device arrays) with least-recently-used eviction.

Thread-safe: the engine's prefill thread looks up, its generate thread
saves.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

import numpy as np


@dataclasses.dataclass
class Entry:
  """One finished row: its tokens and their keys/values.

  Attributes:
    tokens: int32 `[n]`, the row's sequence (prompt and sampled tokens), every
      one of which has keys/values in `kv`.
    kv: the engine's keys/values of the row, positions `[0, n)` valid
      (device arrays; opaque here except for their size).
    version: the policy version that computed them.
    nbytes: device bytes of `kv`.
  """
  tokens: np.ndarray
  kv: Any
  version: int
  nbytes: int


@dataclasses.dataclass
class Stats:
  """Counters since the server started (served by the admin `Status`)."""
  lookups: int = 0
  hits: int = 0
  prefilled_tokens: int = 0  # tokens run through the model by prefills
  reused_tokens: int = 0  # prompt tokens whose keys/values came from here
  saved: int = 0
  evicted: int = 0  # for memory
  invalidated: int = 0  # computed by an older policy version


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
  """Length of the longest common prefix of two 1-D int arrays."""
  n = min(len(a), len(b))
  differ = np.flatnonzero(a[:n] != b[:n])
  return int(differ[0]) if len(differ) else n


class PrefixCache:
  """LRU store of `Entry`s under a byte budget (see module docstring)."""

  def __init__(self, max_bytes: int):
    if max_bytes < 0:
      raise ValueError(f'max_bytes must be >= 0, got {max_bytes}')
    self.max_bytes = int(max_bytes)
    self.stats = Stats()
    self._lock = threading.Lock()
    self._entries: collections.OrderedDict[int, Entry] = (
        collections.OrderedDict())
    self._next_key = 0
    self._bytes = 0
    self._newest_version = -1

  @property
  def enabled(self) -> bool:
    return self.max_bytes > 0

  def __len__(self) -> int:
    with self._lock:
      return len(self._entries)

  @property
  def nbytes(self) -> int:
    with self._lock:
      return self._bytes

  def _see_version(self, version: int) -> None:
    """Drops every entry of another version once `version` is newer."""
    if version <= self._newest_version:
      return
    self._newest_version = version
    for key in [k for k, e in self._entries.items() if e.version != version]:
      self._bytes -= self._entries.pop(key).nbytes
      self.stats.invalidated += 1

  def lookup(self, tokens: np.ndarray, version: int,
             min_reuse: int = 1) -> tuple[Entry | None, int]:
    """The entry sharing the longest prefix with `tokens` under `version`.

    Returns:
      `(entry, reuse)`: `reuse` tokens of `tokens` have keys/values in
      `entry` (at most `len(tokens) - 1`: the last prompt token is always
      computed, for the logits of the first sampled token); `(None, 0)`
      when no entry shares at least `min_reuse` tokens.
    """
    tokens = np.asarray(tokens, np.int32)
    with self._lock:
      self.stats.lookups += 1
      self._see_version(version)
      best, best_len = None, 0
      for key, entry in self._entries.items():
        if entry.version != version:
          continue
        n = common_prefix_length(entry.tokens, tokens)
        if n > best_len:
          best, best_len = key, n
      reuse = min(best_len, len(tokens) - 1)
      if best is None or reuse < min_reuse:
        return None, 0
      self._entries.move_to_end(best)
      self.stats.hits += 1
      return self._entries[best], reuse

  def count_prefill(self, computed: int, reused: int) -> None:
    with self._lock:
      self.stats.prefilled_tokens += computed
      self.stats.reused_tokens += reused

  def save(self, tokens: np.ndarray, kv, version: int, nbytes: int) -> bool:
    """Keeps a finished row; False when it cannot be kept (too large, an
    older version than the newest seen, or the store is off)."""
    if not self.enabled or nbytes > self.max_bytes or len(tokens) == 0:
      return False
    tokens = np.asarray(tokens, np.int32)
    with self._lock:
      self._see_version(version)
      if version != self._newest_version:
        return False
      # A row that only extends (or repeats) a kept one replaces it: the
      # longer entry serves every lookup the shorter one would.
      for key in [k for k, e in self._entries.items()
                  if len(e.tokens) <= len(tokens)
                  and common_prefix_length(e.tokens, tokens) == len(e.tokens)]:
        self._bytes -= self._entries.pop(key).nbytes
      while self._entries and self._bytes + nbytes > self.max_bytes:
        _, old = self._entries.popitem(last=False)
        self._bytes -= old.nbytes
        self.stats.evicted += 1
      self._entries[self._next_key] = Entry(tokens, kv, int(version),
                                            int(nbytes))
      self._next_key += 1
      self._bytes += nbytes
      self.stats.saved += 1
      return True

  def status(self) -> dict:
    """Counters and occupancy, for the admin `Status`."""
    with self._lock:
      s = dataclasses.asdict(self.stats)
      s.update(entries=len(self._entries), bytes=self._bytes,
               max_bytes=self.max_bytes)
      return s
