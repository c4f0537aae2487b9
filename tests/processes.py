"""Finding and waiting for the processes a test run started."""

import os
import time

import pytest


def server_pids(trainer_pid):
  """The `sao_jax.serve` processes started by trainer `trainer_pid`."""
  pids = []
  for name in os.listdir('/proc'):
    if not name.isdigit():
      continue
    try:
      with open(f'/proc/{name}/cmdline', 'rb') as f:
        argv = f.read().decode(errors='replace').split('\0')
    except OSError:
      continue
    if 'sao_jax.serve' in argv and f'--parent_pid={trainer_pid}' in argv:
      pids.append(int(name))
  return sorted(pids)


def wait_until(predicate, timeout, what):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if predicate():
      return
    time.sleep(0.2)
  pytest.fail(f'{what} within {timeout} s')
