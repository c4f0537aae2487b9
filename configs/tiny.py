r"""A tiny random model on the word-target task: the whole pipeline in minutes.

  python -m sao_jax.train --config=configs/tiny.py --workdir=runs/tiny

CI runs it (tests/test_train.py): local JetStream servers, workers, the async
queue, the sharded learner, checkpoints and metrics, on a model small enough
to train on two CPU cores in about a minute. `arg` selects the algorithm as
in configs/default.py.
"""

from sao_jax import config_lib


def get_config(arg=None):
  """configs/default.py with a tiny model, task and budget."""
  c = config_lib.load_module(config_lib.sibling(__file__, 'default.py')
                             ).get_config(arg)
  c.model.source = 'tiny-random'
  # The demo's memory savings cost time and buy nothing at this size.
  c.model.remat = False
  c.model.layer_loop = 'auto'
  c.model.logits_chunk_size = 0
  c.task.name = 'word_target'
  c.task.held_out = 16
  c.total_steps = 30
  c.batch_size = 16
  c.group_size = 4 if c.group_size > 1 else 1
  for role in ('actor', 'critic'):
    c.optim[role].learning_rate = 3e-3
    c.optim[role].warmup_steps = 2
    # Constant, as the evidence benchmarks were measured (the demo's actor
    # decays; configs/default.py).
    c.optim[role].schedule = 'constant'
  if c.critic.pretrain_steps:  # ppo keeps none
    c.critic.pretrain_steps = 20  # measured: the rule stops it after ~13 here
  c.rollout.num_servers = 1
  c.rollout.num_workers = 16
  c.rollout.max_concurrent_decodes = 8
  c.rollout.max_prefill_length = 32
  c.rollout.max_target_length = 64
  c.rollout.max_sequence_length = 64
  c.rollout.max_new_tokens = 8
  # word_target rewards each even-numbered word of a reply: a reply the
  # budget cuts is still a list of words.
  c.rollout.reward_cut_replies = True
  c.eval.max_new_tokens = 8
  c.eval.every = 0  # at the start and end only
  c.eval.batch_size = 16
  c.checkpoint.every = 10
  return c
