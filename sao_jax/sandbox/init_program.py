"""The init of one sandboxed run: PID 1 of its namespaces, if it has any.

`runner.py` starts this file by its path for every execution, as

  python -I -S init_program.py key=value...

(inside `unshare ... --` when the mode has namespaces). It builds the run's
root, forks and execs the program, enforces the deadline and writes a
one-line status file into the run's host directory. It imports no `sao_jax`
module and as little else as it can, since it starts once per execution; the
library imports it too, for the host directory's entry names and the layout
constants below. The root it builds is described in docs/design/sandbox.md.
"""

from __future__ import annotations

# This program imports these only (see the module docstring).
import ctypes
import os
import resource
import signal
import stat
import sys

#: The program's working directory and HOME inside the namespaces.
SANDBOX_WORKDIR = '/sandbox'
PROGRAM_NAME = 'main.py'
_SANDBOX_ENV = {
    'PATH': '/usr/local/bin:/usr/bin:/bin',
    'HOME': SANDBOX_WORKDIR,
    'TMPDIR': '/tmp',
    'LANG': 'C.UTF-8',
    # Numeric libraries start a thread per core when imported: threads count
    # against the process limit, and one core is all a run should use.
    'OMP_NUM_THREADS': '1',
    'OPENBLAS_NUM_THREADS': '1',
    'MKL_NUM_THREADS': '1',
}
# Host paths bound read-only into the new root; symlinks among them (merged
# /usr: /bin -> usr/bin) are recreated as symlinks.
SYSTEM_PATHS = ('/usr', '/bin', '/sbin', '/lib', '/lib32', '/lib64',
                '/libx32', '/etc')
_DEVICES = ('null', 'zero', 'full', 'random', 'urandom')
# The writable places: (path in the sandbox, directory in the scratch tmpfs,
# mode). One tmpfs behind all of them makes `tmpfs_mb` a bound on everything
# a run can store.
_SCRATCH = (('/tmp', 'tmp', 0o1777), ('/var/tmp', 'var_tmp', 0o1777),
            ('/dev/shm', 'shm', 0o1777), (SANDBOX_WORKDIR, 'sandbox', 0o755))
# The program's uid inside its nested user namespace ('userns' mode).
_USERNS_UID = 1000

# Entries of the per-run host directory that the init reads or writes (the
# library makes the directory and also puts the program's outputs there).
PROGRAM_FILE = 'program.py'
STDIN_FILE = 'stdin'
STATUS_FILE = 'status'
ROOT_DIR = 'root'  # mount point of the new root
SCRATCH_DIR = 'scratch'  # mount point of the scratch tmpfs
WORK_DIR = 'work'  # the program's directory in 'none' mode

# <sys/mount.h>, <sched.h>, <sys/prctl.h>.
_MS_RDONLY = 0x1
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MS_NOEXEC = 0x8
_MS_REMOUNT = 0x20
_MS_NOATIME = 0x400
_MS_NODIRATIME = 0x800
_MS_BIND = 0x1000
_MS_MOVE = 0x2000
_MS_REC = 0x4000
_MS_RELATIME = 0x200000
_MS_STRICTATIME = 0x1000000
_CLONE_NEWUSER = 0x10000000
_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NO_NEW_PRIVS = 38
# Per-mount options (mountinfo's sixth field) a remount must repeat: inside a
# user namespace they are locked, and a remount that drops one fails.
_LOCKED_OPTIONS = {'nosuid': _MS_NOSUID, 'nodev': _MS_NODEV,
                   'noexec': _MS_NOEXEC, 'noatime': _MS_NOATIME,
                   'nodiratime': _MS_NODIRATIME, 'relatime': _MS_RELATIME}

_LIBC = ctypes.CDLL(None, use_errno=True)


class _Deadline(Exception):
  """The run's wall-clock time is up (SIGALRM)."""


