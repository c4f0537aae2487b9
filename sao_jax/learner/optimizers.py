"""Optimisers of the actor and the critic from config (`config.optim.<role>`).

AdamW after global-norm clipping, with a linear warm-up to a constant rate
(SAO: 10-step warm-up, critic at 5x the actor's rate) or a cosine decay, the
first moment in `mu_dtype` (bfloat16 halves it, as MaxText and big_vision
offer), the whole chain inside `optax.apply_if_finite`: an update whose
gradient holds a NaN or inf is skipped (parameters untouched) and counted,
never applied.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

from sao_jax import config_lib

# An effectively unbounded number of consecutive non-finite updates: the
# learner reports them and keeps going (a run of them is visible in metrics).
_MAX_NONFINITE = 2**31 - 1


# The rate after the warm-up, by `optim.<role>.schedule`, over `steps`.
_AFTER_WARMUP = {
    'constant': lambda cfg, steps: optax.constant_schedule(cfg.learning_rate),
    # verl's and OpenRLHF's cosine with a floor (min_lr_ratio).
    'cosine': lambda cfg, steps: optax.cosine_decay_schedule(
        cfg.learning_rate, max(steps, 1), alpha=cfg.min_lr_ratio),
}
assert set(_AFTER_WARMUP) == set(config_lib.LR_SCHEDULES)


def schedule(cfg, total_steps: int) -> optax.Schedule:
  """Linear warm-up over `warmup_steps`, then `learning_rate`: constant, or
  (`schedule = 'cosine'`) a cosine decay to `min_lr_ratio` of it at
  `total_steps` optimizer steps.
  """
  after = _AFTER_WARMUP[cfg.schedule](cfg, total_steps - cfg.warmup_steps)
  if cfg.warmup_steps == 0:
    return after
  return optax.join_schedules(
      [optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps),
       after], boundaries=[cfg.warmup_steps])


def make(cfg, total_steps: int) -> optax.GradientTransformation:
  """The optimiser of one role's config section; `total_steps` optimizer
  steps end its schedule."""
  return optax.apply_if_finite(
      optax.chain(
          optax.clip_by_global_norm(cfg.grad_clip_norm),
          optax.adamw(schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2,
                      mu_dtype=jnp.dtype(cfg.mu_dtype),
                      weight_decay=cfg.weight_decay)),
      max_consecutive_errors=_MAX_NONFINITE)


def nonfinite_count(opt_state) -> int:
  """Updates skipped so far for a non-finite gradient."""
  return opt_state.total_notfinite
