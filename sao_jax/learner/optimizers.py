"""Optimisers of the actor and the critic from config (`config.optim.<role>`).

AdamW after global-norm clipping, with a linear warm-up to a constant rate
(SAO: 10-step warm-up, critic at 5x the actor's rate), the first moment in
`mu_dtype` (bfloat16 halves it, as MaxText and big_vision offer), the whole
chain inside `optax.apply_if_finite`: an update whose gradient holds a NaN or inf is
skipped (parameters untouched) and counted, never applied.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

# An effectively unbounded number of consecutive non-finite updates: the
# learner reports them and keeps going (a run of them is visible in metrics).
_MAX_NONFINITE = 2**31 - 1


def schedule(cfg) -> optax.Schedule:
  """Linear warm-up over `warmup_steps`, then `learning_rate`."""
  if cfg.warmup_steps == 0:
    return optax.constant_schedule(cfg.learning_rate)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps),
       optax.constant_schedule(cfg.learning_rate)],
      boundaries=[cfg.warmup_steps])


def make(cfg) -> optax.GradientTransformation:
  """The optimiser of one role's config section."""
  return optax.apply_if_finite(
      optax.chain(
          optax.clip_by_global_norm(cfg.grad_clip_norm),
          optax.adamw(schedule(cfg), b1=cfg.b1, b2=cfg.b2,
                      mu_dtype=jnp.dtype(cfg.mu_dtype),
                      weight_decay=cfg.weight_decay)),
      max_consecutive_errors=_MAX_NONFINITE)


def nonfinite_count(opt_state) -> int:
  """Updates skipped so far for a non-finite gradient."""
  return opt_state.total_notfinite
