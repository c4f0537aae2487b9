"""Whether a finished trajectory can be trained on, and if not, why.

Workers hand the queue whatever their episodes produced, and a worker bug (or
a server returning garbage) must cost that trajectory, not the learner: a
NaN log-prob or an out-of-range token would poison a whole batch, a version
from the future would defeat the staleness bound, a reward beyond float32 or
an unhashable prompt id would crash or skip the step that trains on it. The
queue is the one gate: everything the trainer and learner read from a
trajectory (arrays, reward, ids, the info keys they need) is checked here, so
that a bad row costs itself and never the good rows of its batch. The rollout
queue checks every trajectory it is given with `rejection_reason`, then
against its GRPO groups, and counts rejections by reason: its `stats()` has
one `rejected/<reason>` per entry of `REJECT_REASONS`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import numpy as np

from sao_jax import types
from sao_jax.rollout import wire

# Why a trajectory was rejected; the queue's `stats()` has one
# `rejected/<reason>` each. The last three are the queue's own group checks.
REJECT_REASONS = (
    'malformed',  # not a Trajectory, arrays of wrong rank or dtype
    'inconsistent_lengths',  # the per-token arrays differ in length
    'too_long',  # longer than max_length
    'token_out_of_range',  # a token id outside [0, vocab_size)
    'no_action_tokens',  # nothing to train on (and no token for the reward)
    # Its first token is an action: nothing predicts it (no prompt token).
    'starts_with_action',
    'missing_version',  # an action token with version NO_VERSION (or < 0)
    'future_version',  # an action version newer than any that exists yet
    # An action log-prob non-finite (in float32, as batches hold it), above
    # the tolerance, or below LOGPROB_FLOOR.
    'bad_logprobs',
    'non_finite_reward',  # NaN, inf or not a number
    # Not representable as a finite float32 (batches hold rewards as float32,
    # where 1e39 is inf and skips the whole update), or beyond max_abs_reward.
    'reward_out_of_range',
    'bad_prompt_id',  # not a str (running-mean slots and metrics hash it)
    'bad_group_id',  # neither None nor a str (GRPO groups key on it)
    'bad_info',  # not a dict, or a required key missing or of the wrong type
    # An MoE routing record of the wrong shape or dtype, an expert id out of
    # range, a token partly recorded, or a record from a dense policy's run.
    'bad_routing_record',
    'missing_group_id',  # group_size > 1 and group_id is None
    'group_mismatch',  # not the group the lease was admitted for
    'group_overflow',  # a member of a group already released to the learner
)


# The largest finite float32: batches hold rewards as float32.
_FLOAT32_MAX = float(np.finfo(np.float32).max)
# No sampled token has a log-prob this low (a probability of e^-10000); one
# that claims it is corrupt, and far enough below it float32 has only -inf.
LOGPROB_FLOOR = -1e4


def layout_reason(traj: types.Trajectory, max_length: int) -> str | None:
  """The rules a batch row imposes on a well-formed trajectory (one of
  `REJECT_REASONS`, or None): the queue rejects by them at `put`, and
  `batching.assemble_batch` refuses by the same rules, so that a batch
  built from the queue's trajectories never fails."""
  mask = np.asarray(traj.action_mask, bool)
  if len(traj.tokens) > max_length:
    return 'too_long'
  if not mask.any():
    return 'no_action_tokens'
  if mask[0]:
    # Nothing predicts a first token: its log-prob and value would be
    # another trajectory's output in a packed row (and 0 in its own).
    return 'starts_with_action'
  return None


def rejection_reason(traj, *, vocab_size: int, max_length: int,
                     newest_version: int,
                     logprob_tolerance: float = 1e-3,
                     max_abs_reward: float | None = None,
                     required_info: Mapping[str, type | tuple[type, ...]]
                     | None = None,
                     routing: wire.RoutingLayout = wire.RoutingLayout()
                     ) -> str | None:
  """Why `traj` cannot be trained on (one of `REJECT_REASONS`), or None.

  Never raises: a worker bug must cost its trajectory, not the queue. An
  object that defeats the checks themselves (a property or `__float__` that
  raises) is 'malformed'.

  The reward must be a real number (a Python or numpy int, float or bool:
  True is a reward of 1, as a correctness verdict often is) whose magnitude a
  float32 holds and that is at most `max_abs_reward`. The prompt id must be a
  str and the group id None or a str, both hashable. The info must be a dict
  holding every key of `required_info` with a value of its type; a bool
  passes only where bool itself is named (it is an int to `isinstance`, but
  True is no task index).

  Args:
    traj: the candidate `Trajectory`.
    vocab_size: token ids must lie in [0, vocab_size).
    max_length: the most tokens a batch row holds.
    newest_version: the newest policy version that exists; an action token
      claiming a newer one is corrupt.
    logprob_tolerance: behaviour log-probs above this are corrupt.
    max_abs_reward: rewards of larger magnitude are corrupt (an environment
      bug); None bounds them by float32 only.
    required_info: info key -> the type (or tuple of types, as `isinstance`
      takes) its value must have; None requires no key.
    routing: an MoE policy's `wire.RoutingLayout` (R ids per token of E
      experts): a routing record, where there is one, is `[L, R]` ints, each
      token's row all `types.NOT_RECORDED` or all expert ids in [0, E). The
      default, a dense policy: trajectories carry none.
  """
  try:
    return _reason(traj, vocab_size, max_length, newest_version,
                   logprob_tolerance, max_abs_reward, required_info, routing)
  except Exception:  # pylint: disable=broad-exception-caught
    # Every check below guards what it touches; this is for objects whose
    # attributes or dunders raise what no check foresaw.
    return 'malformed'


