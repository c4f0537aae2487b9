"""What the sandbox achieves on this machine: its modes, and their probe.

`probe(try_mode, path)` finds the best of the modes 'root', 'userns' and
'none' that works here (`runner.isolation()` calls it once per process) and
returns an `Isolation` saying what that mode contains. What each mode
isolates, and why, is in docs/design/sandbox.md. Standard library only, like
the rest of `sao_jax.sandbox`.
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
