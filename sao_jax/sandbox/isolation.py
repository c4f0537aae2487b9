"""What the sandbox achieves on this machine: its modes, and their probe.

The namespaces `runner.py` relies on are not available everywhere, so the
sandbox runs in the best of three modes that works here (`sandbox.isolation()`
probes once per process, with `probe` below):

  'root'    the trainer is root (CI machines): the namespaces are created
            directly and the program runs as a random unprivileged uid. Root
            ignores RLIMIT_NPROC and can write anywhere; a uid of its own also
            gives each run its own process count, where a shared `nobody`
            would let one fork bomb starve the concurrent runs.
  'userns'  an ordinary user with unprivileged user namespaces (most laptops):
            `unshare --user --map-root-user ...` builds the same root, and the
            program then enters a nested user namespace so that it holds no
            capability over its mounts. It keeps the user's supplementary
            groups (the kernel forbids dropping them there), which is why no
            host socket directory is mounted.
  'none'    neither works (no `unshare`, namespaces disabled, a container
            without CAP_SYS_ADMIN): rlimits, the deadline and the kill only
            (the init is the subreaper of whatever the program detaches). The
            program has the host's network and file system, as the trainer's
            user (as root: a random uid, so the interpreter must be readable
            by anyone). `ExecutionResult.network_isolated` is False and a
            warning is logged once: never silently.

Standard library only, like the rest of `sao_jax.sandbox`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from collections.abc import Callable

MODES = ('root', 'userns', 'none')


@dataclasses.dataclass(frozen=True)
class Isolation:
  """What the sandbox achieves on this machine.

  Attributes:
    mode: 'root', 'userns' or 'none' (see the module docstring).
    network_isolated: the program cannot open connections.
    filesystem_isolated: the program sees a private root: host files are
      absent or read-only, and its writes vanish with the run.
    processes_isolated: a PID namespace: nothing the program starts survives
      the run, and no other process is visible to it.
    detail: why the namespace modes failed, when they did.
  """
  mode: str
  network_isolated: bool
  filesystem_isolated: bool
  processes_isolated: bool
  detail: str = ''


def probe(try_mode: Callable[[str], str | None], path: str) -> Isolation:
  """The best mode here: the namespace mode for our uid, if a program runs.

  Trying is the only reliable test: `unshare` may exist while the kernel, a
  container or a sysctl refuses the namespaces.

  Args:
    try_mode: runs a probe program in the given mode; returns why it failed
      there, or None when it worked.
    path: the PATH that util-linux `unshare` is looked up in.
  """
  if sys.platform != 'linux':
    return _isolation_of('none', f'platform {sys.platform} has no namespaces')
  if shutil.which('unshare', path=path) is None:
    return _isolation_of('none', 'util-linux `unshare` is not installed')
  candidates = ('root',) if os.geteuid() == 0 else ('userns',)
  failures = []
  for mode in candidates:
    failure = try_mode(mode)
    if failure is None:
      return _isolation_of(mode)
    failures.append(f'{mode}: {failure}')
  return _isolation_of('none', '; '.join(failures))


def _isolation_of(mode: str, detail: str = '') -> Isolation:
  isolated = mode != 'none'
  return Isolation(mode, isolated, isolated, isolated, detail)
