"""Training under faults, as an operator would cause them: the trainer and its
servers killed, stopped, starved, or misconfigured.

Each test runs `python -m sao_jax.train` on the tiny config in a subprocess
and checks what the run leaves behind: its exit, its checkpoints, its
`metrics.jsonl` (every admitted trajectory accounted for), and that no server
process outlives the trainer. Malformed trajectories are covered at the gate
itself (tests/rollout/test_queue.py), the admin API in
tests/rollout/test_servers.py.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from sao_jax import xla_flags
from sao_jax.logs import metrics_log
from sao_jax.rollout import launch

import processes  # tests/processes.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The trainer runs on one CPU device.
ENV = xla_flags.child_environment(
    dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT))

# Short runs: no evaluation or value pretraining (they are not what is
# tested), a checkpoint every 4 steps, fast supervision.
SHORT = ('--config.eval.at_start=False', '--config.critic.pretrain_steps=0',
         '--config.checkpoint.every=4', '--config.rollout.health_interval_s=1',
         '--config.rollout.health_timeout_s=2',
         '--config.rollout.max_restart_backoff_s=2')

# Every admitted trajectory ends in exactly one of these (queue.py).
OUTCOMES = ('consumed', 'rejected', 'cancelled', 'dropped_stale',
            'dropped_incomplete_group', 'queued', 'in_flight',
            'lost_on_restore')


def command(workdir, *overrides):
  return [sys.executable, '-m', 'sao_jax.train', '--config=configs/tiny.py',
          f'--workdir={workdir}', *SHORT, *overrides]


def start(workdir, *overrides):
  return subprocess.Popen(command(workdir, *overrides), cwd=ROOT, env=ENV,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)


def run(workdir, *overrides, timeout=600):
  return subprocess.run(command(workdir, *overrides), cwd=ROOT, env=ENV,
                        capture_output=True, text=True, timeout=timeout)


def records(workdir):
  path = os.path.join(workdir, 'metrics.jsonl')
  return metrics_log.read_jsonl(path, dedupe=True) if os.path.exists(
      path) else []


def trained_steps(workdir):
  return sorted(r['step'] for r in records(workdir) if 'train/reward' in r)


def wait_for_step(process, workdir, step, timeout=300):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    steps = trained_steps(workdir)
    if steps and steps[-1] >= step:
      return
    if process.poll() is not None:
      _, err = process.communicate()
      pytest.fail(f'the run ended before step {step}:\n{err[-3000:]}')
    time.sleep(0.2)
  pytest.fail(f'no step {step} within {timeout} s')


def assert_accounted(record):
  """The queue's identity on one metrics record."""
  admitted = record['queue/admitted']
  assert admitted > 0
  assert admitted == sum(record[f'queue/{k}'] for k in OUTCOMES), {
      k: record[f'queue/{k}'] for k in ('admitted', *OUTCOMES)}


@pytest.mark.slow
def test_stops_resumes_and_extends(tmp_path):
  """SIGTERM saves the step reached, and the same command resumes it; a
  finished run extends. (A SIGKILLed trainer: tests/test_train.py.)"""
  workdir = tmp_path / 'run'
  steps = ('--config.total_steps=6',)
  # SIGTERM in the middle: it saves the step reached and exits cleanly.
  process = start(workdir, *steps)
  wait_for_step(process, workdir, 2)
  process.send_signal(signal.SIGTERM)
  out, err = process.communicate(timeout=120)
  assert process.returncode == 0, err[-3000:]
  assert 'run the same command to resume' in out + err
  saved = sorted(int(d) for d in os.listdir(workdir / 'checkpoints')
                 if d.isdigit())
  assert saved and saved[-1] >= 2
  # The same command resumes (and rewrites the weights of that step).
  resumed = run(workdir, *steps)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert trained_steps(workdir)[-1] == 6
  # A finished run, extended.
  extended = run(workdir, '--config.total_steps=8')
  assert extended.returncode == 0, extended.stderr[-3000:]
  assert trained_steps(workdir) == list(range(1, 9))
  assert_accounted(records(workdir)[-1])


