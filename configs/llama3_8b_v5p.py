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
  # The 1B preset's recipe (bf16 compute, remat, 2k-token trajectories, the
  # paper's learning rates), scaled to an 8B model and a 64-chip slice.
  c = config_lib.load_module(config_lib.sibling(__file__, 'llama3_1b_v6e.py')
                             ).get_config(arg)
  c.model.source = 'arch:llama3.1-8b'
  c.batch_size = 64
  c.optim.microbatches = 1  # 4 rows per batch shard fit in one pass
  # FSDP 16 x tensor 4: 23.5 of 95 GiB per chip. Pure FSDP over 64 chips
  # does not fit (128 GiB of temporaries: whole layers are gathered per chip).
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 16, 4
  return c
