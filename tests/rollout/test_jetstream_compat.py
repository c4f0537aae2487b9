"""The guards `jetstream_compat` puts on JetStream 0.2.2's orchestrator."""

import subprocess
import sys

from sao_jax.rollout import jetstream_compat

orchestrator = jetstream_compat.orchestrator


def test_generate_loop_restarts_after_the_free_slot_race():
  calls = []

  def generate_loop(idx):
    calls.append(idx)
    if len(calls) < 3:  # what JetStream asserts when every slot freed
      raise AssertionError('At this point we must have some requests inserted'
                           ' into the slots.')

  before = jetstream_compat.GENERATE_LOOP_RESTARTS
  thread = orchestrator.JetThread(target=generate_loop, args=(7,),
                                  name='generate-0')
  thread.start()
  thread.join(timeout=10)
  assert not thread.is_alive()
  # Restarted twice, with its arguments, and the process is still here.
  assert calls == [7, 7, 7]
  assert jetstream_compat.GENERATE_LOOP_RESTARTS == before + 2


# A fresh interpreter: whether TensorFlow gets imported depends on what the
# process imported before.
_SEQIO_CHECK = '''
import sys
from sao_jax.rollout import jetstream_compat
from jetstream.engine import token_utils
assert 'tensorflow' not in sys.modules, 'JetStream pulled in TensorFlow'
assert 'seqio' not in sys.modules, 'the seqio stand-in stayed registered'
vocab = token_utils.SentencePieceVocabulary('/nonexistent/spm.model')
from seqio import vocabularies
assert type(vocab) is vocabularies.SentencePieceVocabulary, type(vocab)
assert not getattr(vocabularies, 'SAO_STAND_IN', False)
print('ok')
'''


def test_jetstream_imports_without_tensorflow_and_seqio_stays_real():
  # JetStream's SentencePiece tokenizer still gets seqio's own vocabulary
  # (its constructor reads no file: seqio loads the model lazily).
  proc = subprocess.run([sys.executable, '-c', _SEQIO_CHECK],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.strip().endswith('ok')