@pytest.mark.slow
def test_servers_killed_and_hung_mid_run(tmp_path):
  """Two local servers: one hung (SIGSTOP) then continued, one SIGKILLed,
  then both; the run routes around, restarts, catches up, and finishes."""
  workdir = tmp_path / 'run'
  process = start(workdir, '--config.total_steps=14',
                  '--config.rollout.num_servers=2',
                  '--config.rollout.num_workers=8')
  wait_for_step(process, workdir, 2)
  first, second = processes.server_pids(process.pid)
  os.kill(first, signal.SIGSTOP)  # hung: pushes must not wait on it
  wait_for_step(process, workdir, 5)
  os.kill(first, signal.SIGCONT)
  os.kill(second, signal.SIGKILL)
  # Then the other one too, while the first is still restarting: no server
  # is left, and nothing trains until a restarted one has caught up.
  wait_for_step(process, workdir, 7)
  os.kill(first, signal.SIGKILL)
  out, err = process.communicate(timeout=600)
  assert process.returncode == 0, err[-3000:]
  assert 'held-out accuracy' in out
  steps = [r for r in records(workdir) if 'train/reward' in r]
  assert [r['step'] for r in steps] == list(range(1, 15))
  last = steps[-1]
  assert_accounted(last)
  assert last['rollout/server_deaths'] == 2
  assert last['rollout/server_restarts'] >= 1  # nothing trains without one
  assert last['rollout/catch_ups'] >= 1  # it started with the source weights
  # The hung server was routed around within the health timeout: no push
  # waited for it (the push timeout is 120 s).
  sick = sum(last.get(f'rollout/client/server_marked_dead/{why}', 0)
             for why in ('failed_health_check', 'weight_push_failed'))
  assert sick >= 1
  assert max(r['time/sync_seconds'] for r in steps) < 30
  # Every live server serves the version before the last at least: the
  # push of version 14 (streamed) overlaps the logging of step 14.
  assert last['rollout/rollout_version'] >= 13


def dead_address():
  import socket  # pylint: disable=g-import-not-at-top
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return f'127.0.0.1:{s.getsockname()[1]}'  # closed: nothing listens


@pytest.fixture
def secret_file(tmp_path):
  path = tmp_path / 'secret'
  path.write_text('s' * 32 + '\n')
  return path


@pytest.mark.slow
def test_starved_learner_stops_on_sigterm_and_reports_dead_servers(
    tmp_path, secret_file):
  remote = (f'--config.rollout.server_addresses={dead_address()}',
            f'--config.rollout.admin_secret_file={secret_file}',
            '--config.log.progress=False')
  # SIGTERM during start-up (loading the model, building the learner): the
  # run stops at once, with nothing new to save.
  process = start(tmp_path / 'starting', *remote)
  time.sleep(8)
  sent = time.monotonic()
  process.send_signal(signal.SIGTERM)
  out, err = process.communicate(timeout=60)
  assert time.monotonic() - sent < 10, err[-3000:]
  assert process.returncode in (0, -signal.SIGTERM), err[-3000:]
  # SIGTERM while waiting for data that never comes: within seconds.
  # The file transport writes the weights the servers are to load right
  # before the loop: a visible mark that start-up is over (the stream
  # transport leaves none, and starving does not depend on the transport).
  process = start(tmp_path / 'starved', *remote,
                  '--config.rollout.weight_transport=files')
  processes.wait_until(
      lambda: os.path.exists(tmp_path / 'starved' / 'weights' / 'v0') or
      process.poll() is not None, 120, 'no start')
  time.sleep(5)  # well inside the wait for the first batch
  sent = time.monotonic()
  process.send_signal(signal.SIGTERM)
  _, err = process.communicate(timeout=60)
  assert process.returncode == 0, err[-3000:]
  assert time.monotonic() - sent < 20
  # No server alive past the grace period: one line that says so.
  proc = run(tmp_path / 'dead', *remote,
             '--config.rollout.no_server_grace_s=3')
  assert proc.returncode != 0
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error:'), proc.stderr
  assert 'no rollout server has been alive' in lines[0]


@pytest.mark.slow
def test_refuses_a_server_that_samples_differently(tmp_path, secret_file):
  config = os.path.join(ROOT, 'configs', 'tiny.py')
  servers = launch.start_subprocesses(
      config, count=1, secret=secret_file.read_text().strip(),
      log_dir=str(tmp_path / 'logs'),
      overrides=['--config.rollout.temperature=0.5'],
      weights_root=str(tmp_path / 'run' / 'weights'))
  try:
    proc = run(tmp_path / 'run',
               f'--config.rollout.server_addresses={servers[0].address}',
               f'--config.rollout.admin_secret_file={secret_file}',
               '--config.log.progress=False')
  finally:
    launch.stop(servers)
  assert proc.returncode != 0
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error:'), proc.stderr
  assert 'temperature=0.5' in lines[0], lines[0]
