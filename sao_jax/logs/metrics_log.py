"""Training metrics to a JSONL file and TensorBoard, written by the chief only.

Two sinks, for two readers. `metrics.jsonl` is what tests, plots and people with
`jq` read: one self-contained JSON object per line, flushed as it is written, so
a run killed at any point leaves a log that parses up to its last step. The
TensorBoard event files under `tensorboard/` are for watching a live run.

The JSONL format is

  {"step": 12, "time": 37.512, "train/reward": 0.41, "policy/kl_k3": null,
   "nonfinite": ["policy/kl_k3"]}

where `time` is seconds since this logger started (each run, resumed or not,
counts from 0).
JSON has no NaN or infinity (Python's `json` would write the non-standard
tokens `NaN`/`Infinity`, which strict readers reject), so a non-finite value is
written as `null` and its name listed under `"nonfinite"`: a diverging run still
leaves a valid file, and the divergence is still visible in it.

Resuming a run in the same workdir appends to the file, and the first record
the resumed run writes carries `"resumed": true`. The resumed run re-logs the
steps between its checkpoint and the point where the old run died, so the raw
file can hold a step twice; `read_jsonl(path, dedupe=True)` gives the view in
which every step appears once, with the values written last.

In a multi-host job every process runs the same training loop; only the chief
(pass `is_chief=jax.process_index() == 0`) writes, the others get a logger whose
methods do nothing, so call sites need no `if`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from sao_jax.logs import event_file

JSONL_NAME = 'metrics.jsonl'
TENSORBOARD_DIR = 'tensorboard'

# Keys of every record that are not metrics; a metric may not shadow them.
_STEP, _TIME, _NONFINITE, _RESUMED = 'step', 'time', 'nonfinite', 'resumed'
_RESERVED = frozenset((_STEP, _TIME, _NONFINITE, _RESUMED))

# Integer-valued histograms (staleness) spanning at most this many values get
# one bucket per integer; anything else gets this many equal-width buckets.
_HISTOGRAM_BUCKETS = 30


class MetricsLogger:
  """Writes scalar metrics and histograms to `workdir`; see the module doc.

  Typical use:

    is_chief = jax.process_index() == 0
    with metrics_log.MetricsLogger(workdir, is_chief=is_chief) as logger:
      for step in ...:
        logger.write(step, {'reward': r, 'grad_norm': g}, prefix='train')
        logger.write_histogram(step, 'rollout/staleness', staleness)

  Methods are thread-safe (the rollout and learner threads may both log).
  """

  def __init__(self, workdir: str | os.PathLike[str], *,
               tensorboard: bool = True, jsonl: bool = True,
               is_chief: bool = True):
    """Opens the sinks; creates `workdir` if needed.

    Args:
      workdir: the run's directory. The JSONL file is `workdir/metrics.jsonl`
        (appended to if it exists), event files go to `workdir/tensorboard/`.
      tensorboard: write TensorBoard event files (`event_file`, no
        TensorFlow).
      jsonl: write `metrics.jsonl`.
      is_chief: whether this process writes. Non-chief loggers touch no file.
    """
    self.workdir = os.fspath(workdir)
    self.jsonl_path = os.path.join(self.workdir, JSONL_NAME)
    self.tensorboard_dir = os.path.join(self.workdir, TENSORBOARD_DIR)
    self.is_chief = is_chief
    self._lock = threading.Lock()
    self._closed = False
    self._start = time.monotonic()
    self._file = None
    self._resumed = False
    self._tb_writer = None
    if not is_chief:
      return
    os.makedirs(self.workdir, exist_ok=True)
    if jsonl:
      self._resumed = (os.path.exists(self.jsonl_path)
                       and os.path.getsize(self.jsonl_path) > 0)
      self._file = _open_for_append(self.jsonl_path)
    if tensorboard:
      self._tb_writer = event_file.EventFileWriter(self.tensorboard_dir)

  def write(self, step: int, metrics: Mapping[str, Any], *,
            prefix: str = '') -> None:
    """Logs scalar `metrics` at `step` as one JSONL record and TB scalars.

    Args:
      step: the policy step (the x axis of every curve).
      metrics: name -> scalar: a Python number or bool, a numpy scalar, or a
        0-d / one-element numpy or jax array (fetched to host here).
      prefix: prepended to every name as `prefix/name`, e.g. `'train'`.

    Raises:
      ValueError: a value is an array of more than one element, a name is
        reserved (`step`, `time`, `nonfinite`, `resumed`), or the logger is
        closed.
      TypeError: a value is not numeric.
    """
    if not self.is_chief:
      return
    step = _to_step(step)
    names = [_join(prefix, name) for name in metrics]
    values = [_to_scalar(name, value)
              for name, value in zip(names, metrics.values())]
    record, nonfinite = self._record(step)
    for name, value in zip(names, values):
      _check_name(name, record)
      if isinstance(value, float) and not math.isfinite(value):
        nonfinite.append(name)
        value = None
      record[name] = value
    with self._lock:
      self._check_open()
      self._write_jsonl(record, nonfinite)
      if self._tb_writer is not None:
        self._write_tb_scalars(step, names, values)

  def write_histogram(self, step: int, name: str,
                      values: Iterable[Any] | np.ndarray) -> None:
    """Logs the distribution of `values` (e.g. per-trajectory staleness).

    TensorBoard gets a histogram; the JSONL record gets the raw values as a
    list (integers stay integers, non-finite values become `null` and the name
    is listed under `"nonfinite"`), so plots and tests can rebucket them.

    Args:
      step: the policy step.
      name: full metric name, e.g. `'rollout/staleness'`.
      values: numbers of any shape (flattened); may be empty.
    """
    if not self.is_chief:
      return
    step = _to_step(step)
    array = np.asarray(values).ravel()
    if array.dtype.kind == 'b':
      array = array.astype(np.int64)
    elif array.dtype.kind == 'V':
      # ml_dtypes' floats (bfloat16, the float8s) are numpy void-kind dtypes.
      array = array.astype(np.float64)
    if array.dtype.kind in 'iu':
      listed = [int(v) for v in array]
      finite = array.astype(np.float64)
    elif array.dtype.kind == 'f' or array.size == 0:
      array = array.astype(np.float64)
      ok = np.isfinite(array)
      listed = [float(v) if k else None for v, k in zip(array, ok)]
      finite = array[ok]
    else:
      raise TypeError(f'histogram {name!r}: values of dtype {array.dtype} are '
                      'not numbers')
    record, nonfinite = self._record(step)
    _check_name(name, record)
    record[name] = listed
    if len(finite) < len(listed):
      nonfinite.append(name)
    with self._lock:
      self._check_open()
      self._write_jsonl(record, nonfinite)
      if self._tb_writer is not None:
        self._write_tb_histogram(step, name, finite)

  def close(self) -> None:
    """Flushes and closes both sinks; later calls do nothing."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
      if self._file is not None:
        self._file.close()
      if self._tb_writer is not None:
        self._tb_writer.close()

  def __enter__(self) -> MetricsLogger:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  # ----------------------------------------------------------------- internals

  def _record(self, step: int) -> tuple[dict[str, Any], list[str]]:
    elapsed = round(time.monotonic() - self._start, 3)
    return {_STEP: step, _TIME: elapsed}, []

  def _check_open(self) -> None:
    if self._closed:
      raise ValueError(f'MetricsLogger for {self.workdir} is closed')

  def _write_jsonl(self, record: dict[str, Any], nonfinite: list[str]) -> None:
    if self._file is None:
      return
    if nonfinite:
      record[_NONFINITE] = nonfinite
    if self._resumed:
      # Marks where this run starts in the file, for `read_jsonl(dedupe=True)`.
      record[_RESUMED] = True
      self._resumed = False
    # allow_nan=False: a NaN that slipped past the conversion must fail here,
    # not silently produce a line strict JSON readers reject.
    self._file.write(json.dumps(record, allow_nan=False) + '\n')
    # Flushed to the OS on every write, so a killed process loses nothing.
    # No fsync: that only matters if the host itself dies, and costs a disk
    # round trip per step.
    self._file.flush()

  def _write_tb_scalars(self, step: int, names: Sequence[str],
                        values: Sequence[float | int | bool]) -> None:
    # Non-finite values go to TensorBoard as they are: it plots them as
    # markers, which is what one wants to see.
    self._tb_writer.scalars(step, zip(names, (float(v) for v in values)))

  def _write_tb_histogram(self, step: int, name: str,
                          finite: np.ndarray) -> None:
    self._tb_writer.histogram(step, name,
                              tensorboard_histogram_buckets(finite))


