"""The sandbox against hostile programs: each is contained, reported as a
failure, and leaves nothing behind (files, processes, connections)."""

import asyncio
import os
import pathlib
import secrets
import shutil
import socket
import subprocess
import sys
import time

import pytest

from sao_jax.sandbox import runner as sandbox

_REPO = pathlib.Path(__file__).resolve().parents[2]
_ISOLATION = sandbox.isolation()
_needs_namespaces = pytest.mark.skipif(
    _ISOLATION.mode == 'none',
    reason=f'no namespace isolation here: {_ISOLATION.detail}')


# Forks sleepers (tagged MARKER) until refused; prints how many it made.
_FORK_UNTIL_REFUSED = '''
import os, sys
count = 0
while True:
  try:
    pid = os.fork()
  except OSError:
    break
  if pid == 0:
    os.execv(sys.executable,
             [sys.executable, '-c', 'import time; time.sleep(60)', 'MARKER'])
  count += 1
print(count)
'''


def _pids_whose(predicate) -> list[int]:
  pids = []
  for name in os.listdir('/proc'):
    if name.isdigit():
      try:
        if predicate(name):
          pids.append(int(name))
      except OSError:  # it exited meanwhile
        pass
  return pids


def _pids_with_marker(marker: str) -> list[int]:
  def has_marker(pid):
    with open(f'/proc/{pid}/cmdline', 'rb') as f:
      return marker.encode() in f.read()
  return _pids_whose(has_marker)


def _pids_of_uid(uid: int) -> list[int]:
  def owned(pid):
    with open(f'/proc/{pid}/status', encoding='utf-8') as f:
      line = next(entry for entry in f if entry.startswith('Uid:'))
    return int(line.split()[1]) == uid
  return _pids_whose(owned)


def _unshare_works(*prefix: str, as_root: bool = False) -> bool:
  """Whether the namespaces of the 'root' (or else 'userns') mode work."""
  unshare = shutil.which('unshare')
  if unshare is None:
    return False
  user = () if as_root else ('--user', '--map-root-user')
  return subprocess.run(
      [*prefix, unshare, *user, '--net', '--mount', '--pid', '--fork', 'true'],
      capture_output=True, check=False).returncode == 0


def _python_for_any_uid() -> str | None:
  """A system interpreter every uid can run (the test venv may live under
  root's 0700 home), for the modes that run it outside a private root."""
  for path in ('/usr/bin/python3', '/usr/local/bin/python3'):
    if os.path.exists(path) and all(
        os.stat(p).st_mode & 0o005 == 0o005 for p in (
            os.path.realpath(path), os.path.dirname(os.path.realpath(path)))):
      return path
  return None


def test_isolation_uses_namespaces_where_the_kernel_allows():
  if sys.platform == 'linux' and os.geteuid() == 0 and _unshare_works(
      as_root=True):
    assert _ISOLATION.mode == 'root'
  elif sys.platform == 'linux' and os.geteuid() != 0 and _unshare_works():
    assert _ISOLATION.mode == 'userns'
  else:
    assert _ISOLATION.mode == 'none'
  isolated = _ISOLATION.mode != 'none'
  assert _ISOLATION.network_isolated == isolated
  assert _ISOLATION.filesystem_isolated == isolated
  assert sandbox.isolation() is _ISOLATION  # probed once


def test_missing_isolation_is_reported_and_logged_once(monkeypatch, caplog):
  monkeypatch.setattr(sandbox, '_isolation', None)
  monkeypatch.setattr(shutil, 'which', lambda *args, **kwargs: None)
  with caplog.at_level('WARNING', logger=sandbox.__name__):
    first = sandbox.isolation()
    second = sandbox.isolation()
  assert first is second
  if sys.platform == 'linux':
    assert first == sandbox.Isolation(
        'none', False, False, False, 'util-linux `unshare` is not installed')
  assert first.mode == 'none' and not first.network_isolated
  warnings = [record for record in caplog.records
              if 'no namespace isolation' in record.message]
  assert len(warnings) == 1
  assert 'WITH network access' in warnings[0].message


def test_runs_code_and_returns_its_output():
  result = sandbox.run_python('print(sum(range(10)))\nprint("é")')
  assert result.ok and result.reason == 'ok'
  assert result.returncode == 0
  assert result.stdout == '45\né\n'
  assert result.stderr == ''
  assert not result.timed_out and not result.truncated
  assert result.isolation == _ISOLATION.mode
  assert 0 <= result.cpu_s < 5
  assert 0 < result.wall_s < 10


