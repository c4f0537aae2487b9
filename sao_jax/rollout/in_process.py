"""A rollout server inside the calling process, for notebooks.

`python -m sao_jax.train` starts its rollout servers as subprocesses
(`local_servers`). A notebook cannot always do that: on a TPU runtime one
process holds the chips, and two processes cannot share them. `serve` runs the
same JetStream server (`server.RolloutServer`: orchestrator, engine, gRPC and
admin services) on background threads of this process, on a free loopback
port, and yields a copy of the config that points the trainer at it through
`rollout.server_addresses`, exactly as at a remote server. The learner's
weight pushes are authenticated by a fresh admin secret, kept in a private
temporary file (`rollout.admin_secret_file`) that is removed afterwards.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile

import jax

from sao_jax.rollout import engine as engine_lib
from sao_jax.rollout import server as server_lib


@contextlib.contextmanager
def serve(config, devices=None, server_index: int = 0, restart: int = 0,
          weights_root: str = os.sep):
  """Serves `config`'s model in this process while the context is open.

  Args:
    config: a training config; its model, sampling and engine shape are
      served. It is not modified.
    devices: the engine's devices; defaults to the first local device, which
      the learner shares.
    server_index: this server's position among the run's servers.
    restart: how many times the run was restarted. Both are folded into the
      sampling key with `config.seed` (`engine.EngineConfig`), so that no two
      servers, and no restart of a run, draw the same random stream.
    weights_root: the directory weight pushes may load from. Any by default:
      the admin secret never leaves this user's private file, and this user
      can read every path the server could.

  Yields:
    A copy of `config` with `rollout.server_addresses` and
    `rollout.admin_secret_file` set for this server.
  """
  secret = secrets.token_hex(16)
  fd, secret_file = tempfile.mkstemp(prefix='sao_admin_')  # mode 600
  try:
    with os.fdopen(fd, 'w') as f:
      f.write(secret)
    engine = engine_lib.build_engine(
        config, devices=devices or jax.local_devices()[:1],
        server_index=server_index, restart=restart)
    server = server_lib.RolloutServer(engine, port=0, secret=secret,
                                      host='127.0.0.1',
                                      weights_root=weights_root)
    try:
      run_config = config.copy_and_resolve_references()
      run_config.rollout.server_addresses = f'127.0.0.1:{server.port}'
      run_config.rollout.admin_secret_file = secret_file
      yield run_config
    finally:
      server.stop()
  finally:
    os.remove(secret_file)
