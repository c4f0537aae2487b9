"""Starting rollout servers: as subprocesses, or inside this process.

Either way a server is a real JetStream gRPC server (`server.RolloutServer`)
on a free loopback port, serving the run's config, with weight pushes
authenticated by an admin secret; each started server is a handle with an
`address` and `alive()`, and `stop` ends any of them.

  * `start_subprocesses`: one `python -m sao_jax.serve` process per server,
    started with the same config as the learner (written to a config file).
    The trainer's default on a laptop or in CI, and what tests and benchmarks
    use; `respawn` starts a dead one again (`server_supervisor` does).
  * `start_in_process`: the server on background threads of this process,
    for notebooks: on a TPU runtime one process holds the chips, and two
    processes cannot share them. `serve_in_process` wraps it for the trainer:

      with launch.serve_in_process(config) as run_config:
        trainer.run(run_config, workdir)

    yields a copy of the config that points the trainer at the server through
    `rollout.server_addresses`, exactly as at a remote server, with a fresh
    admin secret in a private temporary file (`rollout.admin_secret_file`)
    that is removed afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import jax

from sao_jax import xla_flags
from sao_jax.rollout import weight_sync

if TYPE_CHECKING:
  from sao_jax.rollout import server as server_lib

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))


@dataclasses.dataclass
class SubprocessServer:
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


def start_subprocesses(config_path: str, *, count: int, secret: str,
                       log_dir: str, overrides: Sequence[str] = (),
                       env: dict | None = None, timeout_s: float = 600.0,
                       restart: int = 0, weights_root: str | None = None,
                       should_abort: Callable[[], bool] | None = None,
                       first_index: int = 0) -> list[SubprocessServer]:
  """Starts `count` server processes and waits until each accepts requests.

  The processes start together (their imports and model loads overlap); each
  prints a JSON ready line with its port, which this reads. Each server exits
  by itself when this process dies (`--parent_pid`), even of SIGKILL.

  Args:
    config_path: `path.py[:arg]` given to `--config`.
    count: number of servers.
    secret: the admin secret (passed in the environment, never argv).
    log_dir: where each server's log goes (`server<index>.log`).
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
    first_index: the index of the first server among the run's servers
      (on several hosts each starts its own: process p's are numbered from
      p * count, so no two draw the same stream or share a log).

  Raises:
    RuntimeError: a server exited or did not become ready; the message holds
      the end of its log. Servers already started are stopped.
  """
  os.makedirs(log_dir, exist_ok=True)
  # A server on fake CPU devices of a parent test would split its model.
  base_env = xla_flags.child_environment(dict(os.environ, **(env or {})))
  base_env[weight_sync.SECRET_ENV] = secret
  python_path = base_env.get('PYTHONPATH', '')
  base_env['PYTHONPATH'] = _ROOT + (os.pathsep + python_path if python_path
                                    else '')
  started = []
  try:
    for i in range(first_index, first_index + count):
      log_path = os.path.join(log_dir, f'server{i}.log')
      argv = server_argv(config_path, i, restart, overrides,
                         weights_root=weights_root, parent_pid=os.getpid())
      started.append(SubprocessServer(_spawn(argv, base_env, log_path, 'w'), '',
                                 log_path, argv, base_env))
    return [_wait_ready(s, timeout_s, should_abort) for s in started]
  except BaseException:
    stop(started)
    raise


class StartAborted(RuntimeError):
  """`should_abort` said to stop waiting for a server."""


def respawn(server: SubprocessServer, timeout_s: float = 600.0,
            should_abort: Callable[[], bool] | None = None) -> SubprocessServer:
  """Starts a dead server again, on its old port (clients keep its address).

  Its log gets the new run appended, so the cause of the death stays on
  record. Raises like `start_subprocesses`.
  """
  argv = [f'--port={server.port}' if a == '--port=0' else a
          for a in server.argv]
  with open(server.log_path, 'a') as f:
    f.write(f'\n--- restarted at {time.strftime("%Y-%m-%d %H:%M:%S")} ---\n')
  fresh = SubprocessServer(_spawn(argv, server.env, server.log_path, 'a'), '',
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


def _wait_ready(server: SubprocessServer, timeout_s: float,
                should_abort: Callable[[], bool] | None) -> SubprocessServer:
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


def stop(servers: Sequence[SubprocessServer | InProcessServer],
         grace_s: float = 30.0) -> None:
  """Stops servers of either kind.

  A process gets SIGTERM (graceful), then SIGKILL if it is still there after
  `grace_s`; an in-process server stops its gRPC server and driver threads.
  """
  processes = [s for s in servers if isinstance(s, SubprocessServer)]
  for server in servers:
    if isinstance(server, InProcessServer):
      server.stop()
  for server in processes:
    if server.alive():
      server.process.send_signal(signal.SIGTERM)
      # A stopped (SIGSTOP) process acts on SIGTERM only once continued.
      server.process.send_signal(signal.SIGCONT)
  deadline = time.monotonic() + grace_s
  for server in processes:
    try:
      server.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
      server.process.kill()
      server.process.wait()


class InProcessServer:
  """A server running on background threads of this process."""

  def __init__(self, rollout_server: server_lib.RolloutServer):
    self._server = rollout_server
    self._stopped = False
    self.address = f'127.0.0.1:{rollout_server.port}'

  def alive(self) -> bool:
    return not self._stopped

  def stop(self) -> None:
    if not self._stopped:
      self._stopped = True
      self._server.stop()


def start_in_process(config, *, secret: str, devices=None,
                     server_index: int = 0, restart: int = 0,
                     weights_root: str = os.sep) -> InProcessServer:
  """Serves `config`'s model on background threads of this process.

  Args:
    config: a training config; its model, sampling and engine shape are
      served. It is not modified.
    secret: the admin secret weight pushes must carry.
    devices: the engine's devices; defaults to the first local device, which
      the learner shares.
    server_index: this server's position among the run's servers.
    restart: how many times the run was restarted. Both are folded into the
      sampling key with `config.seed` (`engine.EngineConfig`), so that no two
      servers, and no restart of a run, draw the same random stream.
    weights_root: the directory weight pushes may load from. Any by default:
      the admin secret never leaves this process (or this user's private
      file, with `serve_in_process`), and this user can read every path the
      server could.
  """
  # Imported here, not at the top: JetStream's orchestrator imports
  # TensorFlow (through seqio), ~0.5 GiB of resident memory that a learner
  # whose servers are other processes never needs.
  # pylint: disable=g-import-not-at-top
  from sao_jax.rollout import engine as engine_lib
  from sao_jax.rollout import server as server_lib
  # pylint: enable=g-import-not-at-top
  engine = engine_lib.build_engine(
      config, devices=devices or jax.local_devices()[:1],
      server_index=server_index, restart=restart)
  return InProcessServer(server_lib.RolloutServer(
      engine, port=0, secret=secret, host='127.0.0.1',
      weights_root=weights_root,
      reuse_host_buffers=config.rollout.weight_reuse_host_buffers))


@contextlib.contextmanager
def serve_in_process(config, devices=None, server_index: int = 0,
                     restart: int = 0, weights_root: str = os.sep
                     ) -> Iterator:
  """Serves `config`'s model in this process while the context is open.

  Arguments as `start_in_process`, which this calls with a fresh secret.

  Yields:
    A copy of `config` with `rollout.server_addresses` and
    `rollout.admin_secret_file` set for this server.
  """
  secret = secrets.token_hex(16)
  fd, secret_file = tempfile.mkstemp(prefix='sao_admin_')  # mode 600
  try:
    with os.fdopen(fd, 'w') as f:
      f.write(secret)
    server = start_in_process(config, secret=secret, devices=devices,
                              server_index=server_index, restart=restart,
                              weights_root=weights_root)
    try:
      run_config = config.copy_and_resolve_references()
      run_config.rollout.server_addresses = server.address
      run_config.rollout.admin_secret_file = secret_file
      yield run_config
    finally:
      stop([server])
  finally:
    os.remove(secret_file)
