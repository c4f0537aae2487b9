r"""SAO for a Llama-3.2-1B-class policy on a TPU v6e-8 slice (planning preset).

  python -m sao_jax.tools.aot_compile --config=configs/llama3_1b_v6e.py \
      --topology=v6e:2x4

checks without TPUs that the sharded SAO step (policy, same-size critic, both
AdamW states) compiles and fits; for a real run, set --config.model.source to
a Llama-3.2-1B checkpoint directory and start with
  python -m sao_jax.train --config=configs/llama3_1b_v6e.py --workdir=gs://...
The architecture preset `arch:llama3.2-1b` has no weights.
"""

from sao_jax import config_lib


def get_config(arg=None):
  """1B policy + critic, FSDP over 8 chips, 2k-token trajectories."""
  c = config_lib.load_module(config_lib.sibling(__file__, 'default.py')
                             ).get_config(arg)
  c.model.source = 'arch:llama3.2-1b'
  c.model.dtype = 'bfloat16'  # compute; parameters and AdamW stay f32
  c.model.remat = True
  c.batch_size = 32
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
  # 2k-token trajectories in 4 micro-batches (one row per chip each). With
  # splash attention (model.attention='auto' on TPU) longer ones fit too:
  # 8k tokens take 4.7 GiB of temporaries per chip, 32k 11.7 (14.8 of 32 GiB
  # with the state; BENCHMARKS.md, planning TPU runs).
  c.optim.microbatches = 4
  c.rollout.max_prefill_length = 1024
  c.rollout.max_target_length = 2048
  c.rollout.max_sequence_length = 2048
  c.rollout.max_new_tokens = 1024
  c.rollout.temperature = 1.0
  c.kernels.implementation = 'auto'
  # Host RAM is not what bounds a TPU learner: keep a spare host copy of the
  # weights so each push copies into touched pages (rollout config comment).
  c.rollout.weight_reuse_host_buffers = True
  for role, lr in (('actor', 1e-6), ('critic', 5e-6)):  # the paper's rates
    c.optim[role].learning_rate = lr
    c.optim[role].warmup_steps = 10
    c.optim[role].schedule = 'constant'
  c.total_steps = 1000
  c.critic.pretrain_steps = 50
  return c
