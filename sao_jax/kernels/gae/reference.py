"""The definition of skip-observation GAE: `sao_jax.rl.advantages`.

The plain-JAX recurrence in `sao_jax.rl.advantages.skip_observation_gae` is the
reference every implementation is tested against; it runs under XLA anywhere.
"""

from sao_jax.rl import advantages

skip_observation_gae = advantages.skip_observation_gae
