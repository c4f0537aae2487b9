"""The definition of the DIS policy loss: `sao_jax.rl.losses.dis_policy_loss`.

The plain-JAX loss in `sao_jax.rl.losses` is the reference every implementation is
tested against (forward value, metrics and gradient); it runs under XLA
anywhere.
"""

from sao_jax.rl import losses

dis_policy_loss = losses.dis_policy_loss