def test_stdin_is_passed():
  result = sandbox.run_python(
      'a, b = map(int, input().split()); print(a * b, input())',
      stdin='6 7\nsecond line\n')
  assert result.stdout == '42 second line\n'


def test_a_failing_program_is_a_result_with_its_exit_code():
  result = sandbox.run_python(
      'import sys\nprint("partial")\nprint("bad", file=sys.stderr)\n'
      'sys.exit(3)')
  assert not result.ok
  assert (result.returncode, result.reason) == (3, 'exit 3')
  assert (result.stdout, result.stderr) == ('partial\n', 'bad\n')


def test_parent_environment_is_invisible(monkeypatch):
  secret = secrets.token_hex(16)
  monkeypatch.setenv('SAO_SANDBOX_TEST_SECRET', secret)
  result = sandbox.run_python('import os\nprint(sorted(os.environ.items()))')
  assert result.ok
  assert secret not in result.stdout
  assert 'SAO_SANDBOX_TEST_SECRET' not in result.stdout
  assert "('PATH', '/usr/local/bin:/usr/bin:/bin')" in result.stdout


def test_infinite_loop_is_killed_at_the_deadline():
  start = time.monotonic()
  result = sandbox.run_python('while True:\n  pass', timeout_s=1, cpu_s=30)
  elapsed = time.monotonic() - start
  assert result.timed_out and not result.ok
  assert (result.reason, result.returncode) == ('timeout', None)
  assert 1.0 <= elapsed < 8


def test_cpu_limit_stops_a_busy_program_before_its_deadline():
  result = sandbox.run_python('while True:\n  pass', timeout_s=30, cpu_s=1)
  assert not result.ok and not result.timed_out
  assert result.reason == 'cpu'
  assert 0.5 < result.cpu_s < 3


def test_2gb_allocation_hits_the_memory_limit():
  result = sandbox.run_python('x = bytearray(2 * 1024**3)\nprint("allocated")',
                              memory_mb=256)
  assert not result.ok
  assert result.reason == 'memory'
  assert 'allocated' not in result.stdout
  assert result.stderr.strip().endswith('MemoryError')


def test_process_limit_bounds_forks_and_no_process_survives():
  marker = f'sao-sandbox-sleeper-{secrets.token_hex(8)}'
  program = _FORK_UNTIL_REFUSED.replace('MARKER', marker)
  result = sandbox.run_python(program, max_procs=8, timeout_s=20)
  assert result.ok, result.stderr
  # The program itself is one of the 8. (Without namespaces or root, the
  # count is the user's: other processes take their share.)
  if _ISOLATION.mode != 'none' or os.geteuid() == 0:
    assert int(result.stdout) == 7
  else:
    assert 0 <= int(result.stdout) <= 7
  assert _pids_with_marker(marker) == []


def test_fork_bomb_is_contained_and_leaves_no_process():
  program = '''
import os
print(os.getuid(), flush=True)
while True:
  try:
    os.fork()
  except OSError:
    pass
'''
  result = sandbox.run_python(program, max_procs=16, timeout_s=2, cpu_s=30)
  assert result.timed_out and not result.ok
  uid = int(result.stdout.split()[0])
  if os.geteuid() == 0:  # the run's own uid, as seen from here
    assert uid != 0
    assert _pids_of_uid(uid) == []


def test_detached_daemons_do_not_outlive_the_run():
  marker = f'sao-sandbox-daemon-{secrets.token_hex(8)}'
  program = f'''
import os, sys
for _ in range(3):
  if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
      os.execv(sys.executable, [sys.executable, '-c',
                                'import time; time.sleep(60)', {marker!r}])
    os._exit(0)
print('detached')
'''
  start = time.monotonic()
  result = sandbox.run_python(program, timeout_s=20)
  assert result.ok and result.stdout == 'detached\n'
  assert time.monotonic() - start < 10  # not held up by the daemons
  assert _pids_with_marker(marker) == []


