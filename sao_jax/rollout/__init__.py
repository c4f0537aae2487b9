"""Rollouts: JetStream serving the policy, async workers, the host-side queue.

The transport of tokens between the rollout servers and the learner; the
tasks themselves live in `sao_jax.envs`. The trainer uses `system` only.

  system.py            RolloutSystem: servers, workers, queue, weight pushes
  launch.py            starting servers: subprocesses or in this process
  server_supervisor.py restarting local server processes that died
  trajectory_checks.py validation of trajectories before they are queued
  jetstream_compat.py  importing JetStream 0.2.2 safely on current JAX
  wire.py              how tokens, mu_t and versions travel per step
  engine.py            our model behind JetStream's Engine contract
  server.py            JetStream gRPC server + authenticated admin service
  options.py           the rollout section's config checks (no JetStream)
  weight_sync.py       weight pushes to servers: streamed or as checkpoints
  weight_stream.py     the streamed push's wire format and its sender
  weight_staging.py    its receiver: checked buckets staged into a version
  weight_delta.py      sparse deltas against the version a server holds
  weight_socket.py     the push's data connection (token, blocking I/O)
  host_buffers.py      aligned host buffers, pages faulted in up front
  prefix_cache.py      finished rows' KV kept for an episode's next turn
  client.py            asyncio gRPC client: least-loaded routing, retries
  episodes.py          the multi-turn agent loop (token-in/token-out)
  workers.py           rollout workers feeding the queue
  queue.py             admission control, backpressure, staleness filter
  queue_books.py       the queue's counts and accounting
  batching.py          fixed [B, T] batches from trajectories; packing policy
"""
