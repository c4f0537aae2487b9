"""The RL math, pure and jit-able: advantage estimators, losses, algorithms.

  tokens.py      masked [B, T] arrays: argument checks, aggregation, ratio stats
  advantages.py  A_t: GAE (skip-observation), GRPO groups, running mean
  losses.py      the DIS and PPO policy losses, the value loss, KL terms
  algorithms.py  estimators, losses and algorithms registered by name

The DIS loss and skip-observation GAE are defined next to their Pallas
kernels (`sao_jax.kernels.<kernel>.reference`) and re-exported by `losses`
and `advantages`; `tokens` sits below both.
"""
