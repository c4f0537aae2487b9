"""Two processes joined by `jax.distributed` train like one process."""

import json
import os
import socket
import subprocess
import sys

import chex
import pytest

from sao_jax import xla_flags

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def run_processes(num_processes, out):
  port = free_port()
  env = xla_flags.child_environment(dict(os.environ, PYTHONPATH=ROOT))
  procs = [subprocess.Popen(
      [sys.executable, os.path.join(HERE, 'distributed_worker.py'), str(i),
       str(num_processes), str(port), str(out)],
      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(num_processes)]
  outputs = [p.communicate(timeout=600)[0] for p in procs]
  for p, output in zip(procs, outputs):
    assert p.returncode == 0, output[-4000:]
  with open(out) as f:
    return json.load(f)


@pytest.mark.slow
def test_two_processes_agree_with_one(tmp_path):
  single = run_processes(1, tmp_path / 'single.json')
  double = run_processes(2, tmp_path / 'double.json')
  # Both steps' losses and every parameter's checksum.
  chex.assert_trees_all_close(double, single, rtol=1e-5)
