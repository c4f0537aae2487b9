"""The evidence benchmarks' reductions, on hand-worked curves."""

import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), 'benchmarks'))
import ablations  # pylint: disable=g-import-not-at-top,wrong-import-position
import online  # pylint: disable=g-import-not-at-top,wrong-import-position
import training_runs  # pylint: disable=g-import-not-at-top,wrong-import-position


def test_collapse_step_finds_a_lasting_fall_not_a_dip():
  steps = list(range(1, 13))
  # Rises to 0.8, dips for one window and recovers: no collapse.
  dip = [0.2, 0.5, 0.8, 0.8, 0.8, 0.2, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8]
  assert training_runs.collapse_step(steps, dip, drop=0.25, window=1) is None
  # Rises to 0.8, then falls to 0.1 for good at step 8.
  fall = [0.2, 0.5, 0.8, 0.8, 0.8, 0.8, 0.8, 0.1, 0.1, 0.1, 0.1, 0.1]
  assert training_runs.collapse_step(steps, fall, drop=0.25, window=1) == 8
  # With a 2-step trailing mean the fall shows one step later
  # (step 8: (0.8 + 0.1) / 2 = 0.45 is not below 0.8 - 0.5).
  assert training_runs.collapse_step(steps, fall, drop=0.5, window=2) == 9
  # A slow decline that ends within drop / 2 of the best is not a collapse.
  assert training_runs.collapse_step(
      steps, [0.8] * 6 + [0.7] * 6, drop=0.25, window=1) is None


def test_first_time_at_and_mean_se():
  curve = [dict(seconds=10, accuracy=0.2), dict(seconds=20, accuracy=0.85),
           dict(seconds=30, accuracy=0.95)]
  assert training_runs.first_time_at(curve, 0.9) == 30
  assert training_runs.first_time_at(curve, 0.8) == 20
  assert training_runs.first_time_at(curve, 0.99) is None
  mean, se = training_runs.mean_se([1.0, 2.0, 3.0])
  assert (mean, se) == (2.0, pytest.approx(1.0 / 3 ** 0.5))
  assert training_runs.mean_se([4.0]) == (4.0, 0.0)
  # Step 0 (the untrained policy) is not part of the area.
  curve = [dict(step=0, accuracy=0.1), dict(step=5, accuracy=0.4),
           dict(step=10, accuracy=0.8)]
  assert training_runs.area_under_accuracy(curve) == pytest.approx(0.6)


def test_switch_report_recovery_and_post_switch_reward():
  # Reward 1 before the switch at step 4; after it 0, 0.5, 0.95, 1, 1.
  rewards = [0.9, 1.0, 1.0, 1.0, 0.0, 0.5, 0.95, 1.0, 1.0]
  curve = [dict(step=s, reward=r) for s, r in enumerate(rewards, 1)]
  (report,) = online.switch_report(curve, [4], total_steps=9, window=1)
  assert report['pre_switch_reward'] == 1.0
  # First step after the switch at >= 0.9 x 1.0: step 7, 3 steps after it.
  assert report['steps_to_recover_90'] == 3
  assert report['post_switch_mean_reward'] == pytest.approx(
      (0.0 + 0.5 + 0.95 + 1.0 + 1.0) / 5)
  assert report['first_step_reward'] == 0.0
  # A 2-step window: pre-switch mean (1 + 1) / 2, recovered when the
  # trailing mean reaches 0.9: step 8 ((0.95 + 1) / 2 = 0.975).
  (report,) = online.switch_report(curve, [4], total_steps=9, window=2)
  assert report['steps_to_recover_90'] == 4


def test_welch_and_paired_tests_match_hand_worked_values():
  # Welch: means 2 and 5.5, sample variances 1 and 5/3, n = 3 and 4:
  # t = -3.5 / sqrt(1/3 + 5/12) = -3.5 / sqrt(0.75).
  welch = training_runs.welch([1, 2, 3], [4, 5, 6, 7])
  assert welch['difference'] == -3.5
  assert welch['t'] == pytest.approx(-3.5 / 0.75 ** 0.5)
  assert 0.005 < welch['p'] < 0.02
  # Paired: differences 1, 2, 3 -> mean 2, se 1/sqrt(3), t = 2 sqrt(3) on 2
  # degrees of freedom, whose CDF is 1/2 + t / (2 sqrt(2 + t^2)).
  paired = training_runs.paired([1, 2, 4], [0, 0, 1])
  t = 2 * 3 ** 0.5
  assert paired['difference'] == 2.0
  assert paired['se'] == pytest.approx(1 / 3 ** 0.5)
  assert paired['p'] == pytest.approx(2 * (0.5 - t / (2 * (2 + t * t) ** 0.5)))
  # Too few values or no spread: no test, the difference still reported.
  assert training_runs.welch([1.0], [2.0, 3.0])['difference'] == -1.5
  assert training_runs.welch([1.0], [2.0, 3.0])['p'] != training_runs.welch(
      [1.0], [2.0, 3.0])['p']  # NaN
  assert training_runs.paired([1, 1], [0, 0])['difference'] == 1.0


