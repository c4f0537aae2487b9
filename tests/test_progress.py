"""The progress bar in a non-TTY stream: few lines, right postfix numbers."""

import io

import jax.numpy as jnp
import pytest

from sao_jax.logs import progress

class FakeClock:

  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


def redraws(stream):
  """The bar's drawings: tqdm separates them with \\r (and a final \\n)."""
  return [line for line in stream.getvalue().replace('\n', '\r').split('\r')
          if line.strip()]


def test_non_tty_stream_is_not_flooded():
  stream = io.StringIO()
  with progress.Progress(1000, file=stream) as bar:
    for step in range(1, 1001):
      bar.update(step, {'train/reward': 0.5})
  lines = redraws(stream)
  # The first drawing and the final one, nothing per step: a non-TTY redraws
  # at most every 30 s.
  assert len(lines) <= 3, lines
  assert '1000/1000' in lines[-1] and 'step=1000' in lines[-1]
  assert '\x1b' not in stream.getvalue()  # No terminal control codes.


def test_postfix_shows_window_mean_reward_accuracy_and_rates():
  stream, clock = io.StringIO(), FakeClock()
  # A with block even here: a bar left open by a failing test would make the
  # next tests' bars nest under it.
  with progress.Progress(100, initial=10, file=stream, mininterval=0,
                         reward_window=3, clock=clock) as bar:
    rewards = [0.0, 1.0, 2.0, 3.0, float('nan')]
    for i, reward in enumerate(rewards):
      clock.now += 6.0  # One step per 6 s: 10 steps/min.
      metrics = {'train/reward': jnp.float32(reward)}
      if i == 1:
        metrics['eval/accuracy'] = 0.625
      bar.update(11 + i, metrics, trajectories=8 * (i + 1))
    # Reward: mean of the last 3 finite values (1, 2, 3), the NaN left out.
    # Accuracy: kept from the eval three updates ago. Trajectories: 8 per 6 s.
    want = 'step=15 reward=2.000 acc=0.625 steps/min=10.00 traj/s=1.33'
    assert bar.postfix(15) == want
    assert want in redraws(stream)[-1]
  bar.close()  # Idempotent.
  bar.update(16, {})  # After close: ignored, not an error.


def test_postfix_before_any_eval_or_rate():
  with progress.Progress(10, file=io.StringIO(), clock=FakeClock()) as bar:
    assert bar.postfix(0) == 'step=0'


def test_print_line_and_disabled_bar():
  stream = io.StringIO()
  bar = progress.Progress(10, enabled=False, file=stream)
  bar.update(1, {'train/reward': 1.0})
  bar.print_line('eval: accuracy 0.5')
  bar.close()
  # Disabled: no bar drawn, but print_line still prints.
  assert stream.getvalue() == 'eval: accuracy 0.5\n'


def test_print_line_keeps_the_bar_intact():
  stream = io.StringIO()
  with progress.Progress(10, file=stream, mininterval=0) as bar:
    bar.update(1, {'train/reward': 1.0})
    bar.print_line('checkpoint saved')
    bar.update(2, {'train/reward': 1.0})
  text = stream.getvalue()
  # tqdm.write blanks the bar's line first, so the text starts a clean line.
  assert text.count('checkpoint saved') == 1
  assert '\rcheckpoint saved\n' in text
  assert 'step=2' in redraws(stream)[-1]


def test_non_scalar_reward_is_an_error():
  with progress.Progress(10, file=io.StringIO()) as bar:
    with pytest.raises(ValueError):
      bar.update(1, {'train/reward': jnp.ones(2)})
