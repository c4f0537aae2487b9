r"""SAO for a Llama-3.1-8B-class policy on a TPU v5p-128 slice (planning preset).

  python -m sao_jax.tools.aot_compile --config=configs/llama3_8b_v5p.py \
      --topology=v5p:4x4x4

checks without TPUs that the sharded SAO step (8B policy, 8B critic, both
AdamW states: ~190 GB of state) compiles and fits 64 chips; for a real run,
set --config.model.source to a Llama-3.1-8B checkpoint directory and launch
with tpu_scripts/. The architecture preset `arch:llama3.1-8b` has no weights.
"""

from sao_jax import config_lib


def get_config(arg=None):
  """8B policy + critic, FSDP x tensor parallel over 64 chips, 2k tokens."""
  c = config_lib.load_module(config_lib.sibling(__file__, 'default.py')
                             ).get_config(arg)
  c.model.source = 'arch:llama3.1-8b'
  c.model.dtype = 'bfloat16'  # compute; parameters and AdamW stay f32
  c.model.remat = True
  c.batch_size = 64
  # FSDP 16 x tensor 4: 23.5 of 95 GiB per chip. Pure FSDP over 64 chips
  # does not fit (128 GiB of temporaries: whole layers are gathered per chip).
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 16, 4
  c.rollout.max_prefill_length = 1024
  c.rollout.max_target_length = 2048
  c.rollout.max_sequence_length = 2048
  c.rollout.max_new_tokens = 1024
  c.rollout.temperature = 1.0
  for role, lr in (('actor', 1e-6), ('critic', 5e-6)):  # the paper's rates
    c.optim[role].learning_rate = lr
    c.optim[role].warmup_steps = 10
  c.total_steps = 1000
  c.critic.pretrain_steps = 50
  return c
