"""Runs untrusted, model-generated Python in a contained child process.

This is the library side of the sandbox, which code environments call:

  result = runner.run_python(source, timeout_s=10.0)         # blocking
  result = await runner.arun_python(source, timeout_s=10.0)  # in an event loop
  result.ok, result.returncode, result.stdout, result.network_isolated

Each execution gets a fresh `python -I` with a minimal environment, rlimits, a
wall-clock deadline and, where the kernel allows it, network, PID, IPC, UTS
and mount namespaces; `isolation()` says which of the three modes ('root',
'userns', 'none') this machine gets. The per-run init is `init_program.py`,
started by its path. The threat model, the modes and what is not covered are
in docs/design/sandbox.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from sao_jax.sandbox import init_program
from sao_jax.sandbox import isolation as isolation_lib

_log = logging.getLogger(__name__)

# The init ends a run at its deadline; the parent kills the run's process
# group this much later only if the init failed to.
_KILL_GRACE_S = 2.0
# What `unshare` and the init run with (the program gets the init's
# `_SANDBOX_ENV`).
_HOST_ENV = {'PATH': '/usr/sbin:/usr/bin:/sbin:/bin', 'LANG': 'C.UTF-8'}
_NAMESPACE_FLAGS = ('--net', '--mount', '--pid', '--ipc', '--uts', '--fork',
                    '--kill-child', '--mount-proc')
# uids for runs started by root: far above any account or subordinate range.
_UID_RANGE = (1 << 30, (1 << 31) - 2)
# The init program of every run, started by its path.
_INIT_SCRIPT = init_program.__file__
# The program's outputs, in the run's host directory.
_STDOUT_FILE = 'stdout'
_STDERR_FILE = 'stderr'


#: The program's working directory and HOME inside the namespaces.
SANDBOX_WORKDIR = init_program.SANDBOX_WORKDIR
MODES = isolation_lib.MODES
Isolation = isolation_lib.Isolation


class SandboxError(RuntimeError):
  """The sandbox itself failed, not the program (set-up, an impossible mode)."""


@dataclasses.dataclass(frozen=True)
class ExecutionResult:
  """The outcome of one run.

  Attributes:
    ok: the program exited 0 within its limits.
    returncode: its exit code, -N when signal N killed it, None when it did
      not finish (timeout).
    stdout: its output decoded as UTF-8 (invalid bytes replaced). Past
      `output_limit_bytes`, only the first and last halves of that, joined
      by a '[... N bytes cut ...]' line.
    stderr: the same for its error stream.
    timed_out: the wall-clock deadline ended it.
    reason: 'ok', 'timeout', 'cpu' (CPU limit), 'memory' (a MemoryError),
      'processes' (fork or thread creation refused), 'file_size' (a write
      past `max_file_mb`), 'disk_full' (`tmpfs_mb` used up), 'signal N',
      'exit N', or 'sandbox_error' (the init vanished; only possible in
      'none' mode without root). Labels beyond the exit status come from the
      last line of stderr, which the program controls: for metrics, never for
      rewards.
    wall_s: wall-clock seconds of the whole run, sandbox set-up included.
    cpu_s: CPU seconds of the program and its reaped children, when known.
    network_isolated: the program had no network (False in 'none' mode).
    isolation: the mode it ran in.
    truncated: stdout or stderr was longer than `output_limit_bytes`.
  """
  ok: bool
  returncode: int | None
  stdout: str
  stderr: str
  timed_out: bool
  reason: str
  wall_s: float
  cpu_s: float | None = None
  network_isolated: bool = False
  isolation: str = 'none'
  truncated: bool = False


@dataclasses.dataclass(frozen=True)
class _Limits:
  """`run_python`'s limits, validated (see its docstring)."""
  timeout_s: float
  cpu_s: int
  memory_mb: int
  max_file_mb: int
  max_procs: int
  max_open_files: int
  tmpfs_mb: int
  output_limit_bytes: int

  def __post_init__(self):
    if not self.timeout_s > 0:
      raise ValueError(f'timeout_s must be > 0, got {self.timeout_s}')
    for field in dataclasses.fields(self)[1:]:
      if getattr(self, field.name) < 1:
        raise ValueError(f'{field.name} must be >= 1, got'
                         f' {getattr(self, field.name)}')


_isolation_lock = threading.Lock()
_isolation: Isolation | None = None  # isolation()'s, once probed
_uids_lock = threading.Lock()
_uids_in_use: set[int] = set()
_runtime_paths_cache: dict[str, tuple[str, ...]] = {}