def read_jsonl(path: str | os.PathLike[str], *,
               dedupe: bool = False) -> list[dict[str, Any]]:
  """Reads a `metrics.jsonl` written by `MetricsLogger`.

  Lines that do not parse are skipped with a warning: the only way the logger
  leaves one is a process killed in the middle of a write, and the records
  around it are still good.

  Args:
    path: the JSONL file.
    dedupe: give the view of a run that was resumed from a checkpoint, in
      which every step appears once and steps increase. Every record of the
      earlier runs at or after the first step a resumed run logged is
      superseded and dropped (even for metrics the resumed run has not
      re-logged yet, e.g. an eval it has not reached). Then records of the same
      step are merged into one, later values winning, so a step's train and
      eval metrics share a record; its `time` is that of the last one merged.
      The `resumed` markers are left out.

  Returns:
    The records in file order (sorted by step when `dedupe`); non-finite
    values are `None`, as written.
  """
  records = []
  with open(path, encoding='utf-8') as f:
    for line_number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        logging.warning('%s:%d: skipping a line that is not JSON (a torn '
                        'write?): %.80r', path, line_number, line)
        continue
      records.append(record)
  return _dedupe(records) if dedupe else records


def window_means(records: Sequence[Mapping[str, Any]], key: str,
                 window: int) -> list[float]:
  """Means of `key` over consecutive, non-overlapping windows of records.

  Only records that hold a finite value for `key` count (a record of other
  metrics, or a `null` from a non-finite value, is skipped), so windows are
  `window` values of `key` each. A trailing partial window is averaged too:
  dropping it would hide the end of a run shorter than a few windows.

  Tests assert trends ("reward rises") on these rather than on single steps,
  whose noise would make the assertion flaky.

  Args:
    records: as from `read_jsonl`.
    key: the metric name, e.g. `'train/reward'`.
    window: values per window, >= 1.

  Returns:
    One mean per window, in record order; empty if no record holds `key`.
  """
  if window < 1:
    raise ValueError(f'window must be >= 1, got {window}')
  values = [float(r[key]) for r in records
            if isinstance(r.get(key), (int, float))
            and not isinstance(r.get(key), bool)]
  return [float(np.mean(values[i:i + window]))
          for i in range(0, len(values), window)]


