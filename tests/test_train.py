"""`python -m sao_jax.train` end to end on the tiny config: learning, logs,
and an exact resume after SIGKILL."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from sao_jax import config_lib
from sao_jax import xla_flags
from sao_jax.logs import metrics_log
from sao_jax.rollout import system as rollout_system
import processes  # tests/processes.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_command(workdir, *overrides):
  return [sys.executable, '-m', 'sao_jax.train', '--config=configs/tiny.py',
          f'--workdir={workdir}', *overrides]


def run_train(workdir, *overrides, timeout=600):
  return subprocess.run(
      train_command(workdir, *overrides), cwd=ROOT, capture_output=True,
      text=True, timeout=timeout,
      env=dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT))


@pytest.mark.slow
def test_tiny_config_trains_and_reward_rises(tmp_path):
  proc = run_train(tmp_path)
  assert proc.returncode == 0, proc.stderr[-4000:]
  records = metrics_log.read_jsonl(tmp_path / 'metrics.jsonl', dedupe=True)
  rewards = metrics_log.window_means(records, 'train/reward', window=10)
  assert len(rewards) == 3
  assert rewards[-1] > rewards[0] + 0.1, rewards  # averaged, not one step
  steps = [r['step'] for r in records if 'train/reward' in r]
  assert steps == list(range(1, 31))
  last = [r for r in records if 'policy/frac_below' in r][-1]
  for key in ('policy/frac_below', 'policy/frac_above', 'policy/kl_k1',
              'policy/kl_k3', 'policy/ratio_mean', 'policy/grad_norm',
              'critic/grad_norm', 'critic/explained_variance', 'critic/loss',
              'rollout/staleness_mean', 'queue/dropped_stale',
              'queue/in_flight', 'time/learner_idle_fraction',
              'time/train_seconds', 'time/wait_seconds',
              'time/weight_push_seconds', 'time/weight_prepare_seconds',
              'rollout/server_swap_pause_max_seconds',
              'policy/nonfinite_skips', 'policy/nonfinite_skips_total'):
    assert key in last, key
  # Weights were streamed: no file (nor its directory) was written.
  assert not (tmp_path / 'weights').exists()
  assert last['rollout/servers_updated'] == 1
  assert last['rollout/weight_push_megabytes'] == pytest.approx(
      last['rollout/weight_version_megabytes'])  # deltas are off
  assert last['rollout/staleness_max'] <= 2  # config.rollout.max_staleness
  # Memory by phase: the learner after each step, the servers beside it.
  # (VmHWM lags VmRSS by a few pages: the kernel syncs them lazily.)
  assert 0.1 < last['memory/train_rss_gb'] <= last['memory/peak_rss_gb'] + 0.01
  assert last['rollout/server_rss_gb'] > 0.1
  first = next(r for r in records if 'memory/learner_init_rss_gb' in r)
  assert first['step'] == 1 and 'memory/model_load_rss_gb' in first
  assert 'memory/compile_rss_gb' in first  # the step compiled ahead
  evals = [r for r in records if 'eval/accuracy' in r]
  assert [r['step'] for r in evals] == [0, 30]
  assert 'before' in proc.stdout and 'after' in proc.stdout
  assert (tmp_path / 'learning_curves.png').stat().st_size > 10_000
  assert any(name.startswith('events.out.tfevents')
             for name in os.listdir(tmp_path / 'tensorboard'))
  # The last step is saved (after the loop, once the rollouts stopped).
  assert '30' in os.listdir(tmp_path / 'checkpoints')


@pytest.mark.slow
def test_a_tiny_moe_learns_with_routing_replay(tmp_path):
  """A tiny random Qwen3-MoE (4 experts, 2 per token) through the whole
  pipeline: its server records each token's experts, the learner replays
  them (so at version v its log pi equals mu), the balancing loss is on,
  and the reward rises as the dense model's does."""
  proc = run_train(tmp_path, '--config.model.source=tiny-random-moe',
                   '--config.model.moe_routing=replay',
                   '--config.model.router_aux_loss_coef=0.001',
                   '--config.eval.at_start=False')
  assert proc.returncode == 0, proc.stderr[-4000:]
  records = metrics_log.read_jsonl(tmp_path / 'metrics.jsonl', dedupe=True)
  rewards = metrics_log.window_means(records, 'train/reward', window=10)
  assert rewards[-1] > rewards[0] + 0.1, rewards
  steps = [r for r in records if 'policy/routing_disagreement' in r]
  assert len(steps) == 30
  assert all(0 < r['policy/router_aux_loss'] < 4 for r in steps)
  # Tokens sampled at the learner's version: pi_old and mu agree to f32.
  fresh = [r['parity/mean_abs_diff'] for r in steps
           if r.get('parity/tokens', 0) > 0]
  assert fresh and max(fresh) < 1e-4, fresh


