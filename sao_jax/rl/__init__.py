"""The RL math, pure and jit-able: advantage estimators, losses, algorithms.

  advantages.py  A_t: GAE (skip-observation), GRPO groups, running mean
  losses.py      the DIS and PPO policy losses, the value loss, KL terms
  algorithms.py  the parts each algorithm is made of, chosen by name
"""
