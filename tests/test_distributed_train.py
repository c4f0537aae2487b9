"""`python -m sao_jax.train` as two `jax.distributed` processes, each with its
own rollout server: every host trains its own prompts, and a resume of both
continues each host's slice of the task stream."""

import json
import os
import subprocess
import sys

import pytest

from sao_jax import config_lib
from sao_jax import evaluation
from sao_jax import xla_flags
from sao_jax.envs import registry
from sao_jax.envs import task_stream
from sao_jax.logs import metrics_log
from sao_jax.models import pretrained
import test_distributed  # tests/test_distributed.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTS = 2
BATCH = 8  # global: 4 trajectories per host
# Synchronous (each step's tasks are the next ones of each host's slice), no
# value pretraining; evaluation at the start and the end, split over hosts.
RUN = ('--config.rollout.max_staleness=0', '--config.checkpoint.every=2',
       f'--config.batch_size={BATCH}', '--config.critic.pretrain_steps=0',
       '--config.rollout.num_workers=4',
       '--config.task.held_out=6', '--config.eval.batch_size=4',
       '--config.log.progress=False')


def run_hosts(workdir, *overrides):
  port = test_distributed.free_port()
  env = xla_flags.child_environment(dict(os.environ, PYTHONPATH=ROOT,
                                         JAX_PLATFORMS='cpu'))
  # One CPU device per process; see tests/conftest.py for the scheduler flag
  # (concurrent collectives deadlock XLA:CPU's blocking rendezvous).
  env['XLA_FLAGS'] = ' '.join([
      env.get('XLA_FLAGS', ''), '--xla_force_host_platform_device_count=1',
      '--xla_cpu_enable_concurrency_optimized_scheduler=false']).strip()
  procs = [subprocess.Popen(
      [sys.executable, '-m', 'sao_jax.train', '--config=configs/tiny.py',
       f'--workdir={workdir}', *RUN, *overrides,
       '--config.distributed.enabled=True',
       f'--config.distributed.coordinator_address=127.0.0.1:{port}',
       f'--config.distributed.num_processes={HOSTS}',
       f'--config.distributed.process_id={i}'],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True) for i in range(HOSTS)]
  try:
    outputs = [p.communicate(timeout=900)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, output in zip(procs, outputs):
    assert p.returncode == 0, output[-6000:]
  return outputs


def trained_tasks(workdir):
  """{step: [host 0's task indices, host 1's]}, the last record of a step."""
  with open(os.path.join(workdir, 'trained_tasks.jsonl')) as f:
    return {r['step']: r['task_index'] for r in map(json.loads, f)}


def tiny_task():
  """The tiny config's environment and its 6 held-out tasks."""
  config = config_lib.load_module(os.path.join(ROOT, 'configs', 'tiny.py')
                                  ).get_config()
  env = registry.make(config.task)
  return env, evaluation.held_out_tasks(env, 6)


def host_slices(n):
  """The first `n` task indices of each host's slice of the stream, held-out
  questions excluded: an independent reading of the tiny config's task."""
  env, tasks = tiny_task()
  held = {t.question for t in tasks}
  slices = []
  for host in range(HOSTS):
    stream = task_stream.TaskStream(env, held, start=host, stride=HOSTS)
    indices = []
    for _ in range(n):
      next(stream)
      indices.append(stream.last_index)
    slices.append(indices)
  return slices


@pytest.mark.slow
def test_two_hosts_train_their_own_prompts_and_resume_exactly(tmp_path):
  workdir = tmp_path / 'run'
  first = run_hosts(workdir, '--config.total_steps=2')
  assert 'before' in first[0] and 'after' in first[0]
  # The resumed run goes on to step 4 from the checkpoint of step 2.
  run_hosts(workdir, '--config.total_steps=4')
  steps = trained_tasks(workdir)
  assert sorted(steps) == [1, 2, 3, 4]
  per_host = BATCH // HOSTS
  for step, hosts in steps.items():
    every = [i for host in hosts for i in host]
    # One rollout per prompt: B distinct prompts in each global batch, each
    # host's from its own slice.
    assert len(every) == BATCH and len(set(every)) == BATCH, (step, hosts)
    for host, indices in enumerate(hosts):
      assert len(indices) == per_host
      assert all(i % HOSTS == host for i in indices), (step, host, indices)
  # Synchronous training consumes each host's next tasks: across the
  # resume, steps 1-4 are exactly the first 16 tasks of each slice, none
  # twice, none skipped.
  expected = host_slices(4 * per_host)
  for host in range(HOSTS):
    got = [i for step in sorted(steps) for i in steps[step][host]]
    assert got == expected[host], host
  # The checkpoint keeps each host's data cursor (orbax writes process 0's
  # metadata: the hosts' parts are gathered into it), and one table of
  # running-mean slots that numbers every host's questions.
  with open(workdir / 'checkpoints' / '4' / 'metadata' / 'metadata') as f:
    meta = json.load(f)
  cursors = [h['ledger']['stream']['cursor'] for h in meta['hosts']]
  assert cursors == [expected[h][-1] + HOSTS for h in range(HOSTS)]
  questions = {t.question for t in (tiny_task()[0].task('train', i)
                                    for i in range(4 * BATCH))}
  slots = meta['prompt_slots']['slots']
  assert len(slots) == len(questions)
  assert sorted(slots.values()) == list(range(len(questions)))
  records = metrics_log.read_jsonl(workdir / 'metrics.jsonl', dedupe=True)
  distinct = {r['step']: r['data/distinct_tasks'] for r in records
              if 'data/distinct_tasks' in r}
  assert distinct == {s: BATCH for s in (1, 2, 3, 4)}
  # The held-out set was split over the hosts: all 6 tasks scored once.
  evals = [r for r in records if 'eval/accuracy' in r]
  assert [r['step'] for r in evals] == [0, 2, 4]
  with open(workdir / 'eval' / 'step_4.jsonl') as f:
    assert len(f.readlines()) == 6
  # ... and decoded as one process decodes it: the untrained policy's
  # greedy replies, task by task.
  with open(workdir / 'eval' / 'step_0.jsonl') as f:
    split = [json.loads(line) for line in f]
  model, tok = pretrained.from_pretrained('tiny-random')
  env, tasks = tiny_task()
  alone = evaluation.evaluate(model, tok, env, tasks, max_new_tokens=8,
                              batch_size=4)
  assert [r['task_id'] for r in split] == alone.task_ids
  assert [r['reply'] for r in split] == alone.replies
  assert [r['correct'] for r in split] == alone.correct
  # Each host's server has its own index (stream and log).
  logs = sorted(os.listdir(workdir / 'server_logs'))
  assert logs == ['server0.log', 'server1.log']