def _reason(traj, vocab_size, max_length, newest_version, logprob_tolerance,
            max_abs_reward, required_info, routing) -> str | None:
  """`rejection_reason`, which may raise on adversarial objects."""
  if not isinstance(traj, types.Trajectory):
    return 'malformed'
  try:
    tokens = np.asarray(traj.tokens)
    mask = np.asarray(traj.action_mask)
    logprobs = np.asarray(traj.behavior_logprobs)
    versions = np.asarray(traj.versions)
  except Exception:  # pylint: disable=broad-exception-caught
    return 'malformed'
  arrays = (tokens, mask, logprobs, versions)
  if any(a.ndim != 1 for a in arrays):
    return 'malformed'
  # A 0/1 integer mask is refused too: `versions[mask]` would then gather
  # positions 0 and 1 instead of selecting, in every consumer downstream.
  if (tokens.dtype.kind not in 'iu' or versions.dtype.kind not in 'iu' or
      mask.dtype.kind != 'b' or logprobs.dtype.kind != 'f'):
    return 'malformed'
  if len({a.shape[0] for a in arrays}) != 1:
    return 'inconsistent_lengths'
  if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
    return 'token_out_of_range'
  reason = layout_reason(traj, max_length)
  if reason is not None:
    return reason
  action_versions = versions[mask]
  if np.any(action_versions < 0):
    return 'missing_version'
  if action_versions.max() > newest_version:
    return 'future_version'
  with np.errstate(over='ignore', invalid='ignore'):
    action_logprobs = logprobs[mask].astype(np.float32)
  if (not np.all(np.isfinite(action_logprobs)) or
      np.any(action_logprobs > logprob_tolerance) or
      np.any(action_logprobs < LOGPROB_FLOOR)):
    return 'bad_logprobs'
  if _routing_reason(traj.routed_experts, tokens.shape[0], routing):
    return 'bad_routing_record'
  reason = _reward_reason(traj.reward, max_abs_reward)
  if reason is not None:
    return reason
  if not _is_key(traj.prompt_id):
    return 'bad_prompt_id'
  if traj.group_id is not None and not _is_key(traj.group_id):
    return 'bad_group_id'
  return _info_reason(traj.info, required_info)


def _routing_reason(record, length: int, routing) -> bool:
  """Whether a routing record is unusable (see `rejection_reason`)."""
  if record is None:
    return False
  if not routing.ids_per_token or not isinstance(record, np.ndarray):
    return True
  if (record.dtype.kind not in 'iu'
      or record.shape != (length, routing.ids_per_token)):
    return True
  unset_L = np.all(record == types.NOT_RECORDED, axis=1)
  valid_L = np.all((record >= 0) & (record < routing.num_experts), axis=1)
  return not np.all(unset_L | valid_L)


def _reward_reason(reward, max_abs_reward) -> str | None:
  # Only real scalars: a string would parse, and a one-element array would
  # convert here but break the batch's reward column.
  if not isinstance(reward, (numbers.Real, np.bool_)):
    return 'non_finite_reward'
  try:
    value = float(reward)
  except OverflowError:  # an int (or Fraction) beyond any float
    return 'reward_out_of_range'
  except (TypeError, ValueError):
    return 'non_finite_reward'
  if not math.isfinite(value):
    return 'non_finite_reward'
  if abs(value) > _FLOAT32_MAX:
    return 'reward_out_of_range'
  if max_abs_reward is not None and abs(value) > max_abs_reward:
    return 'reward_out_of_range'
  return None


def _is_key(value) -> bool:
  """Whether `value` is a str that hashes (a subclass may break `hash`)."""
  if not isinstance(value, str):
    return False
  try:
    hash(value)
  except Exception:  # pylint: disable=broad-exception-caught
    return False
  return True


def _info_reason(info, required_info) -> str | None:
  # Metrics read optional keys with `info.get`, so a dict is needed even when
  # no key is required.
  if not isinstance(info, dict):
    return 'bad_info'
  for key, kind in (required_info or {}).items():
    if key not in info:
      return 'bad_info'
    value = info[key]
    if not isinstance(value, kind):
      return 'bad_info'
    if isinstance(value, bool) and not _names_bool(kind):
      return 'bad_info'
  return None


def _names_bool(kind) -> bool:
  return kind is bool or (isinstance(kind, tuple) and bool in kind)
