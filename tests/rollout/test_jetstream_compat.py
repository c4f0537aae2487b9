"""The guards `jetstream_compat` puts on JetStream 0.2.2's orchestrator."""

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
