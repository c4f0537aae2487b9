"""The rollout side of one training process, behind one object.

`RolloutSystem` owns the rollout servers (started here as supervised
subprocesses, or remote ones named by `config.rollout.server_addresses`), the
workers that play episodes against them, the queue the workers fill, and the
weight publisher that brings the servers to the learner's policy. The trainer
talks to it only through its methods:

  rollouts = system.RolloutSystem(config, workdir, tok, env, ledger,
                                  vocab_size, batch_size, version=step,
                                  restart=restart, stop_flag=stop_flag)
  rollouts.start(policy_state, step)
  batch = rollouts.next_batch(timeout_s)  # .train_batch, .task_indices
  ... train at version step ...
  rollouts.set_learner_version(step + 1)
  rollouts.push_weights(policy_state, step + 1)   # every sync_every steps
  rollouts.stats(); rollouts.state_dict()          # metrics, checkpoints
  rollouts.stop()

Every wait (a batch, a drain, a weight push) polls once a second for a stop
request (`stop_flag`) and for live servers, so that neither a SIGTERM nor a
run without servers leaves the trainer blocked.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from sao_jax import config_lib
from sao_jax import host_gather
from sao_jax import types
from sao_jax.rollout import batching
from sao_jax.rollout import episodes
from sao_jax.rollout import launch
from sao_jax.rollout import prompt_slots
from sao_jax.rollout import queue as queue_lib
from sao_jax.rollout import server_supervisor
from sao_jax.rollout import weight_stream
from sao_jax.rollout import weight_sync
from sao_jax.rollout import wire
from sao_jax.rollout import workers

# The longest single wait between two checks for a stop or a dead fleet.
_POLL_S = 1.0


class Batch(NamedTuple):
  """One batch of this process, complete for the learner and the ledger.

  Attributes:
    trajectories: the finished rollouts, in row order.
    train_batch: their rows, `slot_ids_N` filled in.
    task_indices: the training-stream index of each trajectory's task.
  """
  trajectories: list[types.Trajectory]
  train_batch: types.TrainBatch
  task_indices: tuple[int, ...]


def check_inputs(config) -> None:
  """Raises what `RolloutSystem` would fail on in its inputs, before the
  model loads: a known weight transport; remote servers need a readable
  admin secret."""
  transport = config.rollout.weight_transport
  if transport not in weight_sync.TRANSPORTS:
    raise config_lib.ConfigError(
        f'config.rollout.weight_transport={transport!r} is not one of'
        f' {", ".join(weight_sync.TRANSPORTS)}'
        f'{config_lib.did_you_mean(str(transport), weight_sync.TRANSPORTS)}')
  if config.rollout.server_addresses:
    weight_sync.read_secret(config.rollout.admin_secret_file or None)


class RolloutSystem:
  """Servers, queue and workers of this process, and how weights reach them.

  Local servers are supervised (restarted when they die). Every server, local
  or remote, starts out of rotation: the pool's revive hook
  (`WeightPublisher.catch_up`) checks its sampling settings and loads the
  current weights before it gets traffic, and does the same for any server
  that died, hung or missed a push. The queue's rollout version is the
  minimum version the live servers acknowledged.
  """

  def __init__(self, config, workdir: str, tok, env, ledger, vocab_size: int,
               batch_size: int, version: int, restart: int, stop_flag, *,
               routing: wire.RoutingLayout = wire.RoutingLayout()):
    """Starts the local servers (if any) and sets up queue and workers.

    Args:
      config: the run's config (its `rollout` section, `group_size`).
      workdir: the run's directory; weights go to `weights/`, local server
        logs to `server_logs/`.
      tok: the policy's tokenizer.
      env: the environment episodes run in.
      ledger: the task ledger workers take tasks from (`next_task`).
      vocab_size: token ids must lie in [0, vocab_size).
      batch_size: trajectories per batch of this process.
      version: the policy version the run starts at (learner and servers).
      restart: how many times the run was restarted (folded into the local
        servers' sampling keys).
      stop_flag: `checkpointing`'s stop flag, polled in every wait.
      routing: how an MoE policy's servers record each token's experts
        (`wire.RoutingLayout.for_config`), which the queue checks and
        batches carry; the default: a dense policy, no records.
    """
    r = config.rollout
    self._config = config
    self._pad_id = tok.pad_id or 0
    # Packing runs on one process only (batching.packs), so the learner's mesh
    # is config.mesh over this process's devices.
    self._packed_rows = batching.packed_rows(config)
    self._batch_size = batch_size
    self._stop_flag = stop_flag
    # Checkpointed by the trainer (`state_dict`), with the learner state.
    self.prompt_slots = prompt_slots.PromptSlots(
        config.advantage.running_mean_slots)
    # Made by the files transport only: with stream nothing is written.
    self._weights_dir = os.path.join(workdir, 'weights')
    if r.server_addresses or r.admin_secret_file:
      secret = weight_sync.read_secret(r.admin_secret_file or None)
    else:
      # Local servers get a fresh secret; on several processes process 0's,
      # since each streams its part of a version to every host's servers.
      secret = host_gather.allgather_json(secrets.token_hex(16))[0]
    self._supervisor = None
    self._server_log_dir = os.path.join(workdir, 'server_logs')
    if r.server_addresses:
      self._addresses = [a.strip() for a in r.server_addresses.split(',')
                         if a.strip()]
    else:
      # On several hosts sharing the workdir each writes its own copy.
      process = jax.process_index()
      config_path = os.path.join(
          workdir, 'server_config.py' if jax.process_count() == 1
          else f'server_config_{process}.py')
      config_lib.write_config_file(config, config_path)
      servers = launch.start_subprocesses(
          config_path, count=r.num_servers, secret=secret,
          log_dir=self._server_log_dir, restart=restart,
          weights_root=self._weights_dir,
          first_index=process * r.num_servers)
      self._addresses = [s.address for s in servers]
      self._supervisor = server_supervisor.Supervisor(
          servers, on_death=self._on_death,
          max_backoff_s=r.max_restart_backoff_s)
    self._transport = weight_sync.TRANSPORTS[r.weight_transport].from_config(
        r, weights_dir=self._weights_dir,
        dtype=weight_stream.serving_param_dtype(config),
        part=jax.process_index(), parts=jax.process_count())
    # A streamed version is in parts, one per learner process: every process
    # sends its part to every server, its own and the other hosts'.
    self._push_to_all = self._transport.parts > 1
    self._publisher = weight_sync.WeightPublisher(
        self._push_targets(r) if self._push_to_all else self._addresses,
        secret, transport=self._transport,
        push_timeout_s=r.push_timeout_s,
        health_timeout_s=r.health_timeout_s,
        sampling={k: r[k] for k in weight_sync.SAMPLING_KEYS})
    # The push in flight (streamed pushes overlap the next learner step),
    # and what the last finished one reported.
    self._pending_push = None
    self._last_push: dict[str, float] = {}
    self._send_while_copying = r.weight_send_while_copying
    self._version_lock = threading.Lock()
    self._queue = queue_lib.RolloutQueue(
        batch_size, r.max_staleness, vocab_size, r.max_sequence_length,
        group_size=config.group_size, capacity=r.queue_capacity or None,
        logprob_tolerance=r.logprob_tolerance,
        max_abs_reward=r.max_abs_reward,
        required_info={workers.TASK_INDEX: int},
        routing=routing)
    self._queue.set_learner_version(version)
    self._queue.set_rollout_version(version)
    self._rollout_version = version
    self._runner = workers.RolloutRunner(
        addresses=self._addresses, env=env, next_task=ledger.next_task,
        queue=self._queue, tok=tok,
        limits=episodes.EpisodeLimits(
            max_new_tokens=r.max_new_tokens,
            max_sequence_length=r.max_sequence_length,
            max_prompt_length=r.max_prefill_length - 1,
            reward_cut_replies=r.reward_cut_replies),
        num_workers=r.num_workers, group_size=config.group_size,
        group_in_one_request=r.group_in_one_request,
        pool_options=dict(stop_ids=tok.stop_ids,
                          max_in_flight_per_server=r.max_in_flight_per_server,
                          deadline_s=r.request_deadline_s,
                          max_retries=r.max_retries,
                          max_prompt_length=r.max_prefill_length - 1,
                          probe_interval_s=r.health_interval_s,
                          health_timeout_s=r.health_timeout_s,
                          before_revive=self._publisher.catch_up,
                          start_dead=True, routing=routing))
    self._last_live = time.monotonic()

  # ------------------------------------------------------------- lifecycle

  def start(self, policy_state, version: int) -> None:
    """Starts workers and supervision; servers join once they serve
    `version` (written now: a resume's servers, or remote ones left at
    another run's version, load it before they get traffic)."""
    prepared = self._transport.prepare(policy_state, version)
    self._transport.wait(prepared)  # before the first step may donate
    self._publisher.set_current(prepared, version)
    self._runner.start()
    if self._push_to_all and version > 0:
      # The servers start from the model source's weights; no process can
      # bring one up alone (`catch_up`), so all send their parts now.
      self._pending_push = self._start_push(version)
    if self._supervisor is not None:
      self._supervisor.start()
    self._last_live = time.monotonic()

  def stop(self) -> None:
    """Stops the workers (closing the queue) and the local servers."""
    if self._pending_push is not None:
      self._pending_push.cancel()
    self._runner.stop()
    servers = (self._supervisor.stop() if self._supervisor is not None
               else [])
    launch.stop(servers)

  # ---------------------------------------------------------------- batches

  def next_batch(self, timeout_s: float) -> Batch:
    """The next batch: its trajectories, their [B, T] rows (packed when
    `config.batching` says so: `batching.packed_rows`) with each one's
    running-mean slot, and the task index each answers.

    A collective on several processes (the slots are numbered across every
    host's batch): every process calls it at the same step.

    Waits in short polls (see `_poll`).

    Raises:
      TimeoutError: no batch within `timeout_s`, or no live server for
        `no_server_grace_s` (`check_servers`).
      stop_signal.StopRequested: a stop was requested meanwhile.
    """
    deadline = time.monotonic() + timeout_s

    def give_up(e: TimeoutError) -> None:
      if time.monotonic() >= deadline:
        raise TimeoutError(
            f'no batch within config.rollout.get_batch_timeout_s='
            f'{timeout_s:.0f} s: {str(e).partition("(")[2].rstrip(")")};'
            f' live servers: {len(self._runner.pool.live_servers)} of'
            f' {len(self._addresses)}') from None

    trajectories = self._poll(
        lambda poll_s: self._queue.get_batch_blocking(
            timeout=max(min(poll_s, deadline - time.monotonic()), 0.0)),
        on_timeout=give_up)
    rows = batching.assemble_batch(
        trajectories, self._config.rollout.max_sequence_length, self._pad_id,
        self._packed_rows)
    return Batch(
        trajectories=trajectories,
        train_batch=rows.replace(
            slot_ids_N=self.prompt_slots.trajectory_ids(trajectories)),
        # The queue admitted only trajectories whose task index is an int.
        task_indices=tuple(int(t.info[workers.TASK_INDEX]) for t in trajectories))

  @property
  def batch_rows(self) -> int:
    """Rows of this process's batches: the packed rows, or one per
    trajectory (a packed batch that overflows its rows also takes these)."""
    return self._packed_rows or self._batch_size

  def set_learner_version(self, version: int) -> None:
    """The policy version the learner now holds; call it after every step
    (`RolloutQueue.set_learner_version`)."""
    self._queue.set_learner_version(version)

  def drain(self) -> None:
    """Waits until nothing is in flight (synchronous mode), in short polls."""
    self._poll(lambda poll_s: self._queue.drain_blocking(timeout=poll_s))

  # ---------------------------------------------------------------- weights

  def _push_targets(self, r) -> list[str]:
    """Every server of the run (a collective): where each process sends its
    part of a version. Remote servers are the same list on every host; local
    ones are reached by this host at their loopback address and by the
    others at this host's (`rollout.bind_host` must then not be loopback,
    unless every process runs on this machine)."""
    if r.server_addresses:
      return list(dict.fromkeys(self._addresses))
    host = socket.gethostname()
    bind = r.bind_host
    reachable = (bind if bind not in ('0.0.0.0', '::', '')
                 else socket.gethostbyname(host))
    gathered = host_gather.allgather_json({
        'host': host, 'loopback': bind.startswith('127.') or bind in (
            'localhost', '::1'),
        'addresses': self._addresses,
        'reachable': [f'{reachable}:{a.rpartition(":")[2]}'
                      for a in self._addresses]})
    everyone_here = all(g['host'] == host for g in gathered)
    if not everyone_here and any(g['loopback'] for g in gathered):
      raise config_lib.ConfigError(
          'config.rollout.weight_transport=stream with learner processes on'
          ' several machines sends every process\'s part of the weights to'
          ' every host\'s servers, which listen on loopback only: set'
          ' config.rollout.bind_host=0.0.0.0 (or use'
          ' weight_transport=files on shared storage)')
    me = jax.process_index()
    return [a for i, g in enumerate(gathered)
            for a in (g['addresses'] if i == me or everyone_here
                      else g['reachable'])]

  def push_weights(self, policy_state, version: int) -> dict[str, float]:
    """Makes the live servers serve the policy as `version`.

    With the `stream` transport the push runs on while the learner takes
    its next step: this call waits only for the previous push (if it is
    still going) and for the copy of the parameters to the host. With
    `files` it waits for the checkpoint and the servers' loads.

    Returns:
      Timings and outcome counts, as metrics: the copy to the host (or the
      checkpoint write), and the last finished push's transfer time and
      outcome (the learner's whole wait is the trainer's `time/sync_seconds`).
    """
    start = time.perf_counter()
    self._finish_push()
    prepared = self._transport.prepare(policy_state, version)
    self._publisher.set_current(prepared, version)
    # The next step may donate the parameters only once all of them are on
    # the host: the learner waits for the copy either way. Sending while
    # copying shortens the push but, where the two share the cores, slows
    # the copy (BENCHMARKS.md, "Weight sync").
    if self._send_while_copying:
      self._pending_push = self._start_push(version)
    self._transport.wait(prepared)
    ready = time.perf_counter()
    if not self._send_while_copying:
      self._pending_push = self._start_push(version)
    if not self._transport.overlaps:
      self._finish_push()
    return {'time/weight_prepare_seconds': ready - start, **self._last_push}

  def _start_push(self, version: int):
    """Sends the current version to the live servers (to every server when
    each process holds a part), on the workers' event loop."""
    publisher = self._publisher

    async def push():
      pool = self._runner.pool
      targets = publisher.addresses if self._push_to_all else (
          pool.live_servers)
      result = await publisher.push(publisher.current[0], version, targets)
      for address in result.failed:
        await pool.mark_unhealthy(address, 'weight_push_failed')
      self._sync_rollout_version()
      self._transport.retire(version)
      return result

    return asyncio.run_coroutine_threadsafe(push(), self._runner.loop)

  def _finish_push(self) -> None:
    """Waits for the push in flight (if any) and records its outcome."""
    future, self._pending_push = self._pending_push, None
    if future is None:
      return
    result = self._poll(lambda poll_s: future.result(timeout=poll_s),
                        on_abort=future.cancel)
    self._last_push = {
        'time/weight_push_seconds': result.seconds,
        'rollout/servers_updated': float(len(result.updated)),
        'rollout/servers_failed_update': float(len(result.failed))}
    sent = [self._transport.sent_bytes[a] for a in result.updated
            if a in self._transport.sent_bytes]
    if sent:
      # Per server: below the version's bytes when deltas went out.
      self._last_push['rollout/weight_push_megabytes'] = (
          sum(sent) / len(sent) / 1e6)
      self._last_push['rollout/weight_version_megabytes'] = (
          self._transport.version_bytes / 1e6)

  def _sync_rollout_version(self) -> None:
    """The queue's rollout version: the least the live servers serve."""
    pool = self._runner.pool
    if pool is None:
      return
    version = self._publisher.rollout_version(pool.live_servers)
    # From the trainer's thread and from a push finishing on the loop.
    with self._version_lock:
      if version is not None and version > self._rollout_version:
        self._rollout_version = version
        self._queue.set_rollout_version(version)

  # ---------------------------------------------------------------- servers

  def check_servers(self) -> None:
    """Raises when training cannot go on: a server samples differently
    (`ConfigError`), or no server has been live for `no_server_grace_s`."""
    if self._publisher.mismatch is not None:
      raise config_lib.ConfigError(str(self._publisher.mismatch))
    pool = self._runner.pool
    now = time.monotonic()
    if pool is None or pool.live_servers:
      self._last_live = now
      self._sync_rollout_version()
      return
    grace = self._config.rollout.no_server_grace_s
    if now - self._last_live > grace:
      where = (f'{self._supervisor.restarts} restarts so far, logs in'
               f' {self._server_log_dir}' if self._supervisor is not None
               else ', '.join(self._addresses))
      raise TimeoutError(
          f'no rollout server has been alive for {grace:.0f} s'
          f' (config.rollout.no_server_grace_s; 0 of {len(self._addresses)}'
          f' live: {where})')

  def _on_death(self, address: str) -> None:
    """From the supervisor thread: take a dead server out of rotation now
    (it was idle, or its restart could take traffic before its weights)."""
    loop = self._runner.loop
    if loop is not None and not loop.is_closed() and self._runner.pool:
      asyncio.run_coroutine_threadsafe(
          self._runner.pool.mark_unhealthy(address, 'process_exited'), loop)

  def _poll(self, attempt: Callable[[float], Any], *,
            on_timeout: Callable[[TimeoutError], None] | None = None,
            on_abort: Callable[[], Any] | None = None) -> Any:
    """Calls `attempt(_POLL_S)` until it returns rather than times out.

    After each `TimeoutError` of an attempt, `on_timeout` may raise (the
    caller's own deadline passed); then a stop request or no live server
    ends the wait, after `on_abort` (e.g. cancelling a future).
    """
    while True:
      try:
        return attempt(_POLL_S)
      except TimeoutError as e:
        if on_timeout is not None:
          on_timeout(e)
      try:
        self._stop_flag.raise_if_requested()
        self.check_servers()
      except BaseException:
        if on_abort is not None:
          on_abort()
        raise

  # --------------------------------------------------------- state, metrics

  def stats(self) -> dict[str, dict[str, float]]:
    """Counters and gauges by section: 'queue' (`RolloutQueue.stats`) and
    'rollout' (workers and client, weight pushes, the rollout version, local
    server restarts), each to be logged under its section's prefix."""
    rollout = dict(self._runner.stats())
    rollout.update(self._publisher.counters)
    rollout.update(self._publisher.prefill_metrics())
    rollout.update(self._publisher.pause_metrics())
    rollout['rollout_version'] = float(self._rollout_version)
    if self._supervisor is not None:
      rollout.update(self._supervisor.stats())
    return {'queue': self._queue.stats(), 'rollout': rollout}

  def state_dict(self) -> dict[str, Any]:
    """The queue's counters, JSON-able, for a checkpoint."""
    return self._queue.state_dict()

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores `state_dict()` into a system whose workers have not
    started."""
    self._queue.load_state_dict(state)
