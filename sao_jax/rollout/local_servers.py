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
from collections.abc import Callable, Sequence

from sao_jax.rollout import weight_sync

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))


@dataclasses.dataclass
class LocalServer:
  """A running server process, and how to start it again."""
  process: subprocess.Popen
  address: str
  log_path: str
  argv: list[str] = dataclasses.field(default_factory=list)
  env: dict[str, str] | None = None

  def alive(self) -> bool:
    return self.process.poll() is None

  @property
  def port(self) -> int:
    return int(self.address.rpartition(':')[2])


def server_argv(config_path: str, index: int, restart: int = 0,
                overrides: Sequence[str] = (), *,
                weights_root: str | None = None,
                parent_pid: int = 0) -> list[str]:
  """The command line of server `index` (its position among the servers).

  `weights_root` is the only directory the server loads pushed weights from;
  with `parent_pid` the server exits when that process (the trainer) dies.
  """
  argv = [sys.executable, '-m', 'sao_jax.serve', f'--config={config_path}',
          '--port=0', f'--server_index={index}', f'--restart={restart}']
  if weights_root:
    argv.append(f'--weights_root={os.path.abspath(weights_root)}')
  if parent_pid:
    argv.append(f'--parent_pid={parent_pid}')
  return argv + list(overrides)


def start(config_path: str, *, count: int, secret: str, log_dir: str,
          overrides: Sequence[str] = (), env: dict | None = None,
          timeout_s: float = 600.0, restart: int = 0,
          weights_root: str | None = None,
          should_abort: Callable[[], bool] | None = None
          ) -> list[LocalServer]:
  """Starts `count` servers and waits until each accepts requests.

  The processes start together (their imports and model loads overlap); each
  prints a JSON ready line with its port, which this reads. Each server exits
  by itself when this process dies (`--parent_pid`), even of SIGKILL.

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
    weights_root: the directory pushed weights are loaded from (servers
      refuse any other path).
    should_abort: polled while waiting; True stops the servers and raises
      `StartAborted` (a stop requested during start-up).

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
      argv = server_argv(config_path, i, restart, overrides,
                         weights_root=weights_root, parent_pid=os.getpid())
      started.append(LocalServer(_spawn(argv, base_env, log_path, 'w'), '',
                                 log_path, argv, base_env))
    return [_wait_ready(s, timeout_s, should_abort) for s in started]
  except BaseException:
    stop(started)
    raise


class StartAborted(RuntimeError):
  """`should_abort` said to stop waiting for a server."""


def respawn(server: LocalServer, timeout_s: float = 600.0,
            should_abort: Callable[[], bool] | None = None) -> LocalServer:
  """Starts a dead server again, on its old port (clients keep its address).

  Its log gets the new run appended, so the cause of the death stays on
  record. Raises like `start`.
  """
  argv = [f'--port={server.port}' if a == '--port=0' else a
          for a in server.argv]
  with open(server.log_path, 'a') as f:
    f.write(f'\n--- restarted at {time.strftime("%Y-%m-%d %H:%M:%S")} ---\n')
  fresh = LocalServer(_spawn(argv, server.env, server.log_path, 'a'), '',
                      server.log_path, server.argv, server.env)
  try:
    return _wait_ready(fresh, timeout_s, should_abort)
  except BaseException:
    stop([fresh])
    raise


def _spawn(argv, env, log_path, mode) -> subprocess.Popen:
  with open(log_path, mode) as log:
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                            stderr=log, text=True)


def log_tail(log_path: str, chars: int = 4000) -> str:
  try:
    with open(log_path, errors='replace') as f:
      return f.read()[-chars:]
  except OSError as e:
    return f'(cannot read {log_path}: {e})'


def _wait_ready(server: LocalServer, timeout_s: float,
                should_abort: Callable[[], bool] | None) -> LocalServer:
  process = server.process
  selector = selectors.DefaultSelector()
  selector.register(process.stdout, selectors.EVENT_READ)
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if should_abort is not None and should_abort():
      raise StartAborted('stopped while waiting for a rollout server')
    if selector.select(timeout=1.0):
      line = process.stdout.readline()
      if line:
        ready = json.loads(line)
        return dataclasses.replace(server,
                                   address=f'127.0.0.1:{ready["port"]}')
    if process.poll() is not None:
      break
  raise RuntimeError(f'rollout server (pid {process.pid}) did not start;'
                     f' end of {server.log_path}:\n{log_tail(server.log_path)}')


def stop(servers: Sequence[LocalServer], grace_s: float = 30.0) -> None:
  """SIGTERM (graceful), then SIGKILL whatever is left after `grace_s`."""
  for server in servers:
    if server.alive():
      server.process.send_signal(signal.SIGTERM)
      # A stopped (SIGSTOP) process acts on SIGTERM only once continued.
      server.process.send_signal(signal.SIGCONT)
  deadline = time.monotonic() + grace_s
  for server in servers:
    try:
      server.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
      server.process.kill()
      server.process.wait()
