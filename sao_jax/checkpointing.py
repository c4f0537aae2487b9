"""Learner checkpoints: sharded state plus JSON metadata, saved atomically.

A step directory holds the learner's state pytree (each host writes its own
shards) and a JSON metadata dict (data cursor, queue counters, config
snapshot), finalized together. Saves are asynchronous; stopping on SIGTERM
goes through a flag the training loop polls (`stop_signal`):

    stop = stop_signal.install_sigterm_handler()
    with checkpointing.Checkpointer(directory, save_interval_steps=100) as ckpt:
      if ckpt.latest_step() is not None:
        state, metadata = ckpt.restore(abstract_state=abstract_state)
      for step in range(start, num_steps):
        state = train_step(state, ...)
        ckpt.save(step, state, metadata)  # only at multiples of the interval
        if stop.should_stop():
          ckpt.save(step, state, metadata, force=True)
          break

Every process calls `save`, `restore` and `wait` at the same steps (they are
collectives). Atomicity, the asynchronous save and the SIGTERM contract are
explained in docs/design/checkpointing.md.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from sao_jax import errors

_STATE = 'state'
_METADATA = 'metadata'

_log = logging.getLogger(__name__)

# What the storage layer (tensorstore, under orbax) says when the write itself
# failed, as opposed to a bug: its status code or the system's words.
_WRITE_FAILURES = ('RESOURCE_EXHAUSTED', 'PERMISSION_DENIED', 'No space left',
                   'File too large', 'Read-only file system', 'Failed writing',
                   'Failed to write')


class CheckpointWriteError(errors.UserError):
  """A checkpoint could not be written (a full disk, no permission, ...).

  The background write's error, in one line that names the step, the
  directory and the system's reason; the checkpoints finalized before it are
  intact.
  """


class Checkpointer:
  """Periodic, atomic, asynchronous checkpoints of the learner's state.

  Args:
    directory: where step directories go; created if missing. Local paths are
      made absolute (orbax requires it); `gs://` paths are used as given.
    max_to_keep: how many finalized steps to keep, newest first; older ones are
      deleted after each save. None keeps every step.
    save_interval_steps: `save` writes only at steps that are multiples of
      this (unless forced), so the training loop can call it every step.
    write_concurrent_gb: most GB of the state being written at once (orbax's
      `save_concurrent_gb`; its default is 96). The background write encodes
      each array into buffers of its own: unbounded, the demo's learner
      (SmolLM2, 2.6 GiB of state) held +1.9 GiB more for the seconds of a
      write, at 1 GB +0.7 GiB.
  """

  def __init__(self, directory: str | os.PathLike[str], *,
               max_to_keep: int | None = 3, save_interval_steps: int = 100,
               write_concurrent_gb: int = 96):
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f'max_to_keep must be >= 1 or None, got {max_to_keep}')
    if save_interval_steps < 1:
      raise ValueError(
          f'save_interval_steps must be >= 1, got {save_interval_steps}')
    directory = os.fspath(directory)
    if '://' not in directory:
      directory = os.path.abspath(directory)
    self.directory = directory
    self.save_interval_steps = save_interval_steps
    self._last_started: int | None = None
    policies = ocp.checkpoint_managers
    options = ocp.CheckpointManagerOptions(
        # Saves exactly at multiples of the interval: orbax's default policy
        # would also save whatever step comes first, surprising a trainer
        # that resumes at step 137. The preemption policy is a no-op on a
        # single host; with jax.distributed it saves at the step all hosts
        # agree on when the coordination service sees a preemption notice.
        save_decision_policy=policies.AnySavePolicy([
            policies.FixedIntervalPolicy(save_interval_steps),
            policies.PreemptionCheckpointingPolicy(),
        ]),
        preservation_policy=(
            policies.LatestN(max_to_keep) if max_to_keep is not None else None),
        # A process killed mid-save leaves `<step>.orbax-checkpoint-tmp`; it
        # is never read, and removing it here reclaims the space.
        cleanup_tmp_directories=True,
        enable_async_checkpointing=True,
    )
    # Handlers are registered up front (not inferred from the first save) so
    # that a fresh process can read a step's tree metadata before restoring:
    # that is what `restore` checks the target against.
    self._manager = ocp.CheckpointManager(
        directory, options=options,
        item_handlers={_STATE: ocp.StandardCheckpointHandler(
            save_concurrent_gb=write_concurrent_gb),
                       _METADATA: ocp.JsonCheckpointHandler()})

  def save(self, step: int, state: Any, metadata: Mapping[str, Any], *,
           force: bool = False) -> bool:
    """Starts saving `state` and `metadata` as `step`, if it is time to.

    Args:
      step: the training step; saved when it is a multiple of
        `save_interval_steps`, or whenever `force` is set.
      state: a pytree of jax arrays (any sharding), numpy arrays or Python
        scalars.
      metadata: a JSON-able dict with string keys (no NaN or infinity, which
        JSON lacks). It is copied now, so the caller may keep mutating it
        while the save runs in the background. Tuples come back as lists.
      force: save regardless of the interval (at the end of training, on
        SIGTERM).

    Blocks while the arrays are copied to host memory, and first for the
    previous save if it is still writing.

    Returns:
      True if a save was started; False if it was not time to, or `step` is
      already saved (a forced save right after a periodic one of the same
      step is a no-op, not an error).

    Raises:
      TypeError: when `metadata` is not JSON-able or has a non-string key;
        raised here, in the caller's thread, not later from the writer.
    """
    step = int(step)
    metadata = _json_copy(metadata)
    if force:
      if step in self._manager.all_steps():
        return False
    elif not self._manager.should_save(step):
      return False
    try:
      # Waits first for the previous save, whose write may have failed.
      saved = self._manager.save(
          step,
          args=ocp.args.Composite(**{
              _STATE: ocp.args.StandardSave(state),
              _METADATA: ocp.args.JsonSave(metadata),
          }),
          force=force)
    except (OSError, ValueError) as e:
      error = self._write_error(e)
      if error is None:
        raise
      raise error from e
    if saved:
      self._last_started = step
      _log.info('checkpoint of step %d started in %s', step, self.directory)
    return bool(saved)

  def due(self, step: int, *, force: bool = False) -> bool:
    """Whether `save(step, ..., force=force)` would start a save.

    Lets the caller build the metadata only when it is needed: on several
    processes gathering it is a collective (every process asks at the same
    step, and gets the same answer).
    """
    step = int(step)
    if force:
      return step not in self._manager.all_steps()
    return bool(self._manager.should_save(step))

  def wait(self) -> None:
    """Blocks until the last started save is finalized on disk.

    Raises:
      CheckpointWriteError: the background write failed for a reason of the
        storage (a full disk, no permission); any other error as it is.
    """
    try:
      self._manager.wait_until_finished()
    except (OSError, ValueError) as e:
      error = self._write_error(e)
      if error is None:
        raise
      raise error from e

  def _write_error(self, e: Exception) -> CheckpointWriteError | None:
    """`e` as a `CheckpointWriteError` when the storage refused the write;
    None for any other error, which is re-raised as it is."""
    text = ' '.join(str(e).split())
    if not isinstance(e, OSError) and not any(w in text
                                              for w in _WRITE_FAILURES):
      return None
    # tensorstore's status ends with the system's reason, after the paths.
    tail = text.rfind('Failed to write')
    reason = text[tail:] if tail >= 0 else text[-300:]
    done = [s for s in self._manager.all_steps() if s != self._last_started]
    kept = (f'step {max(done)} is the last complete one'
            if done else 'no complete checkpoint exists yet')
    return CheckpointWriteError(
        f'the checkpoint of step {self._last_started} could not be written'
        f' to {self.directory} ({reason}); {kept}, and the same command'
        ' resumes from it once the storage has room'
        ' (checkpoint.max_to_keep bounds how many steps are kept)')

  def all_steps(self) -> list[int]:
    """The finalized steps in the directory, ascending."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest finalized step, or None when there is none.

    A save still in flight in this process is counted (orbax lists a step
    from the moment it starts); `restore` waits for it to finalize first.
    Steps another process left unfinalized are never counted.
    """
    return self._manager.latest_step()

  def read_metadata(self, step: int | None = None) -> dict[str, Any]:
    """Only the metadata of `step` (default: the latest).

    Lets a resuming trainer read the config snapshot or data cursor before it
    has built the model whose shapes `restore` needs.
    """
    step = self._finalized_step(step)
    restored = self._manager.restore(
        step, args=ocp.args.Composite(**{_METADATA: ocp.args.JsonRestore()}))
    return restored[_METADATA]

  def restore(self, step: int | None = None, *,
              abstract_state: Any) -> tuple[Any, dict[str, Any]]:
    """Restores `(state, metadata)` of `step` (default: the latest).

    Args:
      step: a finalized step; None means `latest_step()`.
      abstract_state: the target: a pytree shaped like the saved state whose
        array leaves are `jax.ShapeDtypeStruct`s with a `.sharding` (or jax
        arrays, whose shape, dtype and sharding are used). Arrays are read
        straight into those shardings, each host reading only its shards, and
        cast to those dtypes. Other leaves (Python scalars) are restored as
        saved.

    Returns:
      `(state, metadata)`: state with `abstract_state`'s tree structure.

    Raises:
      FileNotFoundError: no finalized checkpoint (at `step`).
      ValueError: the checkpoint's tree does not match `abstract_state`; the
        message names the first mismatching leaf path and both shapes, which
        orbax's own errors do not (and a missing or extra leaf is checked
        before any array is read).
    """
    step = self._finalized_step(step)
    target = jax.tree_util.tree_map_with_path(
        _restore_target, abstract_state, is_leaf=_is_abstract_leaf)
    saved = self._manager.item_metadata(step)[_STATE]
    _check_matches(step, getattr(saved, 'tree', saved), target)
    restored = self._manager.restore(
        step,
        args=ocp.args.Composite(**{
            _STATE: ocp.args.StandardRestore(target),
            _METADATA: ocp.args.JsonRestore(),
        }))
    return restored[_STATE], restored[_METADATA]

  def close(self) -> None:
    """Waits for the last save and releases orbax's threads."""
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def _finalized_step(self, step: int | None) -> int:
    # orbax lists a step from the moment its save starts; waiting makes
    # "listed" mean "finalized" before anything is read.
    self.wait()
    steps = self._manager.all_steps()
    if step is None:
      if not steps:
        raise FileNotFoundError(f'no finalized checkpoint in {self.directory}')
      return max(steps)
    if int(step) not in steps:
      raise FileNotFoundError(
          f'no finalized checkpoint of step {step} in {self.directory};'
          f' finalized steps: {sorted(steps)}')
    return int(step)


