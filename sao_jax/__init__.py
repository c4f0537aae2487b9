"""sao_jax: Single-rollout Asynchronous Optimization (SAO) in JAX."""
