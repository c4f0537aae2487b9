r"""SAO for an 8B policy on 32k-token agent trajectories, TPU v5p-128 (plan).

  python -m sao_jax.tools.aot_compile --config=configs/llama3_8b_agent_32k.py \
      --topology=v5p:4x4x4

The 8B preset (`llama3_8b_v5p.py`: FSDP 16 x tensor 4, bf16 compute, remat,
the paper's learning rates) with trajectories of up to 32,768 tokens: splash
attention in every learner pass (`model.attention='auto'` on TPU), four
micro-batches so that each chip holds one trajectory at a time, in the
gradient passes and in the forward-only ones alike. Memory per chip at each
length: BENCHMARKS.md (planning TPU runs, long trajectories). Multi-turn
episodes reach this length over their turns: the prompt bucket bounds the
longest single prefill, the KV-cache length the whole episode.
"""

from sao_jax import config_lib


def get_config(arg=None):
  """8B policy + critic over 64 chips, 32k-token trajectories."""
  c = config_lib.load_module(config_lib.sibling(__file__, 'llama3_8b_v5p.py')
                             ).get_config(arg)
  c.optim.microbatches = 4  # one 32k-token row per batch shard at a time
  c.rollout.max_prefill_length = 16384  # a JetStream padding bucket
  c.rollout.max_target_length = 32768
  c.rollout.max_sequence_length = 32768
  c.rollout.max_new_tokens = 4096  # per model turn
  # Each turn prefills only what the environment appended: a 32k-token row
  # of the 8B model is 4 GiB of keys/values (bf16), so 4 episodes kept.
  c.rollout.prefix_cache_gib = 16.0
  return c