# -- restore targets ----------------------------------------------------------


def _is_abstract_leaf(x) -> bool:
  return isinstance(x, (jax.ShapeDtypeStruct, jax.Array))


def _restore_target(path, leaf):
  """One leaf of what orbax restores into: a ShapeDtypeStruct with sharding."""
  if not _is_abstract_leaf(leaf):
    return leaf
  name = _path_name(path)
  sharding = getattr(leaf, 'sharding', None)
  if sharding is None:
    raise ValueError(
        f'abstract_state leaf {name!r} (shape {leaf.shape}) has no sharding:'
        ' restore needs to know where each array goes; build the target with'
        ' jax.ShapeDtypeStruct(shape, dtype, sharding=...)')
  return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


def _key_name(key) -> str:
  # DictKey.key, GetAttrKey.name, SequenceKey.idx, FlattenedIndexKey.key:
  # orbax records namedtuples and dataclasses as dicts of their field names
  # and tuples as lists, so paths are compared by name, not by key type.
  for attr in ('key', 'name', 'idx'):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _path_name(path) -> str:
  return '/'.join(_key_name(k) for k in path)


def _flat_by_path(tree) -> dict[str, Any]:
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {_path_name(path): leaf for path, leaf in leaves}


def _check_matches(step: int, saved_tree, target) -> None:
  """Raises ValueError at the first leaf where checkpoint and target differ.

  Leaves are compared in the target's flattening order.
  """
  saved = _flat_by_path(saved_tree)
  wanted = _flat_by_path(target)
  for path, leaf in wanted.items():
    if path not in saved:
      raise ValueError(
          f'checkpoint step {step} does not match abstract_state: leaf'
          f' {path!r} (shape {tuple(np.shape(leaf))}) is not in the'
          f' checkpoint; the checkpoint has {_some(saved)}')
    saved_shape = _shape(saved[path])
    wanted_shape = tuple(np.shape(leaf))
    if saved_shape != wanted_shape:
      raise ValueError(
          f'checkpoint step {step} does not match abstract_state at leaf'
          f' {path!r}: checkpoint shape {saved_shape}, abstract_state shape'
          f' {wanted_shape}')
  for path, meta in saved.items():
    if path not in wanted:
      raise ValueError(
          f'checkpoint step {step} does not match abstract_state: the'
          f' checkpoint has leaf {path!r} (shape {_shape(meta)}) that'
          ' abstract_state lacks')


