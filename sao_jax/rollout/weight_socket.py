"""The byte path of a streamed weight push: one TCP connection per push.

The admin gRPC call (`PushWeights`) is the push's control plane: it is
authenticated by the admin secret, carries the manifest, and ends with the
server's verdict. The buckets themselves go over a plain TCP connection to
the server's data port, because gRPC's Python stack copies every message
several times (measured in benchmarks/weight_sync.py: a loopback gRPC copy
of the same bytes runs at a third of a loopback socket's speed). Here the
sender writes each bucket from the learner's host arrays with one `sendmsg`
and the server reads it with `recv_into` straight into the staging leaf it
belongs to.

A data connection is admitted only by a one-time token the server handed
out on an authenticated call: its first `TOKEN_BYTES` bytes must be a token
it is waiting for, or it is closed with nothing more read. So a peer without
the admin secret moves no bytes into the server, as on the gRPC path.

`Listener` is the server's side, `send_frames` the learner's, and
`receive_frames` the server's reading of one connection into a `Staging`.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import struct
import threading
from collections.abc import Iterable
from concurrent import futures

from sao_jax.rollout import weight_staging
from sao_jax.rollout import weight_stream

TOKEN_BYTES = 32
# A connection must present its token within this long.
TOKEN_TIMEOUT_S = 10.0
# Kernel socket buffers: a few MiB keep a loopback or LAN link busy while
# the other side checksums a bucket.
_SOCKET_BUFFER_BYTES = 8 << 20

# Buffers per sendmsg: below every kernel's IOV_MAX (Linux: 1024).
_IOV_MAX = 512

_log = logging.getLogger(__name__)


def _tune(sock: socket.socket) -> None:
  for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
    try:
      sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER_BYTES)
    except OSError:  # a kernel that caps buffers keeps its own size
      pass
  sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _blocking(sock: socket.socket, timeout_s: float) -> None:
  """Blocking I/O with the kernel's own timeouts (SO_RCVTIMEO, SO_SNDTIMEO).

  A socket with a Python timeout is non-blocking underneath: every partial
  read or write returns to Python and must take the GIL back, which a busy
  decode thread holds for up to the switch interval (5 ms) each time. A
  blocking socket fills a whole region with one `recv_into(MSG_WAITALL)` and
  writes a whole bucket with one `sendmsg`, so a transfer takes the GIL a
  few times per bucket, not per kernel chunk. A kernel timeout surfaces as
  `BlockingIOError` (EAGAIN), turned into `TimeoutError` below.
  """
  sock.settimeout(None)
  seconds = max(timeout_s, 0.001)
  timeval = struct.pack('ll', int(seconds), int(seconds % 1 * 1e6))
  for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
    sock.setsockopt(socket.SOL_SOCKET, option, timeval)


class Listener:
  """A server's data port: hands each admitted connection to the push that
  issued its token."""

  def __init__(self, host: str, port: int = 0):
    """Binds `host:port` (0: a free port, see `self.port`) and starts
    accepting in a daemon thread."""
    family = socket.AF_INET6 if ':' in host else socket.AF_INET
    self._sock = socket.create_server((host, port), family=family,
                                      backlog=64)
    self.port = self._sock.getsockname()[1]
    self._waiting: dict[bytes, futures.Future] = {}
    self._lock = threading.Lock()
    self.refused = 0  # connections without a token we were waiting for
    self._closed = False
    self._thread = threading.Thread(target=self._accept, daemon=True,
                                    name='weight-data-accept')
    self._thread.start()

  def expect(self) -> tuple[bytes, futures.Future]:
    """A fresh one-time token, and the future of the connection that
    presents it. `forget(token)` when no connection is wanted any more."""
    token = secrets.token_bytes(TOKEN_BYTES)
    future: futures.Future = futures.Future()
    with self._lock:
      self._waiting[token] = future
    return token, future

  def forget(self, token: bytes) -> None:
    with self._lock:
      future = self._waiting.pop(token, None)
    if future is not None:
      future.cancel()

  def _accept(self) -> None:
    while not self._closed:
      try:
        conn, _ = self._sock.accept()
      except OSError:
        return  # closed
      threading.Thread(target=self._admit, args=(conn,), daemon=True,
                       name='weight-data-admit').start()

  def _admit(self, conn: socket.socket) -> None:
    try:
      conn.settimeout(TOKEN_TIMEOUT_S)
      sent = _read_exactly(conn, TOKEN_BYTES)
    except (OSError, EOFError):
      sent = b''
    future = None
    with self._lock:
      for token in list(self._waiting):
        # Constant time per comparison: a wrong token says nothing about
        # how close it came.
        if hmac.compare_digest(token, sent):
          future = self._waiting.pop(token)
          break
    if future is None or not future.set_running_or_notify_cancel():
      with self._lock:
        self.refused += 1
      _log.warning('weight data connection refused: no valid token')
      conn.close()
      return
    _tune(conn)
    future.set_result(conn)

  def close(self) -> None:
    self._closed = True
    try:
      self._sock.close()
    except OSError:
      pass
    with self._lock:
      waiting, self._waiting = self._waiting, {}
    for future in waiting.values():
      future.cancel()


def _read_exactly(conn: socket.socket, n: int) -> bytes:
  buffer = bytearray(n)
  _fill(conn, memoryview(buffer))
  return bytes(buffer)


def _fill(conn: socket.socket, view: memoryview) -> None:
  """Reads exactly `len(view)` bytes into `view`; EOFError if the peer
  closed first, TimeoutError if it sent nothing for the socket's timeout."""
  while len(view):
    try:
      got = conn.recv_into(view, len(view), socket.MSG_WAITALL)
    except BlockingIOError as e:  # SO_RCVTIMEO passed with nothing read
      raise TimeoutError('no bytes within the timeout') from e
    if not got:
      raise EOFError('the connection closed mid-stream')
    view = view[got:]


