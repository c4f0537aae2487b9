r"""SAO for Qwen3-30B-A3B (128 routed experts) on a TPU v5p-64 slice (plan).

  python -m sao_jax.tools.aot_compile --config=configs/qwen3_30b_a3b_v5p.py \
      --topology=v5p:2x4x4

Qwen3-8B's recipe (`qwen3_8b_v5p.py`: bf16 compute, remat, 8k-token
trajectories, the paper's learning rates) on the MoE's shape
(`arch:qwen3-30b-a3b`: 48 layers, 8 of 128 experts of width 768 per token)
with its experts split 8 ways over the `expert` mesh axis (16 per chip) and
the rest FSDP over 4. The critic is the same MoE with attention frozen (its
experts train). Routing replay is on (the servers record each token's
experts and the learner routes by them: pi and mu on the same experts) with
Qwen3-MoE's own balancing-loss weight. For a real run set --config.model.source to a Qwen3-30B-A3B
checkpoint directory. Memory per chip: BENCHMARKS.md (planning TPU runs).
"""

from sao_jax import config_lib


def get_config(arg=None):
  """Qwen3-30B-A3B policy + critic, FSDP 4 x expert 8 over 32 chips."""
  c = config_lib.load_module(config_lib.sibling(__file__, 'qwen3_8b_v5p.py')
                             ).get_config(arg)
  c.model.source = 'arch:qwen3-30b-a3b'
  c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.tensor = 1, 4, 8, 1
  c.optim.microbatches = 1  # 32 rows over 32 shards: one 8k row per chip
  c.model.moe_routing = 'replay'
  c.model.router_aux_loss_coef = 0.001  # HF Qwen3MoeConfig's default
  return c
