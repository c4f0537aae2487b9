"""Rollouts: JetStream serving the policy, async workers, the host-side queue.

  environments/        tasks, tools, sandboxed code, rewards (all offline)
  trajectory.py        the Trajectory record workers produce
  trajectory_checks.py validation of trajectories before they are queued
  jetstream_compat.py  importing JetStream 0.2.2 safely on current JAX
  engine.py            our model behind JetStream's Engine contract
  server.py            JetStream gRPC server + authenticated admin service
  weight_sync.py       policy checkpoints and weight pushes to servers
  client.py            asyncio gRPC client: least-loaded routing, retries
  episodes.py          the multi-turn agent loop (token-in/token-out)
  workers.py           rollout workers feeding the queue
  queue.py             admission control, backpressure, staleness filter
  queue_state.py       the queue's counts and accounting
  batching.py          fixed [B, T] batches from trajectories
  sandbox.py           running model-written code (library side)
  sandbox_init.py      the per-run init of a sandbox (namespaces, limits)
  sandbox_isolation.py what containment this machine supports
"""
