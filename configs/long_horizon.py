r"""A long-horizon agent task on the tiny model: 12 turns, 200-word observations.

  python -m sao_jax.train --config=configs/long_horizon.py --workdir=runs/long

The word-target task as a tool-using episode: 12 model turns, each followed
by an observation of 200 words (a long tool output), so an episode reaches
~2,500 tokens over its turns. What it exercises: packed multi-turn rows of
4,096 tokens through blockwise attention (`model.attention='auto'` above one
tile), skip-observation GAE over long observation runs, and the servers'
prefix cache (each turn prefills only the observation the environment
appended: `rollout/prefilled_tokens_per_generated_token` in the metrics).
CI trains it for a few steps (tests/test_train.py); `arg` selects the
algorithm as in configs/default.py.
"""

from sao_jax import config_lib


def get_config(arg=None):
  """configs/tiny.py with 12-turn, ~2.5k-token episodes."""
  c = config_lib.load_module(config_lib.sibling(__file__, 'tiny.py')
                             ).get_config(arg)
  c.task.word_target.turns = 12
  c.task.word_target.observation_words = 200
  c.task.held_out = 8
  c.batch_size = 8
  c.group_size = 4 if c.group_size > 1 else 1
  c.total_steps = 4
  if c.critic.pretrain_steps:
    c.critic.pretrain_steps = 1
  c.rollout.num_workers = 8
  c.rollout.max_concurrent_decodes = 8
  # The last turn's prompt is the whole episode so far.
  c.rollout.max_prefill_length = 4096
  c.rollout.max_target_length = 4608
  c.rollout.max_sequence_length = 4096
  c.rollout.prefix_cache_gib = 0.25
  c.eval.batch_size = 8
  c.checkpoint.every = 4
  return c