def series(records: Sequence[Mapping[str, Any]],
           key: str) -> tuple[np.ndarray, np.ndarray]:
  """`(steps, values)` of the records holding a finite number under `key`.

  The shape plots want: parallel float arrays, ready for `ax.plot`.
  """
  steps, values = [], []
  for r in records:
    value = r.get(key)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      steps.append(r[_STEP])
      values.append(float(value))
  return np.asarray(steps, np.float64), np.asarray(values, np.float64)


def tensorboard_histogram_buckets(values: np.ndarray) -> np.ndarray:
  """`[k, 3]` float64 `(left edge, right edge, count)` rows: TensorBoard's.

  This is the tensor the `histograms` plugin reads (what
  `tensorboard.summary.histogram` would write), built here so that writing
  needs no `tensorboard` package.
  Integer-valued inputs with a small range get one bucket per integer, so a
  staleness histogram reads 0, 1, 2 rather than 30 slivers.
  """
  values = np.asarray(values, np.float64).ravel()
  if values.size == 0:
    return np.zeros((0, 3), np.float64)
  low, high = float(values.min()), float(values.max())
  if np.all(values == np.round(values)) and high - low < _HISTOGRAM_BUCKETS:
    edges = np.arange(low - 0.5, high + 1.0, 1.0)
  elif low == high:
    edges = np.array([low - 0.5, high + 0.5])
  else:
    edges = np.linspace(low, high, _HISTOGRAM_BUCKETS + 1)
  counts, edges = np.histogram(values, bins=edges)
  return np.stack([edges[:-1], edges[1:], counts.astype(np.float64)], axis=1)


