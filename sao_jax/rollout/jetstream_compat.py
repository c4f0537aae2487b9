"""Importing JetStream 0.2.2 safely on current JAX.

`google-jetstream` 0.2.2 is the last release (the project moved to vLLM
tpu-inference). Used unchanged, it has faults this module neutralises; import
JetStream modules only through here:

  * its orchestrator calls the removed `jax.tree_map` when it frees a prefix
    after the first insert; the exception kills the thread, and JetStream's
    thread wrapper answers any thread failure with SIGKILL of the whole
    server. `orchestrator.delete_pytree` is replaced with a `jax.tree.map`
    version;
  * importing the orchestrator sets the root logger to DEBUG and adds a stdout
    handler, flooding every program that imports it: both are undone;
  * a thread failure SIGKILLs the process without a word in the logs; the
    wrapper is kept (a dead driver thread cannot serve), but the failure is
    logged at CRITICAL first so the cause is on record.

Faults handled elsewhere: `max_tokens` unset returns no tokens and over-long
prompts are truncated silently (the client always sets `max_tokens` and checks
prompt lengths); a cancelled stream keeps its slot until it finishes (requests
carry bounded `max_tokens`); two servers can bind one port (our server
disables SO_REUSEPORT); the server never rejects load (the client bounds
requests in flight); a non-empty `session_cache` with token content crashes
(never sent).
"""

from __future__ import annotations

import logging
import os
import signal
import traceback

import jax

_root = logging.getLogger()
_level_before = _root.level
_handlers_before = list(_root.handlers)

# pylint: disable=g-import-not-at-top,wrong-import-position
from jetstream.core import orchestrator
from jetstream.core.proto import jetstream_pb2
from jetstream.core.proto import jetstream_pb2_grpc
from jetstream.engine import engine_api
from jetstream.engine import tokenizer_api
# pylint: enable=g-import-not-at-top,wrong-import-position

_root.setLevel(_level_before)
for _handler in list(_root.handlers):
  if _handler not in _handlers_before:
    _root.removeHandler(_handler)

_log = logging.getLogger(__name__)


def _delete_pytree(tree):
  """Frees the device buffers of a prefix once it is inserted."""

  def delete(leaf):
    if isinstance(leaf, jax.Array) and not leaf.is_deleted():
      leaf.delete()

  jax.tree.map(delete, tree)


def _run_logged(self):
  try:
    self._sao_run()  # pylint: disable=protected-access
  except Exception:  # pylint: disable=broad-except
    _log.critical('JetStream thread %s failed; the server stops:\n%s',
                  self.name, traceback.format_exc())
    os.kill(os.getpid(), signal.SIGKILL)


orchestrator.delete_pytree = _delete_pytree
if not hasattr(orchestrator.JetThread, '_sao_run'):
  orchestrator.JetThread._sao_run = orchestrator.JetThread.__mro__[1].run  # pylint: disable=protected-access
  orchestrator.JetThread.run = _run_logged

class _DropOrchestratorChatter(logging.Filter):
  """Drops the orchestrator's per-step INFO lines (several per decode step)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.levelno <= logging.INFO
                and record.pathname.endswith(os.path.join('core',
                                                          'orchestrator.py')))


def quiet_orchestrator_logs() -> None:
  """Keeps JetStream's warnings and errors, not its per-step INFO lines.

  The orchestrator logs through the root logger, so this filters the root
  handlers; call it after logging is configured.
  """
  for handler in logging.getLogger().handlers:
    if not any(isinstance(f, _DropOrchestratorChatter) for f in handler.filters):
      handler.addFilter(_DropOrchestratorChatter())


# The modules the rest of sao_jax uses.
__all__ = ['orchestrator', 'jetstream_pb2', 'jetstream_pb2_grpc', 'engine_api',
           'tokenizer_api']
