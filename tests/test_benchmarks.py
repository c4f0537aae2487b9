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
                 '--layer-loops', 'scan', 'unroll', '--critic-steps', '2',
                 '--parts', 'step', 'critic')
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(out.read_text())
  parts = {f'{p}{s}' for p in ('step_k2', 'critic') for s in ('', '_unroll')}
  assert set(result['median_seconds']) == parts
  assert result['batch']['tokens'] == 4 * (16 + 48)
  for name in parts:
    assert len(result['seconds'][name]) == 2  # rounds
    assert result['tokens_per_s'][name] > 0
    assert result['compiled_memory_bytes'][name]['argument'] > 0
    assert result['compile_s'][name] > 0
  assert '| step_k2_unroll |' in proc.stdout


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
  assert [r['variant'] for r in result['runs']] == ['sao', 'grpo']
  for run in result['runs']:
    _check_run(run, 3)
  # SAO logs DIS band fractions, GRPO (PPO clip) its clip fraction.
  sao, grpo = result['runs']
  assert 'policy/frac_below' in sao['stability']
  assert 'policy/clip_frac' in grpo['stability']
  # GRPO as verl runs it: 4 mini-batch steps per batch, so its ratio against
  # the recomputed old policy moves off 1; SAO takes one step.
  assert grpo['stability']['policy/optimizer_steps'] == 4
  assert sao['stability']['policy/optimizer_steps'] == 1
  # SAO's critic: K = 2 full-batch steps per policy step (configs/tiny.py).
  assert sao['stability']['critic/optimizer_steps'] == 2
  assert (grpo['stability']['policy/ratio_max']
          > grpo['stability']['policy/ratio_min'])
  assert 'critic/explained_variance' in sao['stability']
  assert 'critic/explained_variance' not in grpo['stability']
  assert result['aggregate']['sao']['runs'] == 1
  for variant in ('sao', 'grpo'):
    target = result['to_target'][variant]
    run = next(r for r in result['runs'] if r['variant'] == variant)
    reached = [p for p in run['eval_curve'] if p['accuracy'] >= 0.8]
    assert target['trajectories'] == [
        reached[0]['trajectories'] if reached else None]
  assert '| sao | 1/1 |' in stdout


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
  runs = {r['variant']: r for r in result['runs']}
  assert set(runs) == {'sao staleness=0', 'sao staleness=4'}
  for run in runs.values():
    _check_run(run, 3)
  # Synchronous training consumes only fresh data.
  assert runs['sao staleness=0']['stability']['rollout/staleness_max'] == 0
  assert runs['sao staleness=0']['stability'][
      'rollout/token_staleness_p95'] == 0
  for run in runs.values():
    # The peers' schedule for every variant, at 2.5x the recipe's rate.
    assert run['stability']['policy/optimizer_steps'] == 4
    assert '--config.optim.actor.learning_rate=0.0075' in run['command']
    assert 'collapse_rule_step' in run
  assert '| collapsed (rule) |' in stdout
  assert '| sao staleness=4 | 1/1 |' in stdout
  # What bound 4 cost SAO against bound 0: one seed each, a difference and
  # no test; no other variant ran to compare SAO with.
  (lag,) = result['comparisons']['bound_minus_lowest']
  assert (lag['variant'], lag['bound'], lag['against']) == ('sao', 4, 0)
  areas = [sum(p['accuracy'] for p in r['eval_curve'] if p['step'] > 0)
           / sum(p['step'] > 0 for p in r['eval_curve'])
           for r in (runs['sao staleness=4'], runs['sao staleness=0'])]
  assert lag['area']['difference'] == pytest.approx(areas[0] - areas[1])
  assert result['comparisons']['sao_minus_variant'] == []
  assert '| sao | ' in stdout and '(p = -)' in stdout


