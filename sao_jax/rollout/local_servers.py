"""Rollout servers as local subprocesses (`python -m sao_jax.serve`).

The trainer's default on a laptop or in CI, and what tests and benchmarks use:
each server is a real JetStream gRPC server in its own process on loopback,
started with the same config as the learner (written to a config file) and a
fresh admin secret, and stopped with SIGTERM (SIGKILL after a grace period).
"""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from sao_jax.rollout import weight_sync

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))


@dataclasses.dataclass
class LocalServer:
  """A running server process."""
  process: subprocess.Popen
  address: str
  log_path: str

  def alive(self) -> bool:
    return self.process.poll() is None


def server_argv(config_path: str, index: int, restart: int = 0,
                overrides: Sequence[str] = ()) -> list[str]:
  """The command line of server `index` (its position among the servers)."""
  return [sys.executable, '-m', 'sao_jax.serve', f'--config={config_path}',
          '--port=0', f'--server_index={index}', f'--restart={restart}',
          *overrides]


def start(config_path: str, *, count: int, secret: str, log_dir: str,
          overrides: Sequence[str] = (), env: dict | None = None,
          timeout_s: float = 600.0, restart: int = 0) -> list[LocalServer]:
  """Starts `count` servers and waits until each accepts requests.

  The processes start together (their imports and model loads overlap); each
  prints a JSON ready line with its port, which this reads.

  Args:
    config_path: `path.py[:arg]` given to `--config`.
    count: number of servers.
    secret: the admin secret (passed in the environment, never argv).
    log_dir: where each server's log goes (`server<i>.log`).
    overrides: extra `--config.a.b=value` flags.
    env: extra environment variables for the servers.
    timeout_s: how long a server may take to become ready.
    restart: how many times the run was restarted; with each server's index
      it is folded into that server's sampling key, so that no two servers,
      and no restart of the run, draw the same random stream.

  Raises:
    RuntimeError: a server exited or did not become ready; the message holds
      the end of its log. Servers already started are stopped.
  """
  os.makedirs(log_dir, exist_ok=True)
  base_env = dict(os.environ, **(env or {}))
  base_env[weight_sync.SECRET_ENV] = secret
  # A server on fake CPU devices of a parent test would split its model.
  base_env.pop('XLA_FLAGS', None)
  python_path = base_env.get('PYTHONPATH', '')
  base_env['PYTHONPATH'] = _ROOT + (os.pathsep + python_path if python_path
                                    else '')
  started = []
  try:
    for i in range(count):
      log_path = os.path.join(log_dir, f'server{i}.log')
      process = subprocess.Popen(
          server_argv(config_path, i, restart, overrides), env=base_env,
          stdout=subprocess.PIPE, stderr=open(log_path, 'w'), text=True)
      started.append((process, log_path))
    return [_wait_ready(p, log, timeout_s) for p, log in started]
  except BaseException:
    stop([LocalServer(p, '', log) for p, log in started])
    raise


def _wait_ready(process, log_path, timeout_s) -> LocalServer:
  selector = selectors.DefaultSelector()
  selector.register(process.stdout, selectors.EVENT_READ)
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if selector.select(timeout=1.0):
      line = process.stdout.readline()
      if line:
        ready = json.loads(line)
        return LocalServer(process, f'127.0.0.1:{ready["port"]}', log_path)
    if process.poll() is not None:
      break
  with open(log_path) as f:
    tail = f.read()[-4000:]
  raise RuntimeError(f'rollout server (pid {process.pid}) did not start;'
                     f' end of {log_path}:\n{tail}')


def stop(servers: Sequence[LocalServer], grace_s: float = 30.0) -> None:
  """SIGTERM (graceful), then SIGKILL whatever is left after `grace_s`."""
  for server in servers:
    if server.alive():
      server.process.send_signal(signal.SIGTERM)
  deadline = time.monotonic() + grace_s
  for server in servers:
    try:
      server.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
      server.process.kill()
      server.process.wait()
