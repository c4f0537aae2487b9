"""Keeps the trainer's local rollout servers running.

A background thread polls each local server process; one that exited (a
crash, an OOM kill, a stray signal) is reported to `on_death` at once (the
trainer routes traffic around it) and started again on its old port after a
backoff that doubles with each restart of the same server (1, 2, 4, ... s, up
to `max_backoff_s`; reset once it has stayed up for a minute). A restarted
server loads the model source's weights; the server pool's revive hook brings
it to the current version before it gets traffic. Restarts are counted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from sao_jax import process_memory
from sao_jax.rollout import launch

_log = logging.getLogger(__name__)

# A server that stayed up this long starts its backoff from the bottom again.
_STABLE_S = 60.0
_POLL_S = 0.5


class Supervisor:
  """Restarts dead local servers with backoff (a daemon thread)."""

  def __init__(self, servers: Sequence[launch.SubprocessServer], *,
               on_death: Callable[[str], None], max_backoff_s: float = 30.0,
               start_timeout_s: float = 600.0):
    """Sets up (does not start) supervision of `servers`.

    Args:
      servers: the running servers; `servers` (the attribute) always holds the
        current process of each.
      on_death: called with a server's address when its process is found dead
        (from the supervisor thread).
      max_backoff_s: the longest wait before a restart.
      start_timeout_s: how long a restarted server may take to be ready.
    """
    self.servers = list(servers)
    self._on_death = on_death
    self._max_backoff_s = max_backoff_s
    self._start_timeout_s = start_timeout_s
    self._stop = threading.Event()
    self._lock = threading.Lock()
    self._thread: threading.Thread | None = None
    n = len(self.servers)
    self._backoff_s = [1.0] * n
    self._started_at = [time.monotonic()] * n
    self._retry_at: list[float | None] = [None] * n
    self.restarts = 0
    self.failed_restarts = 0
    self.deaths = 0

  def start(self) -> None:
    self._thread = threading.Thread(target=self._run, name='supervisor',
                                    daemon=True)
    self._thread.start()

  def stop(self) -> list[launch.SubprocessServer]:
    """Stops supervising (no restart after this); returns the servers."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=60)
    with self._lock:
      return list(self.servers)

  def stats(self) -> dict[str, float]:
    """Restart counters, and the local servers' resident memory (summed)."""
    with self._lock:
      pids = [s.process.pid for s in self.servers if s.alive()]
    usage = [process_memory.usage(pid) for pid in pids]
    return {'server_deaths': float(self.deaths),
            'server_restarts': float(self.restarts),
            'server_failed_restarts': float(self.failed_restarts),
            'server_rss_gb': sum(rss for rss, _ in usage),
            'server_peak_rss_gb': sum(peak for _, peak in usage)}

  def _run(self) -> None:
    while not self._stop.wait(_POLL_S):
      for i in range(len(self.servers)):
        if self._stop.is_set():
          return
        self._check(i)

  def _check(self, i: int) -> None:
    server = self.servers[i]
    now = time.monotonic()
    if server.alive():
      if now - self._started_at[i] > _STABLE_S:
        self._backoff_s[i] = 1.0
      return
    if self._retry_at[i] is None:  # newly found dead
      self.deaths += 1
      _log.warning('rollout server %s exited with %s; restarting it in'
                   ' %.0f s; end of %s:\n%s', server.address,
                   server.process.returncode, self._backoff_s[i],
                   server.log_path, launch.log_tail(server.log_path,
                                                           1500))
      self._on_death(server.address)
      self._retry_at[i] = now + self._backoff_s[i]
      self._backoff_s[i] = min(self._backoff_s[i] * 2, self._max_backoff_s)
      return
    if now < self._retry_at[i]:
      return
    try:
      fresh = launch.respawn(server, self._start_timeout_s,
                                    should_abort=self._stop.is_set)
    except launch.StartAborted:
      return
    except Exception as e:  # pylint: disable=broad-except
      # Port taken, crash during start: try again after a longer backoff.
      self.failed_restarts += 1
      _log.warning('restarting rollout server %s failed: %s', server.address,
                   str(e).splitlines()[0] if str(e) else repr(e))
      self._retry_at[i] = time.monotonic() + self._backoff_s[i]
      self._backoff_s[i] = min(self._backoff_s[i] * 2, self._max_backoff_s)
      return
    with self._lock:
      self.servers[i] = fresh
    self.restarts += 1
    self._retry_at[i] = None
    self._started_at[i] = time.monotonic()
    _log.warning('rollout server %s restarted (pid %d)', fresh.address,
                 fresh.process.pid)