@pytest.mark.slow
def test_ablations_benchmark_quick(tmp_path):
  result, _ = _quick('ablations.py', tmp_path)
  runs = {r['variant']: r for r in result['runs']}
  assert result['complete'] and result['comparisons'] == []  # no reference
  assert set(runs) == {'K=1', '3 turns: naive GAE'}
  for run in runs.values():
    _check_run(run, 3)
  assert '--config.advantage.skip_observations=False' in (
      runs['3 turns: naive GAE']['command'])


@pytest.mark.slow
def test_online_benchmark_quick(tmp_path):
  result, stdout = _quick('online.py', tmp_path)
  baseline = 'running_mean (per question, W=8)'
  assert result['complete']
  assert set(result['per_switch']) == {'sao', baseline}
  for run in result['runs']:
    _check_run(run, 6)
    assert [s['switch_step'] for s in run['switches']] == [2, 4]
  per_question = next(r for r in result['runs'] if r['variant'] == baseline)
  assert '--config.advantage.running_mean_scope=prompt' in (
      per_question['command'])
  # One seed each: the difference is reported, a test needs two.
  for sao, entry in zip(result['per_switch']['sao'],
                        result['per_switch'][baseline]):
    assert entry['sao_minus_this']['difference'] == pytest.approx(
        sao['post_switch_mean_reward'] - entry['post_switch_mean_reward'])
  assert '| sao | 2 |' in stdout


@pytest.mark.slow
def test_async_speedup_benchmark_quick(tmp_path):
  result, stdout = _quick('async_speedup.py', tmp_path)
  runs = {r['variant']: r for r in result['runs']}
  assert set(runs) == {'sync', 'async'}
  for run in runs.values():
    _check_run(run, 3)
  assert runs['sync']['stability']['rollout/staleness_max'] == 0
  assert result['report']['sync']['runs'] == 1
  assert '| async |' in stdout


@pytest.mark.slow
def test_group_waiting_benchmark_quick(tmp_path):
  result, stdout = _quick('group_waiting.py', tmp_path)
  runs = {r['variant']: r for r in result['runs']}
  assert set(runs) == {'sao sigma=1', 'grpo_dis G=4 sigma=1'}
  for run in runs.values():
    _check_run(run, 3)
  sao, grpo = runs['sao sigma=1'], runs['grpo_dis G=4 sigma=1']
  # Single rollouts never wait for a group; a group's members do (they are
  # queued one by one as their episodes end, with lognormal latencies).
  assert sao['final']['queue/group_wait_share'] == 0.0
  assert 0.0 < grpo['final']['queue/group_wait_share'] < 1.0
  assert grpo['final']['queue/group_wait_mean_seconds'] > 0.0
  for run in (sao, grpo):
    stability = run['stability']
    assert 0.0 <= stability['rollout/token_staleness_mean'] <= (
        stability['rollout/token_staleness_p95'])
  # 5 episodes of B = 16 in flight per unit of the bound, however grouped.
  assert '--config.rollout.num_workers=80' in sao['command']
  assert '--config.rollout.num_workers=20' in grpo['command']
  row = result['report']['grpo_dis G=4 sigma=1']
  assert 'vs_sao_seconds_to_target' in row
  assert '| grpo_dis G=4 sigma=1 | 1 |' in stdout
  (test,) = result['comparisons']  # no running mean in the quick mode
  assert (test['a'], test['b']) == ('grpo_dis G=4', 'sao')
  assert '| 1 | grpo_dis G=4 minus sao |' in stdout


@pytest.mark.slow
def test_credit_assignment_benchmark_quick(tmp_path):
  result, stdout = _quick('credit_assignment.py', tmp_path)
  runs = {r['variant']: r for r in result['runs']}
  assert set(runs) == {'sao', 'running_mean'}
  for run in runs.values():
    _check_run(run, 3)
    assert '--config.task.word_target.scored_reply=first' in run['command']
  assert 'critic/explained_variance' in runs['sao']['stability']
  assert 'critic/explained_variance' not in runs['running_mean']['stability']
  assert 'running_mean' in result['sao_minus_this_area']
  assert '| SAO minus |' in stdout


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