# ---------------------------------------------------------------- helpers


def _join(prefix: str, name: str) -> str:
  if not isinstance(name, str):
    raise TypeError(f'metric names must be str, got {name!r}')
  return f'{prefix.rstrip("/")}/{name}' if prefix else name


def _check_name(name: str, record: Mapping[str, Any]) -> None:
  if name in _RESERVED:
    raise ValueError(f'metric name {name!r} is reserved; use a prefix')
  if name in record:
    raise ValueError(f'metric {name!r} given twice in one record')


def _to_step(step: Any) -> int:
  array = np.asarray(step)
  if array.size != 1 or array.dtype.kind not in 'iu':
    raise TypeError(f'step must be an integer, got {step!r}')
  return int(array.reshape(()))


def _to_scalar(name: str, value: Any) -> float | int | bool:
  """A JSON-ready Python scalar from a number, numpy scalar or jax array."""
  if isinstance(value, bool):
    return value
  if isinstance(value, int):
    return int(value)
  if isinstance(value, float):  # Also np.float64, a float subclass.
    return float(value)
  # np.asarray fetches a jax array to host; numpy scalars pass through.
  try:
    array = np.asarray(value)
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise TypeError(f'metric {name!r}: cannot convert {type(value)} to a '
                    'number') from e
  if array.size != 1:
    raise ValueError(f'metric {name!r} must be a scalar, got shape '
                     f'{array.shape} (log a mean, or use write_histogram)')
  array = array.reshape(())
  kind = array.dtype.kind
  if kind == 'b':
    return bool(array)
  if kind in 'iu':
    return int(array)
  if kind == 'f':
    return float(array)
  if kind == 'V':
    # ml_dtypes' floats (bfloat16, the float8s) are numpy void-kind dtypes.
    try:
      return float(array)
    except (TypeError, ValueError):
      pass
  raise TypeError(f'metric {name!r}: {value!r} of dtype {array.dtype} is not '
                  'a real number')


def _open_for_append(path: str):
  """Opens `path` for appending, repairing a final line torn by a kill."""
  torn = False
  if os.path.exists(path) and os.path.getsize(path) > 0:
    with open(path, 'rb') as f:
      f.seek(-1, os.SEEK_END)
      torn = f.read(1) != b'\n'
  f = open(path, 'a', encoding='utf-8')  # pylint: disable=consider-using-with
  if torn:
    # Without this newline the first record of the resumed run would be glued
    # onto the torn fragment and lost with it.
    f.write('\n')
    f.flush()
  return f


def _dedupe(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  runs = _split_runs([r for r in records if isinstance(r.get(_STEP), int)])
  kept: list[dict[str, Any]] = []
  for run in runs:
    # The resumed run restarts from its checkpoint: every record the dead runs
    # wrote from that step on is superseded, re-logged or not.
    first = min(r[_STEP] for r in run)
    kept = [r for r in kept if r[_STEP] < first] + run
  merged: dict[int, dict[str, Any]] = {}
  for record in kept:
    into = merged.setdefault(record[_STEP], {})
    nonfinite = [n for n in into.get(_NONFINITE, []) if n not in record]
    into.update(record)
    nonfinite += record.get(_NONFINITE, [])
    if nonfinite:
      into[_NONFINITE] = nonfinite
    else:
      into.pop(_NONFINITE, None)
    into.pop(_RESUMED, None)
  return [merged[s] for s in sorted(merged)]


def _split_runs(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
  """Splits a log into the runs (logger lifetimes) that appended to it.

  A run starts at a record marked `resumed`. Logs from elsewhere (hand-written,
  or with the marker lost to a torn line) fall back on `time`, which each run
  starts at 0: a record whose time is below its predecessor's starts a run.
  Steps are no guide, as one run may log out of order (an asynchronous eval of
  step 100 after train step 103).
  """
  runs: list[list[dict[str, Any]]] = []
  previous = None
  for record in records:
    new_run = (previous is None or record.get(_RESUMED) is True
               or record.get(_TIME, math.inf) < previous.get(_TIME, -math.inf))
    if new_run:
      runs.append([])
    runs[-1].append(record)
    previous = record
  return runs
