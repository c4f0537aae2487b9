"""Importing JetStream 0.2.2 safely on current JAX.

`google-jetstream` 0.2.2 is the last release (the project moved to vLLM
tpu-inference). Used unchanged, it has faults this module neutralises; import
JetStream modules only through here (except its protobuf messages,
`jetstream.core.proto.jetstream_pb2`, which import no JAX and which the
client imports directly so that it stays free of JAX):

  * its orchestrator calls the removed `jax.tree_map` when it frees a prefix
    after the first insert; the exception kills the thread, and JetStream's
    thread wrapper answers any thread failure with SIGKILL of the whole
    server. `orchestrator.delete_pytree` is replaced with a `jax.tree.map`
    version;
  * importing the orchestrator sets the root logger to DEBUG and adds a stdout
    handler, flooding every program that imports it: both are undone;
  * a thread failure SIGKILLs the process without a word in the logs; the
    wrapper is kept (a dead driver thread cannot serve), but the failure is
    logged at CRITICAL first so the cause is on record;
  * its generate thread races with the detokenize thread: it reads the free
    slot count, finds no request to insert, and then asserts that some slot is
    busy, while the detokenize thread may have freed the last busy slot in
    between (`AssertionError: At this point we must have some requests
    inserted into the slots`; seen in training runs and under a stress
    client). The assertion fails only when every slot is free, so no request
    lives in the decode state: the thread's loop is restarted (a fresh decode
    state, counted in `GENERATE_LOOP_RESTARTS`) instead of killing the server;
  * its `token_utils` imports seqio at module level, for a SentencePiece
    tokenizer sao_jax never uses (it tokenizes with Hugging Face
    `tokenizers`), and seqio imports TensorFlow: 0.65 GiB resident and ~3 s
    in every process that serves. While JetStream imports, `seqio.vocabularies`
    is a stand-in whose `SentencePieceVocabulary` imports the real seqio when
    first constructed; it leaves `sys.modules` right after, so a later
    `import seqio` gets the real package. Its `Vocabulary` is a plain base
    class: JetStream's test vocabulary (`mock_utils.TestVocab`) derives from
    it and is not for use here. When seqio is already imported, the real one
    serves.

Faults handled elsewhere: `max_tokens` unset returns no tokens and over-long
prompts are truncated silently (the client always sets `max_tokens` and checks
prompt lengths); a cancelled stream keeps its slot until it finishes (requests
carry bounded `max_tokens`); two servers can bind one port (our server
disables SO_REUSEPORT); the server never rejects load (the client bounds
requests in flight); a non-empty `session_cache` with token content crashes
(never sent).
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import traceback
import types

import jax


class _SeqioVocabulary:
  """Stands for `seqio.vocabularies.Vocabulary` in JetStream's annotations."""


class _SeqioSentencePieceVocabulary:
  """`seqio.vocabularies.SentencePieceVocabulary`, imported when constructed."""

  def __new__(cls, *args, **kwargs):
    return _real_seqio_vocabularies().SentencePieceVocabulary(*args, **kwargs)


def _real_seqio_vocabularies():
  _drop_seqio_stand_in()
  return importlib.import_module('seqio.vocabularies')


def _drop_seqio_stand_in():
  for name in ('seqio.vocabularies', 'seqio'):
    if getattr(sys.modules.get(name), 'SAO_STAND_IN', False):
      del sys.modules[name]


def _install_seqio_stand_in() -> None:
  if 'seqio' in sys.modules:
    return
  package = types.ModuleType('seqio')
  package.__path__ = []  # a package: `seqio.vocabularies` resolves below
  vocabularies = types.ModuleType('seqio.vocabularies')
  vocabularies.Vocabulary = _SeqioVocabulary
  vocabularies.SentencePieceVocabulary = _SeqioSentencePieceVocabulary
  for module in (package, vocabularies):
    module.SAO_STAND_IN = True
  package.vocabularies = vocabularies
  sys.modules['seqio'] = package
  sys.modules['seqio.vocabularies'] = vocabularies


_root = logging.getLogger()
_level_before = _root.level
_handlers_before = list(_root.handlers)

_install_seqio_stand_in()
# pylint: disable=g-import-not-at-top,wrong-import-position
from jetstream.core import orchestrator
from jetstream.core.proto import jetstream_pb2
from jetstream.core.proto import jetstream_pb2_grpc
from jetstream.engine import engine_api
from jetstream.engine import tokenizer_api
# pylint: enable=g-import-not-at-top,wrong-import-position
_drop_seqio_stand_in()

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


_SLOT_RACE = 'At this point we must have some requests inserted'

# How often a generate loop was restarted after the free-slot race.
GENERATE_LOOP_RESTARTS = 0


def _run_logged(self):
  """`JetThread.run`: restarts a generate loop after the slot race, logs and
  kills the server on any other failure."""
  global GENERATE_LOOP_RESTARTS
  # `Thread.run` forgets its target when it returns or raises: keep it.
  target, args, kwargs = self._target, self._args, self._kwargs  # pylint: disable=protected-access
  while True:
    try:
      if target is not None:
        target(*args, **kwargs)
      return
    except AssertionError as e:
      if _SLOT_RACE not in str(e):
        _fail(self)
      GENERATE_LOOP_RESTARTS += 1
      _log.warning('JetStream %s: every decode slot freed during a step'
                   ' (a known race); restarting its loop (%d so far)',
                   self.name, GENERATE_LOOP_RESTARTS)
    except Exception:  # pylint: disable=broad-except
      _fail(self)


def _fail(thread) -> None:
  _log.critical('JetStream thread %s failed; the server stops:\n%s',
                thread.name, traceback.format_exc())
  os.kill(os.getpid(), signal.SIGKILL)


orchestrator.delete_pytree = _delete_pytree
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
