"""Pallas TPU kernels for SAO's hot loops, with their XLA references.

  sao_jax.kernels.dis_policy_loss(..., implementation='auto')
  sao_jax.kernels.skip_observation_gae(..., implementation='auto')

take the arguments of `sao_jax.rl.losses.dis_policy_loss` and
`sao_jax.rl.advantages.skip_observation_gae` (the definitions) and return the same
results. 'auto' runs the Pallas kernel on TPU and the XLA reference elsewhere;
'pallas' off a TPU runs the kernel in interpret mode.
"""

from sao_jax.kernels.dis_loss import api as dis_loss_api
from sao_jax.kernels import dispatch
from sao_jax.kernels.gae import api as gae_api

IMPLEMENTATIONS = dispatch.IMPLEMENTATIONS
dis_policy_loss = dis_loss_api.dis_policy_loss
skip_observation_gae = gae_api.skip_observation_gae