def _shape(leaf_metadata) -> tuple[int, ...]:
  return tuple(getattr(leaf_metadata, 'shape', None) or ())


def _some(flat: Mapping[str, Any], limit: int = 8) -> str:
  names = list(flat)
  more = f' and {len(names) - limit} more' if len(names) > limit else ''
  return ', '.join(repr(n) for n in names[:limit]) + more


# -- metadata -----------------------------------------------------------------


def _json_copy(metadata: Mapping[str, Any]) -> dict[str, Any]:
  """A deep copy through JSON, refusing what JSON would silently change.

  Integer dict keys (a slot map keyed by slot index, say) would come back as
  strings, and lookups after a resume would miss; that is refused here rather
  than discovered after a preemption.
  """
  def check_keys(x, path):
    if isinstance(x, Mapping):
      for k, v in x.items():
        if not isinstance(k, str):
          raise TypeError(
              f'checkpoint metadata key {path}[{k!r}] is a {type(k).__name__};'
              ' JSON keys must be str (convert it, e.g. str(k))')
        check_keys(v, f'{path}[{k!r}]')
    elif isinstance(x, (list, tuple)):
      for i, v in enumerate(x):
        check_keys(v, f'{path}[{i}]')

  if not isinstance(metadata, Mapping):
    raise TypeError(f'checkpoint metadata must be a dict, got {type(metadata)}')
  check_keys(metadata, 'metadata')
  try:
    return json.loads(json.dumps(metadata, allow_nan=False))
  except (TypeError, ValueError) as e:
    raise TypeError(f'checkpoint metadata is not JSON-able: {e}') from e
