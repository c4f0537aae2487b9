"""The learner: the sharded training state and its jitted update steps.

  learner.py     the state on the mesh and the policy / critic steps
  optimizers.py  optax chains from the config
"""
