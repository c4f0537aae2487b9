"""Stopping on SIGTERM: a flag the training loop polls, and what waits raise.

A scheduler (Kubernetes, a TPU VM's maintenance, `timeout`) asks a training
process to stop with SIGTERM. `install_sigterm_handler` turns the signal into
a `StopFlag`; the trainer polls it once per step (a collective on several
processes, so all stop at the same step) and saves a final checkpoint, and
blocking waits in between end early by raising `StopRequested`. The contract
with the checkpoints is in docs/design/checkpointing.md.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


class StopRequested(BaseException):
  """A stop was requested while the program waited.

  A BaseException, like KeyboardInterrupt, so that no `except Exception`
  on the way up swallows it.
  """


class StopFlag:
  """Records that the process was asked to stop; polled by the training loop.

  The signal handler does nothing but store the signal number. Python runs
  handlers in the main thread between bytecodes, i.e. in the middle of
  whatever the loop was doing: saving from the handler would re-enter orbax
  mid-save or mid-step, and even `threading.Event.set` could deadlock (its
  lock is not reentrant and the interrupted code may hold it). A plain
  attribute store is the one thing that is always safe.

  Contract for the training loop: call `should_stop()` once per step, at the
  same step on every process; when it returns True, `save(..., force=True)`,
  `wait()`, then exit. Schedulers follow SIGTERM with SIGKILL after a grace
  period (30 s on Kubernetes by default), so the final save must fit in it;
  if it does not, the atomic finalize means the previous checkpoint is
  what the next run resumes from.

  Two more ways to be prompt, for one process (with several, a stop must go
  through `should_stop` at the same step everywhere):
    * `exit_immediately`: while set, the handler ends the process at once
      with SIGTERM's default action, as if no handler were installed. Only
      for phases with nothing to save (start-up before the first step: the
      state equals the checkpoint it came from). Raising from the handler
      instead would unwind through whatever native code the main thread was
      in (an import, a compile), which crashed the interpreter at exit.
    * `raise_if_requested()`: called by blocking waits between their short
      polls, so that a starved queue or a hung weight push ends in seconds.
  """

  def __init__(self):
    self.signum: int | None = None
    self.exit_immediately = False
    self._previous: dict[int, Any] = {}

  def _handle(self, signum, frame) -> None:
    del frame
    self.signum = signum
    if self.exit_immediately:
      os.write(2, b'stop requested during start-up: nothing to save yet;'
               b' run the same command to resume\n')
      signal.signal(signum, signal.SIG_DFL)
      os.kill(os.getpid(), signum)

  @property
  def requested(self) -> bool:
    """A stop was requested of this process (no collective)."""
    return self.signum is not None

  def raise_if_requested(self) -> None:
    """Raises `StopRequested` if a stop was requested (one process only:
    with several, waits must not leave the lock-step of `should_stop`)."""
    if self.signum is not None and jax.process_count() == 1:
      raise StopRequested(f'signal {self.signum}')

  def should_stop(self) -> bool:
    """True once a stop was requested on any process.

    With several processes this is a collective (an all-gather of one flag
    per process), so all of them see the same answer at the same step and
    enter the final save together; a signal reaching only some hosts, or
    reaching them a step apart, would otherwise deadlock that save.
    """
    local = self.signum is not None
    if jax.process_count() == 1:
      return local
    flags = multihost_utils.process_allgather(np.asarray(local, np.int32))
    return bool(np.any(flags))

  def uninstall(self) -> None:
    """Puts back the handlers that were there before `install`."""
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    self._previous.clear()

  def install(self, signals: Iterable[int]) -> StopFlag:
    # signal.signal only works in the main thread; it raises ValueError
    # elsewhere, which is the right error to surface.
    for signum in signals:
      self._previous[signum] = signal.signal(signum, self._handle)
    return self


def install_sigterm_handler(
    signals: Sequence[int] = (signal.SIGTERM,)) -> StopFlag:
  """Installs a flag-setting handler for `signals`; see `StopFlag`.

  Call from the main thread. Once installed, SIGTERM no longer kills the
  process: the training loop must poll `should_stop()` and exit itself. With
  jax.distributed, this replaces the coordination service's own SIGTERM
  notifier, so orbax's preemption save policy stays idle and `should_stop()`
  is what synchronises the hosts.
  """
  return StopFlag().install(signals)
