r"""Serves the policy with JetStream: `python -m sao_jax.serve`.

  SAO_ADMIN_SECRET=... python -m sao_jax.serve --config=configs/default.py \
      --port=9000 --weights_root=WORKDIR/weights [--host=0.0.0.0] \
      [--server_index=0] [--restart=0] [--parent_pid=PID] \
      [--config.rollout.max_concurrent_decodes=16]

Starts a JetStream gRPC server on `--host:--port` (loopback by default) with
our engine for `config.model.source`, plus the admin service the learner uses
to push weights (authenticated by the secret in $SAO_ADMIN_SECRET or
`--config.rollout.admin_secret_file`), loaded only from under
`--weights_root` (the learner's `<workdir>/weights`; without it the server
refuses pushes). Prints one JSON line `{"event": "ready", "port": P, "pid": N}`
on stdout when it accepts requests (`--port=0` picks a free port), and stops
gracefully on SIGTERM or SIGINT, and, with `--parent_pid`, when that process
(the trainer that started it) dies, even of SIGKILL.

The sampling key is `config.seed` with `--server_index` (this server's
position among the run's servers) and `--restart` (how often the run was
restarted) folded in: the servers of one run, and a run resumed from a
checkpoint, draw different random streams.
"""

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

from absl import flags

from sao_jax import config_lib
from sao_jax import process_memory
from sao_jax import recipe_checks
from sao_jax.rollout import engine as engine_lib
from sao_jax.rollout import jetstream_compat
from sao_jax.rollout import server as server_lib
from sao_jax.rollout import weight_sync

_CONFIG = config_lib.define_config_flag()
_PORT = flags.DEFINE_integer('port', 9000, 'gRPC port (0: any free port)')
_HOST = flags.DEFINE_string('host', None,
                            'bind address (default config.rollout.bind_host)')
_WEIGHTS = flags.DEFINE_string(
    'weights', None, 'orbax policy checkpoint to serve instead of the model'
    " source's weights (written by the learner)")
_VERSION = flags.DEFINE_integer('version', 0, 'policy version of the weights')
_SERVER_INDEX = flags.DEFINE_integer(
    'server_index', 0, "this server's position among the run's servers"
    ' (folded into the sampling key)', lower_bound=0)
_RESTART = flags.DEFINE_integer(
    'restart', 0, 'how many times the run was restarted (folded into the'
    ' sampling key)', lower_bound=0)
_WEIGHTS_ROOT = flags.DEFINE_string(
    'weights_root', None, 'the only directory UpdateWeights loads pushed'
    ' checkpoints from (the learner\'s <workdir>/weights); unset: pushes are'
    ' refused')
_PARENT_PID = flags.DEFINE_integer(
    'parent_pid', 0, 'stop when this process (the trainer) dies; 0: never',
    lower_bound=0)


def main(argv: Sequence[str]) -> None:
  del argv
  process_memory.release_freed_arrays()
  logging.basicConfig(level=logging.INFO,
                      format='%(asctime)s %(levelname)s %(name)s: %(message)s')
  if _PARENT_PID.value:
    _stop_with_parent(_PARENT_PID.value)
  jetstream_compat.quiet_orchestrator_logs()
  config = _CONFIG.value
  recipe_checks.validate(config)
  recipe_checks.check_inputs(config, task=False)
  secret = weight_sync.read_secret(config.rollout.admin_secret_file or None)
  weights_root = (os.path.abspath(_WEIGHTS_ROOT.value) if _WEIGHTS_ROOT.value
                  else None)
  engine = engine_lib.build_engine(config, version=_VERSION.value,
                                   server_index=_SERVER_INDEX.value,
                                   restart=_RESTART.value)
  if _WEIGHTS.value:
    engine.weights.swap(
        weight_sync.load_policy(_WEIGHTS.value, engine.abstract_state()),
        _VERSION.value)
  try:
    server = server_lib.RolloutServer(
        engine, port=_PORT.value, secret=secret,
        host=_HOST.value or config.rollout.bind_host,
        weights_root=weights_root,
        data_port=config.rollout.weight_data_port,
        reuse_host_buffers=config.rollout.weight_reuse_host_buffers)
  except server_lib.PortInUseError as e:
    raise config_lib.ConfigError(str(e)) from e
  stop = threading.Event()

  def on_signal(signum, frame):
    del frame
    logging.info('signal %d: stopping gracefully', signum)
    stop.set()

  signal.signal(signal.SIGTERM, on_signal)
  signal.signal(signal.SIGINT, on_signal)
  if weights_root is None:
    logging.warning('started without --weights_root: weight pushes will be'
                    ' refused')
  print(json.dumps({'event': 'ready', 'port': server.port,
                    'pid': os.getpid()}), flush=True)
  stop.wait()
  server.stop()
  sys.exit(0)


def _stop_with_parent(parent_pid: int, interval_s: float = 1.0) -> None:
  """Sends this process SIGTERM once `parent_pid` is gone (a daemon thread).

  A server must not outlive the trainer that started it, even one killed by
  SIGKILL (no chance to stop its children). SIGTERM takes the usual way out:
  a graceful stop once serving, the default (immediate exit) while starting.
  """
  # Our parent's death re-parents us (to init or a subreaper), which also
  # holds when its pid is reused meanwhile; a process that is not our parent
  # can only be checked for existence.
  is_parent = os.getppid() == parent_pid

  def gone() -> bool:
    if is_parent:
      return os.getppid() != parent_pid
    try:
      os.kill(parent_pid, 0)
    except ProcessLookupError:
      return True
    except PermissionError:  # it exists, as another user's process
      return False
    return False

  def watch():
    while not gone():
      time.sleep(interval_s)
    logging.warning('process %d (the parent) is gone: stopping', parent_pid)
    os.kill(os.getpid(), signal.SIGTERM)

  threading.Thread(target=watch, name='parent-watch', daemon=True).start()


if __name__ == '__main__':
  config_lib.run(main)
