"""The asynchronous training program: servers, workers, queue, learner.

`run(config, workdir)` is what `python -m sao_jax.train` calls. Top to bottom:
the model and task; the held-out set (its questions removed from training);
the learner on its mesh; a resume from the latest checkpoint; the rollout
servers (local processes on loopback unless addresses are configured); the
workers filling the queue; an evaluation of the untrained policy; value
pretraining; then the loop: take a batch, train, push weights every
`sync_every` steps, log, evaluate, checkpoint; and at the end the final
evaluation beside the first, the plot, and (optionally) a Hugging Face export.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import jax
import numpy as np

from sao_jax import checkpointing
from sao_jax import config_lib
from sao_jax import distributed
from sao_jax import evaluation
from sao_jax import host_gather
from sao_jax import process_memory
from sao_jax import recipe_checks
from sao_jax import stop_signal
from sao_jax.envs import registry
from sao_jax.envs import task_ledger
from sao_jax.envs import task_stream
from sao_jax.learner import learner as learner_lib
from sao_jax.logs import metrics_log
from sao_jax.logs import progress as progress_lib
from sao_jax.logs import train_metrics
from sao_jax.models import model_config
from sao_jax.models import pretrained
from sao_jax.models import sampling
from sao_jax.rollout import batching
from sao_jax.rollout import system as rollout_system
from sao_jax.rollout import wire

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class RunResult:
  """What a finished (or stopped) run reports."""
  steps: int
  before: evaluation.EvalResult | None
  after: evaluation.EvalResult | None
  plot_path: str | None
  stopped_early: bool


def run(config, workdir: str) -> RunResult:
  """Trains as `config` says, in `workdir` (resuming what is there).

  SIGTERM is honoured within seconds everywhere: during start-up (before the
  first step, when the state equals the checkpoint it came from) the
  process ends at once, by SIGTERM's default action; later, between steps or in any wait (a starved queue, a weight
  push), the step reached is saved and the run returns `stopped_early`.
  """
  _check_before_start(config, workdir)
  process_memory.release_freed_arrays()
  stop_flag = stop_signal.install_sigterm_handler()
  stop_flag.exit_immediately = True
  try:
    return _run(config, workdir, stop_flag)
  finally:
    stop_flag.exit_immediately = False
    stop_flag.uninstall()


def _check_before_start(config, workdir: str) -> None:
  """Raises the user's mistakes in seconds, not after the model loaded.

  A multi-host run joins its process group first: the mesh is checked
  against the devices of every host, which only then are known (and JAX
  allows no device query before the join).
  """
  distributed.initialize(config.distributed)
  recipe_checks.validate(config)
  recipe_checks.check_inputs(config)
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise config_lib.ConfigError(f'--workdir={workdir} is a file, not a'
                                 ' directory')
  rollout_system.check_inputs(config)


def _run(config, workdir: str, stop_flag) -> RunResult:
  # With several processes a stop must reach all at one step (should_stop).
  stop_flag.exit_immediately = jax.process_count() == 1
  chief = jax.process_index() == 0
  os.makedirs(workdir, exist_ok=True)
  logger = metrics_log.MetricsLogger(workdir, tensorboard=config.log.tensorboard,
                                     is_chief=chief)
  memory = train_metrics.MemoryPhases()
  model, tok = pretrained.from_pretrained(
      config.model.source, **model_config.overrides(config.model))
  memory.mark('model_load')
  env = registry.make(config.task)
  held_out = evaluation.held_out_tasks(env, config.task.held_out)
  # Each host reads its own slice of the train indices: no prompt is rolled
  # out twice, and a global batch of B trajectories holds B prompts.
  ledger = task_ledger.TaskLedger(task_stream.TaskStream(
      env, exclude_questions={t.question for t in held_out},
      start=jax.process_index(), stride=jax.process_count()))
  mesh = learner_lib.mesh_from_config(config)
  ckpt = checkpointing.Checkpointer(
      os.path.join(workdir, 'checkpoints'),
      max_to_keep=config.checkpoint.max_to_keep,
      save_interval_steps=config.checkpoint.every,
      write_concurrent_gb=config.checkpoint.write_concurrent_gb)
  resume = ckpt.latest_step() is not None
  # A resumed learner needs only the state's shapes: no copy of the initial
  # weights for the critic.
  learner = learner_lib.Learner(config, model, mesh, init_state=not resume)
  vocab_size = model.config.vocab_size
  routing = wire.RoutingLayout.for_config(model.config)
  # From here on the learner state holds the weights: the loaded model's own
  # buffers would be one more resident copy of the policy.
  del model
  # The run owns the learner state; every step donates it and returns the
  # next one.
  state = None
  meta: dict[str, Any] = {}
  if resume:
    state, meta = ckpt.restore(abstract_state=learner.abstract_state)
    host = _host_metadata(meta)
    ledger.load_state_dict(host['ledger'])
    _log.info('resumed from step %d', int(state.step))
  else:
    state = learner.init_state()
  memory.mark('learner_init')
  step = int(state.step)
  # Each start of a run samples from its own random streams (servers fold it
  # into their seed), so a resume does not replay the first run's samples.
  restart = int(meta.get('restart', -1)) + 1
  batch_size = config.batch_size // jax.process_count()
  rollouts = records = None
  before = after = None
  stopped = False
  progress = progress_lib.Progress(config.total_steps, initial=step,
                                   enabled=chief and config.log.progress)
  try:
    rollouts = rollout_system.RolloutSystem(
        config, workdir, tok, env, ledger, vocab_size,
        batch_size, step, restart, stop_flag, routing=routing)
    if resume:
      rollouts.prompt_slots.load_state_dict(meta['prompt_slots'])
    if resume and host.get('queue'):
      rollouts.load_state_dict(host['queue'])
    env.on_policy_step(step)
    rollouts.start(state.policy, step)
    memory.mark('rollouts_start')
    if config.eval.at_start and step == 0:
      before = _evaluate(learner, state, tok, env, held_out, config, logger, 0,
                         progress)
      memory.mark('eval')
    elif meta.get('eval_before'):
      before = evaluation.EvalResult(**meta['eval_before'])
    if step == 0 and learner.uses_critic and not meta.get('pretrained'):
      state = _pretrain_critic(learner, state, rollouts, config, logger,
                               ledger)
      memory.mark('pretrain')
    if step < config.total_steps:
      # While the rollouts generate the first batch (batch_rows per process).
      learner.compile_train_step(
          config.batch_size, config.rollout.max_sequence_length,
          rows=rollouts.batch_rows * jax.process_count())
      memory.mark('compile')
    # From here on a stop saves the step reached (polled, never mid-step).
    stop_flag.exit_immediately = False
    tracker = train_metrics.StepTimer()
    records = _StepRecords(logger, progress, config.batch_size)
    while step < config.total_steps:
      try:
        with tracker.phase('wait'):
          batch = rollouts.next_batch(config.rollout.get_batch_timeout_s)
      except stop_signal.StopRequested:
        stopped = True
        break
      with tracker.phase('train'):
        # A checkpoint still being written reads the state this step
        # donates: in the demo the step after a save, overlapping its write,
        # peaked 2.8 GiB higher. The write overlapped the wait for the batch.
        ckpt.wait()
        # What the write's threads freed stays resident in their arenas,
        # under the step's own buffers: 0.5 GiB more at the demo's peak.
        process_memory.return_free_pages()
        trained = host_gather.allgather_json(sorted(batch.task_indices))
        state, device_metrics = learner.train_step(
            state, learner.device_batch(batch.train_batch))
        # Step n-1's metrics are read while step n runs (nanodo's order).
        records.flush()
        jax.block_until_ready(state.step)
      memory.mark('train')
      ledger.mark_done(trained[jax.process_index()])
      step += 1
      rollouts.set_learner_version(step)
      env.on_policy_step(step)
      metrics = {}
      if step % config.rollout.sync_every == 0:
        with tracker.phase('sync'):
          try:
            if config.rollout.max_staleness == 0:
              rollouts.drain()
            metrics.update(rollouts.push_weights(state.policy, step))
          except stop_signal.StopRequested:
            stopped = True  # the step is done: log and save it below
        memory.mark('weight_push')
      metrics.update(train_metrics.batch_metrics(batch.trajectories, step))
      metrics['batch/rows'] = batch.train_batch.tokens_BxT.shape[0]
      metrics['batch/padding_fraction'] = batching.padding_fraction(
          batch.train_batch)
      metrics.update(_data_metrics(
          trained, host_gather.allgather_json(
              ledger.state_dict()['stream']['cursor'])))
      if chief:
        _log_trained_tasks(workdir, step, trained)
      for section, stats in rollouts.stats().items():
        metrics.update(train_metrics.prefixed(section, stats))
      metrics.update(tracker.metrics())
      metrics.update(memory.metrics())
      records.add(step, device_metrics, metrics,
                  [step - 1 - t.oldest_version for t in batch.trajectories])
      if config.eval.every and step % config.eval.every == 0 and (
          step < config.total_steps) and not stopped:
        records.flush()
        _evaluate(learner, state, tok, env, held_out, config, logger, step,
                  progress)
        memory.mark('eval')
      stopped = stop_flag.should_stop() or stopped
      # The last step is saved after the loop, once the rollouts are
      # stopped: written here, its write overlapped the rollouts (in the
      # Colab quickstart, an engine decoding in this process).
      if ((step < config.total_steps or stopped) and
          ckpt.due(step, force=stopped) and ckpt.save(
              step, state, _metadata(config, ledger, rollouts, before,
                                     restart), force=stopped)):
        memory.mark('checkpoint')
      if stopped:
        break
    records.flush()
    if stopped:
      # Nothing to do when this step was saved in the loop.
      if ckpt.due(step, force=True):
        ckpt.save(step, state, _metadata(
            config, ledger, rollouts, before, restart), force=True)
      progress.print_line(f'stop requested: saved step {step}')
    else:
      # The rollouts stopped, then the last step saved and written, before
      # the last held-out evaluation: its decoding runs beside neither a
      # checkpoint write nor rollout workers, nor does the write run beside
      # the workers. Overlapped, the end of the run was its peak (the demo's
      # learner: 5.54 GiB, its steps 5.10; BENCHMARKS.md).
      metadata = _metadata(config, ledger, rollouts, before, restart)
      rollouts.stop()
      rollouts = None
      ckpt.save(step, state, metadata, force=True)
      ckpt.wait()
      process_memory.return_free_pages()
      after = _evaluate(learner, state, tok, env, held_out, config, logger,
                        step, progress)
  finally:
    if records is not None:
      records.flush()  # a failed run still logs the steps it finished
    try:
      ckpt.wait()  # a failed write raises here: the servers still stop
    finally:
      progress.close()
      if rollouts is not None:
        rollouts.stop()
      logger.close()
  plot_path = None
  if chief:
    # matplotlib is imported here, where it is used: at the top it cost
    # every trainer 0.5 s of start-up (and the suite's ~50 runs 25 CPU-s).
    from sao_jax.logs import plots  # pylint: disable=g-import-not-at-top
    plot_path = plots.plot_learning_curves(
        os.path.join(workdir, 'metrics.jsonl'),
        os.path.join(workdir, 'learning_curves.png'),
        title=f'{config.algorithm} on {config.task.name}')
    if config.export_hf and not stopped:
      pretrained.export_pretrained(learner.policy_model(state), tok,
                                   os.path.join(workdir, 'hf_export'))
  ckpt.close()
  return RunResult(step, before, after, plot_path, stopped)


def _metadata(config, ledger, rollouts, before, restart) -> dict[str, Any]:
  """What a checkpoint keeps beside the state (a collective on several
  processes: orbax writes the metadata of process 0, so every host's data
  cursor and queue counters are gathered into it, under `hosts`)."""
  return {
      'restart': restart,
      'hosts': host_gather.allgather_json({
          'ledger': ledger.state_dict(), 'queue': rollouts.state_dict()}),
      'prompt_slots': rollouts.prompt_slots.state_dict(),
      'pretrained': True,
      'eval_before': (dataclasses.asdict(before) if before is not None
                      else None),
      'config': config.to_json(),
  }


def _host_metadata(meta: dict[str, Any]) -> dict[str, Any]:
  """This process's part of a checkpoint's metadata (`_metadata`)."""
  if 'hosts' not in meta:  # written before hosts were kept apart
    hosts = [{'ledger': meta['ledger'], 'queue': meta.get('queue')}]
  else:
    hosts = meta['hosts']
  if len(hosts) != jax.process_count():
    raise config_lib.ConfigError(
        f'the checkpoint was written by {len(hosts)} processes, this run has'
        f' {jax.process_count()}: each host resumes its own slice of the'
        ' task stream, so resume with the same number of processes')
  return hosts[jax.process_index()]


def _data_metrics(trained: list[list[int]],
                  frontiers: list[int]) -> dict[str, float]:
  """Which tasks the global batch trained on (`trained`: each host's task
  indices), and the data frontier (the least of the hosts')."""
  every = [i for host in trained for i in host]
  return {'data/task_min': min(every), 'data/task_max': max(every),
          'data/task_sum': sum(every),
          'data/distinct_tasks': len(set(every)),
          'data/frontier': min(frontiers)}


def _log_trained_tasks(workdir: str, step: int,
                       trained: list[list[int]]) -> None:
  """Appends the step's task indices, per host, to `trained_tasks.jsonl`.

  The record of which prompts each step trained on (a resume appends; a step
  re-run after a crash past its checkpoint appears again, the last line
  counts).
  """
  with open(os.path.join(workdir, 'trained_tasks.jsonl'), 'a') as f:
    f.write(json.dumps({'step': step, 'task_index': trained}) + '\n')


class _StepRecords:
  """Writes each step's metrics one step late, without a device sync.

  A step's device metrics are read (`host_metrics`, a device-to-host copy)
  only after the next step was dispatched, or at a flush before anything
  else is logged (evaluations, the end of the run).
  """

  def __init__(self, logger, progress, batch_size: int):
    self._logger = logger
    self._progress = progress
    self._batch_size = batch_size
    self._pending = None

  def add(self, step, device_metrics, host_metrics, staleness) -> None:
    self.flush()
    self._pending = (step, device_metrics, host_metrics, staleness)

  def flush(self) -> None:
    if self._pending is None:
      return
    step, device_metrics, host, staleness = self._pending
    self._pending = None
    metrics = train_metrics.host_metrics(device_metrics)
    metrics.update(host)
    self._logger.write(step, metrics)
    self._logger.write_histogram(step, 'rollout/staleness', staleness)
    self._progress.update(step, metrics,
                          trajectories=step * self._batch_size)


def _evaluate(learner, state, tok, env, tasks, config, logger, step,
              progress):
  if not tasks:
    return None
  params, key = evaluation.GREEDY, None
  if config.eval.temperature > 0:
    params = sampling.SamplingParams(temperature=config.eval.temperature)
    key = jax.random.fold_in(jax.random.key(config.seed), step)
  result = evaluation.evaluate(
      learner.policy_model(state), tok, env, tasks,
      max_new_tokens=config.eval.max_new_tokens,
      batch_size=config.eval.batch_size, params=params, key=key,
      row_sharding=learner.row_sharding)
  if jax.process_index() == 0:
    _save_replies(os.path.join(logger.workdir, 'eval', f'step_{step}.jsonl'),
                  tasks, result)
  logger.write(step, {'eval/accuracy': result.accuracy,
                      'eval/accuracy_se': result.standard_error,
                      'eval/mean_reward': result.mean_reward,
                      'eval/seconds': result.seconds})
  progress.update(step, {'eval/accuracy': result.accuracy})
  progress.print_line(f'step {step}: held-out accuracy {result.accuracy:.3f}'
                      f' +- {result.standard_error:.3f} (n={result.n})')
  return result


def _pretrain_critic(learner, state, rollouts, config, logger, ledger):
  """Value pretraining (SAO §1.3): regress the initial policy's returns.

  Batches come from the frozen initial policy (version 0: nothing is pushed).
  Each batch's R^2 (`losses.r_squared`: explained variance that also counts
  the critic's offset from the mean return) is measured before the critic
  trains on it, a held-out score; training stops by `train_metrics.Plateau`
  or after `critic.pretrain_steps` batches. The critic's optimizer is then
  reset, so that RL's critic warm-up starts at RL step 0.

  Returns:
    the learner state after pretraining.
  """
  cfg = config.critic
  plateau = train_metrics.Plateau(cfg.pretrain_patience, cfg.pretrain_min_delta)
  for i in range(cfg.pretrain_steps):
    batch = rollouts.next_batch(config.rollout.get_batch_timeout_s)
    state, m = learner.critic_step(state, learner.device_batch(
        batch.train_batch))
    # The policy does not move: keep the queue's staleness clock at 0.
    rollouts.set_learner_version(0)
    ledger.mark_done(set(batch.task_indices))
    m = train_metrics.host_metrics(m)
    stop = plateau.update(m.get('critic/r_squared', float('nan')))
    m = train_metrics.prefixed('pretrain', m)
    if np.isfinite(plateau.best):
      m['pretrain/best_r_squared'] = plateau.best
    logger.write(i, m)
    if stop:
      _log.info('value pretraining: R^2 plateaued at %.3f'
                ' after %d batches', plateau.best, i + 1)
      break
  return learner.reset_critic_optimizer(state)


def _save_replies(path, tasks, result) -> None:
  """What the policy answered on each held-out task (for inspection)."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w') as f:
    for task, reply, correct in zip(tasks, result.replies, result.correct):
      f.write(json.dumps({'task_id': task.id, 'question': task.question,
                          'expected': str(task.answer), 'reply': reply,
                          'correct': bool(correct)}) + '\n')
