"""Optimisers of the actor and the critic from config (`config.optim.<role>`).

AdamW after global-norm clipping, with a linear warm-up to a constant rate
(SAO: 10-step warm-up, critic at 5x the actor's rate) or a cosine decay, the
first moment in `mu_dtype` (bfloat16 halves it, as MaxText and big_vision
offer), the whole chain inside `optax.apply_if_finite`: an update whose
gradient holds a NaN or inf, or whose global norm overflows float32 (finite
elements, as a reward of 1e30 gives: clipping would scale them by
max_norm / inf = 0, a silent zero update), is skipped (parameters
untouched) and counted, never applied.

Schedules count policy steps (batches), not optimizer steps: every optimizer
step of one batch (E x M for the actor, K x M_c for the critic) takes that
batch's rate, so presets with M = 4 warm up over as many batches as SAO's
M = 1, and the first batch already trains (its rate is above 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from sao_jax import config_lib

# An effectively unbounded number of consecutive non-finite updates: the
# learner reports them and keeps going (a run of them is visible in metrics).
_MAX_NONFINITE = 2**31 - 1


# The rate after the warm-up, by `optim.<role>.schedule`, over `batches`.
_AFTER_WARMUP = {
    'constant': lambda cfg, batches: optax.constant_schedule(cfg.learning_rate),
    # verl's and OpenRLHF's cosine with a floor (min_lr_ratio), reached at
    # the run's last batch.
    'cosine': lambda cfg, batches: optax.cosine_decay_schedule(
        cfg.learning_rate, max(batches - 1, 1), alpha=cfg.min_lr_ratio),
}
LR_SCHEDULES = tuple(_AFTER_WARMUP)


def check_config(check) -> None:
  """`config.optim`: each role's optimiser, the actor's update schedule.

  Args:
    check: a `config_lib.Checker` of the whole config.
  """
  for role in ('actor', 'critic'):
    optim = check.scope(f'optim.{role}')
    optim.positive('learning_rate')
    optim.non_negative_int('warmup_steps')
    optim.positive('grad_clip_norm')
    optim.choice('mu_dtype', config_lib.DTYPES)
    optim.choice('schedule', LR_SCHEDULES)
    optim.closed_interval('min_lr_ratio', 0.0, 1.0)
  check.positive_int('optim.policy_epochs')
  check.positive_int('optim.policy_minibatches')
  check.positive_int('optim.microbatches')


def schedule(cfg, total_batches: int) -> optax.Schedule:
  """The rate of batch `b` (0-based) of a run of `total_batches`.

  Warm-up: `learning_rate * (b + 1) / (warmup_steps + 1)` for the first
  `warmup_steps` batches (above 0 from the first), then `learning_rate`:
  constant, or (`schedule = 'cosine'`) a cosine decay that reaches
  `min_lr_ratio` of it at the last batch.
  """
  warmup = cfg.warmup_steps
  after = _AFTER_WARMUP[cfg.schedule](cfg, total_batches - warmup)
  if warmup == 0:
    return after
  return optax.join_schedules(
      [optax.linear_schedule(cfg.learning_rate / (warmup + 1),
                             cfg.learning_rate, warmup),
       after], boundaries=[warmup])


def make(cfg, total_batches: int,
         steps_per_batch: int = 1) -> optax.GradientTransformation:
  """The optimiser of one role's config section.

  Args:
    cfg: `config.optim.<role>`.
    total_batches: the batches that end its schedule.
    steps_per_batch: optimizer steps per batch; all of a batch's steps take
      its rate (a skipped non-finite step does not advance the count).
  """
  by_batch = schedule(cfg, total_batches)
  rate = (by_batch if steps_per_batch == 1 else
          lambda count: by_batch(count // steps_per_batch))
  return _skip_unless_norm_finite(optax.apply_if_finite(
      optax.chain(
          optax.clip_by_global_norm(cfg.grad_clip_norm),
          optax.adamw(rate, b1=cfg.b1, b2=cfg.b2,
                      mu_dtype=jnp.dtype(cfg.mu_dtype),
                      weight_decay=cfg.weight_decay)),
      max_consecutive_errors=_MAX_NONFINITE))


def _skip_unless_norm_finite(
    tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """`tx` (an `apply_if_finite`) that also skips, and counts, a gradient
  whose global norm is not finite: its elements become NaN before
  `apply_if_finite` looks at them. The state is `tx`'s own, so
  checkpoints and `nonfinite_count` read it unchanged."""

  def update(updates, state, params=None):
    finite = jnp.isfinite(optax.tree.norm(updates))
    updates = jax.tree.map(lambda g: jnp.where(finite, g, jnp.nan), updates)
    return tx.update(updates, state, params)

  return optax.GradientTransformation(tx.init, update)


def nonfinite_count(opt_state) -> int:
  """Updates skipped so far (since the optimizer state was made) for a
  non-finite gradient or gradient norm."""
  return opt_state.total_notfinite