def isolation() -> Isolation:
  """The best mode this machine allows, found by running a probe once.

  The first call costs one or two sandbox runs (~50 ms each); the result is
  cached for the process. A degraded result is logged as a warning, once.
  """
  global _isolation
  with _isolation_lock:
    if _isolation is None:
      _isolation = isolation_lib.probe(_try_mode, _HOST_ENV['PATH'])
      if _isolation.mode == 'none':
        _log.warning(
            'sandbox: no namespace isolation on this machine (%s); generated'
            ' code runs under rlimits and a timeout only, WITH network access'
            ' and the host file system (as uid %s)', _isolation.detail,
            'random' if os.geteuid() == 0 else os.geteuid())
    return _isolation


def _try_mode(mode: str) -> str | None:
  """Runs a probe program in `mode`: why it failed there, or None."""
  try:
    result = run_python('print(6 * 7)', timeout_s=10.0, cpu_s=5,
                        memory_mb=512, mode=mode)
  except SandboxError as e:
    return str(e)
  if result.ok and result.stdout == '42\n':
    return None
  return f'{result.reason}: {result.stderr[-300:]}'


def run_python(source: str, *, timeout_s: float = 10.0,
               cpu_s: float | None = None, memory_mb: int = 1024,
               max_file_mb: int = 16, max_procs: int = 32,
               max_open_files: int = 64, tmpfs_mb: int = 64,
               output_limit_bytes: int = 64 * 1024, stdin: str | None = None,
               mode: str | None = None, python: str | None = None,
               temp_root: str | None = None) -> ExecutionResult:
  """Runs `source` as a Python program in a sandbox; blocks until it ends.

  Args:
    source: the program, run as `python -I main.py` in its working directory.
    timeout_s: wall-clock seconds before every process of the run is killed.
    cpu_s: CPU seconds per process (RLIMIT_CPU, rounded up); defaults to
      `timeout_s`.
    memory_mb: address space per process (RLIMIT_AS). The interpreter alone
      maps ~30 MB, numpy ~400 MB.
    max_file_mb: largest file the program may write (RLIMIT_FSIZE); it also
      bounds what its stdout and stderr occupy on the host's disk.
    max_procs: processes and threads (RLIMIT_NPROC), the program included.
    max_open_files: file descriptors per process (RLIMIT_NOFILE).
    tmpfs_mb: the one tmpfs behind /tmp, /var/tmp, /dev/shm and the working
      directory (namespace modes): all a run can store.
    output_limit_bytes: how much of stdout and of stderr is returned (head
      and tail when longer).
    stdin: text for the program's standard input (else /dev/null).
    mode: 'root', 'userns' or 'none' to insist on one (if it is impossible
      here, `SandboxError`); None or 'auto' takes `isolation().mode`.
    python: the interpreter; defaults to this one. Its prefixes are bound
      read-only into the sandbox, so its site-packages are importable.
    temp_root: where the run's host directory (control files only, in
      namespace modes) is made; defaults to the system's. It is removed
      whatever happens.

  Returns:
    The `ExecutionResult`. The program's failures (exceptions, limits,
    timeouts) are results, never exceptions.

  Raises:
    SandboxError: the sandbox could not start the program.
  """
  limits = _limits(timeout_s, cpu_s, memory_mb, max_file_mb, max_procs,
                   max_open_files, tmpfs_mb, output_limit_bytes)
  job = _Job(source, stdin, limits, mode, python, temp_root)
  try:
    with job.open_outputs() as (stdout, stderr):
      proc = subprocess.Popen(  # pylint: disable=consider-using-with
          job.argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
          env=_HOST_ENV, cwd=job.host_dir, start_new_session=True)
    try:
      job.killed = not _wait(proc, limits.timeout_s + _KILL_GRACE_S)
    finally:
      if proc.returncode is None:
        _kill_group(proc.pid)
        proc.wait()
    return job.result()
  finally:
    job.cleanup()


