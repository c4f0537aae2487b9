r"""SAO for a Qwen3-8B policy on a TPU v5p-64 slice, 8k-token trajectories (plan).

  python -m sao_jax.tools.aot_compile --config=configs/qwen3_8b_v5p.py \
      --topology=v5p:2x4x4

The 8B preset's recipe (`llama3_8b_v5p.py`: bf16 compute, remat, the
paper's learning rates, FSDP x tensor parallel) on Qwen3-8B's shape
(`arch:qwen3-8b`: 36 layers, 32 query and 8 key/value heads of 128, per-head
q/k RMSNorm, untied head, 152k vocabulary) over 32 chips, with trajectories
of up to 8,192 tokens through splash attention. For a real run set
--config.model.source to a Qwen3-8B checkpoint directory. Memory per chip:
BENCHMARKS.md (planning TPU runs).
"""

from sao_jax import config_lib


def get_config(arg=None):
  """Qwen3-8B policy + critic, FSDP 8 x tensor 4 over 32 chips, 8k tokens."""
  c = config_lib.load_module(config_lib.sibling(__file__, 'llama3_8b_v5p.py')
                             ).get_config(arg)
  c.model.source = 'arch:qwen3-8b'
  c.batch_size = 32
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 8, 4
  c.optim.microbatches = 4  # one 8k-token row per batch shard at a time
  c.rollout.max_prefill_length = 4096
  c.rollout.max_target_length = 8192
  c.rollout.max_sequence_length = 8192
  c.rollout.max_new_tokens = 4096
  return c
