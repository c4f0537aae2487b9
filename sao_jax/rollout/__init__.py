"""Rollouts: JetStream serving the policy, async workers, the host-side queue.

  environments/   tasks, tools, sandboxed code, rewards (all offline)
  trajectory.py   the Trajectory record workers produce and the queue checks
  engine.py       our model behind JetStream's Engine contract
  server.py       JetStream gRPC server + authenticated admin (weight swap)
  client.py       asyncio gRPC client: least-loaded routing, retries, deadlines
  workers.py      the multi-turn agent loop producing trajectories
  queue.py        bounded queue, admission control, staleness filter, batches
"""