@_needs_namespaces
def test_writes_outside_the_sandbox_do_not_reach_the_host(tmp_path):
  token = secrets.token_hex(8)
  targets = [str(_REPO / f'sandbox_escape_{token}'),
             f'/root/sandbox_escape_{token}', f'/tmp/sandbox_escape_{token}',
             f'/var/tmp/sandbox_escape_{token}',
             f'/dev/shm/sandbox_escape_{token}',
             str(tmp_path / f'sandbox_escape_{token}'),
             f'/usr/sandbox_escape_{token}', f'/etc/sandbox_escape_{token}']
  program = f'''
import os
for path in {targets!r}:
  try:
    with open(path, 'w') as f:
      f.write('escaped')
    print('wrote', path)
  except OSError as e:
    print('refused', path, e.errno)
with open('here.txt', 'w') as f:
  f.write('mine')
print(open('here.txt').read(), os.getcwd())
'''
  result = sandbox.run_python(program)
  assert result.ok, result.stderr
  for path in targets:
    assert not os.path.exists(path), path
  lines = result.stdout.splitlines()
  # The private /tmp is writable, the host's paths are not even there.
  assert f'wrote /tmp/sandbox_escape_{token}' in lines
  assert any(line.startswith(f'refused {_REPO}/') for line in lines)
  assert any(line.startswith('refused /usr/') for line in lines)
  assert lines[-1] == f'mine {sandbox.SANDBOX_WORKDIR}'


@_needs_namespaces
def test_only_the_scratch_mounts_and_proc_are_writable():
  # Read-only mounts, not file permissions, keep a 'userns' run (the user's
  # own uid) out of the user's files; so check the mounts themselves.
  program = '''
for line in open('/proc/self/mountinfo'):
  fields = line.split()
  print(fields[4], 'rw' if 'rw' in fields[5].split(',') else 'ro')
'''
  result = sandbox.run_python(program)
  mounts = dict(line.split() for line in result.stdout.splitlines())
  writable = {point for point, access in mounts.items() if access == 'rw'}
  assert writable == {'/tmp', '/var/tmp', '/dev/shm', '/proc',
                      sandbox.SANDBOX_WORKDIR}
  assert mounts['/'] == mounts['/usr'] == mounts['/etc'] == 'ro'
  assert mounts['/dev/null'] == 'ro'


@_needs_namespaces
def test_network_connections_fail_and_reach_no_listener():
  token = secrets.token_hex(8)
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp, \
       socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
    tcp.bind(('127.0.0.1', 0))
    tcp.listen()
    port = tcp.getsockname()[1]
    unix.bind(f'\0sao-sandbox-test-{token}')  # abstract: scoped to the netns
    unix.listen()
    program = f'''
import socket
def attempt(name, connect):
  try:
    connect()
    print(name, 'connected')
  except OSError:
    print(name, 'failed')
attempt('local', lambda: socket.create_connection(('127.0.0.1', {port}), 2))
attempt('external', lambda: socket.create_connection(('1.1.1.1', 80), 2))
attempt('dns', lambda: socket.getaddrinfo('example.com', 80))
attempt('unix', lambda: socket.socket(socket.AF_UNIX).connect(
    '\\0sao-sandbox-test-{token}'))
'''
    result = sandbox.run_python(program, timeout_s=20)
    assert result.ok, result.stderr
    assert result.network_isolated
    assert result.stdout.splitlines() == [
        'local failed', 'external failed', 'dns failed', 'unix failed']
    for listener in (tcp, unix):
      listener.setblocking(False)
      with pytest.raises(BlockingIOError):
        listener.accept()


def test_run_directory_is_removed(tmp_path):
  runs = tmp_path / 'runs'
  runs.mkdir()
  for program in ('open("a.txt", "w").write("x")', 'while True:\n  pass',
                  'import os\nos.mkdir("d")\nos.chmod("d", 0)'):
    sandbox.run_python(program, timeout_s=1, temp_root=str(runs))
    assert os.listdir(runs) == []


def test_long_output_keeps_head_and_tail():
  result = sandbox.run_python('for i in range(20000):\n  print(i)',
                              output_limit_bytes=64)
  assert result.ok and result.truncated
  assert result.stdout.startswith('0\n1\n2\n')
  assert result.stdout.endswith('19998\n19999\n')
  assert 'bytes cut ...]' in result.stdout
  assert len(result.stdout) < 120


