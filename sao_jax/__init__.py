"""sao_jax: Single-rollout Asynchronous Optimization (SAO) in JAX."""

from sao_jax import quiet_start

# Before any submodule imports JAX or TensorFlow.
quiet_start.install()