def test_ablations_pair_each_ablation_with_its_reference_by_seed():
  def run(variant, seed, curve, final):
    return {'variant': variant, 'seed': seed, 'final_accuracy': final,
            'eval_curve': [{'step': 0, 'accuracy': 0.0}]
                          + [{'step': i + 1, 'accuracy': a}
                             for i, a in enumerate(curve)]}
  summaries = [
      run('sao', 0, [0.5, 0.7], 0.7), run('sao', 1, [0.6, 0.8], 0.8),
      run('sao', 2, [0.4, 0.6], 0.6),
      # seed 2 of K=1 failed: only seeds 0 and 1 pair up.
      run('K=1', 0, [0.3, 0.7], 0.7), run('K=1', 1, [0.2, 0.6], 0.6),
      {'variant': 'K=1', 'seed': 2, 'failed': 'exit 1'},
      run('full critic', 0, [0.5, 0.9], 0.9)]
  tests = {t['ablation']: t for t in ablations.comparisons(
      summaries, ['sao', 'K=1', 'full critic', '3 turns: naive GAE'])}
  # naive GAE's reference (skip-observation GAE) did not run: no test.
  assert set(tests) == {'K=1', 'full critic'}
  k1 = tests['K=1']
  assert (k1['reference'], k1['seeds']) == ('sao', [0, 1])
  # Areas (mean over the evaluations after step 0): K=1 0.5, 0.4 against
  # SAO 0.6, 0.7, differences -0.1 and -0.3: mean -0.2, se 0.1, t = -2 on
  # 1 degree of freedom, two-sided p = 1 - 2 atan(2) / pi.
  area = k1['area_under_accuracy']
  assert area['difference'] == pytest.approx(-0.2)
  assert area['se'] == pytest.approx(0.1)
  assert area['p'] == pytest.approx(1 - 2 * math.atan(2) / math.pi)
  assert k1['final_accuracy']['difference'] == pytest.approx(-0.1)
  # One seed: a difference, no test.
  single = tests['full critic']['final_accuracy']
  assert single['difference'] == pytest.approx(0.2) and math.isnan(single['p'])
  assert '| K=1 minus sao | 2 | -0.200 ± 0.100 (p = 0.3) |' in (
      ablations.comparisons_markdown(tests.values()))


def test_collapse_below_half_peak_needs_five_steps_under_half_the_peak():
  steps = list(range(1, 13))
  # The 3-step mean peaks at 0.8 (steps 4-6); steps 7-11 are at 0.3 < 0.4.
  rewards = [0.2, 0.4, 0.6, 0.8, 0.8, 0.8, 0.3, 0.3, 0.3, 0.3, 0.3, 0.8]
  assert training_runs.collapse_below_half_peak(steps, rewards) == 7
  # Six steps are not reached before the reward comes back.
  assert training_runs.collapse_below_half_peak(steps, rewards,
                                                patience=6) is None
  # 0.45 is not below half of 0.8.
  assert training_runs.collapse_below_half_peak(
      steps, rewards[:6] + [0.45] * 6) is None
  # One lucky batch of 1.0 among 0.3s makes a 3-step peak of ~0.53, not 1.0.
  lucky = [0.3, 0.3, 1.0, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3]
  assert training_runs.collapse_below_half_peak(range(10), lucky) is None
  # A run that never learned (peak below 0.2) has nothing to collapse from.
  assert training_runs.collapse_below_half_peak(
      steps, [0.1] * 6 + [0.0] * 6) is None


def test_a_grid_resumes_from_an_earlier_result_without_rerunning(tmp_path):
  """A run whose command (workdir aside) is in the earlier result is taken
  from it; the others would run (here: none is left to run)."""
  spec = training_runs.RunSpec('sao', 1, 'configs/tiny.py:algorithm=sao',
                               {'total_steps': 3})
  earlier = dict(variant='sao', seed=1, final_accuracy=0.5, command=' '.join(
      spec.command('/elsewhere/sao/seed1')[1:]))
  result = tmp_path / 'result.json'
  result.write_text(json.dumps({'runs': [earlier]}))
  finished = training_runs.load_finished(str(result))
  calls = []
  summaries = training_runs.run_grid([spec], str(tmp_path / 'runs'),
                                     batch_size=16, finished=finished,
                                     on_run=calls.append)
  assert summaries == [earlier]
  assert calls == []  # nothing new ran
  other = training_runs.RunSpec('sao', 1, 'configs/tiny.py:algorithm=sao',
                                {'total_steps': 4})
  assert training_runs.run_key(' '.join(other.command('/x')[1:])) not in (
      finished)
  assert training_runs.load_finished(str(tmp_path / 'missing.json')) == {}


def test_a_grid_command_with_a_stale_key_fails_before_anything_runs():
  """`check_commands` parses and validates each variant as the trainer
  would, naming the variant and the key's new place."""
  good = training_runs.RunSpec('sao', 0, 'configs/tiny.py:algorithm=sao',
                               {'total_steps': 3, 'task.word_target.turns': 2})
  moved = training_runs.RunSpec('old key', 0, 'configs/tiny.py:algorithm=sao',
                                {'task.humaneval_max_turns': 2})
  typed = training_runs.RunSpec('typed', 0, 'configs/tiny.py:algorithm=grpo',
                                {'batch_size': 'sixteen'})
  invalid = training_runs.RunSpec('invalid', 0, 'configs/tiny.py:algorithm=sao',
                                  {'rollout.dtype': 'float8'})
  assert training_runs.quick_grid([good], 'sao') == [good]
  for spec, expected in (
      (moved, "variant 'old key': unknown config key"
              ' --config.task.humaneval_max_turns'),
      (typed, "variant 'typed': flag --config.batch_size=sixteen"),
      (invalid, "variant 'invalid': invalid config: config.rollout.dtype")):
    with pytest.raises(SystemExit, match=expected) as e:
      training_runs.quick_grid([good, spec], 'sao')
    assert str(e.value).startswith('error: ')
  with pytest.raises(SystemExit, match='did you mean --config.task.humaneval'
                     '.max_turns'):
    training_runs.check_commands([moved])
  with pytest.raises(ValueError, match="no spec of variant 'grpo'"):
    training_runs.quick_grid([good], 'grpo')