def receive_frames(conn: socket.socket, staging: weight_staging.Staging,
                   stream, timeout_s: float) -> None:
  """Reads one part's buckets from `conn` into `staging` until the part's
  `total_bytes` arrived; each read gets `timeout_s`.

  Raises:
    weight_stream.StreamError: for a bucket that fails its checks, or a
      connection that closes or stalls before the part is complete.
  """
  _blocking(conn, timeout_s)
  header = memoryview(bytearray(weight_stream.HEADER_BYTES))
  try:
    while stream.received < stream.total:
      _fill(conn, header)
      staging.read_bucket(stream, bytes(header),
                          lambda view: _fill(conn, view))
  except EOFError as e:
    raise weight_stream.StreamError(
        f'the data connection closed after {stream.received} of'
        f' {stream.total} bytes') from e
  except socket.timeout as e:
    raise weight_stream.StreamError(
        f'no bytes for {timeout_s:g} s after {stream.received} of'
        f' {stream.total}') from e
  except OSError as e:
    raise weight_stream.StreamError(
        f'the data connection broke after {stream.received} of'
        f' {stream.total} bytes: {e}') from e


def connect(host: str, port: int, token: bytes,
            timeout_s: float) -> socket.socket:
  """The learner's end of a data connection, its token presented; each
  later write gets `timeout_s`."""
  conn = socket.create_connection((host, port), timeout=timeout_s)
  _tune(conn)
  conn.sendall(token)
  _blocking(conn, timeout_s)
  return conn


def send_frames(conn: socket.socket,
                frames: Iterable[tuple[bytes, list[memoryview]]]) -> int:
  """Writes `weight_stream.frames` to `conn` (each bucket one `sendmsg`,
  resumed where the kernel took only part); returns the bytes sent.

  Raises:
    TimeoutError: the peer took nothing for the socket's timeout.
  """
  sent = 0
  for header, parts in frames:
    buffers = [memoryview(header), *parts]
    while buffers:
      try:
        n = conn.sendmsg(buffers[:_IOV_MAX])
      except BlockingIOError as e:  # SO_SNDTIMEO passed with nothing sent
        raise TimeoutError('the peer took no bytes within the'
                           ' timeout') from e
      sent += n
      while buffers and n >= len(buffers[0]):
        n -= len(buffers[0])
        buffers.pop(0)
      if n:
        buffers[0] = buffers[0][n:]
  return sent