def test_an_unknown_weight_transport_names_the_known_ones():
  # In process, what the trainer checks before the model loads; it prints
  # the ConfigError as one line (tests/test_entry_point_errors.py).
  config = config_lib.load_config(os.path.join(ROOT, 'configs', 'tiny.py'))
  config.rollout.weight_transport = 'stream2'
  with pytest.raises(config_lib.ConfigError) as error:
    rollout_system.check_inputs(config)
  assert "weight_transport='stream2' is not one of stream, files" in str(
      error.value)
  assert "did you mean 'stream'?" in str(error.value)


SYNC = ('--config.rollout.max_staleness=0', '--config.total_steps=8',
        '--config.checkpoint.every=3', '--config.eval.at_start=False',
        '--config.critic.pretrain_steps=0')


def task_sums(workdir):
  records = metrics_log.read_jsonl(os.path.join(workdir, 'metrics.jsonl'),
                                   dedupe=True)
  return {r['step']: r['data/task_sum'] for r in records
          if 'data/task_sum' in r}


@pytest.mark.slow
def test_sigkill_between_checkpoints_resumes_exactly(tmp_path):
  # Reference: the same synchronous run, uninterrupted, its weights sent to
  # the server through files (the other transport: it trains the same
  # prompts, each version pushed, older files retired).
  reference = run_train(tmp_path / 'reference', *SYNC,
                        '--config.rollout.weight_transport=files')
  assert reference.returncode == 0, reference.stderr[-4000:]
  pushed = [r for r in metrics_log.read_jsonl(
      tmp_path / 'reference' / 'metrics.jsonl', dedupe=True)
            if 'time/weight_push_seconds' in r]
  assert [r['rollout/servers_updated'] for r in pushed] == [1.0] * 8
  assert os.listdir(tmp_path / 'reference' / 'weights') == ['v8']
  # Killed run: SIGKILL (no chance to save) of the trainer alone (not its
  # process group) after step 4, between the checkpoints of steps 3 and 6.
  workdir = tmp_path / 'killed'
  process = subprocess.Popen(
      train_command(workdir, *SYNC), cwd=ROOT, stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL, start_new_session=True,
      env=dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT))
  log = workdir / 'metrics.jsonl'
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline:
    if log.exists() and 4 in task_sums(workdir):
      break
    assert process.poll() is None, 'the run ended before it was killed'
    time.sleep(0.2)
  servers = processes.server_pids(process.pid)
  assert servers
  process.kill()
  process.wait()
  # Its servers notice that their parent is gone and exit by themselves.
  processes.wait_until(
      lambda: not any(os.path.exists(f'/proc/{p}') for p in servers), 30,
      'servers still running after their trainer was SIGKILLed')
  checkpoints = sorted(int(d) for d in os.listdir(workdir / 'checkpoints')
                       if d.isdigit())
  assert checkpoints[-1] == 3
  resumed = run_train(workdir, *SYNC)
  assert resumed.returncode == 0, resumed.stderr[-4000:]
  # Same final step, and every step trained on the same prompts as the
  # uninterrupted run: the data cursor continued from the checkpoint.
  assert task_sums(workdir) == task_sums(tmp_path / 'reference')
  assert sorted(task_sums(workdir)) == list(range(1, 9))
  records = metrics_log.read_jsonl(log)
  resumed_at = [r['step'] for r in records if r.get('resumed')]
  assert resumed_at and resumed_at[0] == 4


@pytest.mark.slow
def test_long_horizon_episodes_train_and_reuse_the_servers_kv(tmp_path):
  """configs/long_horizon.py: 12-turn episodes packed into 4k-token rows
  (blockwise attention), and turns after the first prefill mostly the
  appended observation. Four episodes a step, not the recipe's eight, no
  value-pretraining batch, two held-out episodes and observations of 100
  words, not 200 (~1.3k-token episodes, three to a row): the same rows and
  turns at a fraction of the CPU time (the suite's longest test; warm, 95 ->
  46 s alone; docs/design/test_suite_time.md)."""
  proc = subprocess.run(
      [sys.executable, '-m', 'sao_jax.train', '--config=configs/long_horizon.py',
       f'--workdir={tmp_path}', '--config.total_steps=2',
       '--config.eval.at_start=False', '--config.checkpoint.every=2',
       '--config.batch_size=4', '--config.rollout.num_workers=4',
       '--config.critic.pretrain_steps=0', '--config.task.held_out=2',
       '--config.eval.batch_size=2',
       '--config.task.word_target.observation_words=100'],
      cwd=ROOT, capture_output=True, text=True, timeout=900,
      # One CPU device, as a user's run has (not conftest's eight fake ones).
      env=xla_flags.child_environment(
          dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT)))
  assert proc.returncode == 0, proc.stderr[-4000:]
  records = metrics_log.read_jsonl(tmp_path / 'metrics.jsonl', dedupe=True)
  assert [r['step'] for r in records if 'train/reward' in r] == [1, 2]
  last = [r for r in records if 'rollout/prefilled_tokens' in r][-1]
  # Most prompt tokens came from kept rows (85% here: 5.5x the prefilled).
  assert last['rollout/prefix_reused_tokens'] > 3 * last[
      'rollout/prefilled_tokens']
  assert last['rollout/prefilled_tokens_per_generated_token'] < 40
  assert last['policy/num_tokens'] > 0
