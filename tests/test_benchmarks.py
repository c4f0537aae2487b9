"""Quick modes of the benchmark scripts run in CI, so the scripts cannot rot."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from sao_jax import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(*argv, timeout=600):
  """Runs a repository script on the CPU; returns the finished process.

  The script sees one CPU device, as a user's run does, not conftest's eight
  fake ones (its other XLA flags pass through).
  """
  env = xla_flags.child_environment(
      dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT))
  return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout, env=env)


def test_kernels_benchmark_quick(tmp_path):
  out = tmp_path / 'kernels.json'
  proc = _script('benchmarks/kernels.py', '--quick', f'--out={out}')
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads(out.read_text())['results']
  assert {r['kernel'] for r in results} == {'gae', 'dis_fwd_bwd'}
  for r in results:
    assert r['min_hbm_bytes'] == r['batch'] * r['length'] * 17 + (
        r['batch'] * 4 if r['kernel'] == 'gae' else 0)
    assert r['xla_reference_ms']['cpu'] > 0
    assert r['tpu_compile_only']['v5e']['pallas']['bytes_accessed'] > 0
  assert '| gae |' in proc.stdout


def test_learner_benchmark_quick(tmp_path):
  out = tmp_path / 'learner.json'
  proc = _script('benchmarks/learner.py', '--quick', f'--out={out}',
                 '--layer-loops', 'unroll', '--critic-steps', '2',
                 '--parts', 'step', 'critic')
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(out.read_text())
  # One set of contenders (a second layer loop would compile both parts
  # again; its names would carry the loop as a suffix).
  parts = {'step_k2', 'critic'}
  assert set(result['median_seconds']) == parts
  assert result['batch']['tokens'] == 4 * (16 + 48)
  for name in parts:
    assert len(result['seconds'][name]) == 2  # rounds
    assert result['tokens_per_s'][name] > 0
    assert result['compiled_memory_bytes'][name]['argument'] > 0
    assert result['compile_s'][name] > 0
  assert '| critic |' in proc.stdout


@pytest.mark.slow
def test_layouts_benchmark_quick(tmp_path):
  out = tmp_path / 'layouts.json'
  proc = _script('benchmarks/layouts.py', '--quick', f'--out={out}')
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads(out.read_text())['results']
  assert set(results) == {'projection', 'mlp', 'attention'}
  for r in results.values():
    # Each pair is one function written two ways.
    assert r['max_abs_diff'] < 1e-4
    assert all(ms > 0 for v in r['ms'].values() for ms in v)
  assert '| attention | heads_inner |' in proc.stdout


def test_packing_benchmark_quick(tmp_path):
  out = tmp_path / 'packing.json'
  proc = _script('benchmarks/packing.py', '--quick', f'--out={out}')
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(out.read_text())
  entry = result['distributions']['calculator_quick']
  padding = entry['padding']
  packed = padding['packed'][str(result['default_rows'])]
  assert 0 <= packed['padding'] < padding['unpacked_padding'] < 1
  assert 0 <= packed['overflow_fraction'] <= 1
  speed = entry['learner']
  assert set(speed['median_seconds']) == {'unpacked', 'packed_2'}
  assert speed['rows'] == {'unpacked': 4, 'packed_2': 2}
  assert all(v > 0 for v in speed['real_tokens_per_s'].values())
  assert '| calculator_quick (T = 128) |' in proc.stdout


def test_rollout_benchmark_quick(tmp_path):
  out = tmp_path / 'rollout.json'
  proc = _script('benchmarks/rollout.py', '--quick', f'--out={out}',
                 timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(out.read_text())
  assert result['median_batched_tokens_per_s'] > 0
  assert result['median_sequential_tokens_per_s'] > 0
  assert result['server_load_and_swap_s'][0] > 0
  assert '| tiny-random |' in proc.stdout


@pytest.mark.slow
def test_weight_sync_benchmark_quick(tmp_path):
  out = tmp_path / 'weight_sync.json'
  proc = _script('benchmarks/weight_sync.py', '--quick', f'--out={out}',
                 timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  tiny = json.loads(out.read_text())['models']['tiny']
  for transport in ('bound_grpc', 'bound_tcp', 'stream', 'files'):
    assert tiny[transport]['median_s'] > 0
  # The server measured the swap of each push while it was decoding.
  assert tiny['stream']['median_pause_s'] >= 0
  assert tiny['stream']['median_first_step_s'] > 0
  assert '| tiny | 0.00 | stream |' in proc.stdout


@pytest.mark.slow
def test_server_stress_benchmark_quick(tmp_path):
  out = tmp_path / 'server_stress.json'
  proc = _script('benchmarks/server_stress.py', '--quick', f'--out={out}')
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  result = json.loads(out.read_text())
  assert result['server_alive_at_end'], result
  assert result['server_exit_code'] is None
  assert result['completed'] > 0
  assert result['cancelled'] > 0
  assert result['failed'] == {}, result['errors']
  assert result['health_check_failures'] == 0
  assert result['requests'] == result['completed'] + result['cancelled']


def _quick(script, tmp_path, timeout=600):
  """Runs `benchmarks/<script> --quick` in tmp_path; its JSON and stdout.

  Its runs share the suite's XLA compilation cache (tests/conftest.py).
  """
  out, plot = tmp_path / 'result.json', tmp_path / 'plot.png'
  proc = subprocess.run(
      [sys.executable, f'benchmarks/{script}', '--quick', f'--out={out}',
       f'--plot={plot}', f'--workdir={tmp_path / "runs"}'],
      cwd=ROOT, capture_output=True, text=True, timeout=timeout,
      env=dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT))
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert plot.stat().st_size > 10_000  # a PNG with curves, not an empty one
  result = json.loads(out.read_text())
  failed = [r for r in result['runs'] if 'failed' in r]
  assert not failed, failed[0]['output_tail']
  return result, proc.stdout


def _check_run(run, steps, batch_size=16):
  assert run['steps'] == steps
  assert run['trajectories'] == steps * batch_size
  assert [p['step'] for p in run['eval_curve']] == [0, steps]
  assert [p['step'] for p in run['reward_curve']] == list(range(1, steps + 1))
  assert 0.0 <= run['final_accuracy'] <= 1.0
  assert run['seconds'] > run['loop_seconds'] > 0
  assert 0.0 <= run['learner_idle_fraction'] <= 1.0
  assert 0.0 <= run['generator_idle_fraction'] <= 1.0


@pytest.mark.slow
def test_algorithms_benchmark_quick(tmp_path):
  result, stdout = _quick('algorithms.py', tmp_path)
  # Every row's command was checked; GRPO ran.
  (grpo,) = result['runs']
  assert grpo['variant'] == 'grpo'
  _check_run(grpo, 3)
  # GRPO as verl runs it: 4 mini-batch steps per batch, so its ratio against
  # the recomputed old policy moves off 1 (PPO clip, no critic).
  stability = grpo['stability']
  assert stability['policy/optimizer_steps'] == 4
  assert 'policy/clip_frac' in stability
  assert stability['policy/ratio_max'] > stability['policy/ratio_min']
  assert 'critic/explained_variance' not in stability
  assert result['aggregate']['grpo']['runs'] == 1
  reached = [p for p in grpo['eval_curve'] if p['accuracy'] >= 0.8]
  assert result['to_target']['grpo']['trajectories'] == [
      reached[0]['trajectories'] if reached else None]
  assert result['final_accuracy_paired_with_sao'] == {}  # SAO did not run
  assert '| grpo | 1/1 |' in stdout


@pytest.mark.slow
def test_logprob_parity_benchmark_quick(tmp_path):
  result, stdout = _quick('logprob_parity.py', tmp_path)
  runs = {r['variant']: r for r in result['runs']}
  assert set(runs) == {'server f32 / learner f32', 'server bf16 / learner f32'}
  assert '--config.rollout.dtype=bfloat16' in runs[
      'server bf16 / learner f32']['command']
  same, bf16 = (result['rows'][k] for k in (
      'server f32 / learner f32', 'server bf16 / learner f32'))
  for row in (same, bf16):
    assert row['tokens'] > 0
    assert 0 <= row['frac_gt_1'] <= row['frac_gt_0.1'] <= row['frac_gt_0.01'] <= 1
  # The same f32 policy on both sides differs by the order of its sums
  # (~1e-7 here); a bf16 server by its rounding (~6e-4 on the tiny model,
  # whose log-probs are nearly uniform, so few tokens pass 0.01).
  assert same['frac_gt_0.01'] < 0.01 and same['mean_abs_diff'] < 1e-5
  assert bf16['mean_abs_diff'] > 100 * same['mean_abs_diff']
  assert bf16['pearson'] < same['pearson']
  assert '| server bf16 / learner f32 | 1 |' in stdout


@pytest.mark.slow
def test_staleness_benchmark_quick(tmp_path):
  result, stdout = _quick('staleness.py', tmp_path)
  # Every variant's command was checked at bounds 0 and 4; SAO at 4 ran.
  (run,) = result['runs']
  assert run['variant'] == 'sao staleness=4'
  _check_run(run, 3)
  # The peers' schedule for every variant, at 2.5x the recipe's rate.
  assert run['stability']['policy/optimizer_steps'] == 4
  assert '--config.optim.actor.learning_rate=0.0075' in run['command']
  assert '--config.rollout.num_workers=80' in run['command']
  assert 'collapse_rule_step' in run
  assert result['aggregate']['sao staleness=4']['runs'] == 1
  # One bound: nothing to compare it with.
  assert result['comparisons'] == {'bound_minus_lowest': [],
                                   'sao_minus_variant': []}
  assert '| collapsed (rule) |' in stdout
  assert '| sao staleness=4 | 1/1 |' in stdout


@pytest.mark.slow
def test_ablations_benchmark_quick(tmp_path):
  result, _ = _quick('ablations.py', tmp_path)
  (run,) = result['runs']  # every variant checked, naive GAE ran
  assert result['complete'] and result['comparisons'] == []  # no reference
  assert run['variant'] == '3 turns: naive GAE'
  _check_run(run, 3)
  assert '--config.advantage.skip_observations=False' in run['command']
  assert '--config.task.word_target.turns=3' in run['command']


@pytest.mark.slow
def test_online_benchmark_quick(tmp_path):
  result, stdout = _quick('online.py', tmp_path)
  baseline = 'running_mean (per question, W=8)'
  assert result['complete']
  (run,) = result['runs']  # every variant checked, the baseline ran
  assert run['variant'] == baseline
  _check_run(run, 6)
  assert '--config.advantage.running_mean_scope=prompt' in run['command']
  assert [s['switch_step'] for s in run['switches']] == [2, 4]
  # The reward of each phase, from the run's own curve.
  rewards = {p['step']: p['reward'] for p in run['reward_curve']}
  for entry, phase in zip(result['per_switch'][baseline], ((3, 4), (5, 6))):
    assert entry['post_switch_mean_reward'] == pytest.approx(
        sum(rewards[t] for t in phase) / 2)
    assert 'sao_minus_this' not in entry  # SAO did not run
  assert f'| {baseline} | 2 |' in stdout


@pytest.mark.slow
def test_async_speedup_benchmark_quick(tmp_path):
  result, stdout = _quick('async_speedup.py', tmp_path)
  (run,) = result['runs']  # both modes checked, sync ran
  assert run['variant'] == 'sync'
  _check_run(run, 3)
  # Synchronous training consumes only fresh data.
  assert run['stability']['rollout/staleness_max'] == 0
  assert run['stability']['rollout/token_staleness_p95'] == 0
  assert result['report']['sync']['runs'] == 1
  assert result['speedup_to_target_per_seed'] == []  # no async run to pair
  assert '| sync |' in stdout


@pytest.mark.slow
def test_group_waiting_benchmark_quick(tmp_path):
  result, stdout = _quick('group_waiting.py', tmp_path)
  (grpo,) = result['runs']  # every variant checked, grpo_dis G=4 ran
  assert grpo['variant'] == 'grpo_dis G=4 sigma=1'
  _check_run(grpo, 3)
  # A group's members wait for each other: they are queued one by one as
  # their episodes end, with lognormal latencies.
  assert 0.0 < grpo['final']['queue/group_wait_share'] < 1.0
  assert grpo['final']['queue/group_wait_mean_seconds'] > 0.0
  stability = grpo['stability']
  assert 0.0 <= stability['rollout/token_staleness_mean'] <= (
      stability['rollout/token_staleness_p95'])
  # 5 episodes of B = 16 in flight per unit of the bound, in groups of 4.
  assert '--config.rollout.num_workers=20' in grpo['command']
  row = result['report']['grpo_dis G=4 sigma=1']
  assert row['runs'] == 1 and 'vs_sao_seconds_to_target' in row
  assert result['comparisons'] == []  # SAO did not run
  assert '| grpo_dis G=4 sigma=1 | 1 |' in stdout


@pytest.mark.slow
def test_credit_assignment_benchmark_quick(tmp_path):
  result, stdout = _quick('credit_assignment.py', tmp_path)
  (sao,) = result['runs']  # every variant checked, SAO ran
  assert sao['variant'] == 'sao'
  _check_run(sao, 3)
  assert '--config.task.word_target.scored_reply=first' in sao['command']
  # SAO's critic: K = 2 full-batch steps per policy step (configs/tiny.py),
  # and one DIS policy step.
  stability = sao['stability']
  assert stability['critic/optimizer_steps'] == 2
  assert stability['policy/optimizer_steps'] == 1
  assert 'policy/frac_below' in stability
  assert 'critic/explained_variance' in stability
  assert result['sao_minus_this_area'] == {}
  assert '| sao | 1/1 |' in stdout


def test_accelerator_check_dry_run_plans_every_step(tmp_path):
  out = tmp_path / 'accelerator.json'
  proc = _script('benchmarks/accelerator.py', '--dry-run', f'--out={out}',
                 timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(out.read_text())
  assert report['dry_run'] and report['platform_found'] == 'cpu'
  assert set(report['plan']) == {'kernels', 'learner_smollm2_135m',
                                 'learner_llama_1b', 'rollout'}
  assert sum(s['limit_s'] for s in report['plan'].values()) < 600
  # Every planned command is a script of this repository that defines the
  # flags it is given.
  for step in report['plan'].values():
    script, *args = step['command'].split()
    source = (pathlib.Path(ROOT) / script).read_text()
    for flag in (a for a in args if a.startswith('--')):
      assert f"'{flag}'" in source, (script, flag)
  assert 'steps' not in report  # nothing ran
