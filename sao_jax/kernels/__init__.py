"""Pallas TPU kernels for SAO's hot loops, each next to its XLA reference.

Each kernel's folder holds `reference.py` (the plain-JAX definition, which
`sao_jax.rl.losses` / `sao_jax.rl.advantages` re-export), `pallas_tpu.py` (the
kernel) and `api.py` (the dispatcher):

  sao_jax.kernels.dis_policy_loss(..., implementation='auto', mesh=None)
  sao_jax.kernels.skip_observation_gae(..., implementation='auto', mesh=None)

take the reference's arguments and return the same results. 'auto' runs the
Pallas kernel on TPU and the XLA reference elsewhere; 'pallas' off a TPU runs
the kernel in interpret mode. With a mesh the kernel runs per batch shard.
"""

from sao_jax.kernels import dispatch
from sao_jax.kernels.dis_loss import api as dis_loss_api
from sao_jax.kernels.gae import api as gae_api

IMPLEMENTATIONS = dispatch.IMPLEMENTATIONS
dis_policy_loss = dis_loss_api.dis_policy_loss
skip_observation_gae = gae_api.skip_observation_gae