async def arun_python(source: str, *, timeout_s: float = 10.0,
                      cpu_s: float | None = None, memory_mb: int = 1024,
                      max_file_mb: int = 16, max_procs: int = 32,
                      max_open_files: int = 64, tmpfs_mb: int = 64,
                      output_limit_bytes: int = 64 * 1024,
                      stdin: str | None = None, mode: str | None = None,
                      python: str | None = None,
                      temp_root: str | None = None) -> ExecutionResult:
  """`run_python` for asyncio: awaits the process without blocking the loop.

  Rollout workers are asyncio tasks, and a blocking run would stall every
  other episode. Cancelling the awaiting task kills the run. The probe of
  `isolation()` runs in a thread; set-up and clean-up (a few small files)
  run inline.
  """
  limits = _limits(timeout_s, cpu_s, memory_mb, max_file_mb, max_procs,
                   max_open_files, tmpfs_mb, output_limit_bytes)
  if mode in (None, 'auto') and _isolation is None:
    await asyncio.to_thread(isolation)
  job = _Job(source, stdin, limits, mode, python, temp_root)
  try:
    with job.open_outputs() as (stdout, stderr):
      proc = await asyncio.create_subprocess_exec(
          *job.argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
          env=_HOST_ENV, cwd=job.host_dir, start_new_session=True)
    try:
      await asyncio.wait_for(proc.wait(), limits.timeout_s + _KILL_GRACE_S)
    except asyncio.TimeoutError:
      job.killed = True
    finally:
      # Also reached on cancellation: nothing of the run may outlive it.
      if proc.returncode is None:
        _kill_group(proc.pid)
        await proc.wait()
    return job.result()
  finally:
    job.cleanup()


