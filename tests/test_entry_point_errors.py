"""`python -m sao_jax.train` and `serve`: a user's mistake is one error line.

Each case runs the real entry point in a subprocess (the mistakes are found
before anything slow starts) and wants exactly one stderr line, `error: ...`:
no traceback, and none of the start-up noise of libtpu or TensorFlow's CUDA
stubs on a machine without accelerators (`sao_jax.quiet_start`). `--verbose`
brings the traceback back.
"""

import glob
import os
import subprocess
import sys
import textwrap

import pytest

from sao_jax import quiet_start
from sao_jax import xla_flags
from sao_jax.rollout import weight_sync

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOISE = ('TPU_WORKER_HOSTNAMES', 'cuInit', 'cudart_stub',
         'absl::InitializeLog', 'Traceback')


def run(module, *args, quiet_env=True, **env):
  """Runs `python -m module args`; `quiet_env`: as our tests (CPU chosen)."""
  full_env = xla_flags.child_environment(dict(os.environ, PYTHONPATH=ROOT,
                                              **env))
  full_env.pop(weight_sync.SECRET_ENV, None)
  if quiet_env:
    full_env['JAX_PLATFORMS'] = 'cpu'
  else:  # as a user's shell: nothing chosen
    for name in ('JAX_PLATFORMS', 'TF_CPP_MIN_LOG_LEVEL'):
      full_env.pop(name, None)
  return subprocess.run([sys.executable, '-m', module, *args], cwd=ROOT,
                        env=full_env, capture_output=True, text=True,
                        timeout=300, check=False)


def train(workdir, *args, **kwargs):
  return run('sao_jax.train', '--config=configs/tiny.py',
             f'--workdir={workdir}', *args, **kwargs)


def assert_one_error_line(proc, *fragments):
  assert proc.returncode == 2, proc.stderr[-3000:]
  lines = proc.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: '), proc.stderr[-3000:]
  for fragment in fragments:
    assert fragment in lines[0], lines[0]


@pytest.mark.parametrize('case', ['model_dir', 'jsonl_file', 'workdir_file',
                                  'no_secret'])
def test_train_user_errors_are_one_line(tmp_path, case):
  workdir = tmp_path / 'run'
  args, fragments = [], []
  if case == 'model_dir':
    args = [f'--config.model.source={tmp_path}/no_model']
    fragments = ['config.model.source=', 'no such directory']
  elif case == 'jsonl_file':
    args = ['--config.task.name=jsonl',
            f'--config.task.jsonl.path={tmp_path}/none.jsonl']
    fragments = ['config.task.jsonl.path=', 'no such file']
  elif case == 'workdir_file':
    workdir.write_text('not a directory')
    fragments = ['is a file, not a directory']
  elif case == 'no_secret':
    args = ['--config.rollout.server_addresses=127.0.0.1:1']
    fragments = ['no admin secret', weight_sync.SECRET_ENV]
  assert_one_error_line(train(workdir, *args), *fragments)
  assert not workdir.is_dir()  # failed before creating anything


def test_verbose_shows_the_traceback(tmp_path):
  proc = train(tmp_path / 'run', f'--config.model.source={tmp_path}/none',
               '--verbose')
  assert proc.returncode != 0
  assert 'Traceback' in proc.stderr and 'ConfigError' in proc.stderr


def test_serve_user_errors_are_one_line(tmp_path):
  proc = run('sao_jax.serve', '--config=configs/tiny.py', '--port=0',
             f'--config.model.source={tmp_path}/none',
             **{weight_sync.SECRET_ENV: 'sixteen-chars-ok'})
  assert_one_error_line(proc, 'config.model.source=', 'no such directory')
  proc = run('sao_jax.serve', '--config=configs/tiny.py', '--port=0')
  assert_one_error_line(proc, 'no admin secret')


_MAIN = textwrap.dedent('''
    import sys
    from sao_jax import config_lib
    _CONFIG = config_lib.define_config_flag()

    def main(argv):
      raise {error}

    config_lib.run(main)
''')


@pytest.mark.parametrize('error, line', [
    ("TimeoutError('no batch within config.rollout.get_batch_timeout_s=5 s')",
     'error: no batch within config.rollout.get_batch_timeout_s=5 s'),
    ("FileNotFoundError(2, 'No such file or directory', '/x/y.jsonl')",
     'error: /x/y.jsonl: No such file or directory'),
    ("IsADirectoryError(21, 'Is a directory', '/x')",
     'error: /x: Is a directory'),
])
def test_run_prints_timeouts_and_os_errors_as_one_line(tmp_path, error, line):
  script = tmp_path / 'main.py'
  script.write_text(_MAIN.format(error=error))
  command = [sys.executable, str(script), '--config=configs/tiny.py']
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu')
  proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300, check=False)
  assert proc.returncode == 2 and proc.stderr.splitlines() == [line], (
      proc.stderr[-3000:])
  verbose = subprocess.run(command + ['--verbose'], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300,
                           check=False)
  assert verbose.returncode == 1 and 'Traceback' in verbose.stderr


def test_run_keeps_the_traceback_of_a_bug(tmp_path):
  script = tmp_path / 'main.py'
  script.write_text(_MAIN.format(error="KeyError('a bug')"))
  proc = subprocess.run(
      [sys.executable, str(script), '--config=configs/tiny.py'], cwd=ROOT,
      env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu'),
      capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 1
  assert 'Traceback' in proc.stderr and "KeyError: 'a bug'" in proc.stderr


def _has_accelerator() -> bool:
  return any(glob.glob(pattern)
             for pattern in quiet_start.TPU_NODES + quiet_start.GPU_NODES)


@pytest.mark.skipif(_has_accelerator(),
                    reason='the quiet start applies to hosts without TPU/GPU')
@pytest.mark.parametrize('module', ['sao_jax.train', 'sao_jax.serve'])
def test_quiet_start_without_accelerators(tmp_path, module):
  # As a user's shell: no JAX_PLATFORMS, no TF_CPP_MIN_LOG_LEVEL. The config
  # error comes after JAX, libtpu, TensorFlow and absl have all started.
  args = ['--config=configs/tiny.py', '--config.total_steps=0']
  if module == 'sao_jax.train':
    args.append(f'--workdir={tmp_path}/run')
  proc = run(module, *args, quiet_env=False)
  for noise in NOISE:
    assert noise not in proc.stderr, proc.stderr[-3000:]
  assert_one_error_line(proc, 'config.total_steps=0 must be >= 1')


def test_filtered_stderr_drops_only_the_noise(capfd):
  with quiet_start.filtered_stderr(('noise',)):
    os.write(2, b'some noise here\nkept line\nnoise again\nkept too')
  assert capfd.readouterr().err == 'kept line\nkept too'