def test_concurrent_runs_do_not_interfere():
  program = '''
import os, sys, time
me = sys.stdin.read()
for path in ('mine.txt', '/tmp/mine.txt'):
  with open(path, 'w') as f:
    f.write(me)
start = time.time()
time.sleep(1)
print(me, open('mine.txt').read(), open('/tmp/mine.txt').read(),
      sorted(os.listdir('.')))
print(start, time.time())
'''
  async def main():
    return await asyncio.gather(*[
        sandbox.arun_python(program, stdin=str(i)) for i in range(4)])

  results = asyncio.run(main())
  for i, result in enumerate(results):
    assert result.ok, result.stderr
    if _ISOLATION.filesystem_isolated:
      assert result.stdout.startswith(
          f"{i} {i} {i} ['main.py', 'mine.txt']\n")
    else:  # the host's /tmp is shared
      assert result.stdout.startswith(f'{i} {i} ')
  # They ran at once: every run was asleep at the same moment.
  spans = [[float(t) for t in result.stdout.splitlines()[-1].split()]
           for result in results]
  assert max(start for start, _ in spans) < min(end for _, end in spans)


def test_cancelling_arun_kills_the_run(tmp_path):
  marker = f'sao-sandbox-cancel-{secrets.token_hex(8)}'
  program = ('import os, sys\nos.execv(sys.executable, [sys.executable, "-c",'
             f' "import time; time.sleep(60)", {marker!r}])')

  async def main():
    task = asyncio.create_task(
        sandbox.arun_python(program, timeout_s=60, temp_root=str(tmp_path)))
    for _ in range(100):
      await asyncio.sleep(0.1)
      if _pids_with_marker(marker):
        break
    assert _pids_with_marker(marker)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
      await task

  asyncio.run(main())
  assert _pids_with_marker(marker) == []
  assert os.listdir(tmp_path) == []


def test_none_mode_reports_no_isolation_but_still_kills():
  python = _python_for_any_uid() if os.geteuid() == 0 else sys.executable
  if python is None:
    pytest.skip('no interpreter that an unprivileged uid can run')
  marker = f'sao-sandbox-none-{secrets.token_hex(8)}'
  program = f'''
import os, sys
if os.fork() == 0:
  os.setsid()
  os.execv(sys.executable,
           [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])
print(os.getuid())
'''
  result = sandbox.run_python(program, mode='none', python=python)
  assert result.ok, result.stderr
  assert (result.isolation, result.network_isolated) == ('none', False)
  if os.geteuid() == 0:
    assert int(result.stdout) != 0  # root still drops to a uid of the run's
  assert _pids_with_marker(marker) == []
  # A CPU limit well above the wall clock: the wall-clock kill is under test
  # (with the default, cpu_s = timeout_s, either limit may fire first).
  result = sandbox.run_python('while True:\n  pass', mode='none',
                              python=python, timeout_s=1, cpu_s=30)
  assert result.timed_out


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which('setpriv') is None,
                    reason='needs root to become an unprivileged user')
def test_unprivileged_user_gets_the_user_namespace_mode():
  python = _python_for_any_uid()
  if python is None:
    pytest.skip('no interpreter that an unprivileged uid can run')
  drop = ['setpriv', '--reuid=65534', '--regid=65534', '--clear-groups']
  # An interpreter without the venv: the sandbox needs the standard library
  # only (and sao_jax's own __init__, which imports nothing else).
  repo = os.path.dirname(os.path.dirname(os.path.dirname(sandbox.__file__)))
  script = f'''
import sys
sys.path.insert(0, {repo!r})
from sao_jax.sandbox import runner as sandbox

result = sandbox.run_python(
    'import os\\nopen("/tmp/x", "w").write("x")\\nprint(os.getuid())')
forks = sandbox.run_python({_FORK_UNTIL_REFUSED!r}, max_procs=8)
print(sandbox.isolation().mode, result.ok, result.stdout.strip(),
      result.network_isolated, forks.stdout.strip())
'''
  output = subprocess.run([*drop, python, '-I', '-c', script], cwd='/',
                          capture_output=True, text=True, timeout=60,
                          check=False)
  assert output.returncode == 0, output.stderr
  if _unshare_works(*drop):
    # The limit of 8 counts the program itself, not the init above it.
    assert output.stdout.split() == ['userns', 'True', '1000', 'True', '7']
  else:
    assert output.stdout.split()[0] == 'none'