def main(argv: list[str]) -> int:
  """PID 1 of a run: builds its root, runs the program, writes its status.

  The status file gets one line: 'exit CODE CPU_S', 'signal NUM CPU_S',
  'timeout', or 'error MESSAGE' when the sandbox itself failed before the
  program started (never the program's fault).
  """
  args = _parse_init_args(argv)
  host_dir = args['host_dir']
  # Python's default SIGINT handler would let the program kill us with a
  # KeyboardInterrupt ('userns' mode shares our uid); non-dumpable keeps it
  # from ptrace and /proc/1/mem.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  _prctl(_PR_SET_DUMPABLE, 0)
  os.umask(0o022)
  status_fd = os.open(os.path.join(host_dir, STATUS_FILE),
                      os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                      0o600)
  mode = args['mode']
  if mode == 'none':
    # Without a PID namespace, orphans of the program must come back to us
    # to be killed (double-forked daemons would otherwise go to the host's
    # init).
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
  # The deadline is ours to keep: the parent's kill is only a backstop, and
  # this way a run ends on time even if the trainer died.
  signal.signal(signal.SIGALRM, _raise_deadline)
  signal.setitimer(signal.ITIMER_REAL, float(args['timeout_s']))
  try:
    stdin_path = os.path.join(host_dir, STDIN_FILE)
    stdin_fd = os.open(stdin_path if os.path.exists(stdin_path) else
                       os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    if mode == 'none':
      workdir = os.path.join(host_dir, WORK_DIR)
    else:
      _enter_new_root(args)
      workdir = SANDBOX_WORKDIR
    try:
      pid = _spawn(args, workdir, stdin_fd)
    except _SetupError as e:
      status = f'error {e}'
    else:
      status = _wait_for(pid)
  except _Deadline:
    status = 'timeout'
  except Exception as e:  # pylint: disable=broad-except
    status = f'error {type(e).__name__}: {e}'
  signal.setitimer(signal.ITIMER_REAL, 0)
  # Truncated again: in 'none' mode the program could have written to it.
  os.ftruncate(status_fd, 0)
  os.pwrite(status_fd, status.replace('\n', ' ').encode(errors='replace'), 0)
  os.close(status_fd)
  if mode == 'none':
    _kill_descendants()
  # In a PID namespace, our exit kills whatever the program left running.
  return 0


class _SetupError(Exception):
  """The program could not be started (reported by the forked child)."""


def _raise_deadline(signum, frame):
  del signum, frame
  raise _Deadline()


def _parse_init_args(argv: list[str]) -> dict:
  args = {'bind': []}
  for item in argv:
    key, _, value = item.partition('=')
    if key == 'bind':
      args['bind'].append(value)
    else:
      args[key] = value
  return args


def _prctl(option: int, value: int) -> None:
  _check(_LIBC.prctl(option, ctypes.c_ulong(value), ctypes.c_ulong(0),
                     ctypes.c_ulong(0), ctypes.c_ulong(0)), f'prctl({option})')


def _check(ret: int, what: str) -> None:
  if ret != 0:
    errno = ctypes.get_errno()
    raise OSError(errno, f'{what}: {os.strerror(errno)}')


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
  _check(_LIBC.mount(
      os.fsencode(source) if source else None, os.fsencode(target),
      fstype.encode() if fstype else None, ctypes.c_ulong(flags),
      data.encode() if data else None), f'mount {source} on {target}')


def _enter_new_root(args: dict) -> None:
  """Builds the sandbox's root in a tmpfs and makes it ours (and the child's).

  Writable places are mounted first so that read-only binds can nest in them
  (a virtualenv under /tmp); then everything except those and /proc is made
  read-only; then the new root is moved onto / and entered, which leaves no
  path to the host's tree.
  """
  host_dir = args['host_dir']
  new_root = os.path.join(host_dir, ROOT_DIR)
  scratch = os.path.join(host_dir, SCRATCH_DIR)
  with open(os.path.join(host_dir, PROGRAM_FILE), 'rb') as f:
    program = f.read()
  # The skeleton holds only mount points and symlinks.
  _mount('tmpfs', new_root, 'tmpfs', _MS_NOSUID | _MS_NODEV,
         'mode=0755,size=1m')
  _mount('tmpfs', scratch, 'tmpfs', _MS_NOSUID | _MS_NODEV,
         f'mode=0755,size={int(args["tmpfs_mb"])}m')
  devices = {os.stat(new_root).st_dev, os.stat(scratch).st_dev}
  owner = os.getuid() if args['uid'] == 'None' else int(args['uid'])
  writable = []
  for target, name, mode in _SCRATCH:
    path = os.path.join(scratch, name)
    os.mkdir(path)
    os.chmod(path, mode)
    point = _mount_point(new_root, target, True, devices)
    _mount(path, point, None, _MS_BIND)
    writable.append(point)
  workdir = os.path.join(scratch, 'sandbox')
  program_path = os.path.join(workdir, PROGRAM_NAME)
  with open(program_path, 'wb') as f:
    f.write(program)
  os.chown(workdir, owner, owner)
  os.chown(program_path, owner, owner)

  for name in _DEVICES:
    _mount(f'/dev/{name}',
           _mount_point(new_root, f'/dev/{name}', False, devices), None,
           _MS_BIND)
  for name, target in (('fd', '/proc/self/fd'), ('stdin', '/proc/self/fd/0'),
                       ('stdout', '/proc/self/fd/1'),
                       ('stderr', '/proc/self/fd/2')):
    os.symlink(target, os.path.join(new_root, 'dev', name))
  proc = _mount_point(new_root, '/proc', True, devices)
  _mount('/proc', proc, None, _MS_BIND | _MS_REC)

  for path in SYSTEM_PATHS + tuple(args['bind']):
    if not os.path.lexists(path):
      continue
    if path in SYSTEM_PATHS and os.path.islink(path):
      os.symlink(os.readlink(path), new_root + path)
      continue
    _mount(path, _mount_point(new_root, path, os.path.isdir(path), devices),
           None, _MS_BIND | _MS_REC)

  _make_read_only(new_root, writable, proc)
  os.chdir(new_root)
  _mount(new_root, '/', None, _MS_MOVE)
  os.chroot('.')
  os.chdir('/')


def _mount_point(new_root: str, path: str, is_dir: bool,
                 devices: set[int]) -> str:
  """Creates `new_root + path` for a mount, only inside our own tmpfs mounts.

  Refuses to pass a symlink or another mount on the way: a mount point made
  through one would be created in the host's file system.
  """
  current = new_root
  parts = [part for part in path.split('/') if part]
  for i, part in enumerate(parts):
    current = os.path.join(current, part)
    try:
      info = os.lstat(current)
    except FileNotFoundError:
      if i == len(parts) - 1 and not is_dir:
        os.close(os.open(current, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
      else:
        os.mkdir(current, 0o755)
      continue
    if stat.S_ISLNK(info.st_mode) or info.st_dev not in devices:
      raise _SetupError(f'cannot mount {path}: {current} is a symlink or'
                        ' another file system')
  return current


def _make_read_only(new_root: str, writable: list[str], proc: str) -> None:
  """Remounts every mount under `new_root` read-only but the `writable` ones
  and /proc (where the child writes its uid_map; the uid it then runs as
  cannot write anything else there)."""
  with open('/proc/self/mountinfo', encoding='utf-8') as f:
    lines = f.read().splitlines()
  found_root = False
  for line in lines:
    fields = line.split(' ')
    point = _unescape(fields[4])
    found_root |= point == new_root
    if not is_within(point, new_root) or point in writable or is_within(
        point, proc):
      continue
    options = fields[5].split(',')
    flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY
    for option in options:
      flags |= _LOCKED_OPTIONS.get(option, 0)
    if 'noatime' not in options and 'relatime' not in options:
      flags |= _MS_STRICTATIME
    _mount(None, point, None, flags)
  if not found_root:  # never a silently writable root
    raise _SetupError(f'{new_root} is not in /proc/self/mountinfo')


def is_within(path: str, directory: str) -> bool:
  """Whether `path` is `directory` or below it (as spelled, not resolved)."""
  return path == directory or path.startswith(directory.rstrip('/') + '/')


def _unescape(path: str) -> str:
  """Undoes mountinfo's octal escapes of space, tab, newline and backslash."""
  for code, char in (('\\040', ' '), ('\\011', '\t'), ('\\012', '\n'),
                     ('\\134', '\\')):
    path = path.replace(code, char)
  return path


def _spawn(args: dict, workdir: str, stdin_fd: int) -> int:
  """Forks and execs the program; raises `_SetupError` if the exec failed.

  The child reports a failure before exec through a close-on-exec pipe, so
  an empty read means the program is running.
  """
  read_fd, write_fd = os.pipe()
  pid = os.fork()
  if pid == 0:
    try:
      os.close(read_fd)
      _exec_program(args, workdir, stdin_fd, write_fd)
    except BaseException as e:  # pylint: disable=broad-except
      os.write(write_fd, f'{type(e).__name__}: {e}'.encode(errors='replace'))
    finally:
      os._exit(127)  # pylint: disable=protected-access
  os.close(write_fd)
  with os.fdopen(read_fd, 'rb') as f:
    error = f.read()
  if error:
    os.waitpid(pid, 0)
    raise _SetupError(error.decode(errors='replace'))
  return pid


def _exec_program(args: dict, workdir: str, stdin_fd: int,
                  error_fd: int) -> None:
  """In the forked child: limits, credentials, then `python -I main.py`."""
  signal.setitimer(signal.ITIMER_REAL, 0)
  for signum in (signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ,
                 signal.SIGALRM):
    signal.signal(signum, signal.SIG_DFL)
  os.dup2(stdin_fd, 0)
  os.closerange(3, error_fd)
  os.closerange(error_fd + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
  os.chdir(workdir)
  _prctl(_PR_SET_NO_NEW_PRIVS, 1)
  if args['uid'] != 'None':
    uid = int(args['uid'])
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
  elif args['mode'] == 'userns':
    _enter_nested_user_namespace()
  # After the switch: a user namespace's process count is checked against
  # the limit its creator had (and the init counts there too), so a limit
  # set before the nested namespace would allow one process less per level.
  _set_limits(args)
  python = args['python']
  os.execve(python, [python, '-I', PROGRAM_NAME], _SANDBOX_ENV)


def _set_limits(args: dict) -> None:
  mb = 1024 * 1024
  cpu_s = int(args['cpu_s'])
  # CPU: SIGXCPU at the soft limit, SIGKILL a second later.
  limits = ((resource.RLIMIT_CPU, cpu_s, cpu_s + 1),
            (resource.RLIMIT_AS, int(args['memory_mb']) * mb, None),
            (resource.RLIMIT_FSIZE, int(args['max_file_mb']) * mb, None),
            (resource.RLIMIT_NPROC, int(args['max_procs']), None),
            (resource.RLIMIT_NOFILE, int(args['max_open_files']), None),
            (resource.RLIMIT_CORE, 0, None))
  for which, soft, hard in limits:
    hard = soft if hard is None else hard
    _, current_hard = resource.getrlimit(which)
    if current_hard != resource.RLIM_INFINITY:
      soft, hard = min(soft, current_hard), min(hard, current_hard)
    resource.setrlimit(which, (soft, hard))


def _enter_nested_user_namespace() -> None:
  """Leaves the namespace root's capabilities behind ('userns' mode).

  Our user namespace maps only uid 0, so the program cannot change uid; a
  nested namespace mapping `_USERNS_UID` to that 0 gives it a non-root uid
  whose capabilities, if any, are over a namespace that owns no mount: the
  read-only binds stay read-only. (After exec it has none at all.)
  """
  _check(_LIBC.unshare(_CLONE_NEWUSER), 'unshare(CLONE_NEWUSER)')
  for name, text in (('setgroups', 'deny'),
                     ('uid_map', f'{_USERNS_UID} 0 1'),
                     ('gid_map', f'{_USERNS_UID} 0 1')):
    with open(f'/proc/self/{name}', 'w', encoding='ascii') as f:
      f.write(text)


def _wait_for(pid: int) -> str:
  """Reaps children (PID 1 inherits orphans) until `pid` exits; its status."""
  while True:
    reaped, status, usage = os.wait4(-1, 0)
    if reaped == pid:
      break
  cpu_s = usage.ru_utime + usage.ru_stime
  if os.WIFSIGNALED(status):
    return f'signal {os.WTERMSIG(status)} {cpu_s:.3f}'
  return f'exit {os.WEXITSTATUS(status)} {cpu_s:.3f}'


def _kill_descendants() -> None:
  """Kills and reaps every descendant ('none' mode; we are their subreaper).

  Killing a child makes its children ours, so this repeats until none is
  left; the process limit bounds the rounds.
  """
  me = str(os.getpid()).encode()
  while True:
    try:
      names = [name for name in os.listdir('/proc') if name.isdigit()]
    except OSError:
      names = []
    for name in names:
      try:
        with open(f'/proc/{name}/stat', 'rb') as f:
          # The parent pid follows the command, which may contain spaces.
          parent = f.read().rsplit(b')', 1)[1].split()[1]
        if parent == me:
          os.kill(int(name), signal.SIGKILL)
      except (OSError, IndexError):
        pass
    try:
      os.waitpid(-1, 0)
      while os.waitpid(-1, os.WNOHANG)[0]:
        pass
    except ChildProcessError:
      return


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