def _limits(timeout_s, cpu_s, memory_mb, max_file_mb, max_procs,
            max_open_files, tmpfs_mb, output_limit_bytes) -> _Limits:
  cpu_s = timeout_s if cpu_s is None else cpu_s
  return _Limits(
      timeout_s=float(timeout_s), cpu_s=max(1, int(-(-cpu_s // 1))),
      memory_mb=int(memory_mb), max_file_mb=int(max_file_mb),
      max_procs=int(max_procs), max_open_files=int(max_open_files),
      tmpfs_mb=int(tmpfs_mb), output_limit_bytes=int(output_limit_bytes))


def _wait(proc: subprocess.Popen, timeout_s: float) -> bool:
  """Waits until `proc` exits (then reaps it) or `timeout_s` passes (then
  leaves it unreaped, so that its process group id cannot be reused yet).

  `Popen.wait(timeout)` polls with sleeps of up to 50 ms, a third of a short
  run; a pidfd wakes us when the process exits.
  """
  try:
    pidfd = os.pidfd_open(proc.pid)
  except (AttributeError, OSError):  # not Linux >= 5.3
    try:
      proc.wait(timeout=timeout_s)
      return True
    except subprocess.TimeoutExpired:
      return False
  try:
    ready, _, _ = select.select([pidfd], [], [], timeout_s)
  finally:
    os.close(pidfd)
  if ready:
    proc.wait()
  return bool(ready)


def _kill_group(pgid: int) -> None:
  """SIGKILLs a run's process group: `unshare` and the init are in it, and
  the init's death (PID 1) takes its namespace down."""
  try:
    os.killpg(pgid, signal.SIGKILL)
  except ProcessLookupError:
    pass


class _Job:
  """One run: its host directory, command line, and the reading of its end."""

  def __init__(self, source: str, stdin: str | None, limits: _Limits,
               mode: str | None, python: str | None, temp_root: str | None):
    self.mode = isolation().mode if mode in (None, 'auto') else mode
    if self.mode not in MODES:
      raise ValueError(f'unknown sandbox mode {self.mode!r}; expected one of'
                       f' {MODES}')
    self.limits = limits
    self.killed = False
    python = os.path.abspath(python or sys.executable)
    binds = _runtime_paths(python) if self.mode != 'none' else ()
    unshare = shutil.which('unshare', path=_HOST_ENV['PATH'])
    if self.mode != 'none' and unshare is None:
      raise SandboxError(f'mode {self.mode!r} needs util-linux `unshare`')
    if self.mode == 'userns' and os.geteuid() == 0:
      # The namespace's root would be the real root: no process limit, and
      # every root-owned file writable wherever a mount is not read-only.
      raise SandboxError("mode 'userns' is for unprivileged users; as root,"
                         " use 'root'")
    self._start = time.monotonic()
    self.uid = self.host_dir = None
    try:
      if os.geteuid() == 0:
        # A uid of the run's own, in every mode: as root the program could
        # signal any process on the host and would ignore RLIMIT_NPROC.
        self.uid = _take_uid()
      # Resolved: the init finds its mounts in mountinfo, which resolves.
      self.host_dir = os.path.realpath(
          tempfile.mkdtemp(prefix='sao_sandbox_', dir=temp_root))
      self._write_files(source, stdin)
    except BaseException:
      self.cleanup()
      raise
    init = [python, '-I', '-S', _INIT_SCRIPT, f'mode={self.mode}',
            f'host_dir={self.host_dir}', f'python={python}', f'uid={self.uid}',
            f'timeout_s={limits.timeout_s}', f'cpu_s={limits.cpu_s}',
            f'memory_mb={limits.memory_mb}',
            f'max_file_mb={limits.max_file_mb}',
            f'max_procs={limits.max_procs}',
            f'max_open_files={limits.max_open_files}',
            f'tmpfs_mb={limits.tmpfs_mb}'] + [f'bind={path}' for path in binds]
    if self.mode == 'none':
      self.argv = init
    else:
      user = ('--user', '--map-root-user') if self.mode == 'userns' else ()
      self.argv = [unshare, *user, *_NAMESPACE_FLAGS, '--', *init]

  def _write_files(self, source: str, stdin: str | None) -> None:
    def write(name, text):
      path = os.path.join(self.host_dir, name)
      # Model output may hold lone surrogates; they become '?', not an error.
      with open(path, 'w', encoding='utf-8', errors='replace') as f:
        f.write(text)
      return path
    write(init_program.PROGRAM_FILE, source)
    if stdin is not None:
      write(init_program.STDIN_FILE, stdin)
    if self.mode != 'none':
      os.mkdir(os.path.join(self.host_dir, init_program.ROOT_DIR))
      os.mkdir(os.path.join(self.host_dir, init_program.SCRATCH_DIR))
      return
    # 'none': the program works in a directory of the host's.
    workdir = os.path.join(self.host_dir, init_program.WORK_DIR)
    os.mkdir(workdir)
    program = write(
        os.path.join(init_program.WORK_DIR, init_program.PROGRAM_NAME), source)
    if self.uid is not None:
      os.chmod(self.host_dir, 0o711)  # the run's uid may pass, not list
      os.chown(workdir, self.uid, self.uid)
      os.chown(program, self.uid, self.uid)

  def open_outputs(self) -> _Outputs:
    return _Outputs(os.path.join(self.host_dir, _STDOUT_FILE),
                    os.path.join(self.host_dir, _STDERR_FILE))

  def result(self) -> ExecutionResult:
    """Reads the status line and outputs into an `ExecutionResult`."""
    wall_s = time.monotonic() - self._start
    stdout, out_cut = self._read(_STDOUT_FILE)
    stderr, err_cut = self._read(_STDERR_FILE)
    try:
      with open(os.path.join(self.host_dir, init_program.STATUS_FILE),
                encoding='utf-8', errors='replace') as f:
        status = f.read().strip()
    except FileNotFoundError:
      status = ''
    kind, _, rest = status.partition(' ')
    if kind == 'error':
      raise SandboxError(f'sandbox ({self.mode} mode) failed before the'
                         f' program started: {rest}')
    returncode = cpu_s = None
    if self.killed or kind == 'timeout':
      reason = 'timeout'
    elif kind in ('exit', 'signal') and _is_status(rest):
      number, cpu = rest.split()
      cpu_s = float(cpu)
      returncode = int(number) if kind == 'exit' else -int(number)
      reason = self._reason(returncode, cpu_s, stderr)
    elif self.mode == 'none' and self.uid is None:
      # The program shares its uid with the init: it may have killed it or
      # written the status file.
      reason = 'sandbox_error'
    else:
      raise SandboxError(f'sandbox ({self.mode} mode) ended without a status'
                         f' ({status!r}); stderr: {stderr[-1000:]}')
    return ExecutionResult(
        ok=reason == 'ok', returncode=returncode, stdout=stdout,
        stderr=stderr, timed_out=reason == 'timeout', reason=reason,
        wall_s=wall_s, cpu_s=cpu_s, network_isolated=self.mode != 'none',
        isolation=self.mode, truncated=out_cut or err_cut)

  def _reason(self, returncode: int, cpu_s: float, stderr: str) -> str:
    if returncode == 0:
      return 'ok'
    # RLIMIT_CPU: SIGXCPU at the soft limit, SIGKILL at the hard one.
    if returncode == -signal.SIGXCPU or (
        returncode == -signal.SIGKILL and cpu_s >= self.limits.cpu_s):
      return 'cpu'
    if returncode < 0:
      return f'signal {-returncode}'
    lines = stderr.strip().splitlines()
    last = lines[-1] if lines else ''
    if last.startswith('MemoryError'):
      return 'memory'
    if (last.startswith('BlockingIOError') and '[Errno 11]' in last) or (
        last == "RuntimeError: can't start new thread"):
      return 'processes'
    if '[Errno 27]' in last:  # EFBIG: Python ignores SIGXFSZ
      return 'file_size'
    if '[Errno 28]' in last:  # ENOSPC: the scratch tmpfs is full
      return 'disk_full'
    return f'exit {returncode}'

  def _read(self, name: str) -> tuple[str, bool]:
    """A stream's text; past the limit, its head and tail around a marker
    (a traceback's last line, or a test harness's final word, is at the end).
    """
    limit = self.limits.output_limit_bytes
    try:
      with open(os.path.join(self.host_dir, name), 'rb') as f:
        size = os.fstat(f.fileno()).st_size
        if size <= limit:
          return f.read().decode('utf-8', errors='replace'), False
        head = f.read(limit // 2)
        f.seek(size - (limit - limit // 2))
        tail = f.read()
    except FileNotFoundError:
      return '', False
    cut = size - len(head) - len(tail)
    return (head.decode('utf-8', errors='replace') +
            f'\n[... {cut} bytes cut ...]\n' +
            tail.decode('utf-8', errors='replace')), True

  def cleanup(self) -> None:
    if self.uid is not None:
      with _uids_lock:
        _uids_in_use.discard(self.uid)
    if self.host_dir is not None and os.path.isdir(self.host_dir):
      _remove_tree(self.host_dir)


class _Outputs:
  """The stdout and stderr files, open only while the run is being started.

  Regular files rather than pipes: nothing blocks on a full pipe, a daemon
  holding them open cannot delay the end of a run, and RLIMIT_FSIZE bounds
  their size.
  """

  def __init__(self, *paths: str):
    self._paths = paths
    self._files = []

  def __enter__(self):
    # pylint: disable-next=consider-using-with
    self._files = [open(path, 'wb') for path in self._paths]
    return tuple(self._files)

  def __exit__(self, *exc_info):
    for f in self._files:
      f.close()


def _is_status(text: str) -> bool:
  """Whether `text` is the 'NUMBER CPU_S' rest of an exit or signal line."""
  parts = text.split()
  return (len(parts) == 2 and parts[0].isdigit() and
          parts[1].replace('.', '', 1).isdigit())


def _take_uid() -> int:
  """A uid no other run of this process uses (nor, by its range, anyone)."""
  with _uids_lock:
    while True:
      uid = _UID_RANGE[0] + secrets.randbelow(_UID_RANGE[1] - _UID_RANGE[0])
      if uid not in _uids_in_use:
        _uids_in_use.add(uid)
        return uid


def _runtime_paths(python: str) -> tuple[str, ...]:
  """The directories `python` needs outside the system paths, to be bound.

  Its prefixes (a virtualenv and the installation behind it) both as spelled
  and resolved, because the interpreter finds its virtualenv through the path
  it was started by. Paths inside system paths or inside each other are
  dropped; the init binds each remaining one at its own path.
  """
  if python not in _runtime_paths_cache:
    if python == os.path.abspath(sys.executable):
      prefixes = [sys.prefix, sys.base_prefix, sys.exec_prefix,
                  sys.base_exec_prefix]
    else:
      code = ('import sys; print(sys.prefix, sys.base_prefix, sys.exec_prefix,'
              ' sys.base_exec_prefix, sep="\\n")')
      prefixes = subprocess.run(
          [python, '-I', '-S', '-c', code], check=True, capture_output=True,
          text=True, env=_HOST_ENV, timeout=30).stdout.splitlines()
    candidates = set()
    for path in prefixes + [os.path.dirname(python),
                            os.path.dirname(os.path.realpath(python))]:
      candidates.update((os.path.abspath(path), os.path.realpath(path)))
    covered = set(init_program.SYSTEM_PATHS) | {
        os.path.realpath(path) for path in init_program.SYSTEM_PATHS}
    kept = []
    for path in sorted(candidates, key=len):
      if path != '/' and not any(
          init_program.is_within(path, c) for c in covered):
        kept.append(path)
        covered.add(path)
    _runtime_paths_cache[python] = tuple(kept)
  return _runtime_paths_cache[python]


def _remove_tree(path: str) -> None:
  """rmtree that also removes what a program made unwritable ('none')."""
  def make_writable_and_retry(function, failed_path, _):
    try:
      os.chmod(os.path.dirname(failed_path), 0o700)
      if os.path.isdir(failed_path) and not os.path.islink(failed_path):
        os.chmod(failed_path, 0o700)
      function(failed_path)
    except OSError:
      _log.warning('sandbox: could not remove %s', failed_path)
  shutil.rmtree(path, onerror=make_writable_and_retry)
